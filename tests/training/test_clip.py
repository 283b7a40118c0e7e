"""`common.clip_grad_norm` is torch's `clip_grad_norm_` bit for bit: the same norm, and the same gradients whether
the norm is under the limit (no pass over the gradients) or over it (scaled)."""

from __future__ import annotations

import pytest
import torch

from latentlm.training import common


def _params(scale: float, seed: int) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(*shape, generator=g)) for shape in ((7, 5), (5,), (3, 4, 2))]
    for p in params:
        p.grad = torch.randn(p.shape, generator=g) * scale
    params.append(torch.nn.Parameter(torch.zeros(2)))  # no gradient: left out, as torch does
    return params


@pytest.mark.parametrize("scale", [1e-3, 0.3, 1.0, 50.0])
def test_clip_grad_norm_equals_torch_bit_for_bit(scale):
    ours, theirs = _params(scale, 0), _params(scale, 0)
    norm = common.clip_grad_norm(ours, 5.0)
    want = torch.nn.utils.clip_grad_norm_(theirs, 5.0)
    assert norm == float(want)
    for a, b in zip(ours, theirs, strict=True):
        assert (a.grad is None and b.grad is None) or torch.equal(a.grad, b.grad)
    clipped = float(want) > 5.0
    assert clipped == (scale >= 1.0)  # 64 entries: a norm of about 8 x scale
    if clipped:
        total = torch.linalg.vector_norm(torch.cat([p.grad.reshape(-1) for p in ours if p.grad is not None]))
        assert abs(float(total) - 5.0) < 1e-4


def test_clip_grad_norm_without_gradients_is_zero():
    assert common.clip_grad_norm([torch.nn.Parameter(torch.ones(3))], 1.0) == 0.0
