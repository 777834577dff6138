"""EngineArgs: one declaration behind the CLI flags, `LLM(**kwargs)` and the EngineConfig."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from rivulet.config import RivuletError
from rivulet.engine.args import EngineArgs
from rivulet.entrypoints.cli import build_parser


def test_every_field_is_a_flag_of_every_engine_command() -> None:
    parser = build_parser()
    for command in (["generate"], ["chat"], ["serve"], ["bench", "throughput"], ["bench", "latency"]):
        a = parser.parse_args(command)
        assert EngineArgs.names() <= set(vars(a)), command


def test_flags_reach_the_engine_config() -> None:
    a = build_parser().parse_args(
        ["serve", "--max-num-seqs", "7", "--no-async-scheduling", "--no-enable-prefix-caching", "-tp", "3",
         "--enable-expert-parallel", "--replicated-experts", "1", "4", "-q", "int4", "--block-size", "32", "--enforce-eager"])
    cfg = EngineArgs.from_cli_args(a).create_engine_config()
    assert cfg.scheduler.max_num_seqs == 7 and cfg.scheduler.async_scheduling is False
    assert cfg.cache.enable_prefix_caching is False and cfg.cache.block_size == 32
    assert cfg.parallel.tensor_parallel_size == 3 and cfg.parallel.replicated_experts == [1, 4]
    assert cfg.model.quantization == "int4" and cfg.model.enforce_eager is True
    default = EngineArgs().create_engine_config()
    assert default.scheduler.async_scheduling is None and default.cache.enable_prefix_caching is True
    on = EngineArgs.from_cli_args(build_parser().parse_args(["generate", "--async-scheduling"]))
    assert on.async_scheduling is True


def test_defaults_agree_between_cli_and_dataclass() -> None:
    p = argparse.ArgumentParser()
    EngineArgs.add_cli_args(p)
    assert EngineArgs.from_cli_args(p.parse_args([])) == EngineArgs()
    for f in dataclasses.fields(EngineArgs):
        assert f.metadata.get("help"), f.name


def test_unknown_llm_keyword_is_a_clear_error() -> None:
    with pytest.raises(RivuletError, match="unknown engine argument.*max_num_seq\\b"):
        EngineArgs.from_kwargs("default", {"max_num_seq": 4})


@pytest.mark.parametrize("flags, words", [
    (["--block-size", "0"], "block_size \\(--block-size\\) must be an integer >= 1, got 0"),
    (["--num-kv-blocks", "-3"], "--num-kv-blocks\\) must be an integer >= 1, got -3"),
    (["--max-model-len", "0"], "--max-model-len\\) must be an integer >= 1, got 0"),
    (["-tp", "0"], "--tensor-parallel-size\\) must be an integer >= 1"),
    (["-pp", "0"], "--pipeline-parallel-size\\) must be an integer >= 1"),
    (["--pipeline-micro-batches", "0", "-pp", "2"], "--pipeline-micro-batches\\) must be an integer >= 1"),
    (["--pipeline-micro-batches", "2"], "is for --pipeline-parallel-size > 1"),
    (["--replicated-experts", "1"], "are for --enable-expert-parallel"),
])
def test_flags_out_of_range_are_one_line_errors(flags, words) -> None:
    """Values that once crashed (block size 0: a division by zero) or were ignored (a context of 0 tokens,
    0 ranks, micro-batches without pipeline stages, replicated experts without expert parallelism)."""
    a = build_parser().parse_args(["generate", *flags])
    with pytest.raises(RivuletError, match=words):
        EngineArgs.from_cli_args(a).create_engine_config()


def test_kv_tier_flags_and_their_errors(tiny_model_dir, tmp_path) -> None:
    a = build_parser().parse_args(["serve", "--kv-offload-memory", "1048576", "--kv-tier-path", "/data/kv",
                                   "--kv-tier-disk-bytes", "4096"])
    cc = EngineArgs.from_cli_args(a).create_engine_config().cache
    assert (cc.kv_offload_memory, cc.kv_tier_path, cc.kv_tier_disk_bytes) == (1048576, "/data/kv", 4096)
    assert cc.kv_tier_enabled and not EngineArgs().create_engine_config().cache.kv_tier_enabled
    with pytest.raises(RivuletError, match=r"^kv_offload_memory \(--kv-offload-memory\) must be >= 0 bytes, got -1$"):
        EngineArgs(kv_offload_memory=-1).create_engine_config()
    with pytest.raises(RivuletError, match=r"^kv_tier_disk_bytes \(--kv-tier-disk-bytes\) needs kv_tier_path "
                                           r"\(--kv-tier-path\), the folder of the disk tier$"):
        EngineArgs(kv_tier_disk_bytes=1 << 30).create_engine_config()
    from rivulet import LLM

    tiny = str(tiny_model_dir("llama")[0])
    with pytest.raises(RivuletError, match=r"it needs prefix caching \(drop --no-enable-prefix-caching\)$"):
        LLM(tiny, kv_offload_memory=1 << 20, enable_prefix_caching=False)
    (tmp_path / "file").write_text("")
    with pytest.raises(RivuletError, match=r"^--kv-tier-path: cannot create .*/file/[0-9a-f]{16}-b16: Not a directory$"):
        LLM(tiny, kv_tier_path=str(tmp_path / "file"))
