"""The Triton multi-LoRA kernel vs `add_lora_ref`: adapters in gathered slots mixed with base tokens."""

from __future__ import annotations

import pytest
import torch

from triton_helpers import DEVICE, DTYPES, close, randn

from rivulet.kernels.lora import LoRAPlan, add_lora_ref
from rivulet.kernels.triton.lora import add_lora


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,d_in,d_out", [(5, 70, 300), (48, 576, 960)])
def test_add_lora_matches_reference(rows, d_in, d_out, dtype):
    a, b = randn(4, rows + 3, d_in, dtype=dtype), randn(4, rows + 3, d_out, dtype=dtype)  # b: B transposed
    x, y = randn(9, d_in, dtype=dtype), randn(9, d_out, dtype=dtype)
    slots = torch.tensor([2, -1, 0, 2, 2, -1, 0, 3, 2], device=DEVICE)
    plan = LoRAPlan(slots, [0, 2, 3], torch.tensor([0, 2, 3], device=DEVICE), None, None, 0)
    want = add_lora_ref(y.clone(), x, a, b, plan, rows)
    assert (want - y).abs().max() > 1.0  # the adapters change the rows they own
    got = add_lora(y.clone(), x, a, b, plan, rows)
    close(got, want, dtype, scale=100.0)  # deltas of ~100 summed over 576 x 48 products: float32 rounding
    assert torch.equal(got[1], y[1]) and torch.equal(got[5], y[5])  # base tokens untouched
