"""The model runner's persistent view of the running requests, updated incrementally each step."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rivulet.core.outputs import SchedulerOutput
from rivulet.sampling_params import SamplingParams


@dataclass
class RequestState:
    req_id: str
    token_ids: list[int]  # prompt then outputs, as far as this runner knows them
    num_prompt_tokens: int
    block_ids: list[int]
    num_computed_tokens: int
    params: SamplingParams
    generator: torch.Generator | None

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]


class InputBatch:
    """Requests enter once (with their prompt and blocks); later steps only send new block ids
    and progress, and the runner appends the tokens it samples itself."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.requests: dict[str, RequestState] = {}
        # kept across preemption so a resumed seeded request continues its random stream
        self.generators: dict[str, torch.Generator] = {}

    def update(self, out: SchedulerOutput) -> None:
        for rid in out.finished_request_ids:
            self.generators.pop(rid, None)
        for rid in out.finished_request_ids | out.preempted_request_ids:
            self.requests.pop(rid, None)
        for new in out.new_requests:
            params: SamplingParams = new.sampling_params or SamplingParams()
            gen = self.generators.get(new.request_id)
            if gen is None and params.seed is not None:
                gen = self.generators[new.request_id] = torch.Generator(self.device).manual_seed(params.seed)
            self.requests[new.request_id] = RequestState(new.request_id, list(new.token_ids), new.num_prompt_tokens,
                                                         list(new.block_ids), new.num_computed_tokens, params, gen)
        for cached in out.cached_requests:
            st = self.requests[cached.request_id]
            st.block_ids.extend(cached.new_block_ids)
            st.num_computed_tokens = cached.num_computed_tokens
