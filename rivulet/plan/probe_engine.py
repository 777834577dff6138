"""The engine-level figures of the device probe (`probe.py`): what steps of tiny models cost beyond their
arithmetic (per step, layer and sequence; a MoE layer; a second pipeline stage; two tensor-parallel ranks),
and two ranks in two processes (the all-reduce's bandwidth, an expert-parallel MoE layer's rest)."""

from __future__ import annotations

import json
import statistics
import time
from typing import Any

from rivulet.plan.timing import typical


def _step_overhead_ms() -> tuple[float, float, float]:
    """(ms per step, per layer, per sequence) of work that does not scale with the arithmetic: decode steps of
    64-wide models of 1 and 9 layers, one sequence and 32 (host work, sampling and outputs; each layer's op
    launches and small ops; each sequence's share of scheduling, sampling and output processing)."""
    per_step = {(layers, seqs): _per_step_ms(layers, seqs) for layers, seqs in ((1, 1), (9, 1), (1, 32))}
    layer = max(0.0, (per_step[9, 1] - per_step[1, 1]) / 8)
    seq = max(0.0, (per_step[1, 32] - per_step[1, 1]) / 31)
    return max(0.0, per_step[1, 1] - layer - seq), layer, seq


def _moe_layer_ms() -> float:
    """ms per step that a MoE layer (8 experts, top 2: two hit at one sequence) costs beyond a dense layer, in the
    engine: the 64-wide models of 1 and 9 layers with MoE MLPs against the dense ones, one sequence (the router,
    its softmax and top-k, choosing and counting the experts, each expert's small ops, beside the GEMMs)."""
    moe = (_per_step_ms(9, experts=8) - _per_step_ms(1, experts=8)) / 8
    dense = (_per_step_ms(9) - _per_step_ms(1)) / 8
    return moe - dense


def _stage_overhead_ms() -> float:
    """ms per step that a second pipeline stage adds beyond its arithmetic: the same 2-layer model of
    64 wide decoding one sequence with two stages (a worker process each) against one; the step's
    command and result messages between the ranks, the hand-off of the hidden states, the other rank's
    host work that the step waits for."""
    return max(0.0, _per_step_ms(2, pipeline_parallel_size=2) - _per_step_ms(2))


def _tp_overheads() -> tuple[float, float]:
    """(µs per hop of a collective, ms per step of a two-rank tensor-parallel group beyond its collectives): the
    64-wide models of 1 and 9 layers decoding one sequence with two ranks (a worker process each) against one.
    A step of L layers runs 1 + 2L all-reduces (2 hops each at two ranks) and one all-gather (1 hop), so the
    extra time is latency x (3 + 4L) + the per-step rest; the layers' difference gives the latency."""
    for _ in range(3):  # a noisy moment can hide the difference (it is tens of µs): measure again
        extra = {layers: _per_step_ms(layers, tensor_parallel_size=2) - _per_step_ms(layers) for layers in (1, 9)}
        if extra[9] > extra[1]:
            break
    latency_ms = max(0.0, (extra[9] - extra[1]) / 32)
    return latency_ms * 1e3, max(0.0, extra[1] - 7 * latency_ms)


def _two_ranks() -> tuple[float, dict[int, tuple[float, int]]]:
    """Two ranks in two processes here (one thread each): (GB/s of the engine's all-reduce payload: the time of
    16 MiB less that of 1 MiB, so the fixed latency cancels; at two ranks a ring all-reduce moves its payload
    once: the planner's share 2 (tp - 1) / tp is 1), and an expert-parallel MoE layer's µs beyond its GEMMs and
    collectives, with the experts it ran, at 32 and 128 tokens (see `_ep_layer_rest`)."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    procs = [ctx.Process(target=_two_rank_times, args=(rank, port, out)) for rank in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        if p.exitcode != 0:
            for q in procs:
                q.kill()
            raise RuntimeError(f"the link probe's rank failed (exit code {p.exitcode})")
    t1, t16, ep_rest = out.get()
    gbps = (15 * 2**20 / (t16 - t1) if t16 > 1.5 * t1 else 16 * 2**20 / t16) / 1e9  # (noise: the whole of 16 MiB)
    return gbps, ep_rest


def _two_rank_times(rank: int, port: int, out: Any) -> None:
    """Rank `rank` of the two-rank probe: median seconds of the engine's all-reduces (`tensor_parallel_all_reduce`:
    through shared memory on one host) of 1 and 16 MiB of bf16, and `_ep_layer_rest` (rank 0 reports)."""
    import torch
    import torch.distributed as dist

    from rivulet.distributed import init_distributed, tensor_parallel_all_reduce

    torch.set_num_threads(1)
    state = init_distributed(rank, 2, f"tcp://127.0.0.1:{port}", "gloo")
    times = []
    for mib in (1, 16):
        x = torch.ones(mib * 2**19, dtype=torch.bfloat16)
        times.append(typical(lambda: tensor_parallel_all_reduce(x, state), 11))
    with torch.inference_mode():  # the median of three rounds: these two-rank timings move a lot on a small host
        rounds = [{t: _ep_layer_rest(state, t) for t in (32, 128)} for _ in range(3)]
    rest = {t: (statistics.median(r[t][0] for r in rounds), rounds[0][t][1]) for t in (32, 128)}
    dist.destroy_process_group()
    if rank == 0:
        out.put((*times, rest))


def _ep_layer_rest(state: Any, tokens: int = 32) -> tuple[float, int]:
    """(µs, experts run here) of Rivulet's MoE layer under expert parallelism over the two ranks (8 experts of
    512 x 1024, top 2, 32 tokens) beyond the GEMMs of the rows this rank computes and its collectives of the same
    sizes (two all-to-alls, the token shards' all-gather), each timed alone: choosing the rows, grouping them
    by destination, the experts' gather and activation, the combine."""
    import dataclasses

    import torch

    from rivulet.distributed import all_to_all, sequence_parallel_all_gather, set_parallel_state
    from rivulet.kernels.ops import get_op
    from rivulet.layers.moe import FusedMoE

    e, k, h, i = 8, 2, 512, 1024
    set_parallel_state(dataclasses.replace(state, expert_parallel=True))
    torch.manual_seed(0)  # the same tokens and routing on both ranks
    moe = FusedMoE(e, k, h, i, True)
    moe.w13_weight.data = (torch.randn(e // 2, 2 * i, h) * 0.02).to(torch.bfloat16)
    moe.w2_weight.data = (torch.randn(e // 2, h, i) * 0.02).to(torch.bfloat16)
    packed = moe.pack_experts()
    x, logits = torch.randn(tokens, h).to(torch.bfloat16), torch.randn(tokens, e)
    ids = get_op("topk_routing")(logits, k, True)[1]
    owner = ids // (e // 2)  # experts 0-3 on rank 0, 4-7 on rank 1
    shard = tokens // 2
    mine = owner[state.tp_rank * shard:(state.tp_rank + 1) * shard].flatten()
    send = torch.bincount(mine, minlength=2).tolist()
    recv = [int((owner[r * shard:(r + 1) * shard] == state.tp_rank).sum()) for r in range(2)]
    rows = torch.bincount(ids[owner == state.tp_rank], minlength=e)[state.tp_rank * e // 2:(state.tp_rank + 1) * e // 2]
    if packed:
        linear, w13, w2 = get_op("packed_linear"), *moe.packed  # type: ignore[misc]
    else:
        linear, w13, w2 = (lambda a, w, b: torch.nn.functional.linear(a, w)), moe.w13_weight, moe.w2_weight
    inputs = [(torch.randn(n, h).to(torch.bfloat16), torch.randn(n, i).to(torch.bfloat16), j)
              for j, n in enumerate(rows.tolist()) if n]
    sent, y = torch.randn(sum(send), h).to(torch.bfloat16), torch.randn(shard, h).to(torch.bfloat16)

    def gemms() -> None:
        for a, b, j in inputs:
            linear(a, w13[j], None)
            linear(b, w2[j], None)

    def comm() -> None:
        got = all_to_all(sent, send, recv, state)
        all_to_all(got, recv, send, state)
        sequence_parallel_all_gather(y, state, tokens)

    layer = typical(lambda: moe(x, logits), 21)
    rest = layer - typical(gemms, 21) - typical(comm, 21)
    set_parallel_state(state)
    return rest * 1e6, len(inputs)


def _per_step_ms(layers: int, seqs: int = 1, experts: int = 0, **parallel: int) -> float:
    """Median ms per decode step of `seqs` sequences on the 64-wide tiny model of `layers` layers (MoE MLPs of
    `experts` experts, top 2, when not 0)."""
    import tempfile

    import torch

    from rivulet.engine.llm import LLM
    from rivulet.sampling_params import SamplingParams

    threads = torch.get_num_threads()  # the probed device's: an engine takes every core the process may use
    with tempfile.TemporaryDirectory() as d:
        _tiny_checkpoint(d, layers, experts)
        llm = LLM(d, dtype="bfloat16", max_model_len=64, num_kv_blocks=256, max_num_seqs=seqs, **parallel)
        if not parallel:
            torch.set_num_threads(threads)
        params = SamplingParams(temperature=0, max_tokens=33, ignore_eos=True)
        _timed(llm, params, seqs)
        ms = statistics.median(_timed(llm, params, seqs) for _ in range(3)) / 33 * 1e3
        llm.shutdown()
    return ms


def _timed(llm: Any, params: Any, seqs: int) -> float:
    t = time.perf_counter()
    llm.generate([{"prompt_token_ids": [1, 2, 3 + i]} for i in range(seqs)], params, use_tqdm=False)
    return time.perf_counter() - t


def _tiny_checkpoint(path: str, layers: int, experts: int = 0) -> None:
    import torch
    from safetensors.torch import save_file

    h, v = 64, 256
    cfg = {"architectures": ["MixtralForCausalLM" if experts else "LlamaForCausalLM"], "vocab_size": v,
           "hidden_size": h, "intermediate_size": 128, "num_hidden_layers": layers, "num_attention_heads": 4,
           "num_key_value_heads": 4, "rms_norm_eps": 1e-5, "max_position_embeddings": 64, "eos_token_id": 0,
           **({"num_local_experts": experts, "num_experts_per_tok": 2} if experts else {})}
    g = torch.Generator().manual_seed(0)
    w = {"model.embed_tokens.weight": (v, h), "lm_head.weight": (v, h), "model.norm.weight": (h,)}
    for i in range(layers):
        p = f"model.layers.{i}"
        w |= {f"{p}.input_layernorm.weight": (h,), f"{p}.post_attention_layernorm.weight": (h,),
              **{f"{p}.self_attn.{x}_proj.weight": (h, h) for x in "qkvo"},
              f"{p}.mlp.gate_proj.weight": (128, h), f"{p}.mlp.up_proj.weight": (128, h), f"{p}.mlp.down_proj.weight": (h, 128)}
        if experts:  # the MLP becomes a router and `experts` experts of its shape
            for m in ("gate", "up", "down"):
                del w[f"{p}.mlp.{m}_proj.weight"]
            w[f"{p}.block_sparse_moe.gate.weight"] = (experts, h)
            for e in range(experts):
                q = f"{p}.block_sparse_moe.experts.{e}"
                w |= {f"{q}.w1.weight": (128, h), f"{q}.w3.weight": (128, h), f"{q}.w2.weight": (h, 128)}
    save_file({name: torch.randn(shape, generator=g) * 0.1 for name, shape in w.items()}, f"{path}/model.safetensors")
    with open(f"{path}/config.json", "w") as f:
        json.dump(cfg, f)
