"""Collect the PTB runs of bench/train_ptb_runs.sh into a Markdown table (printed to stdout).

Usage: python bench/train_ptb_table.py STORE [NAME ...]
Valid/test perplexities come from `latentlm eval` (the service's scoring path) saved by the run script.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def row(store: Path, name: str) -> str | None:
    mdir = store / name
    if not (mdir / "manifest.json").is_file():
        return None
    m = json.loads((mdir / "manifest.json").read_text())
    ev = {}
    evf = store / "logs" / f"{name}.eval"
    if evf.is_file():
        for line in evf.read_text().splitlines():
            if line.startswith("{"):
                r = json.loads(line)
                ev[r["data"]] = r["perplexity"]
    tfile = store / "logs" / f"{name}.time"
    wall = tfile.read_text().strip() if tfile.is_file() else "?"
    s = m["provenance"]["settings"]
    cfg = m["config"]
    family = s.get("family", m["family"])
    keys = {"hmm": ("states", "epochs", "batch", "init_noise", "smoothing"),
            "densehmm": ("states", "hidden", "epochs", "lr", "fit"),
            "blocked_hmm": ("states", "clusters", "hidden", "epochs", "batch", "lr", "state_dropout", "bptt"),
            "rank_hmm": ("states", "rank", "hidden", "epochs", "batch", "lr", "dropout")}.get(family, ())
    fam = m["family"] if family != "densehmm" else "hmm (DenseHMM)"
    settings = ", ".join(f"{k}={s[k]}" for k in keys if s.get(k) is not None)
    steps = m["provenance"].get("steps")
    rows = m["provenance"]["curve"]
    em_iters = rows[-1].get("iteration", len(rows))
    iters = f"{steps} steps, {len(rows) - 1} evals" if steps else f"{em_iters} EM iterations"
    return (f"| {name} | {fam} | {cfg['num_states']} | {ev.get('ptb:valid', float('nan')):.1f} | "
            f"{ev.get('ptb:test', float('nan')):.1f} | {m['provenance']['train_seconds']:.0f} s ({wall}) | "
            f"{iters} | {settings} |")


def main() -> None:
    store = Path(sys.argv[1])
    names = sys.argv[2:] or sorted(p.name for p in store.iterdir() if (p / "manifest.json").is_file())
    print("| model | family | states | valid ppl | test ppl | training time (process) | schedule | settings |")
    print("|---|---|---|---|---|---|---|---|")
    for n in names:
        r = row(store, n)
        if r:
            print(r)


if __name__ == "__main__":
    main()
