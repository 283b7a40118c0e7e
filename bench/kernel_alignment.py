"""What 64-byte alignment of the kernels' derived matrices is worth: the shipped `blas.transposed` /
`blas.padded_array` (rows on cache-line boundaries, `blas.aligned_empty`) against numpy's own copies (which may
start 16 or 32 bytes past a boundary), in one process, interleaved.

    python bench/kernel_alignment.py [--sizes 256,1024] [--rounds 3] [--out FILE]

Workloads of bench/hmm_inference.py (random HMM, V = 10,000): one 10,000-token posterior on two threads
(`sum_product.posterior_halves`, whose backward thread reads the transposed copy), the 64 x 50 batch posterior
and Viterbi (`m.posterior`, `m.viterbi`; Viterbi reads the padded copy). The two-thread posterior's own vectors
and output are aligned in both variants. Results are appended to --out (default
bench/results/kernel_refcounts.md, next to the reference-counting A/B).
"""

from __future__ import annotations

import datetime as dt
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hmm_inference import machine, model_and_batches, size_args, timed  # noqa: E402

from latentlm.models.kernels import blas, sum_product  # noqa: E402

SHIPPED = (blas.transposed, blas.padded_array)


def numpy_transposed(trans: torch.Tensor) -> np.ndarray:
    """The transposed copy as numpy makes it (no alignment asked for)."""
    return blas._derived(trans, "T-numpy", lambda: np.ascontiguousarray(trans.detach().numpy().T))


def numpy_padded(mat: np.ndarray) -> np.ndarray:
    """`blas.padded_array` with numpy's own allocation."""
    stride = blas.row_stride(mat.shape[1], mat.itemsize)
    if stride == mat.shape[1] and mat.flags.c_contiguous:
        return mat
    out = np.full((mat.shape[0], stride), -np.inf, dtype=mat.dtype)
    out[:, : mat.shape[1]] = mat
    return out


def use(transposed, padded) -> None:
    blas.transposed, blas.padded_array = transposed, padded
    blas._DERIVED.clear()


def workloads(Z: int) -> tuple[int, dict[str, tuple[int, object]]]:
    """(the byte offset of numpy's transposed copy past a 64-byte boundary, {name: (tokens per call, call)})."""
    m, b, lg = model_and_batches(Z)
    init, emit, trans = m.chain(lg)
    calls = {"posterior/long (two threads)": (10_000, lambda: sum_product.posterior_halves(
                 init, emit.table, emit.rows, trans, 10_000)),
             "posterior/batch": (3200, lambda: m.posterior(b)), "viterbi/batch": (3200, lambda: m.viterbi(b))}
    return numpy_transposed(trans).ctypes.data % 64, calls


def main() -> None:
    args = size_args(__doc__, "256,1024", "kernel_refcounts.md")
    info = machine()
    lines = []
    for Z in (int(s) for s in args.sizes.split(",")):
        offset, calls = workloads(Z)
        for name, (tokens, call) in calls.items():
            got: dict[str, list[float]] = {"aligned": [], "numpy": []}
            for r in range(args.rounds):  # the order alternates between rounds
                variants = [("aligned", SHIPPED), ("numpy", (numpy_transposed, numpy_padded))]
                for variant, fns in variants[:: 1 if r % 2 == 0 else -1]:
                    use(*fns)
                    got[variant].append(tokens / timed(call, 0.5, 15))
            use(*SHIPPED)
            a, n = float(np.median(got["aligned"])), float(np.median(got["numpy"]))
            lines.append(f"| {Z} | {name} | {offset} | {a:,.0f} | {n:,.0f} | {a / n:.2f}x |")
            print(lines[-1], flush=True)
    when = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    text = [f"\n## Alignment, {when}: {info['cpu']} ({info['vector']}), {info['cores']} cores", "",
            f"Command: `python bench/kernel_alignment.py --sizes {args.sizes} --rounds {args.rounds}`. Tokens/s, "
            f"median of {args.rounds} interleaved rounds (alternating which goes first). \"numpy offset\": bytes past "
            "a 64-byte boundary at which "
            "numpy's transposed copy started in this process (the shipped one starts on it).", "",
            "| Z | workload | numpy offset | aligned (shipped) | numpy's copies | aligned / numpy |",
            "|---|---|---|---|---|---|", *lines, ""]
    with args.out.open("a") as f:
        f.write("\n".join(text))
    print(f"appended to {args.out}")


if __name__ == "__main__":
    main()
