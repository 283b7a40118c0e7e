"""One long sequence's posterior on CPU, three ways, in one process, interleaved: as a batch of its own chunks in
both directions (`chain.posterior_chunked`), on two threads meeting in the middle (`sum_product.posterior_halves`,
exact), and step by step on one thread. What decides `backend.HALVES_MAX_K`, the largest matrix whose long
sequences run on the two meeting threads rather than in chunks.

    python bench/long_posterior.py [--sizes 128,256,512,1024] [--tokens 10000] [--rounds 3] [--out FILE]

The workload of bench/hmm_inference.py (random HMM, V = 10,000, float32, calibrated as the service does).
"% of limit": a posterior's 4 K^2 flop per token (forward and backward) against the faster float32 GEMM peak
of this process's BLAS libraries, measured in the same run. Results are appended to --out (default
bench/results/long_posterior.md).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hmm_inference import (  # noqa: E402
    LONG_S,
    append_section,
    interleaved,
    machine,
    matmul_peaks,
    model_and_batches,
    one_thread,
    posterior_on,
    run_heading,
    shown,
    size_args,
    timed,
)

from latentlm.models import backend, chain  # noqa: E402
from latentlm.models.kernels import sum_product  # noqa: E402


def measure(Z: int, rounds: int, peak: float) -> str:
    """One table row: the three ways on Z states, the chunked result's distance to the exact one."""
    m, _, lg = model_and_batches(Z)
    init, emit, trans = m.chain(lg)
    n = lg.ids.shape[1]
    sec = interleaved({"chunked": lambda: chain.posterior_chunked(init, emit, trans),
                       "halves": lambda: sum_product.posterior_halves(init, emit.table, emit.rows, trans, n)},
                      rounds, LONG_S)
    with one_thread():
        seq = n / timed(lambda: posterior_on(m, lg, chunk_long=False), LONG_S)
    ref = sum_product.posterior_halves(init, emit.table, emit.rows, trans, n)[0]
    err = float((chain.posterior_chunked(init, emit, trans)[0] - ref).abs().max())
    chunked, halves = (n / sec[p] for p in ("chunked", "halves"))
    limit = peak / (4 * Z * Z)
    auto = "chunked" if Z > backend.HALVES_MAX_K else "halves"
    return (f"| {Z} | {chunked:,.0f} ({chunked / limit:.0%}) | {halves:,.0f} ({halves / limit:.0%}) | "
            f"{seq:,.0f} ({seq / limit:.0%}) | {chunked / halves:.2f}x | {err:.1e} | {auto} |")


def main() -> None:
    args = size_args(__doc__, "128,256,512,1024", "long_posterior.md")
    info = machine()
    peaks = matmul_peaks()
    peak = max(peaks.values())
    lines = []
    for Z in (int(s) for s in args.sizes.split(",")):
        shown(lines, measure(Z, args.rounds, peak))
    text = [*run_heading(info),
            f"Command: `python bench/long_posterior.py --sizes {args.sizes} --rounds {args.rounds}`. One 10,000-token "
            f"sequence; tokens/s (median of {args.rounds} interleaved rounds, alternating which path goes first; "
            f"each round the median call over at least {LONG_S} s) and % of the limit (GEMM peaks this run: "
            + ", ".join(f"{k} {v / 1e9:.0f}" for k, v in peaks.items()) + " GFLOP/s). \"max |diff|\": the largest "
            "difference between the chunked and the exact posteriors. \"auto\": what `m.posterior` runs for it.", "",
            "| Z | chunked | halves (exact) | one thread, step by step | chunked / halves | max \\|diff\\| | auto |",
            "|---|---|---|---|---|---|---|", *lines, ""]
    append_section(args.out, "One long sequence's posterior on CPU (`bench/long_posterior.py`): chunks, two "
                   "meeting threads, one thread", text)


if __name__ == "__main__":
    main()
