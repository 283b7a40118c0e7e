"""Shared settings for the training tests: tiny PTB slices, no progress bars."""

from __future__ import annotations

import argparse
from pathlib import Path


def train_args(store: Path, family: str, **kw) -> argparse.Namespace:
    """A `latentlm train` namespace (as argparse would give it) for a small CPU run."""
    base = {"family": family, "data": ["ptb"], "name": f"t-{family}", "store": store, "config": None,
            "resume": False, "progress": False, "valid_sentences": 0, "batch": 64}
    base.update(kw)
    return argparse.Namespace(**base)


def valid_file(tmp: Path, n: int) -> Path:
    """The first n PTB validation sentences as a text file (for `latentlm eval --data FILE`)."""
    from latentlm.training.data import ptb_sentences

    path = tmp / f"valid{n}.txt"
    path.write_text("".join(" ".join(s) + "\n" for s in ptb_sentences("valid")[:n]), encoding="utf-8")
    return path
