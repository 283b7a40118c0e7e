"""Measure, on this machine, which batch sum-product engine and which BLAS is fastest for a model's matrix.

CPUs differ: torch's MKL runs a (rows x K) x (K x K) step near a core's peak on Intel and takes slower paths
on AMD, where numpy's bundled OpenBLAS is often faster; the compiled no-BLAS kernels win for small matrices
on some machines and not on others. `calibrate` times each candidate the process can run (the lockstep
kernels on every loaded BLAS, the compiled groups, the plain PyTorch recursion) on a synthetic batch of the
model's size (a forward for scoring and a posterior), keeps the fastest in `backend.CHOICES` for that
(K, dtype), and logs the timings. Every candidate computes the same numbers (tested); only speed differs.
The service calibrates each chain model it loads (`latentlm serve`, LATENTLM_CALIBRATE). Several processes of one
service (its API workers) share one measurement through a file (`share_with`): the first to load a matrix size
times the candidates while the others wait on the file's lock, then read its choice, so N workers starting
together neither time N times nor disturb each other's timings (and so pick the same engine).
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import timeit
from functools import partial
from pathlib import Path

import torch
from torch import Tensor

from latentlm.models import backend as dispatch
from latentlm.models import chain
from latentlm.models.backend import Backend, Choice
from latentlm.models.kernels import blas

log = logging.getLogger("latentlm.models.calibrate")

ROWS = 32  # sequences in the synthetic batch (a typical merged batch of the service)
MARGIN = 0.9  # another candidate replaces the default engine only when it takes at most this share of its time
#               (timings on a busy machine jitter by 10-30%; a coin-flip switch would help no one)
WORK_FLOP = 1 << 29  # the synthetic forward's size: about this many flop (2 ROWS T K^2), T from 8 to 32


def candidates(K: int) -> list[tuple[Backend, str]]:
    """(engine, BLAS) pairs that can run a batch sum-product on a K x K matrix here."""
    out: list[tuple[Backend, str]] = [(Backend.LOCKSTEP, name) for name in blas.PROVIDERS]
    if dispatch.available(Backend.GROUPS) and K <= 2 * dispatch.GROUPS_MAX_K:
        out.append((Backend.GROUPS, ""))
    out.append((Backend.TORCH, ""))
    return out


def _workload(K: int, dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    steps = max(8, min(32, WORK_FLOP // (2 * ROWS * K * K)))
    g = torch.Generator().manual_seed(0)
    emit = torch.rand(ROWS, steps, K, generator=g, dtype=dtype)
    init = torch.full((ROWS, K), 1.0 / K, dtype=dtype)
    return init, emit, torch.full((ROWS,), steps)


def _fastest(fns: dict[str, object], rounds: int) -> dict[str, float]:
    """Seconds of the fastest call of each fn, timed in `rounds` interleaved rounds (every candidate once per
    round, after one warm-up call each: numba's cache, BLAS buffers) and the minimum kept: other processes
    only ever add time, and interleaving spreads a machine's drift (a busy neighbour, a slower second core in
    a VM) over every candidate instead of charging it to whichever ran while it lasted."""
    for fn in fns.values():
        fn()  # type: ignore[operator]
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(rounds):
        for name, fn in fns.items():
            best[name] = min(best[name], timeit.timeit(fn, number=1))  # type: ignore[arg-type]
    return best


OPERATIONS = {"score": False, "posterior": True}  # what is timed -> whether its calls keep marginals
_shared: Path | None = None  # `share_with`


def share_with(path: Path | str | None) -> None:
    """Calibrations of this process are read from and written to the JSON file `path` (None: this process
    alone), shared by the processes of one service on one machine (`latentlm serve`'s workers). A measurement
    is keyed by matrix size, dtype and torch's thread count; the file holds choices and timings only."""
    global _shared
    _shared = Path(path) if path is not None else None


def _shared_key(K: int, dtype: torch.dtype) -> str:
    return f"{K}/{str(dtype).removeprefix('torch.')}/{torch.get_num_threads()} threads"


def _read_shared(path: Path) -> dict:
    """The file's measurements; {} when it is missing or not what this module writes (measured again)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _choice_from(entry: object) -> Choice | None:
    try:
        engine, provider, timings = entry["engine"], entry["provider"], entry["timings_ms"]  # type: ignore[index]
        choice = Choice(Backend(engine), str(provider), {str(k): float(v) for k, v in dict(timings).items()})
    except (KeyError, TypeError, ValueError):
        return None
    if (choice.provider and choice.provider not in blas.PROVIDERS) or not dispatch.available(choice.engine):
        return None  # a BLAS or an engine this process cannot run: measured again
    return choice


def calibrate(trans: Tensor, *, rounds: int = 7) -> dict[str, Choice] | None:
    """`measure`, or, where this process shares its calibrations (`share_with`), the shared file's choice for
    this matrix size, dtype and thread count: measured by the first process to get there, under the file's lock
    (the others wait for it), and written for the rest."""
    if (_shared is None or trans.device.type != "cpu" or trans.dtype not in (torch.float32, torch.float64)
            or trans.requires_grad):
        return measure(trans, rounds=rounds)
    K, dtype, key = trans.shape[-1], trans.dtype, _shared_key(trans.shape[-1], trans.dtype)
    _shared.parent.mkdir(parents=True, exist_ok=True)
    with open(_shared.with_name(_shared.name + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        data = _read_shared(_shared)  # nobody writes it while this process holds the lock
        entry = data.get(key)
        if isinstance(entry, dict):
            chosen = {op: _choice_from(entry.get(op)) for op in OPERATIONS}
            if all(c is not None for c in chosen.values()):
                for op, marginals in OPERATIONS.items():
                    dispatch.CHOICES[(K, dtype, marginals)] = chosen[op]  # type: ignore[assignment]
                log.info("calibration for K=%d %s read from %s: %s", K, str(dtype).removeprefix("torch."), _shared,
                         {op: label(c.engine, c.provider) for op, c in chosen.items() if c is not None})
                return chosen  # type: ignore[return-value]
        measured = measure(trans, rounds=rounds)
        if measured is not None:
            data[key] = {op: {"engine": c.engine.value, "provider": c.provider, "timings_ms": c.timings_ms}
                         for op, c in measured.items()}
            tmp = _shared.with_name(f"{_shared.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(data, indent=1))
            os.replace(tmp, _shared)
        return measured


def measure(trans: Tensor, *, rounds: int = 7) -> dict[str, Choice] | None:
    """Time every candidate on this machine with `trans` (K, K) on CPU, separately for scoring (a forward)
    and for posteriors (forward and backward keeping marginals), in `rounds` interleaved rounds, and record
    the fastest of each in `backend.CHOICES[(K, dtype, marginals)]`: the default (lockstep on the default
    BLAS) unless another takes at most MARGIN of its time. Returns {"score": Choice, "posterior": Choice},
    or None where no compiled engine can run (GPU, autograd, no numba). Costs well under a second for
    K <= 1,024."""
    if trans.device.type != "cpu" or trans.dtype not in (torch.float32, torch.float64) or trans.requires_grad:
        return None
    K, dtype = trans.shape[-1], trans.dtype
    init, emit, lengths = _workload(K, dtype)
    if not dispatch.compiled_ok(emit, trans, init):
        return None
    runs = {"score": lambda engine: chain.forward(init, emit, trans, lengths, backend=engine),
            "posterior": lambda engine: chain.posterior(init, emit, trans, lengths, backend=engine)}
    before = {key: dispatch.CHOICES.get(key) for key in ((K, dtype, m) for m in OPERATIONS.values())}

    def call(op: str, engine: Backend, provider: str) -> None:
        for key in before:  # so the call (and any forward or backward inside it) takes this BLAS
            dispatch.CHOICES[key] = Choice(engine, provider, {})
        runs[op](engine)

    timings: dict[str, dict[str, float]] = {}
    try:
        for op in OPERATIONS:
            fns = {label(e, p): partial(call, op, e, p) for e, p in candidates(K)}
            timings[op] = {name: round(sec * 1e3, 3) for name, sec in _fastest(fns, rounds).items()}
    finally:
        for key, choice in before.items():
            if choice is None:
                dispatch.CHOICES.pop(key, None)
            else:
                dispatch.CHOICES[key] = choice
    default = label(*candidates(K)[0])
    chosen: dict[str, Choice] = {}
    for op, marginals in OPERATIONS.items():
        best = min(timings[op], key=timings[op].__getitem__)
        if timings[op][best] > MARGIN * timings[op][default]:
            best = default
        engine_name, _, provider = best.partition("/")
        chosen[op] = dispatch.CHOICES[(K, dtype, marginals)] = Choice(Backend(engine_name), provider, timings[op])
        log.info("calibrated %s for K=%d %s: %s (ms for %d x %d tokens: %s)", op, K, str(dtype).removeprefix("torch."),
                 best, ROWS, int(lengths[0]), timings[op])
    return chosen


def label(engine: Backend, provider: str) -> str:
    """"lockstep/openblas", "groups", "torch": how a candidate is named in timings and /v1/models."""
    return f"{engine.value}/{provider}" if provider else engine.value


def describe(K: int, dtype: torch.dtype) -> dict[str, object]:
    """What /v1/models shows for a matrix size: the measured choices and their timings, or that none was made."""
    chosen = {op: dispatch.CHOICES.get((K, dtype, marginals)) for op, marginals in OPERATIONS.items()}
    if any(c is None for c in chosen.values()):
        return {"blas": dispatch.provider(K, dtype) or "none", "calibrated": False}
    return {"calibrated": True,
            "engines": {op: label(c.engine, c.provider) for op, c in chosen.items() if c is not None},
            "calibration_ms": {op: c.timings_ms for op, c in chosen.items() if c is not None}}
