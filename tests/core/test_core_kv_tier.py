"""The KV tier's policy with the scheduler: write-through saves, loads before admission, failures, aborts,
shared loads, LRU and pins, the disk index across restarts. A fake runner keeps the "KV" of every slot and
moves it to host slots / files and back exactly as the ops say, and checks every attended position."""

from __future__ import annotations

import os
from pathlib import Path

from core_helpers import FakeRunner, check_all_free, check_invariants, check_step, det_token, make_request

from rivulet.config import SchedulerConfig
from rivulet.core import KVCacheEvent, KVCacheManager, RequestStatus, Scheduler, SchedulerOutput
from rivulet.core.kv_tier import KVTier, block_file

BS = 4


class TierRunner(FakeRunner):
    """Also carries out the KV tier's ops: saves copy a block's slots after the step, loads copy them back
    ``delay`` steps later (or fail for keys in ``bad``), deletions remove files."""

    def __init__(self, kv: KVCacheManager, delay: int = 1) -> None:
        super().__init__(kv)
        self.host: dict[int, list] = {}
        self.files: dict[str, list] = {}
        self.bad: set[str] = set()
        self.delay = delay
        self.pending: dict[str, list] = {}  # request id -> [steps left, items]
        self.loaded_blocks = 0

    def step(self, out: SchedulerOutput) -> tuple[dict[str, list[int]], dict[str, int], list[str]]:
        for name in out.kv_deletes:
            del self.files[name]
        for rid, items in out.kv_loads.items():
            assert rid not in self.pending and rid not in out.num_scheduled_tokens
            self.pending[rid] = [self.delay, items]
        sampled = self.execute(out)
        for block, slot, name, _ in out.kv_saves:  # after the step: the blocks it computed
            kv = [self.slots.get(block * BS + i) for i in range(BS)]
            assert None not in kv, "a block saved before its KV was written"
            if slot >= 0:
                self.host[slot] = kv
            if name:
                assert name not in self.files
                self.files[name] = kv
        loaded, dropped = {}, []
        for rid, entry in list(self.pending.items()):
            entry[0] -= 1
            if entry[0] > 0:
                continue
            del self.pending[rid]
            n = 0
            for block, slot, name, _ in entry[1]:
                kv = self.host[slot] if slot >= 0 else (None if name in self.bad else self.files.get(name))
                if kv is None:  # like the worker: a bad file is deleted, the key reported
                    self.files.pop(name, None)
                    self.bad.discard(name)
                    dropped.append(name)
                    break
                for i, v in enumerate(kv):
                    self.slots[block * BS + i] = v
                n += 1
            loaded[rid] = n
            self.loaded_blocks += n
        return sampled, loaded, dropped


def make(num_blocks: int, host_slots: int = 0, disk_dir: Path | None = None, disk_blocks: int = 0,
         max_num_seqs: int = 8) -> tuple[Scheduler, TierRunner, KVTier]:
    kv = KVCacheManager(num_blocks, BS)
    tier = KVTier(host_slots, disk_dir, disk_blocks)
    sched = Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=64, max_model_len=128),
                      kv, kv_tier=tier)
    return sched, TierRunner(kv), tier


def run(sched: Scheduler, runner: TierRunner, max_steps: int = 500) -> tuple[dict[str, list[int]], list[SchedulerOutput]]:
    tokens: dict[str, list[int]] = {}
    steps = []
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            break
        out = sched.schedule()
        check_step(sched, out)
        sampled, loaded, dropped = runner.step(out)
        sched.update_kv_tier(loaded, dropped)
        for o in sched.update_from_output(out, sampled):
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
        check_invariants(sched)
        steps.append(out)
    assert not sched.has_unfinished_requests()
    return tokens, steps


DOC_A = list(range(100, 122))  # 5 full blocks + 2
DOC_B = list(range(300, 330))


def expected(rid: str, prompt: list[int], n: int = 4) -> list[int]:
    toks = list(prompt)
    for _ in range(n):
        toks.append(det_token(rid, toks))
    return toks[len(prompt):]


def test_write_through_saves_each_block_once_after_the_step_that_computes_it(tmp_path: Path) -> None:
    sched, runner, tier = make(64, host_slots=16, disk_dir=tmp_path, disk_blocks=16)
    sched.add_request(make_request("a", DOC_A))
    sched.add_request(make_request("b", DOC_A))  # same prompt: hits a's blocks, saves nothing new
    _, steps = run(sched, runner)
    saved = [s for out in steps for s in out.kv_saves]
    names = [name for _, _, name, _ in saved]
    # a's 5 prompt blocks (b hits them), then each one's block of 2 prompt + 2 output tokens
    assert len(names) == len(set(names)) == 7
    assert all(slot >= 0 and name for _, slot, name, _ in saved)
    assert tier.stats.saved_host == tier.stats.saved_disk == 7
    keys = make_request("k", DOC_A)
    sched.kv_cache_manager.get_computed_blocks(keys)
    assert [(name, toks) for _, _, name, toks in saved[:5]] == \
        [(keys.block_hashes[i].hex(), DOC_A[i * BS:(i + 1) * BS]) for i in range(5)]
    assert set(runner.files) == set(names) and len(runner.host) == 7


def test_an_evicted_prefix_is_loaded_and_only_the_rest_computed(tmp_path: Path) -> None:
    for host_slots, disk_blocks in ((32, 0), (0, 32)):
        sched, runner, tier = make(9, host_slots, tmp_path / f"d{host_slots}", disk_blocks)
        sched.add_request(make_request("a", DOC_A))
        run(sched, runner)
        sched.add_request(make_request("b", DOC_B))  # needs every device block: a's cached ones are evicted
        run(sched, runner)
        assert not sched.kv_cache_manager.get_computed_blocks(make_request("probe", DOC_A))[0]
        sched.add_request(make_request("c", DOC_A + [7, 8, 9]))
        tokens, steps = run(sched, runner)  # the runner checks every attended slot holds the right KV
        assert tokens["c"] == expected("c", DOC_A + [7, 8, 9])
        loads = [out.kv_loads for out in steps if out.kv_loads]
        assert len(loads) == 1 and len(loads[0]["c"]) == 5 and runner.loaded_blocks == 5
        assert "c" not in steps[0].num_scheduled_tokens  # it waited for its load
        first = next(out for out in steps if "c" in out.num_scheduled_tokens)
        assert first.num_scheduled_tokens["c"] == len(DOC_A) + 3 - 5 * BS  # only what the tier lacked
        assert first.new_requests[0].num_computed_tokens == 5 * BS
        s = tier.stats
        assert (s.host_hits if host_slots else s.disk_hits) == 5 and s.loads == 1 and s.load_failures == 0
        check_all_free(sched)


def test_a_failed_load_computes_the_rest_and_forgets_the_bad_block(tmp_path: Path) -> None:
    sched, runner, tier = make(9, 0, tmp_path, 32)
    sched.add_request(make_request("a", DOC_A))
    run(sched, runner)
    sched.add_request(make_request("b", DOC_B))
    run(sched, runner)
    keys = make_request("k", DOC_A)
    sched.kv_cache_manager.get_computed_blocks(keys)
    runner.bad.add(keys.block_hashes[2].hex())  # the third block's file is bad
    sched.add_request(make_request("c", DOC_A + [5]))
    tokens, steps = run(sched, runner)
    assert tokens["c"] == expected("c", DOC_A + [5])
    first = next(out for out in steps if "c" in out.num_scheduled_tokens)
    assert first.new_requests[0].num_computed_tokens == 2 * BS  # the two blocks before the bad one
    assert tier.stats.loaded_disk == 2 and tier.stats.load_failures == 3
    # the bad block was forgotten, computed again and saved again (its file rewritten); the later ones kept theirs
    resaved = [name for out in steps for _, _, name, _ in out.kv_saves]
    assert keys.block_hashes[2].hex() in resaved and keys.block_hashes[3].hex() not in resaved
    check_all_free(sched)


def test_abort_while_loading_keeps_the_blocks_until_the_load_reports(tmp_path: Path) -> None:
    sched, runner, tier = make(9, 32)
    runner.delay = 3
    sched.add_request(make_request("a", DOC_A))
    run(sched, runner)
    sched.add_request(make_request("b", DOC_B))
    run(sched, runner)
    sched.add_request(make_request("c", DOC_A + [1]))
    out = sched.schedule()
    assert "c" in out.kv_loads and sched.requests["c"].status == RequestStatus.WAITING_FOR_KV
    _, loaded, dropped = runner.step(out)
    sched.update_kv_tier(loaded, dropped)
    sched.update_from_output(out, {})
    held = sched.kv_cache_manager.get_block_ids("c")
    sched.abort_requests("c")
    assert "c" not in sched.requests and sched.kv_cache_manager.get_block_ids("c") == held  # still being written
    assert sched.has_unfinished_requests()  # the report is due
    check_invariants(sched)
    run(sched, runner)
    assert "c" not in sched.loading
    check_all_free(sched)


def test_two_requests_needing_the_same_blocks_load_them_once(tmp_path: Path) -> None:
    sched, runner, tier = make(10, 0, tmp_path, 32)
    sched.add_request(make_request("a", DOC_A))
    run(sched, runner)
    sched.add_request(make_request("b", DOC_B + DOC_B[:6]))  # 40 tokens with its outputs: all 10 blocks
    run(sched, runner)
    sched.add_request(make_request("c", DOC_A + [1]))
    sched.add_request(make_request("d", DOC_A + [2]))
    tokens, steps = run(sched, runner)
    assert [len(items) for out in steps for items in out.kv_loads.values()] == [5]
    assert tokens["c"] == expected("c", DOC_A + [1]) and tokens["d"] == expected("d", DOC_A + [2])
    d_first = next(out for out in steps if "d" in out.num_scheduled_tokens)
    assert d_first.new_requests[-1].num_computed_tokens == 5 * BS  # from the device pool, after c's load
    check_all_free(sched)


def _stored(tier: KVTier, i: int) -> None:
    tier.on_event(KVCacheEvent("stored", bytes([i]) * 32, i, (i,)))


def test_lru_at_each_level_and_pinned_keys_stay(tmp_path: Path) -> None:
    tier = KVTier(host_slots=2, disk_dir=tmp_path, disk_blocks=3)
    for i in range(3):
        _stored(tier, i)
    saves, deletes = tier.take_ops()
    assert [(b, s, n) for b, s, n, _ in saves] == [(0, 0, "00" * 32), (1, 1, "01" * 32), (2, 0, "02" * 32)]
    assert list(tier.host) == [bytes([1]) * 32, bytes([2]) * 32] and deletes == []
    key1 = bytes([1]) * 32
    found = tier.lookup([key1, bytes([2]) * 32, bytes([9]) * 32])
    assert found == [(key1, 1), (bytes([2]) * 32, 0)]
    tier.start_load("r", found[:1], [5], [[1]])
    assert tier.lookup([key1]) is None  # being loaded: others wait for it
    for i in (3, 4):
        _stored(tier, i)
    saves, deletes = tier.take_ops()
    # host: keys 2 then 3 go, through slot 0 (key 1 is pinned); disk: keys 0 then 2 go (1 pinned)
    assert [s for _, s, _, _ in saves] == [0, 0] and list(tier.host) == [key1, bytes([4]) * 32]
    assert deletes == ["00" * 32, "02" * 32] and list(tier.disk) == [key1, bytes([3]) * 32, bytes([4]) * 32]
    assert tier.finish_load("r", 1) == 1 and not tier.pinned
    _stored(tier, 5)
    saves, deletes = tier.take_ops()
    assert deletes == ["01" * 32] and tier.stats.loaded_host == 1


def test_the_disk_index_is_rebuilt_from_the_folder(tmp_path: Path) -> None:
    names = [bytes([i]) * 32 for i in range(4)]
    for t, key in enumerate(names):
        path = block_file(tmp_path, key.hex())
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(b"x")
        os.utime(path, ns=(10**18 + (3 - t), 10**18 + (3 - t)))  # written newest first
    junk = block_file(tmp_path, "ab" * 32).with_suffix(".kv.123.tmp")
    junk.parent.mkdir(exist_ok=True)
    junk.write_bytes(b"half")
    (tmp_path / "00" / "notes.txt").write_text("not a block")
    tier = KVTier(disk_dir=tmp_path, disk_blocks=3)
    assert list(tier.disk) == names[::-1][1:]  # oldest first; the oldest went over the budget ...
    assert tier.take_ops() == ([], [names[3].hex()])  # ... and its file is the worker's to delete
    assert not junk.exists()


def test_a_block_reused_before_its_copy_runs_is_not_copied(tmp_path: Path) -> None:
    """A registered block evicted for reuse before the step that copies it (a block the tier loaded is free as
    soon as it is registered): the copy would read the new owner's KV under the old key, so it is cancelled,
    with its index entries; other planned copies stay. (The default model served wrong tokens from such a
    host copy: a loaded-from-disk prefix, saved to host memory after its device block was reused.)"""
    tier = KVTier(host_slots=4, disk_dir=tmp_path, disk_blocks=8)
    k1, k2 = b"\x01" * 16, b"\x02" * 16
    tier.on_event(KVCacheEvent("stored", k1, 5, (1, 2, 3, 4)))
    tier.on_event(KVCacheEvent("stored", k2, 6, (5, 6, 7, 8)))
    tier.on_event(KVCacheEvent("removed", k1, 5))
    saves, _ = tier.take_ops()
    assert [(b, toks) for b, _, _, toks in saves] == [(6, [5, 6, 7, 8])]
    assert tier.lookup([k1]) == [] and [k for k, _ in tier.lookup([k2])] == [k2]
    assert tier.stats.saved_host == tier.stats.saved_disk == 1
    tier.on_event(KVCacheEvent("stored", k1, 5, (1, 2, 3, 4)))  # registered again later: copied then
    assert [b for b, *_ in tier.take_ops()[0]] == [5]
    tier.on_event(KVCacheEvent("removed", k2, 6))  # evicted after its copy ran: the tiers keep it
    assert [k for k, _ in tier.lookup([k2])] == [k2]
