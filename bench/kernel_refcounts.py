"""What numba's reference counting costs the compiled kernels: the shipped kernels (`jit.BORROWED`: no
reference counting) against clones of the same functions compiled with it, in one process, interleaved.

    python bench/kernel_refcounts.py [--sizes 64,256,1024] [--rounds 3] [--out FILE]

The clones are made from the kernels' own Python source (every numba function of `groups`, `lockstep`,
`maxplus` and `rows` recompiled with reference counting, each clone calling the other clones), and swapped
into those modules for the "counted" timings, so both variants run through the same public calls, engine
choices and threads: `m.score`, `m.posterior`, `m.viterbi` on the workloads of bench/hmm_inference.py
(random HMM, V = 10,000; a batch of 64 x 50 tokens and one sequence of 10,000). Engines are those the
calibration (`DenseHMM.calibrate`, what `latentlm serve` runs) picks with the shipped kernels; the Z = 64
posterior is also timed on each batch engine by name. Results (markdown) are appended to --out (default
bench/results/kernel_refcounts.md) with the CPU and the date.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import sys
import types
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hmm_inference import machine, model_and_batches, timed  # noqa: E402

from latentlm.models import chain  # noqa: E402
from latentlm.models.kernels import groups, lockstep, maxplus, rows  # noqa: E402

MODULES = (groups, lockstep, maxplus, rows)


def counted_clones() -> dict[types.ModuleType, dict[str, object]]:
    """For each kernel module, its numba functions recompiled with reference counting (no disk cache), as
    {module: {name: clone}}. A clone's globals are its module's with every numba function replaced by its
    clone (inlined helpers from other modules are compiled into their callers, so they follow the caller)."""
    from numba import njit
    from numba.core.registry import CPUDispatcher

    clones: dict[types.ModuleType, dict[str, object]] = {}
    for mod in MODULES:
        namespace = dict(vars(mod))
        made = {}
        for name, obj in vars(mod).items():
            if isinstance(obj, CPUDispatcher) and obj.py_func.__module__ == mod.__name__:
                opts = {k: v for k, v in obj.targetoptions.items() if k not in ("_nrt", "cache", "nopython")}
                f = obj.py_func
                clone = types.FunctionType(f.__code__, namespace, name, f.__defaults__, f.__closure__)
                made[name] = njit(**opts)(clone)
        namespace.update(made)
        clones[mod] = made
    return clones


@contextlib.contextmanager
def swapped(clones: dict[types.ModuleType, dict[str, object]]):
    """The kernel modules' functions replaced by the counted clones while inside."""
    saved = {mod: {name: getattr(mod, name) for name in made} for mod, made in clones.items()}
    try:
        for mod, made in clones.items():
            for name, fn in made.items():
                setattr(mod, name, fn)
        yield
    finally:
        for mod, names in saved.items():
            for name, fn in names.items():
                setattr(mod, name, fn)


def workloads(Z: int) -> dict[str, tuple[int, object]]:
    """name -> (tokens per call, call) for one model of Z states."""
    m, b, lg = model_and_batches(Z)
    calls = {"score/batch": (3200, lambda: m.score(b)), "score/long": (10_000, lambda: m.score(lg)),
             "posterior/batch": (3200, lambda: m.posterior(b)), "posterior/long": (10_000, lambda: m.posterior(lg)),
             "viterbi/batch": (3200, lambda: m.viterbi(b)), "viterbi/long": (10_000, lambda: m.viterbi(lg))}
    if Z <= 64:
        init, emit, trans = m.chain(b)
        for engine in ("groups", "lockstep"):
            calls[f"posterior/batch@{engine}"] = (
                3200, lambda e=engine: chain.posterior(init, emit, trans, b.lengths, backend=e))
    return calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="64,256,1024")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds (shipped, counted) per workload")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "kernel_refcounts.md")
    args = ap.parse_args()
    info = machine()
    clones = counted_clones()
    rows_out = []
    for Z in (int(s) for s in args.sizes.split(",")):
        for name, (tokens, call) in workloads(Z).items():
            shipped, counted = [], []
            for r in range(args.rounds):  # which variant goes first alternates between rounds
                if r % 2:
                    with swapped(clones):
                        counted.append(tokens / timed(call, 0.5, 15))
                shipped.append(tokens / timed(call, 0.5, 15))
                if r % 2 == 0:
                    with swapped(clones):
                        counted.append(tokens / timed(call, 0.5, 15))
            s, c = float(np.median(shipped)), float(np.median(counted))
            rows_out.append(f"| {Z} | {name} | {s:,.0f} | {c:,.0f} | {s / c:.2f}x |")
            print(rows_out[-1], flush=True)
    when = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    text = [f"\n## {when}: {info['cpu']} ({info['vector']}), {info['cores']} cores, torch threads "
            f"{torch.get_num_threads()}", "",
            f"Command: `python bench/kernel_refcounts.py --sizes {args.sizes} --rounds {args.rounds}`. Tokens/s, the "
            f"median of {args.rounds} interleaved rounds (alternating which goes first; each the median call over at "
            "least 0.5 s).", "",
            "| Z | workload | shipped (no reference counting) | counted clones | shipped / counted |",
            "|---|---|---|---|---|", *rows_out, ""]
    if not args.out.exists():
        args.out.write_text("# Reference counting in the compiled kernels\n\nMade by `bench/kernel_refcounts.py` "
                            "(see its docstring).\n")
    with args.out.open("a") as f:
        f.write("\n".join(text))
    print(f"appended to {args.out}")


if __name__ == "__main__":
    main()
