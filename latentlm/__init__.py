"""latentlm: served exact inference for latent-variable language models."""

import os

__version__ = "0.1.0"

TRAINING_GOMP_SPINCOUNT = "10000"


def tune_openmp_for_training() -> None:
    """Call before torch is imported, in a process that will train: let torch's OpenMP threads sleep after
    10,000 spins instead of libgomp's default 300,000 (libgomp reads GOMP_SPINCOUNT once, when torch loads it;
    a value already in the environment wins). A training step alternates torch's parallel regions with the
    compiled E-step (`models.kernels.blocked`), whose second thread shares the cores with torch's pool: with
    the default spin, torch's idle thread holds a core while that thread waits for it. Measured on the Chiu &
    Rush Table 3 Brown step (2-core AMD EPYC Zen 5): the E-step 5.2 -> 3.9 ms, the step 41.2 -> 39.6 ms
    (bench/results/training_throughput.md)."""
    os.environ.setdefault("GOMP_SPINCOUNT", TRAINING_GOMP_SPINCOUNT)
