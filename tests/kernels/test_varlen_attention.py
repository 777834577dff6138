"""The encoder's bidirectional attention over a flat batch against per-sequence full attention."""

from __future__ import annotations

import pytest
import torch

from rivulet.kernels.attention import varlen_attention


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lens: list[int], scale: float) -> torch.Tensor:
    out, start = [], 0
    group = q.shape[1] // k.shape[1]
    for n in lens:
        qs, ks, vs = (x[start:start + n].float().transpose(0, 1) for x in (q, k, v))
        ks, vs = ks.repeat_interleave(group, 0), vs.repeat_interleave(group, 0)
        p = torch.softmax(qs @ ks.transpose(-1, -2) * scale, -1)
        out.append((p @ vs).transpose(0, 1))
        start += n
    return torch.cat(out)


@pytest.mark.parametrize("lens", [[5], [1, 7, 3, 64, 2, 33, 33, 9], [17] * 6, list(range(1, 40, 3))])
@pytest.mark.parametrize("max_waste", [1.0, 1.25, 1e9])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2)])
def test_varlen_attention_matches_each_sequence_alone(lens: list[int], max_waste: float,
                                                     heads: tuple[int, int]) -> None:
    torch.manual_seed(len(lens))
    t, (hq, hk) = sum(lens), heads
    q, k, v = torch.randn(t, hq, 16), torch.randn(t, hk, 16), torch.randn(t, hk, 16)
    qsl = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    got = varlen_attention(q, k, v, qsl, 0.3, max_waste)
    torch.testing.assert_close(got, reference(q, k, v, lens, 0.3), atol=1e-5, rtol=1e-5)
    # no token sees another sequence: changing the last sequence leaves the others alone
    k2 = k.clone()
    k2[t - lens[-1]:] += 1.0
    again = varlen_attention(q, k2, v, qsl, 0.3, max_waste)
    torch.testing.assert_close(again[: t - lens[-1]], got[: t - lens[-1]])
