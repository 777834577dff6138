"""The KV tier end to end (float32, so a loaded prefix must give the very tokens a computed one gives): host
memory and disk, a restart that finds the disk tier, bad files, a full disk, and the default model."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from rivulet import LLM, SamplingParams
from rivulet.core import Request
from rivulet.core.kv_tier import FILE_SUFFIX, block_file
from helpers.tiny import make_tiny_model

SP = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=0)
DOC_A = [(7 * i + 3) % 250 + 1 for i in range(90)]  # 5 full blocks of 16, and some
DOC_B = [(11 * i + 5) % 250 + 1 for i in range(180)]  # with its outputs, every device block: evicts DOC_A's


@pytest.fixture(scope="module")
def tiny(tiny_model_dir) -> Path:
    return tiny_model_dir("llama")[0]


def make_llm(model: Path | str, **kw: object) -> LLM:
    kw = {"dtype": "float32", "num_kv_blocks": 12, "max_model_len": 192, **kw}
    return LLM(str(model), **kw)


class Tokens(list):
    """Greedy token ids that compare equal only when their logprobs agree too (to 1e-4: the same KV in
    float32, whatever the batch shapes), so a load that changed the KV a little cannot pass."""

    def __init__(self, ids: list[int], logprobs: list[float]) -> None:
        super().__init__(ids)
        self.logprobs = logprobs

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Tokens):
            return NotImplemented
        return list(self) == list(other) and all(abs(a - b) < 1e-4 for a, b in zip(self.logprobs, other.logprobs))


def ask(llm: LLM, prompt: list[int]) -> tuple[Tokens, int]:
    res = llm.generate({"prompt_token_ids": prompt}, SP, use_tqdm=False)[0]
    out = res.outputs[0]
    return Tokens(list(out.token_ids), [lp[t].logprob for t, lp in zip(out.token_ids, out.logprobs)]), \
        res.num_cached_tokens


def tier_stats(llm: LLM) -> dict[str, float]:
    return {k.removeprefix("kv_tier_"): v for k, v in llm.engine.core.get_stats().items() if k.startswith("kv_tier_")}


def block_files(root: Path) -> list[Path]:
    return sorted(root.rglob("*" + FILE_SUFFIX))


@pytest.fixture(scope="module")
def reference(tiny: Path) -> dict[str, list[int]]:
    """Greedy tokens with every position computed (no prefix cache at all)."""
    llm = make_llm(tiny, enable_prefix_caching=False)
    ref = {q: ask(llm, DOC_A + [q])[0] for q in (1, 2, 3)}
    llm.shutdown()
    return ref


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_a_prefix_from_the_tier_gives_the_computed_tokens(tiny: Path, reference: dict, tier: str,
                                                         tmp_path: Path) -> None:
    kw = {"kv_offload_memory": 8 << 20} if tier == "host" else {"kv_tier_path": str(tmp_path)}
    llm = make_llm(tiny, **kw)
    assert ask(llm, DOC_A + [1]) == (reference[1], 0)
    ask(llm, DOC_B)  # DOC_A's blocks leave the device pool
    assert llm.engine.core.kv_cache_manager.get_computed_blocks(Request("probe", DOC_A + [2], 1))[1] == 0
    assert ask(llm, DOC_A + [2]) == (reference[2], 80)  # 5 blocks loaded, the rest computed
    s = tier_stats(llm)
    assert s[f"loaded_{tier}"] == 5 and s[f"{tier}_hits"] == 5 and s["load_failures"] == 0 and s["loads"] == 1
    assert s[f"saved_{tier}"] >= 5 + 9  # write-through: DOC_A's blocks and DOC_B's
    llm.shutdown()
    if tier == "disk":
        assert len(block_files(tmp_path)) == s["saved_disk"]


def test_a_restart_finds_the_disk_tier(tiny: Path, reference: dict, tmp_path: Path) -> None:
    first = make_llm(tiny, kv_tier_path=str(tmp_path))
    assert ask(first, DOC_A + [1]) == (reference[1], 0)
    first.shutdown()
    again = make_llm(tiny, kv_tier_path=str(tmp_path))
    assert ask(again, DOC_A + [2]) == (reference[2], 80)
    assert tier_stats(again)["loaded_disk"] == 5
    again.shutdown()
    other = make_llm(tiny, kv_tier_path=str(tmp_path), dtype="bfloat16")  # another KV layout: another folder
    assert ask(other, DOC_A + [3])[1] == 0 and tier_stats(other)["loaded_disk"] == 0
    other.shutdown()
    assert len([p for p in tmp_path.iterdir() if p.is_dir()]) == 2


def _corrupt(kind: str, path: Path, foreign: Path) -> None:
    data = bytearray(path.read_bytes())
    if kind == "flip":
        data[-100] ^= 0xFF
        path.write_bytes(bytes(data))
    elif kind == "truncate":
        path.write_bytes(bytes(data[: len(data) // 2]))
    elif kind == "header":
        path.write_bytes(b"RVKV" + b"\x01\x00\x00\x00" + b"\xff\xff\x00\x00" + bytes(data[12:]))
    else:  # the file of the same block position from another model, under this block's name
        shutil.copyfile(foreign, path)


@pytest.mark.parametrize("kind", ["flip", "truncate", "header", "foreign"])
def test_a_bad_block_file_is_recomputed_never_used(tiny: Path, reference: dict, tmp_path: Path, kind: str) -> None:
    other_model = tmp_path / "other-model"
    make_tiny_model("llama", other_model, seed=3)
    foreign_llm = make_llm(other_model, kv_tier_path=str(tmp_path / "foreign"))
    ask(foreign_llm, DOC_A + [1])
    foreign_llm.shutdown()
    tier = tmp_path / "tier"
    first = make_llm(tiny, kv_tier_path=str(tier))
    ask(first, DOC_A + [1])
    first.shutdown()
    # block 2 of DOC_A: its key is the third in the chain; find the file by the tokens in its header
    def by_block(root: Path, tokens: list[int]) -> Path:
        for p in block_files(root):
            raw = p.read_bytes()
            n = int.from_bytes(raw[8:12], "little")
            if json.loads(raw[12:12 + n])["tokens"] == tokens:
                return p
        raise AssertionError("no file holds those tokens")

    target = by_block(tier, DOC_A[32:48])
    _corrupt(kind, target, by_block(tmp_path / "foreign", DOC_A[32:48]))
    again = make_llm(tiny, kv_tier_path=str(tier))
    assert ask(again, DOC_A + [2]) == (reference[2], 32)  # the blocks before the bad one, then computed
    s = tier_stats(again)
    assert s["loaded_disk"] == 2 and s["load_failures"] == 3
    again.shutdown()
    assert by_block(tier, DOC_A[32:48]) == target  # the bad file was deleted, and written again once computed
    third = make_llm(tiny, kv_tier_path=str(tier))
    assert ask(third, DOC_A + [3]) == (reference[3], 80)
    third.shutdown()


def test_a_full_disk_turns_the_disk_tier_off_with_a_warning(tiny: Path, reference: dict, tmp_path: Path) -> None:
    # once the engine is up, no file of its process may grow past 4 KiB (a block file here is ~8 KiB): every
    # block write fails with EFBIG, as on a full disk
    tests = Path(__file__).resolve().parents[1]
    code = f"""
import resource, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
sys.path[:0] = [{str(tests)!r}, {str(tests / "engine")!r}]
from test_kv_tier import make_llm, ask, DOC_A, DOC_B, tier_stats
llm = make_llm({str(tiny)!r}, kv_tier_path={str(tmp_path)!r})
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
a = ask(llm, DOC_A + [1])
ask(llm, DOC_B)
b = ask(llm, DOC_A + [2])
print("RESULT", a[0], b[0], b[1], tier_stats(llm)["loaded_disk"], flush=True)
llm.shutdown()
"""
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    line = next(line for line in p.stdout.splitlines() if line.startswith("RESULT"))
    assert line == f"RESULT {reference[1]} {reference[2]} 0 0"  # same tokens, all computed
    assert p.stderr.count("the disk tier is off from now on") == 1 and "File too large" in p.stderr
    assert block_files(tmp_path) == [] and not list(tmp_path.rglob("*.tmp"))


def test_the_default_model_loads_from_disk_the_tokens_it_computed(tmp_path: Path) -> None:
    doc = ("The river keeper's log, day {}: the water rose by a hand's width overnight and the ferry "
           "stayed moored; travellers waited at the inn and traded news of the roads. ")
    prompt = "".join(doc.format(i) for i in range(5)) + "Summary of the week:"
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)

    def run() -> tuple[Tokens, int, dict]:
        llm = LLM(dtype="float32", max_model_len=512, kv_cache_memory=64 << 20, kv_tier_path=str(tmp_path))
        res = llm.generate(prompt, sp, use_tqdm=False)[0]
        stats = tier_stats(llm)
        llm.shutdown()
        out = res.outputs[0]
        return Tokens(list(out.token_ids), [lp[t].logprob for t, lp in zip(out.token_ids, out.logprobs)]), \
            res.num_cached_tokens, stats

    computed, cached, _ = run()
    assert cached == 0
    loaded, cached, stats = run()  # a new engine: its device pool is empty, the disk tier is not
    assert loaded == computed and cached >= 160 and cached % 16 == 0
    assert stats["loaded_disk"] == cached // 16 and stats["load_failures"] == 0


@pytest.mark.parametrize("parallel", [{"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}], ids=["tp2", "pp2"])
def test_every_rank_keeps_its_shard_in_the_tier(tiny: Path, reference: dict, tmp_path: Path, parallel: dict) -> None:
    """With two ranks each keeps its shard of a block in host memory and in its own folder; a load counts
    once both ranks have it; a restart with the same layout finds both folders; a rank's missing file
    makes the block computed, never used half-loaded."""
    llm = make_llm(tiny, kv_offload_memory=8 << 20, kv_tier_path=str(tmp_path), **parallel)
    assert ask(llm, DOC_A + [1]) == (reference[1], 0)
    ask(llm, DOC_B)
    assert ask(llm, DOC_A + [2]) == (reference[2], 80)  # from host memory, both ranks
    assert tier_stats(llm)["loaded_host"] == 5
    llm.shutdown()
    folders = sorted(p.name for p in tmp_path.iterdir())
    layout = "-tp2-pp1" if "tensor_parallel_size" in parallel else "-tp1-pp2"
    assert [f.removeprefix(folders[0]) for f in folders] == ["", ".rank1"] and folders[0].endswith(layout)
    rank0, rank1 = (tmp_path / f for f in folders)
    shards = [sorted(p.relative_to(root) for p in block_files(root)) for root in (rank0, rank1)]
    assert shards[0] == shards[1] and len(shards[0]) >= 14
    again = make_llm(tiny, kv_tier_path=str(tmp_path), **parallel)
    assert ask(again, DOC_A + [2]) == (reference[2], 80)
    assert tier_stats(again)["loaded_disk"] == 5
    keys = again.engine.core.kv_cache_manager.block_keys(Request("keys", DOC_A, 1), 0, 5)
    again.shutdown()
    block_file(rank1, keys[2].hex()).unlink()  # rank 1 loses its shard of DOC_A's third block
    third = make_llm(tiny, kv_tier_path=str(tmp_path), **parallel)
    assert ask(third, DOC_A + [3]) == (reference[3], 32)  # 2 blocks loaded on both ranks, the rest computed
    assert tier_stats(third)["loaded_disk"] == 2
    third.shutdown()
