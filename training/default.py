"""The model the service builds on first start with an empty store: a real HMM language model trained on
PTB on the CPU (no GPU), within 5 minutes on 2 cores including data preparation.

Since 2026-11-26 it is a rank-space HMM (Yang et al. 2022; `rank_hmm`: 1,024 states, rank 256, a neural
parameterization trained by AdamW), chosen among the candidates measured on the 2-core machine
(`results/ptb_results.md`, "Default model candidates"); it replaced the 256-state Baum-Welch HMM (20 EM
iterations: 271.4 / 246.7 valid / test perplexity). It serves every operation the README shows the default
model with: score, posterior, decode (viterbi: 1,024^2 entries per token are within rank_hmm's limit; mbr)
and sample.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

DEFAULT_NAME = "ptb-hmm"
DEFAULT_SETTINGS: dict[str, Any] = {"family": "rank_hmm", "data": ["ptb"], "states": 1024, "rank": 256,
                                    "hidden": 128, "epochs": 3, "batch": 64, "lr": 0.01, "dropout": 0.1}


def default_args(store: Path, name: str = DEFAULT_NAME, progress: bool = True, **overrides: Any
                 ) -> argparse.Namespace:
    """The `latentlm train` namespace of the default recipe (`overrides`, e.g. `max_steps` or
    `train_sentences`, shrink it for tests)."""
    settings = {**DEFAULT_SETTINGS, "name": name, "store": Path(store), "progress": progress, "config": None,
                "resume": False, "seed": 0, "patience": 2, **overrides}
    return argparse.Namespace(**settings)


def build_default_model(store: Path, name: str = DEFAULT_NAME, progress: bool = True, **overrides: Any) -> Path:
    """Train and export `name` (the default recipe, `DEFAULT_SETTINGS`) into `store`; returns the artifact
    dir. At most 2 torch threads (the machine it was sized on has 2 cores)."""
    import torch

    from latentlm.training.settings import resolve_settings, train

    ns = resolve_settings(default_args(store, name, progress, **overrides))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(min(threads, 2))
        return train(ns)
    finally:
        torch.set_num_threads(threads)
