"""BERT encoders (`BertModel`, as sentence-transformers folders hold them, e.g. all-MiniLM-L6-v2): word +
absolute position + token-type embeddings, then post-norm layers of bidirectional attention and a GELU MLP.
The forward pass returns every token's hidden state; the model runner pools them into embeddings. Nothing
is cached: each step's sequences are whole."""

from __future__ import annotations

import re
from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from rivulet.config import RivuletError
from rivulet.distributed import get_parallel_state
from rivulet.kernels.attention import AttentionMetadata
from rivulet.layers.attention import EncoderAttention
from rivulet.layers.embedding import VocabParallelEmbedding
from rivulet.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from rivulet.models.arch_config import ArchConfig
from rivulet.models.weights import load_named_weights


class BertEmbeddings(nn.Module):
    def __init__(self, cfg: ArchConfig) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.word_embeddings = VocabParallelEmbedding(cfg.vocab_size, h)
        self.position_embeddings = nn.Embedding(cfg.max_position_embeddings, h).requires_grad_(False)
        self.token_type_embeddings = nn.Embedding(max(cfg.type_vocab_size, 1), h).requires_grad_(False)
        self.LayerNorm = nn.LayerNorm(h, eps=cfg.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.word_embeddings(input_ids) + self.position_embeddings(positions)
        return self.LayerNorm(x + self.token_type_embeddings.weight[0])  # every token is of type 0


class BertLayer(nn.Module):
    """x -> LN(x + attention(x)) -> LN(x + MLP(x)) (post-norm)."""

    def __init__(self, cfg: ArchConfig) -> None:
        super().__init__()
        h, d, heads = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads
        self.qkv_proj = QKVParallelLinear(h, d, heads, heads, bias=True)
        self.attn = EncoderAttention(self.qkv_proj.num_heads, d, d ** -0.5, self.qkv_proj.num_kv_heads)
        self.attn_out = RowParallelLinear(heads * d, h, bias=True)
        self.attn_norm = nn.LayerNorm(h, eps=cfg.rms_norm_eps)
        self.mlp_up = ColumnParallelLinear(h, cfg.intermediate_size, bias=True)
        self.mlp_down = RowParallelLinear(cfg.intermediate_size, h, bias=True)
        self.mlp_norm = nn.LayerNorm(h, eps=cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.qkv_proj.q_size, self.qkv_proj.kv_size, self.qkv_proj.kv_size], -1)
        x = self.attn_norm(x + self.attn_out(self.attn(q, k, v, meta)))
        return self.mlp_norm(x + self.mlp_down(F.gelu(self.mlp_up(x))))


class BertModel(nn.Module):
    # checkpoint name fragment -> (our parameter fragment, shard id): q, k, v fused into one GEMM
    stacked_params = [
        ("attention.self.query", "qkv_proj", "q"),
        ("attention.self.key", "qkv_proj", "k"),
        ("attention.self.value", "qkv_proj", "v"),
    ]
    renamed = [  # checkpoint fragment -> ours, in this order (the attention's "output" first)
        ("attention.output.dense", "attn_out"),
        ("attention.output.LayerNorm", "attn_norm"),
        ("intermediate.dense", "mlp_up"),
        ("output.dense", "mlp_down"),
        ("output.LayerNorm", "mlp_norm"),
    ]

    def __init__(self, cfg: ArchConfig) -> None:
        super().__init__()
        if get_parallel_state().pp_size > 1:
            raise RivuletError("encoder models run without pipeline parallelism")
        self.config = cfg
        self.embeddings = BertEmbeddings(cfg)
        self.layers = nn.ModuleList(BertLayer(cfg) for _ in range(cfg.num_hidden_layers))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states [T, hidden] of every token in the flat batch (whole sequences)."""
        x = self.embeddings(input_ids, positions)
        for layer in self.layers:
            x = layer(x, meta)
        return x

    def compute_logits(self, hidden: torch.Tensor, float32: bool = True) -> torch.Tensor:
        raise RivuletError("an encoder has no LM head: it serves embeddings (--task embed)")

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy checkpoint tensors (Hugging Face names, with or without a `bert.` prefix) into the parameters."""
        def renamed(items: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
            for name, tensor in items:
                name = name.removeprefix("bert.")
                if name.startswith(("pooler.", "cls.")) or name == "embeddings.position_ids":
                    continue  # BERT's own pooler / MLM head: not part of a sentence embedding
                name = re.sub(r"^encoder\.layer\.", "layers.", name)
                for old, new in self.renamed:
                    if f".{old}." in name:
                        name = name.replace(f".{old}.", f".{new}.")
                        break
                yield name, tensor
        return load_named_weights(self, renamed(weights), self.stacked_params)
