"""EngineCore: the loop of scheduler.schedule() -> executor.execute() -> scheduler.update()."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from rivulet.config import EngineConfig, RivuletError
from rivulet.core import KVCacheManager, Request, Scheduler
from rivulet.core.outputs import EngineCoreOutput
from rivulet.core.request import RequestStatus
from rivulet.engine.tokenizer import eos_token_ids
from rivulet.executor import make_executor
from rivulet.models.loader import ModelSource
from rivulet.worker.outputs import TokenLogprobs

logger = logging.getLogger(__name__)


@dataclass
class ModelInfo:
    """What the front end must know about the loaded model."""

    vocab_size: int
    max_model_len: int
    eos_token_ids: set[int]


@dataclass
class StepOutput:
    """One request's share of a step: the scheduler's verdict plus the runner's logprobs."""

    core: EngineCoreOutput
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_logprobs: tuple[int, list[TokenLogprobs | None]] | None = None  # (first position, entries)


class EngineCore:
    def __init__(self, config: EngineConfig, source: ModelSource) -> None:
        self.config = config
        self.executor = make_executor(config, source)
        try:
            self._setup(config, source)
        except BaseException:
            self.executor.shutdown()
            raise

    def _setup(self, config: EngineConfig, source: ModelSource) -> None:
        arch = self.executor.arch_config
        model_len = config.model.max_model_len or arch.max_position_embeddings
        if model_len > arch.max_position_embeddings:
            raise RivuletError(f"max_model_len {model_len} exceeds the model's context length "
                               f"({arch.max_position_embeddings})")
        config.scheduler.max_model_len = model_len
        num_blocks = self.executor.determine_num_blocks()
        bs = config.cache.block_size
        if num_blocks * bs < model_len:
            raise RivuletError(f"the KV cache holds {num_blocks * bs} tokens ({num_blocks} blocks), fewer than "
                               f"max_model_len {model_len}: give it more memory or lower max_model_len")
        self.executor.initialize_cache(num_blocks)
        self.num_blocks = num_blocks
        logger.info("KV cache: %d blocks of %d tokens = %d tokens (%.1f MiB); max_model_len %d", num_blocks, bs,
                    num_blocks * bs, num_blocks * self.executor.kv_bytes_per_block() / 2**20, model_len)
        self.kv_cache_manager = KVCacheManager(num_blocks, bs, config.cache.enable_prefix_caching)
        self.scheduler = Scheduler(config.scheduler, self.kv_cache_manager)
        # the tokenizer lives with the front end; the config files give the end-of-sequence ids here
        self.eos_token_ids = eos_token_ids(source, arch.eos_token_ids, None)
        self.executor.set_eos_token_ids(self.eos_token_ids)

    def model_info(self) -> ModelInfo:
        arch = self.executor.arch_config
        return ModelInfo(arch.vocab_size, self.config.scheduler.max_model_len, set(self.eos_token_ids))

    def shutdown(self) -> None:
        self.executor.shutdown()

    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def abort_requests(self, ids: list[str]) -> None:
        self.scheduler.abort_requests(ids)

    def finish_requests(self, ids: list[str], status: RequestStatus) -> None:
        self.scheduler.finish_requests(ids, status)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> list[StepOutput]:
        sched = self.scheduler.schedule()
        result = self.executor.execute(sched)
        outputs = self.scheduler.update_from_output(sched, result.sampled_token_ids)
        steps = [StepOutput(o, result.logprobs.get(o.request_id, []), result.prompt_logprobs.get(o.request_id))
                 for o in outputs]
        reported = {o.request_id for o in outputs}
        steps += [StepOutput(EngineCoreOutput(rid, []), [], lps)  # mid-prompt chunks: prompt logprobs only
                  for rid, lps in result.prompt_logprobs.items() if rid not in reported]
        return steps
