"""`latentlm distill --family blocked_hmm`: a VL-HMM (Chiu & Rush 2020) over the LM's token ids, trained on the LM's
samples by the neural trainer that `latentlm train --family blocked_hmm` runs (`training.neural.loop.fit`: Brown
clusters of the token ids, exact forward-backward gradients, state dropout, AdamW, evaluation and early stopping,
the best evaluation exported), not by EM.

Why a second family: a dense `hmm` holds Z x V emissions, and EM keeps float32 parameters and float64 counts for
all of them (16 bytes per entry of Z (Z + V): 43 GiB at 32,768 states over GPT-2's 50,257 tokens). A `blocked_hmm`
over M clusters of token ids lets each token be emitted by its cluster's k = Z / M states only: Z^2 transitions
plus V k emissions, and a training step's DP is O(B T k'^2) for the k' states state dropout keeps.

Clusters (`--clusters M`, default `default_clusters`): Brown clusters of the token ids over the training samples'
bigrams (`training.brown`). M divides Z. The default is the largest divisor of Z up to min(128, Z / 16) (and up to
the distinct tokens the samples hold): 128 is the cluster count of every VL-HMM recipe in `configs/` (4,096 to
32,768 states; Chiu & Rush's too), and at least 16 states per cluster leave 8 per token under the trainer's state
dropout 0.5 (fewer, larger clusters give each token more states; more, smaller ones make steps cheaper).

The run: the samples (shards, shared with `--family hmm` runs of the same LM and settings) become the trainer's
training and validation sequences (`data.Sequences`) over the LM's vocabulary; the trainer's settings are the
recipe's defaults (`Recipe.defaults` of blocked_hmm: hidden 256, batch 64 sequences, 10 epochs, lr 0.01, factored
state embeddings, state dropout 0.5, early stopping after 2 evaluations without improvement) with --states,
--clusters, --epochs, --lr, --seed, --device and --time-limit. Checkpoints go to `<work>/train/`; a rerun reuses
the samples and trains afresh."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from latentlm.models.errors import InputError, LimitExceeded
from latentlm.models.kernels import gemm
from latentlm.models.tokenizer import TOKENIZER_FILE
from latentlm.training.data import Sequences
from latentlm.training.distill_em import PAD
from latentlm.training.distill_sampling import LMInfo
from latentlm.training.options import OPTIONS, TrainSettings
from latentlm.training.recipes import recipes

GIB = 1 << 30
MAX_CLUSTERS = 128
MIN_STATES_PER_CLUSTER = 16
PY_BYTES_PER_TOKEN = 48  # a token id in the trainer's list of lists (int object + pointer) and its batch's int64
PY_BYTES_PER_SEQUENCE = 120  # a list's header and its Batch's share
TRAINER_BYTES = 64 << 20  # what the trainer holds whatever the size (measured: up to about 30 MiB above
#                          `memory_estimate`'s parts), with a margin


class DistillSettings(Protocol):
    """What this module reads of `distill.DistillSettings` (described here, not imported: `distill` imports this
    module)."""

    name: str
    store: Path
    states: int
    samples: int
    max_length: int
    seed: int
    progress: bool
    max_memory: float | None
    clusters: int | None
    epochs: int | None
    lr: float | None

    @property
    def valid_count(self) -> int: ...


class Run(Protocol):
    """What `train` reads of a `distill.Run` whose samples are drawn."""

    s: DistillSettings
    info: LMInfo
    clusters: int
    device: torch.device
    sample_dir: Path
    work: Path
    t0: float
    train_tokens: int
    record: dict[str, Any]

    def arrays(self, name: str) -> Iterator[np.ndarray]: ...

    def provenance(self) -> dict[str, Any]: ...


def recipe_defaults() -> dict[str, Any]:
    """The trainer's settings for blocked_hmm before distill's flags: `TrainSettings`' defaults, then the
    recipe's (`latentlm train --family blocked_hmm` without flags)."""
    return {**{k: default for k, (_t, default, _h) in OPTIONS.items()}, **recipes()["blocked_hmm"].defaults}


def default_clusters(states: int, distinct: int | None = None) -> int:
    """The largest divisor of `states` up to min(MAX_CLUSTERS, states // MIN_STATES_PER_CLUSTER) and up to
    `distinct` (the distinct token ids Brown clustering can group), at least 1. O(states)."""
    cap = max(1, min(MAX_CLUSTERS, states // MIN_STATES_PER_CLUSTER, distinct if distinct else states))
    return next(m for m in range(cap, 0, -1) if states % m == 0)


def check(s: DistillSettings) -> None:
    """blocked_hmm's flags, before any work (InputError naming the flag): --clusters divides --states (and keeps a
    state per cluster under state dropout), --epochs a positive integer, --lr positive."""
    if s.clusters is not None:
        c = s.clusters
        if isinstance(c, bool) or not isinstance(c, int) or c < 1:
            raise InputError(f"--clusters: must be a positive integer, got {c!r}", param="clusters")
        if c > s.states or s.states % c:
            raise InputError(f"--clusters {c}: must divide --states {s.states} (each cluster gets --states / "
                             "--clusters states)", param="clusters")
    if s.epochs is not None and (isinstance(s.epochs, bool) or not isinstance(s.epochs, int) or s.epochs < 1):
        raise InputError(f"--epochs: must be a positive integer, got {s.epochs!r}", param="epochs")
    if s.lr is not None and not (s.lr > 0 and math.isfinite(s.lr)):
        raise InputError(f"--lr: must be a positive number, got {s.lr}", param="lr")


def clusters_for(s: DistillSettings, info: LMInfo) -> int:
    """--clusters, or the default for --states; refused (naming --clusters) above the LM's vocabulary."""
    M = s.clusters if s.clusters is not None else default_clusters(s.states)
    if M > info.vocab_size:
        raise InputError(f"--clusters {M}: more clusters than the LM's {info.vocab_size} token ids",
                         param="clusters")
    return M


def memory_estimate(s: DistillSettings, info: LMInfo, clusters: int) -> dict[str, int]:
    """Bytes the run holds at its peak, by part (upper bounds; Z states, M clusters of k = Z / M, k' = k - round(k
    lambda) kept under state dropout lambda, Z' = M k', V tokens, h hidden, B batch rows, L max length):

    * data: the samples as the trainer's lists and batches, PY_BYTES_PER_TOKEN per token of (N + N_valid) L;
    * brown: Liang's window, about 20 (M + 1)^2 float64, and the bigram matrix (CSR and CSC, 32 bytes a token);
    * params: the VL-HMM's parameters ((Z / 2 + V) h + 12 h^2 floats, factored embeddings), each held 7 times
      (parameter, gradient, two AdamW moments, best, checkpoint copy and one spare), float32;
    * step: the transitions over Z' (logits, probabilities, float64 and float32 counts, a float64 retry: 28
      bytes an entry), the emission table V x k' three times, and the DP's B L k' float64 tensors (x 6);
    * evaluate: the exported (Z, Z) float32 transitions three times (export, scoring's log blocks, one spare for
      what the allocator keeps), the (V, k) emissions in float64 and float32, and the export's float64 row blocks;
    * lm: the LM's weights, while sampling.

    Total: max(lm, data + max(brown, params + step + evaluate) + TRAINER_BYTES): step and evaluation add up, since
    the heap keeps what each frees (`common.reuse_freed_memory`, as `latentlm train`). Far below a dense hmm's
    Z (Z + V) entries: O(Z^2 + V k + V h). Measured (the process's peak RSS less a 64-state run's, 587 MiB of Python,
    torch and transformers; 400 samples of 8 tokens, V = 300, one epoch, AMD EPYC, two runs each): 2,048 states
    in 16 clusters +138 and +188 MiB, estimated 249 MiB; 4,096 states +491 and +498 MiB, estimated 562 MiB."""
    ns = recipe_defaults()
    Z, V, M, h, B, L = s.states, info.vocab_size, clusters, ns["hidden"], ns["batch"], s.max_length
    k = Z // M
    kk = k - round(k * ns["state_dropout"])
    Zp = M * kk
    tokens = (s.samples + s.valid_count) * L
    data = PY_BYTES_PER_TOKEN * tokens + PY_BYTES_PER_SEQUENCE * (s.samples + s.valid_count)
    brown = 0 if M == 1 else 20 * 8 * (M + 1) ** 2 + 32 * tokens
    params = 7 * 4 * ((Z // 2 + V + M) * h + 12 * h * h)
    step = 28 * Zp * Zp + 3 * 4 * V * kk + 6 * 8 * B * L * kk + 10 * 4 * Zp * h
    evaluate = 3 * 4 * Z * Z + 12 * V * k + 2 * 8 * min(2048, Z) * Z + 4 * Z * h
    lm = sum(size for size, _ in info.weight_files.values())
    total = max(lm, data + max(brown, params + step + evaluate) + TRAINER_BYTES)
    return {"data": data, "brown": brown, "params": params, "step": step, "evaluate": evaluate, "lm": lm,
            "total": total}


def check_memory(s: DistillSettings, info: LMInfo, device: torch.device, clusters: int, available: int
                 ) -> dict[str, Any]:
    """Refuse (LimitExceeded naming --states) a run whose estimate exceeds `available` bytes."""
    est = memory_estimate(s, info, clusters)
    if est["total"] > available:
        raise LimitExceeded(
            f"--states {s.states}: distilling a blocked_hmm needs about {est['total'] / GIB:.2f} GiB on "
            f"{device.type} ({s.states} states in {clusters} clusters over {info.vocab_size} tokens: "
            f"{est['evaluate'] / GIB:.2f} GiB to export and evaluate the {s.states} x {s.states} transitions, "
            f"{est['step'] / GIB:.2f} GiB per training step, {est['params'] / GIB:.2f} GiB of parameters and "
            f"optimiser state, {est['data'] / GIB:.2f} GiB of samples; the LM {est['lm'] / GIB:.2f} GiB) but "
            f"{available / GIB:.2f} GiB is {'allowed (--max-memory)' if s.max_memory is not None else 'available'}; "
            "lower --states (or --samples, --max-length)", param="states")
    return {"estimate_bytes": est["total"], "available_bytes": available, "parts": est}


def id_sequences(arrays) -> list[list[int]]:
    """Sample shards (int32 [n, L], PAD after each end) as the trainer's sequences: each row's ids up to its end
    (its EOS included where it has one); empty rows dropped. O(n L)."""
    out: list[list[int]] = []
    for a in arrays:
        block = np.asarray(a)
        for row, n in zip(block.tolist(), (block != PAD).sum(1).tolist(), strict=True):
            if n:
                out.append(row[:n])
    return out


def train_settings(s: DistillSettings, *, clusters: int, V: int, device: torch.device, minutes: float,
                   data: str) -> TrainSettings:
    """The trainer's settings: the recipe's (`recipe_defaults`) with --states, --clusters, --epochs, --lr, --seed,
    the device, the minutes left (0: no limit) and the progress bar; `data` names the samples (recorded only).
    Checked by the recipe's own check."""
    values = recipe_defaults()
    values.update(states=s.states, clusters=clusters, seed=s.seed, device=str(device), time_limit=minutes,
                  progress=s.progress, max_vocab=V)
    values.update({k: getattr(s, k) for k in ("epochs", "lr") if getattr(s, k) is not None})
    ns = TrainSettings(family="blocked_hmm", data=(data,), name=s.name, store=Path(s.store), **values)
    check_recipe = recipes()["blocked_hmm"].check
    if check_recipe is not None:
        check_recipe(ns)
    return ns


def train(run: Run, distinct: int, deadline: float | None, log: Callable[[str], None]) -> Path:
    """Train and export the blocked_hmm of a distill run whose samples are drawn (`distinct`: the token ids they
    hold); `deadline` (time.time()) from --time-limit; `log` writes a progress line. Returns the artifact
    directory."""
    from latentlm.training.common import reuse_freed_memory
    from latentlm.training.neural import loop

    s, info = run.s, run.info
    M = run.clusters
    if s.clusters is None:
        M = default_clusters(s.states, distinct)
    elif M > distinct:
        raise InputError(f"--clusters {M}: the {s.samples} training samples hold only {distinct} distinct tokens "
                         "to cluster; lower --clusters (or draw more --samples)", param="clusters")
    minutes = 0.0 if deadline is None else max((deadline - time.time()) / 60, 1e-6)  # > 0: at least one step
    ns = train_settings(s, clusters=M, V=info.vocab_size, device=run.device, minutes=minutes,
                        data=str(run.sample_dir))
    data = Sequences(info.vocab, id_sequences(run.arrays("train")), id_sequences(run.arrays("valid")))
    log(f"blocked_hmm: {s.states} states in {M} clusters of {s.states // M} (Brown clusters of the token ids over "
         f"{len(data.train)} training samples), hidden {ns.hidden}, batch {ns.batch}, lr {ns.lr:g}, up to "
         f"{ns.epochs} epochs" + (f", {minutes:.2f} minutes left" if deadline is not None else ""))
    reuse_freed_memory()  # as `latentlm train` runs its trainer: freed step tensors stay in the heap
    with gemm.using(gemm.backend()):  # the trainer's GEMM library is the process's only while it trains
        fitted = loop.fit(ns, data, checkpoints=run.work / "train")
        for r in fitted.history.rows:
            log(f"step {r['step']} (epoch {r['epoch']:.2f}, {r['seconds']:.1f} s): valid ppl {r['valid_ppl']:.3f}"
                 + (f", train ppl {r['train_ppl']:.3f}" if "train_ppl" in r else ""))
        history = fitted.history
        prov = {**run.provenance(), "init": "random", "clusters": M, "states_per_cluster": s.states // M,
                "trainer_settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(ns).items()},
                "steps": fitted.pos.step, "epochs_done": fitted.pos.tokens / max(run.train_tokens, 1),
                "final_valid_ppl": history.best, "best_valid_ppl": history.best,
                "train_seconds": round(time.perf_counter() - run.t0, 1)}
        path = loop.export(fitted, provenance=prov, extra_files={TOKENIZER_FILE: info.tokenizer_json})
    log(f"wrote {s.name} to {path}: blocked_hmm, {s.states} states in {M} clusters over {info.vocab_size} tokens, "
         f"valid ppl {history.best:.3f} (unigram {run.record['unigram_valid_ppl']:.3f}), {fitted.pos.step} steps")
    return path
