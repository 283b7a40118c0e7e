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


def huge_pages() -> None:
    """Call before torch is imported, in a process that will load or train models (`latentlm serve`, `worker`, the
    scoring commands, `eval`, `train`, `train-tagger`): torch's CPU allocator then aligns every allocation of 2 MiB
    or more to 2 MiB and asks the kernel for transparent huge pages there (THP_MEM_ALLOC_ENABLE=1, read by torch at
    its first allocation; a value already in the environment wins; where THP is "never" the kernel ignores the
    request). A blocked HMM's step reads a k x k block whose k rows lie a whole row of the Z x Z matrix apart: at
    2^15 states, 256 rows 128 KiB apart, each on its own 4 KiB page, so every block costs 256 TLB misses; on 2 MiB
    pages, 16. Measured on the 2^15-state PTB model (2-core Intel Xeon VM, alternating processes): scoring 53k ->
    63k tokens/s on random ids, 57k -> 68k on PTB sentences (bench/results/blocked_sweeps.md). Training's step
    (tied-16k, alternating processes on two days): 4-22% faster; the documented 2-hour run took 16x fewer page
    faults and 15% less peak memory (7.9 against 9.3 GiB; results/ptb_results.md)."""
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")


def flush_denormals_for_training() -> bool:
    """Call in a process that will train, after `tune_openmp_for_training` and before torch runs its first
    parallel operation: set flush-to-zero and denormals-are-zero on the calling thread, which every thread
    created after it inherits (torch's OpenMP pool, which also runs the GEMMs; the compiled E-step's pool).
    Float32 values below 1.2e-38 (float64: 2.2e-308) then count as 0 instead of taking the CPU's slow path. A
    VL-HMM sharpens as it trains: in the 2-hour run's final model, 0.12% of the transition logits' gradient
    entries were denormal and made each of the two backward GEMMs over them ~30% slower (142 -> 107 ms; the
    step ~870 ms at the end of training against ~690 ms at its start; bench/results/training_throughput.md).
    Threads created before the call keep their setting. Returns False where the CPU has no such mode."""
    import torch

    return bool(torch.set_flush_denormal(True))

