"""Speed of sampling from the next-token distribution (`top_k` / `top_p`: forward filtering, then the states by
backward sampling, `ChainFamily.sample_predictive`) against ancestral sampling (state, then token: what a request
without them gets), in one process, on stored models: ms per step (n samples x 20 tokens, no stop), huge pages as
the CLI and the service ask.

    python bench/sampling_shaped.py --model STORE:NAME [--model STORE:NAME ...] [--out FILE]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import latentlm

latentlm.huge_pages()

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hmm_inference import append_section, machine, run_heading  # noqa: E402

from latentlm import ops  # noqa: E402

STEPS = 20


def ms_per_step(model: ops.LoadedModel, n: int, **shaping) -> float:
    ops.sample(model, n=n, max_tokens=2, seed=0, **shaping)  # warm-up: tables, compiled kernels
    t0 = time.perf_counter()
    ops.sample(model, n=n, max_tokens=STEPS, seed=1, stop_at_eos=False, **shaping)
    return (time.perf_counter() - t0) / STEPS * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", action="append", required=True, help="STORE:NAME of a stored chain-family model")
    ap.add_argument("--out", default="bench/results/sampling_shaped.md")
    args = ap.parse_args()
    lines = run_heading(machine()) + ["Command: `python " + " ".join(sys.argv) + "`", "",
                                      "| model | family | states | sampling | ms/step n=1 | n=16 | n=256 |",
                                      "|---|---|---|---|---|---|---|"]
    for spec in args.model:
        store, name = spec.rsplit(":", 1)
        model = ops.load_model(store, name)
        for label, shaping in (("ancestral (T=1)", {}), ("top_p=0.9", {"top_p": 0.9}),
                               ("top_k=40, T=0.8", {"top_k": 40, "temperature": 0.8})):
            ms = [ms_per_step(model, n, **shaping) for n in (1, 16, 256)]
            lines.append(f"| {name} | {model.family} | {model.impl.num_states:,} | {label} | "
                         + " | ".join(f"{x:.2f}" for x in ms) + " |")
            print(lines[-1], flush=True)
    append_section(Path(args.out), "Sampling from the next-token distribution (bench/sampling_shaped.py)",
                   lines + [""])


if __name__ == "__main__":
    main()
