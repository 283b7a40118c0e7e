"""Float32 matrix products for training on the faster of the CPU GEMMs torch carries: its BLAS (MKL in the x86
wheels) or oneDNN (`torch.ops.mkldnn._linear_pointwise`, the library torch's own CPU kernels use).

Why two: MKL dispatches on the CPU vendor, and on AMD CPUs with AVX-512 it runs its AVX2 code path, while
oneDNN dispatches on the instruction set. On a 2-core AMD EPYC Zen 5 the training step's shapes measured
158-225 GFLOP/s through MKL and 370-499 GFLOP/s through oneDNN (bench/results/training_throughput.md, "The GEMM
library"); on Intel the two should be close (not measured). `calibrate` times both on the shapes a run will
use and `choose` picks the faster; the choice is process-wide (`backend`, `set_backend`, `using`) and a trainer
records it, so a resumed run computes with the same library (the two round differently in the last bits).

The products (`linear`, `matmul`: autograd; `nt`, `nn`, `tn`: for custom autograd Functions) take the
oneDNN path only for 2-D float32 CPU operands of at least `ONEDNN_MIN_MACS` multiply-adds (below, its
per-call set-up of ~10 us outweighs the gain); everything else, and every call under the "torch" backend,
is exactly torch's own op. oneDNN reads a transposed left operand through a copy, so a weight gradient
(g^T x) copies g^T first (still ~2x faster overall on those machines).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import Tensor

ONEDNN_MIN_MACS = 128**3  # m k n below which the "onednn" backend still calls torch's BLAS

_LINEAR = (getattr(torch.ops.mkldnn, "_linear_pointwise", None)
           if torch.backends.mkldnn.is_available() else None)
BACKENDS: tuple[str, ...] = ("torch", "onednn") if _LINEAR is not None else ("torch",)
_STATE = {"backend": "torch"}


def backend() -> str:
    """The process-wide GEMM backend: "torch" (torch's BLAS) or "onednn"."""
    return _STATE["backend"]


def _check(name: str) -> str:
    """`name` if it is one of `BACKENDS`, else ValueError naming those this process has."""
    if name not in BACKENDS:
        raise ValueError(f"GEMM backend {name!r}: this process has {', '.join(BACKENDS)}")
    return name


def set_backend(name: str) -> str:
    """Make `name` (one of `BACKENDS`) the process-wide GEMM backend; returns the previous one."""
    _check(name)
    before, _STATE["backend"] = _STATE["backend"], name
    return before


@contextmanager
def using(name: str) -> Iterator[None]:
    """`set_backend(name)` for the duration of a `with` block."""
    before = set_backend(name)
    try:
        yield
    finally:
        set_backend(before)


def _onednn(x: Tensor, w: Tensor) -> bool:
    """Whether x (m, k) @ w (n, k)^T runs on oneDNN under the current backend."""
    return (_STATE["backend"] == "onednn" and x.dim() == 2 and w.dim() == 2 and x.device.type == "cpu"
            and w.device.type == "cpu" and x.dtype == torch.float32 and w.dtype == torch.float32
            and x.shape[0] * x.shape[1] * w.shape[0] >= ONEDNN_MIN_MACS)


def nt(x: Tensor, w: Tensor, bias: Tensor | None = None, out: Tensor | None = None) -> Tensor:
    """x (m, k) @ w (n, k)^T (+ bias, broadcast to (m, n)) -> (m, n), no autograd; into `out` (m, n) if given.
    `w` may be any strided view."""
    if _onednn(x, w) and (bias is None or bias.dtype == torch.float32):
        assert _LINEAR is not None
        fused = bias is not None and bias.dim() == 1  # a bias per column: oneDNN adds it in the product
        y = _LINEAR(x.contiguous(), w, bias if fused else None, "none", [], "")
        if bias is not None and not fused:
            y.add_(bias)
        return y if out is None else out.copy_(y)
    if bias is None:
        return torch.mm(x, w.T, out=out) if out is not None else torch.mm(x, w.T)
    return torch.addmm(bias, x, w.T, out=out) if out is not None else torch.addmm(bias, x, w.T)


def nn(a: Tensor, b: Tensor, out: Tensor | None = None) -> Tensor:
    """a (m, k) @ b (k, n) -> (m, n), no autograd; into `out` if given."""
    return nt(a, b.T, out=out)


def tn(a: Tensor, b: Tensor, out: Tensor | None = None) -> Tensor:
    """a (k, m)^T @ b (k, n) -> (m, n), no autograd, into `out` if given: a weight gradient (oneDNN reads a^T
    through a copy)."""
    if _onednn(a.T, b.T):
        return nt(a.T.contiguous(), b.T, out=out)
    return torch.mm(a.T, b, out=out) if out is not None else torch.mm(a.T, b)


class _Linear(torch.autograd.Function):
    """x (m, k) @ w (n, k)^T + b (n,) with all three products on the current backend."""

    @staticmethod
    def forward(ctx, x: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
        ctx.save_for_backward(x, w)
        ctx.has_bias = b is not None
        return nt(x, w, b)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
        x, w = ctx.saved_tensors
        grad = grad.contiguous()
        dx = nn(grad, w) if ctx.needs_input_grad[0] else None
        dw = tn(grad, x) if ctx.needs_input_grad[1] else None
        db = grad.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return dx, dw, db


def linear(x: Tensor, w: Tensor, b: Tensor | None = None) -> Tensor:
    """`F.linear(x, w, b)` (x (m, k), w (n, k), b (n,) or None -> (m, n)) on the current backend, with its
    gradients; any other shape, dtype or device, or the "torch" backend, is `F.linear` itself."""
    if _onednn(x, w) and (b is None or b.dtype == torch.float32):
        return _Linear.apply(x, w, b)
    return F.linear(x, w, b)


def matmul(a: Tensor, b: Tensor) -> Tensor:
    """a (m, k) @ b (k, n) -> (m, n) on the current backend, with its gradients."""
    if _onednn(a, b.T):
        return _Linear.apply(a, b.T, None)
    return a @ b


def calibrate(shapes: Sequence[tuple[int, int, int]], repeats: int = 5) -> dict[str, float]:
    """Each backend's float32 rate in GFLOP/s on the products (m, k, n) in `shapes`, forward (x w^T) and
    weight gradient (g^T x) alike, median of `repeats` timed rounds after one warm-up: what a run's
    step would see. O(repeats sum m k n) per backend."""
    gen = torch.Generator().manual_seed(0)
    mats = [(torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen), torch.randn(m, n, generator=gen))
            for m, k, n in shapes]
    flops = 4.0 * sum(m * k * n for m, k, n in shapes)
    rounds: dict[str, list[float]] = {name: [] for name in BACKENDS}
    # the backends take turns round by round: timed one after the other, the first paid the process's first
    # touches of the products' memory (at 32,768 states each output is 1 GiB: torch read 96 against oneDNN's
    # 175 GFLOP/s where its training step was the faster, 2.5 against 3.3 s)
    for r in range(repeats + 1):
        for name in BACKENDS:
            with using(name):
                t0 = time.perf_counter()
                for x, w, g in mats:
                    nt(x, w)
                    tn(g, x)
                if r:
                    rounds[name].append(time.perf_counter() - t0)
    return {name: flops / sorted(times)[len(times) // 2] / 1e9 for name, times in rounds.items()}


def choose(shapes: Sequence[tuple[int, int, int]], requested: str = "auto") -> tuple[str, dict[str, float]]:
    """The backend to train with: `requested` itself unless "auto", else the fastest by `calibrate` on
    `shapes` (torch's BLAS unless oneDNN is at least 5% faster: a tie keeps the default). Returns (name,
    the measured rates; empty when nothing was measured)."""
    if requested != "auto":
        return _check(requested), {}
    if len(BACKENDS) == 1 or not shapes:
        return "torch", {}
    rates = calibrate(shapes)
    return ("onednn" if rates["onednn"] >= 1.05 * rates["torch"] else "torch"), rates
