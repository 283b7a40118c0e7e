"""What calibrating at load buys the CLI (`latentlm score` / `eval` load through `ops.load_model(calibrate=True)`
since the service's calibration was shared with them): scoring and posteriors of a 64 x 50-token batch on dense
HMMs, with the engines the uncalibrated defaults pick against the ones `models.calibrate` measured fastest, timed
alternately in one process (the fastest of `--rounds` calls each).

    python bench/cli_calibration.py --states 256 1024 --out bench/results/cli_calibration.md
"""

from __future__ import annotations

import argparse
import platform
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import torch

from latentlm import ops
from latentlm.models import backend as dispatch
from latentlm.models.registry import save_artifact
from latentlm.models.synthetic import random_hmm
from latentlm.models.vocab import Preprocessing, Vocabulary


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown CPU"


def fastest(fn, rounds: int) -> float:
    best = float("inf")
    for _ in range(rounds):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--states", type=int, nargs="+", default=[256, 1024])
    ap.add_argument("--vocab", type=int, default=10_000)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--length", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    torch.set_num_threads(2)
    vocab = Vocabulary([f"w{i}" for i in range(a.vocab - 1)] + ["<eos>"], Preprocessing(unk=None))
    g = torch.Generator().manual_seed(0)
    seqs = torch.randint(0, a.vocab - 1, (a.rows, a.length), generator=g).tolist()
    tokens = a.rows * a.length
    rows = []
    with tempfile.TemporaryDirectory() as d:
        for Z in a.states:
            t, c = random_hmm(Z, a.vocab, seed=Z)
            save_artifact(d, f"z{Z}", "hmm", t, vocab, config=c)
            model = ops.load_model(d, f"z{Z}")
            saved = dict(dispatch.CHOICES)
            for key in [k for k in dispatch.CHOICES if k[0] == Z]:
                dispatch.CHOICES.pop(key)
            uncalibrated = dict(dispatch.CHOICES)
            model.impl.calibrate()
            calibrated = dict(dispatch.CHOICES)
            times: dict[tuple[str, str], float] = {}
            for _ in range(3):  # alternate the two settings
                for label, choices in (("defaults", uncalibrated), ("calibrated", calibrated)):
                    dispatch.CHOICES.clear()
                    dispatch.CHOICES.update(choices)
                    for op in ("score", "posterior"):
                        opts = {"top_k": 1} if op == "posterior" else {}
                        s = fastest(lambda m=model, op=op, opts=opts: ops.run(m, op, seqs, **opts), a.rounds)
                        times[(label, op)] = min(times.get((label, op), float("inf")), s)
            dispatch.CHOICES.clear()
            dispatch.CHOICES.update(saved)
            picked = {op: calibrated[(Z, torch.float32, m)] for op, m in (("score", False), ("posterior", True))}
            engines = {op: f"{c.engine.value}/{c.provider}" for op, c in picked.items()}
            for op in ("score", "posterior"):
                d0, d1 = times[("defaults", op)], times[("calibrated", op)]
                rows.append(f"| {Z} | {op} | {tokens / d0 / 1e3:,.0f}k | {tokens / d1 / 1e3:,.0f}k | {d0 / d1:.2f}x | "
                            f"{engines[op]} |")
    head = (f"\n## {datetime.now(UTC):%Y-%m-%d %H:%M} UTC: {cpu_name()}, {torch.get_num_threads()} torch "
            f"threads\n\nCommand: `python bench/cli_calibration.py --states {' '.join(map(str, a.states))}`; "
            f"{a.rows} x {a.length} tokens, V = {a.vocab}, fastest of {a.rounds} calls, settings alternated 3 "
            "times.\n\n"
            "| states | operation | defaults tok/s | calibrated tok/s | ratio | calibrated engine |\n"
            "|---|---|---|---|---|---|\n")
    text = head + "\n".join(rows) + "\n"
    print(text)
    if a.out is not None:
        if not a.out.exists():
            a.out.write_text("# What calibration at load buys the CLI (bench/cli_calibration.py)\n\nEvery run is "
                             "appended, with its machine.\n")
        with a.out.open("a") as f:
            f.write(text)


if __name__ == "__main__":
    main()
