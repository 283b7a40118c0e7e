"""A stand-in for ../shared/bench/gpu_yardstick.py in `gpu_check.sh --small` runs where that file is absent
(CI): the same entry points (`CASES["rank"](r, V, B, T)`, `CASES["blocked"](M, k, B, T)`) timing a plain
PyTorch scaled forward on tiny shapes, so the check's code paths run. Never a reference for reported ratios:
GPU figures are always taken next to the shared yardstick."""

from __future__ import annotations

import time

import torch


def _forward(step, first, T: int) -> torch.Tensor:
    a = first()
    c = a.sum(-1, keepdim=True)
    a, ll = a / c, c.log().squeeze(-1)
    for t in range(1, T):
        a = step(a, t)
        c = a.sum(-1, keepdim=True)
        a, ll = a / c, ll + c.log().squeeze(-1)
    return ll


def _timed(fn) -> float:
    fn()
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def rank(r: int = 64, V: int = 200, B: int = 8, T: int = 8) -> dict:
    R = torch.softmax(torch.randn(r, r), -1)
    W = torch.softmax(torch.randn(r, V), -1).T.contiguous()
    s = torch.softmax(torch.randn(r), -1)
    x = torch.randint(0, V, (T, B))
    t = _timed(lambda: _forward(lambda a, t: (a @ R) * W[x[t]], lambda: s * W[x[0]], T))
    return {"tokens_per_s": B * T / t, "tflops": 2 * r * r * B * T / t / 1e12}


def blocked(M: int = 4, k: int = 16, B: int = 8, T: int = 8) -> dict:
    A4 = torch.softmax(torch.randn(M * k, M * k), -1).view(M, k, M, k).permute(0, 2, 1, 3).contiguous()
    Eb = torch.rand(M, k)
    c = torch.randint(0, M, (T, B))
    t = _timed(lambda: _forward(lambda a, t: torch.bmm(a.unsqueeze(1), A4[c[t - 1], c[t]]).squeeze(1) * Eb[c[t]],
                                lambda: Eb[c[0]], T))
    return {"tokens_per_s": B * T / t, "gb_per_s_gathered": k * k * 4 * B * T / t / 1e9}


CASES = {"rank": rank, "blocked": blocked}
