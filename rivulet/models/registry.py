"""Model classes keyed by the Hugging Face `architectures` name; installed packages add theirs as
`rivulet.models` entry points (`rivulet/plugins.py`), which take precedence."""

from __future__ import annotations

from torch import nn

from rivulet.config import RivuletError
from rivulet.models.bert import BertModel
from rivulet.models.deepseek import DeepseekV2ForCausalLM, DeepseekV3ForCausalLM
from rivulet.models.llama import LlamaForCausalLM
from rivulet.models.moe import MixtralForCausalLM, Qwen3MoeForCausalLM
from rivulet.plugins import model_plugins

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "Phi3ForCausalLM": LlamaForCausalLM,
    "Gemma2ForCausalLM": LlamaForCausalLM,
    "Gemma3ForCausalLM": LlamaForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "DeepseekV2ForCausalLM": DeepseekV2ForCausalLM,
    "DeepseekV3ForCausalLM": DeepseekV3ForCausalLM,
    "BertModel": BertModel,  # an encoder: --task embed
}


def get_model_class(architecture: str) -> type[nn.Module]:
    registry = {**MODEL_REGISTRY, **model_plugins()}
    try:
        return registry[architecture]
    except KeyError:
        raise RivuletError(
            f"unsupported architecture {architecture!r}; supported: {', '.join(sorted(registry))}"
        ) from None
