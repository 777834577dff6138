"""The persistent batch against the list-based reference (`build_flat_batch`, `SamplingMetadata.build`)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from rivulet.core.outputs import CachedRequestData, NewRequestData, SchedulerOutput
from rivulet.kernels.ops import get_op
from rivulet.layers.sampler import apply_token_bitmask
from rivulet.layers.sampling_metadata import SamplingMetadata
from rivulet.sampling_params import SamplingParams
from rivulet.worker.batch import SeqChunk, build_flat_batch
from rivulet.worker.input_batch import InputBatch

CPU = torch.device("cpu")
BS, VOCAB = 4, 50


class Mirror:
    """What the batch should hold, kept in plain Python lists."""

    def __init__(self) -> None:
        self.tokens: dict[str, list[int]] = {}
        self.prompt: dict[str, int] = {}
        self.blocks: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}


def assert_same_flat(batch: InputBatch, mirror: Mirror, sched: dict[str, int]) -> None:
    out = SchedulerOutput(num_scheduled_tokens=dict(sched), total_num_scheduled_tokens=sum(sched.values()))
    step = batch.prepare(out)
    chunks = [SeqChunk(mirror.tokens[r][mirror.computed[r]:mirror.computed[r] + n], mirror.computed[r],
                       mirror.blocks[r]) for r, n in sched.items()]
    want = build_flat_batch(chunks, BS, CPU)
    got = step.flat
    assert torch.equal(got.input_ids, want.input_ids) and torch.equal(got.positions, want.positions)
    for f in ("slot_mapping", "block_tables", "query_start_loc", "seq_lens"):
        assert torch.equal(getattr(got.meta, f), getattr(want.meta, f)), f
    assert got.layout == want.layout
    assert got.meta.plan.keys() == want.meta.plan.keys()
    for k in got.meta.plan:  # the attention backend's per-step plan
        assert torch.equal(got.meta.plan[k], want.meta.plan[k]), k
    samples = [mirror.computed[r] + n >= len(mirror.tokens[r]) for r, n in sched.items()]
    assert step.sample.tolist() == samples
    assert torch.equal(got.logits_indices, want.logits_indices[torch.tensor(samples, dtype=torch.bool)])
    assert step.req_ids == list(sched)


def test_random_add_remove_append_matches_reference() -> None:
    rng = np.random.default_rng(0)
    batch = InputBatch(BS, VOCAB, CPU, capacity=2, max_len=4, max_blocks=1)  # forces every kind of growth
    mirror, next_block, next_id = Mirror(), 0, 0
    for step in range(200):
        live = list(mirror.tokens)
        out = SchedulerOutput()
        # finish or preempt some, admit some
        for rid in live:
            if rng.random() < 0.1:
                (out.finished_request_ids if rng.random() < 0.5 else out.preempted_request_ids).add(rid)
                for d in (mirror.tokens, mirror.prompt, mirror.blocks, mirror.computed):
                    d.pop(rid)
        for _ in range(int(rng.integers(0, 3))):
            rid, next_id = f"r{next_id}", next_id + 1
            n = int(rng.integers(1, 30))
            toks = rng.integers(0, VOCAB, n).tolist()
            hit = int(rng.integers(0, n)) // BS * BS
            nb = -(-n // BS)
            blocks = list(range(next_block, next_block + nb))
            next_block += nb
            mirror.tokens[rid], mirror.prompt[rid], mirror.blocks[rid], mirror.computed[rid] = toks, n, blocks, hit
            out.new_requests.append(NewRequestData(rid, toks, n, blocks, hit, SamplingParams()))
        # running requests: progress, maybe a new block
        for rid in live:
            if rid not in mirror.tokens:
                continue
            new_blocks = []
            if len(mirror.blocks[rid]) * BS < len(mirror.tokens[rid]) + 1:
                new_blocks, next_block = [next_block], next_block + 1
            mirror.blocks[rid] += new_blocks
            out.cached_requests.append(CachedRequestData(rid, new_blocks, mirror.computed[rid]))
        batch.update(out, set())
        assert len(batch) == len(mirror.tokens)
        for rid in mirror.tokens:
            assert batch.tokens(rid) == mirror.tokens[rid]
        if not mirror.tokens:
            continue
        order = list(mirror.tokens)
        rng.shuffle(order)
        sched = {r: len(mirror.tokens[r]) - mirror.computed[r] if rng.random() < 0.5
                 else int(rng.integers(1, len(mirror.tokens[r]) - mirror.computed[r] + 1)) for r in order}
        assert_same_flat(batch, mirror, sched)
        # the requests that sampled get a token; progress is what was scheduled
        sampled = [r for r, n in sched.items() if mirror.computed[r] + n >= len(mirror.tokens[r])]
        toks = rng.integers(0, VOCAB, len(sampled))
        batch.append_tokens(np.array([batch.row_of[r] for r in sampled], dtype=np.int64), toks)
        for r, t in zip(sampled, toks.tolist()):
            mirror.tokens[r].append(t)
        for r, n in sched.items():
            mirror.computed[r] += n
    assert batch.capacity > 2 and batch.token_ids.shape[1] > 4 and batch.block_table.shape[1] > 1


def test_rows_are_reused_and_a_resumed_request_keeps_its_generator() -> None:
    batch = InputBatch(BS, VOCAB, CPU, capacity=2)
    seeded = SamplingParams(temperature=1.0, seed=7)
    batch.update(SchedulerOutput(new_requests=[NewRequestData("a", [1, 2], 2, [0], 0, seeded),
                                               NewRequestData("b", [3], 1, [1], 0, SamplingParams())]), set())
    gen = batch.generators["a"]
    gen.manual_seed(99)  # its stream moved on
    batch.update(SchedulerOutput(preempted_request_ids={"a"}), set())
    assert "a" not in batch.row_of and len(batch) == 1
    batch.update(SchedulerOutput(new_requests=[NewRequestData("a", [1, 2, 5], 2, [4], 0, seeded)]), set())
    assert batch.generators["a"] is gen and batch.sampling.generators[batch.row_of["a"]] is gen
    assert batch.tokens("a") == [1, 2, 5] and batch.capacity == 2  # the freed row was taken again
    batch.update(SchedulerOutput(finished_request_ids={"a"}), set())
    assert "a" not in batch.generators
    with pytest.raises(ValueError, match="already in the batch"):
        batch.add(NewRequestData("b", [3], 1, [1], 0, None), set())


def test_scheduling_past_known_tokens_or_blocks_is_refused() -> None:
    batch = InputBatch(BS, VOCAB, CPU)
    batch.update(SchedulerOutput(new_requests=[NewRequestData("a", [1, 2, 3, 4, 5], 5, [0], 0, None)]), set())
    with pytest.raises(ValueError, match="blocks"):
        batch.prepare(SchedulerOutput(num_scheduled_tokens={"a": 5}, total_num_scheduled_tokens=5))
    with pytest.raises(ValueError, match="known tokens"):
        batch.prepare(SchedulerOutput(num_scheduled_tokens={"a": 6}, total_num_scheduled_tokens=6))


def test_deferred_tokens_are_read_on_the_device_until_settled() -> None:
    """Async outputs: a step gathered before the host knows the last sampled tokens reads them from the device
    tensor, drafts go after them, and `settle` gives them to the rows still there (not to a row taken since)."""
    batch = InputBatch(BS, VOCAB, CPU)
    batch.update(SchedulerOutput(new_requests=[NewRequestData("a", [1, 2, 3], 3, [0, 1], 0, None),
                                               NewRequestData("b", [4, 5], 2, [2], 0, None),
                                               NewRequestData("c", [6], 1, [3], 0, None)]), set())
    rows = np.array([batch.row_of[r] for r in "abc"])
    batch.defer_tokens(rows, torch.tensor([30, 40, 50]))
    out = SchedulerOutput(num_scheduled_tokens={"b": 1, "a": 1, "c": 1}, total_num_scheduled_tokens=3)
    for rid, done in zip("abc", (3, 2, 1)):
        batch.num_computed[batch.row_of[rid]] = done
    step = batch.prepare(out)
    assert step.flat.input_ids.tolist() == [40, 30, 50] and step.flat.positions.tolist() == [2, 3, 1]
    assert step.sample.all()
    with pytest.raises(ValueError, match="known tokens"):  # one pending token, not two
        batch.prepare(SchedulerOutput(num_scheduled_tokens={"a": 2}, total_num_scheduled_tokens=2))
    batch.update(SchedulerOutput(finished_request_ids={"c"}, new_requests=[
        NewRequestData("d", [7, 8], 2, [4], 0, None)]), set())  # takes c's row
    assert batch.row_of["d"] == rows[2]
    drafts = SchedulerOutput(num_scheduled_tokens={"a": 3}, total_num_scheduled_tokens=3,
                             scheduled_spec_tokens={"a": [11, 12]})
    step = batch.prepare(drafts)  # the pending token, then the drafts after it
    assert step.flat.input_ids.tolist() == [30, 11, 12] and step.num_logits.tolist() == [3]
    batch.settle(rows, np.array([30, 40, 50]))
    assert batch.tokens("a") == [1, 2, 3, 30] and batch.tokens("b") == [4, 5, 40] and batch.tokens("d") == [7, 8]
    assert batch.pending_ids is None and (batch.pending == -1).all()


def test_deferred_tokens_fit_rows_at_the_edge_of_the_token_buffer() -> None:
    """A row as long as its token buffer still has room for the token it will read back from the device."""
    batch = InputBatch(BS, VOCAB, CPU, max_len=4)
    batch.update(SchedulerOutput(new_requests=[NewRequestData("a", [1, 2, 3], 3, [0, 1], 0, None)]), set())
    row = np.array([batch.row_of["a"]])
    for n, tok in ((3, 20), (4, 21), (5, 22)):  # three async steps: each reads the last step's token back
        batch.num_computed[row] = n - 1
        step = batch.prepare(SchedulerOutput(num_scheduled_tokens={"a": 1}, total_num_scheduled_tokens=1))
        assert step.flat.positions.tolist() == [n - 1]
        batch.defer_tokens(row, torch.tensor([tok]))
        batch.num_computed[row] = n
        step = batch.prepare(SchedulerOutput(num_scheduled_tokens={"a": 1}, total_num_scheduled_tokens=1))
        assert step.flat.input_ids.tolist() == [tok] and step.flat.positions.tolist() == [n]
        batch.settle(row, np.array([tok]))
    assert batch.tokens("a") == [1, 2, 3, 20, 21, 22]


PARAMS = [
    SamplingParams(temperature=0),
    SamplingParams(temperature=0.7, top_k=5),
    SamplingParams(temperature=1.2, top_p=0.8, min_p=0.05, seed=3),
    SamplingParams(temperature=0, presence_penalty=0.5, frequency_penalty=0.3),
    SamplingParams(temperature=0.9, repetition_penalty=1.3, logprobs=3),
    SamplingParams(temperature=0, logit_bias={4: 2.0, 9: -1.5}, min_tokens=3, stop_token_ids=[7]),
    SamplingParams(temperature=1.0, min_tokens=2, ignore_eos=True, logprobs=1),
]


def _compare(got: SamplingMetadata, want: SamplingMetadata) -> None:
    for f in dataclasses.fields(SamplingMetadata):
        a, b = getattr(got, f.name), getattr(want, f.name)
        if isinstance(b, torch.Tensor) or isinstance(a, torch.Tensor):
            assert a is not None and b is not None, f.name
            assert a.dtype == b.dtype and torch.equal(a, b), f.name
        elif f.name == "generators":
            assert a.keys() == b.keys() and all(a[k] is b[k] for k in a), f.name
        else:
            assert a == b, f.name


@pytest.mark.parametrize("pick", [[0], [0, 0, 0], [1, 2], [3, 0], list(range(len(PARAMS))), [6, 5, 4, 3, 2, 1, 0]])
def test_sampling_metadata_equals_the_list_built_reference(pick: list[int]) -> None:
    rng = np.random.default_rng(len(pick))
    batch = InputBatch(BS, VOCAB, CPU, capacity=2)
    eos = {2, 11}
    prompts, outputs, rids = [], [], []
    for j, i in enumerate(pick):
        prompt = rng.integers(0, VOCAB, int(rng.integers(1, 9))).tolist()
        out = rng.integers(0, VOCAB, int(rng.integers(0, 4))).tolist()
        rid = f"r{j}"
        batch.add(NewRequestData(rid, prompt + out, len(prompt), [0] * 4, 0, PARAMS[i]), eos)
        prompts.append(prompt), outputs.append(out), rids.append(rid)
    # a few sampled tokens arrive through the batch (the penalty counts follow them)
    rows = np.array([batch.row_of[r] for r in rids], dtype=np.int64)
    for _ in range(2):
        toks = rng.integers(0, VOCAB, len(rids))
        batch.append_tokens(rows, toks)
        batch.sampling.record(rows, torch.from_numpy(toks))
        for o, t in zip(outputs, toks.tolist()):
            o.append(t)
    order = rng.permutation(len(rids))
    rows = rows[order]
    got = batch.sampling.metadata(rows, batch.num_tokens[rows] - batch.num_prompt[rows])
    gens = [batch.generators.get(rids[k]) for k in order]
    want = SamplingMetadata.build([PARAMS[pick[k]] for k in order], [prompts[k] for k in order],
                                  [outputs[k] for k in order], [eos] * len(order), gens, VOCAB, CPU)
    _compare(got, want)


def test_all_greedy_metadata_builds_no_optional_tensor() -> None:
    batch = InputBatch(BS, VOCAB, CPU)
    for i in range(5):
        batch.add(NewRequestData(f"r{i}", [1, 2, 3], 3, [0], 0, SamplingParams(temperature=0)), {2})
    rows = np.arange(5)
    meta = batch.sampling.metadata(rows, np.zeros(5, np.int64))
    assert meta.all_greedy and batch.sampling.output_counts is None and batch.sampling.prompt_mask is None
    optional = [f.name for f in dataclasses.fields(meta) if isinstance(getattr(meta, f.name), torch.Tensor)]
    assert optional == ["temperature"]


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_token_bitmask_masks_exactly_the_zero_bits(backend: str) -> None:
    vocab = 70  # three words, the last one partly past the vocabulary; row 3 allows everything
    allowed = torch.rand(4, vocab, generator=torch.Generator().manual_seed(0)) < 0.3
    allowed[3] = True
    words = torch.zeros(4, 3, dtype=torch.int64)
    for t in range(vocab):
        words[:, t // 32] |= allowed[:, t].long() << (t % 32)
    words[3, 2] = 2**32 - 1  # bits past the vocabulary set too
    bitmask = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    logits = torch.randn(4, vocab)
    out = get_op("apply_token_bitmask", backend)(logits.clone(), bitmask)
    assert torch.equal(out[allowed], logits[allowed]) and bool((out[~allowed] == float("-inf")).all())
    assert torch.equal(apply_token_bitmask(logits.clone(), bitmask), out)  # the platform's choice agrees
