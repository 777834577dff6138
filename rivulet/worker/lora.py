"""The runner's LoRA adapters: slots of weights in every adaptable linear, filled on first use.

`LoRAManager` attaches a `LoRASlots` to each attention and MLP projection of the model, loads an adapter
into a slot when a request first needs it (evicting the least recently used adapter that no request in
the batch holds; the scheduler admits at most `max_loras` different adapters at once, so one is always
free), and turns each step's per-token slots into the segments the layers read.
"""

from __future__ import annotations

import re
from collections import OrderedDict

import numpy as np
import torch
from torch import nn

from rivulet.config import LoRAConfig, RivuletError
from rivulet.layers.linear import LinearBase
from rivulet.kernels.lora import LoRAPlan
from rivulet.layers.lora import LoRASlots, LoRAStep
from rivulet.lora_request import LoRARequest
from rivulet.models.loader.peft import adapter_weights, read_adapter
from rivulet.worker.staging import to_device

# what adapters act on: fused projections as the models build them, and DeepSeek's MLA input projections
_ADAPTED = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa")
_LAYER = re.compile(r"model\.layers\.(\d+)\.")


class LoRAManager:
    def __init__(self, model: nn.Module, config: LoRAConfig, dtype: torch.dtype, device: torch.device) -> None:
        self.step = LoRAStep()
        self.max_rank, self.device, self.dtype = config.max_lora_rank, device, dtype
        stacked = getattr(model, "stacked_params", [])
        self.fused = {frag: fused for frag, fused, _ in stacked}  # q_proj -> qkv_proj
        self.layers: dict[str, LoRASlots] = {}
        for name, module in model.named_modules():
            leaf = name.rsplit(".", 1)[-1]
            if isinstance(module, LinearBase) and leaf in _ADAPTED and ".experts." not in name:
                slices = [frag for frag, fused, _ in stacked if fused == leaf] or [leaf]
                module.lora = LoRASlots(module, slices, config.max_loras, config.max_lora_rank, self.step, dtype,
                                        device)
                self.layers[name] = module.lora
        inner = getattr(model, "model", None)
        self.stage = (getattr(inner, "start_layer", 0), getattr(inner, "end_layer", 1 << 30))
        self.slot_of: OrderedDict[int, int] = OrderedDict()  # adapter id -> slot, least recently used first
        self.free = list(range(config.max_loras - 1, -1, -1))

    def slot_for(self, lora: LoRARequest, in_use: set[int]) -> int:
        """The slot of adapter `lora`, loading it from its path if it is not resident (`in_use`: slots that
        requests in the batch hold)."""
        lora_id = lora.lora_int_id
        if lora_id in self.slot_of:
            self.slot_of.move_to_end(lora_id)
            return self.slot_of[lora_id]
        if self.free:
            slot = self.free.pop()
        else:
            victim = next((i for i, s in self.slot_of.items() if s not in in_use), None)
            if victim is None:
                raise RuntimeError("every LoRA slot holds an adapter of a running request (a scheduler bug)")
            slot = self.slot_of.pop(victim)
        try:
            self._load(slot, lora.lora_path)
        except BaseException:
            self.free.append(slot)
            raise
        self.slot_of[lora_id] = slot
        return slot

    def _load(self, slot: int, path: str) -> None:
        info = read_adapter(path, self.max_rank)
        for layer in self.layers.values():
            layer.clear(slot)
        for module, a, b in adapter_weights(info):
            parent, leaf = module.rsplit(".", 1)
            target = f"{parent}.{self.fused.get(leaf, leaf)}"
            layer = self.layers.get(target)
            if layer is None:
                m = _LAYER.match(module)
                if m and not self.stage[0] <= int(m.group(1)) < self.stage[1]:
                    continue  # on another pipeline stage
                raise RivuletError(f"LoRA adapter {path}: {module} matches no adaptable layer of this model")
            layer.set(slot, leaf, a.to(self.device), b.to(self.device))

    def plan(self, token_slots: np.ndarray) -> None:
        """The step's plan from each token's slot (-1: the base model)."""
        present = np.unique(token_slots)
        present = present[present >= 0]
        if len(present) == 0:
            self.step.plan = None
            return
        k = len(present)
        slot_ids = None if present[-1] == k - 1 else to_device(present, self.device)
        slots_t = to_device(token_slots, self.device)
        if k == 1 and (token_slots == present[0]).all():
            self.step.plan = LoRAPlan(slots_t, present.tolist(), slot_ids, None, None, len(token_slots))
            return
        tokens = [np.flatnonzero(token_slots == s) for s in present]
        n = max(len(t) for t in tokens)
        gather = np.zeros((k, n), np.int64)
        valid = np.zeros((k, n, 1), np.float32)
        for i, t in enumerate(tokens):
            gather[i, :len(t)], valid[i, :len(t)] = t, 1.0
        mask = None if valid.all() else to_device(valid, self.device).to(self.dtype)
        self.step.plan = LoRAPlan(slots_t, present.tolist(), slot_ids,
                                  to_device(gather.reshape(-1), self.device), mask, n)

    def clear_step(self) -> None:
        self.step.plan = None
