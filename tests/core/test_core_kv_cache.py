"""KVCacheManager: allocation, prefix hits, hash registration, freeing order, stats."""

from core_helpers import make_request

from rivulet.core import KVCacheManager, Request


def prefill(kv: KVCacheManager, req: Request) -> list[int]:
    """Look up prefix hits, allocate the rest of the prompt, mark it computed."""
    hit_ids, num_hit = kv.get_computed_blocks(req)
    new = kv.allocate_slots(req, req.num_tokens - num_hit, hit_ids)
    assert new is not None
    req.num_computed_tokens = req.num_tokens
    return kv.get_block_ids(req.request_id)


def test_second_request_with_same_prompt_hits_full_blocks() -> None:
    kv = KVCacheManager(16, 4)
    prompt = list(range(100, 110))  # 2 full blocks + 2 tokens
    a = make_request("a", prompt)
    assert kv.get_computed_blocks(a) == ([], 0)
    assert kv.allocate_slots(a, 10) == [0, 1, 2]
    a.num_computed_tokens = 10
    b = make_request("b", prompt)
    hit_ids, num_hit = kv.get_computed_blocks(b)
    assert (hit_ids, num_hit) == ([0, 1], 8)
    assert kv.allocate_slots(b, 2, hit_ids) == [3]
    assert kv.get_block_ids("b") == [0, 1, 3]
    assert [kv.block_pool.blocks[i].ref_cnt for i in range(4)] == [2, 2, 1, 1]
    assert (kv.stats.queries, kv.stats.hits) == (20, 8)
    assert kv.stats.hit_rate == 0.4
    assert kv.num_free_blocks == 12 and kv.usage == 0.25


def test_hit_never_covers_the_whole_request() -> None:
    kv = KVCacheManager(16, 4)
    prompt = list(range(8))  # exactly 2 full blocks
    prefill(kv, make_request("a", prompt))
    assert kv.get_computed_blocks(make_request("b", prompt)) == ([0], 4)
    longer = make_request("c", prompt + [99])
    assert kv.get_computed_blocks(longer) == ([0, 1], 8)


def test_hash_is_chained_so_position_matters() -> None:
    kv = KVCacheManager(16, 4)
    x, y = [1, 2, 3, 4], [5, 6, 7, 8]
    prefill(kv, make_request("a", x + y + [9]))
    assert kv.get_computed_blocks(make_request("b", y + x + [9])) == ([], 0)
    assert kv.get_computed_blocks(make_request("c", x + [0, 0, 0, 0, 9])) == ([0], 4)


def test_failed_allocation_allocates_nothing() -> None:
    kv = KVCacheManager(3, 4)
    a = make_request("a", list(range(12)))
    assert kv.allocate_slots(a, 12) == [0, 1, 2]
    b = make_request("b", [7])
    assert kv.allocate_slots(b, 1) is None
    assert kv.get_block_ids("b") == [] and kv.num_free_blocks == 0
    assert kv.stats.queries == 12  # only admitted requests are counted
    a.num_computed_tokens = 12
    assert kv.allocate_slots(a, 1) is None  # a decode that needs a 4th block
    assert kv.get_block_ids("a") == [0, 1, 2]


def test_prefix_hits_on_free_blocks_count_against_free_space() -> None:
    kv = KVCacheManager(4, 4)
    prompt = list(range(20, 29))  # 9 tokens: blocks 0, 1 full and cached, block 2 partial
    a = make_request("a", prompt)
    assert prefill(kv, a) == [0, 1, 2]
    kv.free(a)
    assert list(kv.block_pool.free_queue) == [2, 3, 1, 0]  # tail first; uncached to the front
    d = make_request("d", [5, 5, 5, 5])
    prefill(kv, d)
    assert kv.get_block_ids("d") == [2]
    b = make_request("b", prompt[:8] + list(range(50, 58)))  # 16 tokens, first 8 shared
    hit_ids, num_hit = kv.get_computed_blocks(b)
    assert (hit_ids, num_hit) == ([0, 1], 8)
    # 2 new blocks + 2 hit blocks to pull from the free queue = 4 > 3 free
    assert kv.allocate_slots(b, 8, hit_ids) is None
    assert list(kv.block_pool.free_queue) == [3, 1, 0]
    assert [kv.block_pool.blocks[i].ref_cnt for i in (0, 1)] == [0, 0]
    kv.free(d)  # d's one full block is cached, so it goes to the back
    assert list(kv.block_pool.free_queue) == [3, 1, 0, 2]
    assert kv.allocate_slots(b, 8, hit_ids) == [3, 2]
    assert kv.get_block_ids("b") == [0, 1, 3, 2]


def test_only_blocks_full_of_known_tokens_are_registered() -> None:
    kv = KVCacheManager(10, 4)
    a = make_request("a", list(range(10)))
    kv.allocate_slots(a, 6)  # chunk 1: tokens 0..5
    assert len(kv.block_pool.cached) == 1
    a.num_computed_tokens = 6
    kv.allocate_slots(a, 4)  # chunk 2: tokens 6..9
    assert len(kv.block_pool.cached) == 2
    a.num_computed_tokens = 10
    a.append_output_token_id(50)
    assert kv.allocate_slots(a, 1) == []  # token 10 fits in block 2
    assert len(kv.block_pool.cached) == 2
    a.num_computed_tokens = 11
    a.append_output_token_id(51)
    kv.allocate_slots(a, 1)  # token 11 fills block 2
    assert len(kv.block_pool.cached) == 3
    assert kv.block_pool.blocks[2].block_hash == a.block_hashes[2]
    # a later request continuing the same text hits all three blocks
    b = make_request("b", list(range(10)) + [50, 51, 52])
    assert kv.get_computed_blocks(b) == ([0, 1, 2], 12)


def test_free_releases_tail_first_so_the_tail_is_evicted_first() -> None:
    kv = KVCacheManager(8, 4)
    prompt = list(range(13))  # blocks 0, 1, 2 full, block 3 partial
    a = make_request("a", prompt)
    prefill(kv, a)
    kv.free(a)
    kv.free(a)  # idempotent
    assert list(kv.block_pool.free_queue) == [3, 4, 5, 6, 7, 2, 1, 0]
    other = make_request("o", [9] * 24)  # 6 blocks: evicts cached block 2, keeps 0 and 1
    kv.allocate_slots(other, 24)
    assert kv.get_block_ids("o") == [3, 4, 5, 6, 7, 2]
    assert kv.get_computed_blocks(make_request("b", prompt)) == ([0, 1], 8)


def test_n_samples_share_the_prompt_blocks() -> None:
    kv = KVCacheManager(16, 4)
    prompt = list(range(30, 40))
    samples = [make_request(f"s{i}", prompt) for i in range(3)]
    tables = [prefill(kv, r) for r in samples]
    assert tables == [[0, 1, 2], [0, 1, 3], [0, 1, 4]]
    assert [kv.block_pool.blocks[i].ref_cnt for i in range(5)] == [3, 3, 1, 1, 1]
    assert [r.num_computed_tokens for r in samples] == [10, 10, 10]
    kv.free(samples[0])
    kv.free(samples[1])
    assert [kv.block_pool.blocks[i].ref_cnt for i in range(5)] == [1, 1, 0, 0, 1]
    assert kv.num_free_blocks == 13
    kv.free(samples[2])
    assert kv.num_free_blocks == 16 and kv.usage == 0.0


def test_prefix_caching_disabled() -> None:
    kv = KVCacheManager(8, 4, enable_prefix_caching=False)
    prompt = list(range(9))
    prefill(kv, make_request("a", prompt))
    b = make_request("b", prompt)
    assert kv.get_computed_blocks(b) == ([], 0)
    assert prefill(kv, b) == [3, 4, 5]
    assert not kv.block_pool.cached and b.block_hashes == []
    assert (kv.stats.queries, kv.stats.hits) == (18, 0)


def test_reset_prefix_cache() -> None:
    kv = KVCacheManager(8, 4)
    prompt = list(range(9))
    a = make_request("a", prompt)
    prefill(kv, a)
    assert kv.reset_prefix_cache() is False
    kv.free(a)
    assert kv.reset_prefix_cache() is True
    assert kv.get_computed_blocks(make_request("b", prompt)) == ([], 0)


def test_block_key_is_the_same_in_every_process() -> None:
    import subprocess
    import sys
    from pathlib import Path

    root = str(Path(__file__).resolve().parents[2])
    code = ("from rivulet.core import hash_block_tokens as h, root_key as r; "
            "print(h(h(r(b'm', 's'), (1, 2)), (3, 4)).hex())")
    values = {
        subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True,
            env={"PYTHONHASHSEED": seed, "PYTHONPATH": root},
        ).stdout
        for seed in ("1", "2")
    }
    assert len(values) == 1
    # and it is sha256 of the parent key and the int32 little-endian token ids: stable across versions
    import hashlib
    import struct

    from rivulet.core import hash_block_tokens, root_key

    parent = root_key(b"m", "s")
    assert parent == hashlib.sha256(b"rivulet-kv-1\x00m\x00\x01s").digest()
    assert hash_block_tokens(parent, [1, 2]) == hashlib.sha256(parent + struct.pack("<2i", 1, 2)).digest()
    assert values == {hash_block_tokens(hash_block_tokens(parent, [1, 2]), [3, 4]).hex() + "\n"}


def test_cache_salt_and_namespace_separate_cached_prefixes() -> None:
    kv = KVCacheManager(32, 4)
    prompt = list(range(9))
    prefill(kv, make_request("a", prompt))
    salted = make_request("b", prompt)
    salted.cache_salt = "tenant-1"
    assert kv.get_computed_blocks(salted) == ([], 0)  # another tenant's blocks are invisible
    prefill(kv, salted)
    again = make_request("c", prompt)
    again.cache_salt = "tenant-1"
    assert kv.get_computed_blocks(again) == (kv.get_block_ids("b")[:2], 8)
    assert kv.get_computed_blocks(make_request("d", prompt)) == (kv.get_block_ids("a")[:2], 8)
    # the same tokens under another model's namespace get other keys
    other = KVCacheManager(32, 4, namespace=b"another model")
    e = make_request("e", prompt)
    other.get_computed_blocks(e)
    assert e.block_hashes and not set(e.block_hashes) & set(kv.block_pool.cached)


def test_a_hit_is_checked_against_the_tokens() -> None:
    kv = KVCacheManager(16, 4)
    a = make_request("a", list(range(9)))
    prefill(kv, a)
    # forge a collision: another chain's first key now names block 0, which holds other tokens
    b = make_request("b", [7, 7, 7, 7, 8])
    kv.get_computed_blocks(b)
    kv.block_pool.cached[b.block_hashes[0]] = kv.block_pool.blocks[0]
    assert kv.get_computed_blocks(b) == ([], 0)
    assert kv.get_computed_blocks(make_request("c", list(range(9)))) == ([0, 1], 8)


def test_caching_and_eviction_raise_events() -> None:
    from rivulet.core import KVCacheEvent

    kv = KVCacheManager(3, 4)
    events: list[KVCacheEvent] = []
    kv.block_pool.listeners.append(events.append)
    a = make_request("a", list(range(9)))
    prefill(kv, a)
    assert [(e.kind, e.block_hash, e.block_id, e.token_ids) for e in events] == [
        ("stored", a.block_hashes[0], 0, (0, 1, 2, 3)), ("stored", a.block_hashes[1], 1, (4, 5, 6, 7))]
    kv.free(a)
    events.clear()
    prefill(kv, make_request("b", [50] * 10))  # needs all 3 blocks: the cached ones are evicted
    assert [(e.kind, e.block_hash) for e in events if e.kind == "removed"] == [
        ("removed", a.block_hashes[1]), ("removed", a.block_hashes[0])]
    kv.free(make_request("b", []))
    events.clear()
    assert kv.reset_prefix_cache() and [e.kind for e in events] == ["cleared"]
