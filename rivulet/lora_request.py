"""A request's LoRA adapter (vLLM's `LoRARequest`): a name, an id unique to this adapter's files, and the
folder of a PEFT adapter (`adapter_config.json` + `adapter_model.safetensors`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    lora_name: str
    lora_int_id: int  # >= 1; requests with the same id share the adapter's slot and its prefix-cache entries
    lora_path: str
    # the engine sets it from the adapter's files (size and time of change): it keys the adapter's
    # prefix-cache blocks, so new files under the same name and path never hit the old ones' KV
    fingerprint: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be an integer >= 1, got {self.lora_int_id!r}")
        if not self.lora_name:
            raise ValueError("lora_name must not be empty")
