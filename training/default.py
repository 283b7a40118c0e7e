"""The model the service builds on first start with an empty store: a real HMM language model trained on
PTB by Baum-Welch on the CPU (no GPU), a few minutes on 2 cores including data preparation."""

from __future__ import annotations

import argparse
from pathlib import Path

DEFAULT_SETTINGS = {"family": "hmm", "data": ["ptb"], "states": 256, "epochs": 20, "batch": 512,
                    "init_noise": 3.0}


def build_default_model(store: Path, name: str = "ptb-hmm", progress: bool = True) -> Path:
    """Train and export `name` (a dense Baum-Welch HMM on PTB) into `store`; returns the artifact dir."""
    import torch

    from latentlm.training.settings import resolve_settings

    args = argparse.Namespace(**DEFAULT_SETTINGS, name=name, store=Path(store), progress=progress, config=None,
                              resume=False, seed=0, patience=2)
    ns = resolve_settings(args)
    from latentlm.training.baum_welch import train

    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(min(threads, 2))
        return train(ns)
    finally:
        torch.set_num_threads(threads)
