"""What one step of a model costs one device under a parallel layout: weights held and read, KV bytes, FLOPs,
and the bytes of every collective, by the formulas the collectives are tested against (docs/parallelism.md).

Everything is per rank of one pipeline stage, in elements or bytes; `planner.py` turns it into time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from rivulet.config import RivuletError
from rivulet.models.arch_config import ArchConfig


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    pp: int = 1
    ep: bool = False  # experts whole on the TP ranks (expert parallelism) instead of split in width
    dp: int = 1

    @property
    def devices(self) -> int:
        return self.tp * self.pp * self.dp

    def __str__(self) -> str:
        return f"tp{self.tp} pp{self.pp}{' ep' if self.ep else ''} dp{self.dp}"


def check_layout(a: ArchConfig, lay: Layout) -> str | None:
    """Why Rivulet cannot run `lay` for this model (None when it can): the same divisibility rules it enforces."""
    tp = lay.tp
    if a.num_attention_heads % tp:
        return f"tp {tp} does not divide {a.num_attention_heads} heads"
    kv = a.num_key_value_heads
    if not a.is_mla and (tp % kv if tp >= kv else kv % tp):
        return f"tp {tp} and {kv} KV heads: one must divide the other"
    if lay.pp > a.num_hidden_layers:
        return f"pp {lay.pp} exceeds {a.num_hidden_layers} layers"
    if a.intermediate_size % tp and any(not a.is_sparse_layer(i) for i in range(a.num_hidden_layers)):
        return f"tp {tp} does not divide the MLP width {a.intermediate_size}"
    if lay.ep and (not a.is_moe or tp == 1 or a.num_experts % tp):
        return "expert parallelism needs a MoE model whose experts the tp ranks divide"
    if a.is_moe and not lay.ep and a.moe_intermediate_size % tp:
        return f"tp {tp} does not divide the expert width {a.moe_intermediate_size}"
    return None


class ModelCost:
    """Per-rank element counts of `arch` under `layout`."""

    def __init__(self, arch: ArchConfig, layout: Layout) -> None:
        if (why := check_layout(arch, layout)) is not None:
            raise RivuletError(f"layout {layout} is not valid for this model: {why}")
        self.a, self.lay = arch, layout
        a, tp = arch, layout.tp
        h, heads = a.hidden_size, a.num_attention_heads
        if a.is_mla:
            q_out = heads * (a.qk_nope_head_dim + a.head_dim)
            q = h * q_out if a.q_lora_rank is None else a.q_lora_rank * q_out
            self.attn_split = q + a.kv_lora_rank * heads * (a.qk_nope_head_dim + a.v_head_dim) + heads * a.v_head_dim * h
            self.attn_replicated = h * (a.kv_lora_rank + a.head_dim) + (h * a.q_lora_rank if a.q_lora_rank else 0)
            self.kv_per_token_layer = a.kv_lora_rank + a.head_dim  # one latent vector, on every rank
        else:
            kv_rank = max(1, a.num_key_value_heads // tp)  # KV heads per rank (replicated when tp > KV heads)
            bias = int(a.attention_bias)  # q/k/v biases (Qwen2)
            self.attn_split = (2 * h + bias) * heads * a.head_dim
            self.attn_replicated = 0
            self.attn_kv_proj = 2 * (h + bias) * kv_rank * a.head_dim  # already per rank
            self.kv_per_token_layer = 2 * kv_rank * a.head_dim
        self.dense_mlp = 3 * h * a.intermediate_size
        self.expert = 3 * h * a.moe_intermediate_size
        self.shared = self.expert * a.n_shared_experts
        self.vocab_h = a.vocab_size * h

    # ---- stages ----

    def stage_layers(self, stage: int) -> range:
        n, pp = self.a.num_hidden_layers, self.lay.pp
        return range(stage * n // pp, (stage + 1) * n // pp)

    def attn_params(self) -> float:
        """One layer's attention parameters on one rank."""
        return self.attn_split / self.lay.tp + self.attn_replicated + getattr(self, "attn_kv_proj", 0)

    def weights(self, stage: int) -> float:
        """Parameters (elements) one rank of `stage` holds."""
        a, tp = self.a, self.lay.tp
        n = 0.0
        for i in self.stage_layers(stage):
            n += self.attn_params()
            if a.is_sparse_layer(i):
                experts = a.num_experts / tp * self.expert if self.lay.ep else a.num_experts * self.expert / tp
                n += experts + self.shared / tp + a.hidden_size * a.num_experts
            else:
                n += self.dense_mlp / tp
        tables = int(stage == 0) + int(stage == self.lay.pp - 1)  # the embedding first, the LM head last
        if a.tie_word_embeddings and self.lay.pp == 1:
            tables = 1  # one table serves both
        return n + tables * self.vocab_h / tp

    def kv_per_token(self, stage: int) -> int:
        """KV cache elements per token on one rank of `stage`."""
        return self.kv_per_token_layer * len(self.stage_layers(stage))

    # ---- one step ----

    def experts_hit(self, tokens: int) -> float:
        """Expected distinct experts a step of `tokens` tokens routes to (uniform top-k)."""
        a = self.a
        return a.num_experts * (1 - (1 - a.num_experts_per_tok / a.num_experts) ** tokens)

    def imbalance(self, tokens: int) -> float:
        """The busiest EP rank's (token, expert) rows over the mean, for uniform routing (normal approximation)."""
        n = self.lay.tp
        rows = tokens * self.a.num_experts_per_tok / n
        if not self.lay.ep or n == 1 or rows <= 0:
            return 1.0
        return 1 + math.sqrt(2 * math.log(n) * (1 - 1 / n) / rows)

    def step(self, stage: int, tokens: int, sampled: int, context: float, weight_bytes: float,
             act_bytes: int = 2) -> dict[str, float]:
        """One rank of `stage` on a step of `tokens` tokens, `sampled` of which get logits, attending over
        `context` cached tokens on average per token: FLOPs of the weights' GEMMs (`expert_flops` of them in
        routed experts, whose GEMMs see `expert_rows` rows each; `experts_hit` over the stage's MoE layers) and of
        attention, bytes read (weights, KV) and read or written by the element-wise kernels (`act_bytes`: norms,
        RoPE, the KV write, activations, the logits), collective payloads."""
        a, tp, lay = self.a, self.lay.tp, self.lay
        h = a.hidden_size
        layers = self.stage_layers(stage)
        flops = attn_flops = expert_flops = read = hits = ep_rows = 0.0
        moe_layers = 0
        expert_rows = tokens
        # activation elements per token and layer that the element-wise kernels read and write: two residual adds
        # + RMSNorms (4 x H each), RoPE on q and k, the KV write, then the MLP's activation (below)
        q_w = a.num_attention_heads / tp * a.head_dim
        act = 0.0
        for i in layers:
            attn = self.attn_params()
            flops += 2 * tokens * attn
            read += attn * weight_bytes
            heads = a.num_attention_heads / tp
            per_head = (2 * a.kv_lora_rank + a.head_dim) if a.is_mla else 2 * a.head_dim
            attn_flops += 2 * tokens * context * heads * per_head  # scores and the weighted sum
            act += 8 * h + 2 * q_w + 3 * self.kv_per_token_layer
            if a.is_sparse_layer(i):
                moe_layers += 1
                k = a.num_experts_per_tok
                if lay.ep:
                    rows = tokens * k / tp * self.imbalance(tokens)
                    hit = min(a.num_experts / tp, self.experts_hit(tokens) / tp * self.imbalance(tokens))
                    expert_flops += 2 * rows * self.expert
                    read += hit * self.expert * weight_bytes
                else:
                    rows, hit = tokens * k, self.experts_hit(tokens)
                    expert_flops += 2 * rows * self.expert / tp
                    read += hit * self.expert / tp * weight_bytes
                expert_rows = max(1.0, rows / max(hit, 1e-9))  # each expert's GEMMs see only its rows
                hits += hit
                ep_rows += rows if lay.ep else 0.0
                # per routed row: SiLU-and-mul, its input gathered and its output weighted and added back
                act += rows / tokens * (3 * a.moe_intermediate_size / (1 if lay.ep else tp) + 2 * h) + \
                    self.shared / h / tp  # the shared experts' SiLU-and-mul: 3 x their width
                flops += 2 * tokens * (self.shared / tp + h * a.num_experts)
                read += (self.shared / tp + h * a.num_experts) * weight_bytes
            else:
                flops += 2 * tokens * self.dense_mlp / tp
                read += self.dense_mlp / tp * weight_bytes
                act += 3 * a.intermediate_size / tp
        last = stage == lay.pp - 1
        if last:
            flops += 2 * sampled * self.vocab_h / tp
            read += self.vocab_h / tp * weight_bytes
        kv_read = tokens * context * self.kv_per_token_layer * len(layers) * act_bytes if tokens == sampled else \
            sampled * context * self.kv_per_token_layer * len(layers) * act_bytes  # prefill: each sequence's once
        # the logits: this rank's bf16 shard, then the sampler's float32 copy of all, written and read
        logits = sampled * a.vocab_size * (act_bytes / tp + 8) if last else 0.0
        return {"flops": flops + expert_flops, "expert_flops": expert_flops, "expert_rows": expert_rows,
                "experts_hit": hits, "ep_rows": ep_rows, "moe_layers": moe_layers, "act_bytes": tokens * act * act_bytes + logits,
                "attn_flops": attn_flops, "weight_bytes": read, "kv_bytes": kv_read,
                "gemm_calls": self.gemm_calls(stage, tokens),
                **self.comm(stage, tokens, sampled, moe_layers, act_bytes)}

    def gemm_calls(self, stage: int, tokens: int) -> float:
        """GEMMs one rank of `stage` launches in a step: per layer the attention's (fused q/k/v and o; MLA's
        query, latent, two absorbed and o) and the MLP's (gate/up and down; a MoE layer's router, two per expert
        hit and the shared experts'), plus the LM head."""
        a = self.a
        attn = (4 + (a.q_lora_rank is not None)) if a.is_mla else 2
        calls = 0.0
        for i in self.stage_layers(stage):
            if a.is_sparse_layer(i):
                hit = self.experts_hit(tokens) / (self.lay.tp if self.lay.ep else 1)
                calls += attn + 1 + 2 * hit + 2 * (a.n_shared_experts > 0)
            else:
                calls += attn + 2
        return calls + (stage == self.lay.pp - 1)

    def comm(self, stage: int, tokens: int, sampled: int, moe_layers: int, b: int = 2) -> dict[str, float]:
        """Payload bytes one rank of `stage` puts into each kind of collective in one step (what
        `rivulet.distributed.comm` records): TP all-reduces of the embedding and after attention and every
        MLP (EP: MoE layers all-to-all their cross-rank rows there and back, then all-gather the shards),
        the LM head's all-gather of the sampled rows' logits, and the hidden + residual sent to the next
        stage."""
        a, tp, lay = self.a, self.lay.tp, self.lay
        h = a.hidden_size
        layers = len(self.stage_layers(stage))
        out: dict[str, float] = {}
        if tp > 1:
            reductions = (stage == 0) + layers + (layers - moe_layers if lay.ep else layers)
            out["all_reduce"] = reductions * tokens * h * b
            gathers = sampled * a.vocab_size * b if stage == lay.pp - 1 else 0
            if lay.ep and moe_layers:
                t_pad = -(-tokens // tp) * tp
                out["all_to_all"] = moe_layers * 2 * tokens * a.num_experts_per_tok * (tp - 1) / tp / tp * h * b
                gathers += moe_layers * t_pad * h * b
            if gathers:
                out["all_gather"] = gathers
        if stage < lay.pp - 1:
            out["send"] = 2 * tokens * h * b
        return out
