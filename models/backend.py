"""Which engine runs a chain-engine call (`models.chain`), and every threshold behind that choice.

`Backend` names the engines. Each `models.chain` entry point takes `backend=` (default "auto": chosen here
per call from device, dtype, autograd, batch size B, states K, length T and what this machine offers);
an explicit backend runs that engine or raises ValueError if it cannot run the call (tests and benchmarks
name one; `available` says which this machine has).

| backend    | sum-product (forward, backward, posterior)             | max-product (viterbi, maxplus)          |
|------------|--------------------------------------------------------|-----------------------------------------|
| "torch"    | torch ops, one GEMM per step; any device, autograd     | broadcast (max, +) in blocks            |
| "single"   | one sequence's forward whole in compiled code          | one sequence's Viterbi in compiled code |
|            | (log_cond only; split over two threads when large)     | (split by columns over two threads)     |
| "groups"   | ROWS-sequence groups whole in compiled code, no BLAS   | the batch's Viterbi in compiled code    |
|            |                                                        | (threads split the sequences)           |
| "lockstep" | compiled per-row sweeps and one BLAS GEMM per step     | - (no GEMM in a max-product)            |
| "cuda_fused" | a family's `score` only (log p(x), log_cond): fused   | -                                       |
|            | Triton kernels + CUDA graphs (`models.triton_chain`)   |                                         |

Every compiled engine needs a shared (K, K) matrix on CPU, float32/float64 throughout, no autograd and
numba; "lockstep" also needs torch's BLAS to be callable (`kernels.blas.HAVE_GEMM`). A blocked_hmm with more
than one cluster has a matrix per step (a k x k block of its Z x Z matrix), so its `score` and `posterior`
run their own compiled sweeps on CPU (`kernels.blocked`, reported as "groups": whole sequences in compiled
code, no BLAS; threads by `blocked_threads`), and only "torch" elsewhere.
Long sequences are, independently of the engine, scored as batches of chunks (`chunk_long`).
The thresholds are module constants read at call time (tests lower them with `monkeypatch.setattr`).

"cuda_fused" is not a chain-engine call: `ChainFamily.score` asks `score` whether the family's whole scoring
(rank_hmm, blocked_hmm: `triton_chain.score_rank` / `score_blocked`) runs fused; every other operation
(posteriors, Viterbi, sampling, filtered marginals) and every other family stays on the engines above. Its
storage precision (`STORAGE_DTYPES`: float32, or bfloat16 opt-in) applies to that path, and on CPU to blocked_hmm's
compiled `score` sweep (`BlockedHMM.set_storage_dtype`), alone.
"""

from __future__ import annotations

from enum import StrEnum
from typing import NamedTuple

import torch
from torch import Tensor

from latentlm.models.kernels.blas import DEFAULT_PROVIDER, HAVE_GEMM, HAVE_PACK
from latentlm.models.kernels.jit import HAVE_NUMBA


class Backend(StrEnum):
    AUTO = "auto"
    TORCH = "torch"
    SINGLE = "single"
    GROUPS = "groups"
    LOCKSTEP = "lockstep"
    CUDA_FUSED = "cuda_fused"


# -- thresholds (measured on 2-16 core x86 machines; bench/results/hmm_inference_*.md) -------------------------
GROUPS_MAX_K = 512  # largest matrix for the ROWS groups in a batch: beyond it any BLAS GEMM wins
LOCKSTEP_MIN_ROWS = 4  # rows per thread for a GEMM per step to pay (fewer rows in all: ROWS groups)
PACK_MIN_K = 512  # float32 matrices this large are packed once (MKL's gemm_pack, cached) for lockstep GEMMs
SPLIT_MIN_K = 128  # one sequence: below this a step is too short to amortise two threads meeting every step
SPLIT_MIN_WORK = 1 << 24  # T K^2 above which starting a second thread for one sequence pays off
VITERBI_CHUNK_MIN_STEPS = 256  # one sequence's Viterbi runs in chunks on several threads (speculation; no
#                                meeting per step) when each thread gets at least this many steps
NATIVE_MAXPLUS_MIN_WORK = 1 << 16  # B K^2 (a (max, +) step) or T K^2 (one sequence) for compiled max-product
LONG_MIN_TOKENS = 4096  # a sequence at least this long is scored as a batch of its own chunks
BLOCKED_SPLIT_MIN_WORK = 1 << 18  # tokens x k^2 from which a blocked HMM's compiled sweep splits its rows over
#                                  threads (a thread hand-off costs tens of microseconds)
HALVES_MIN_WORK = 1 << 21  # one sequence's posterior on CPU runs its forward and backward on two threads meeting
HALVES_STEP_COST = 4096  # in the middle (exact) once T (K^2 + HALVES_STEP_COST) reaches HALVES_MIN_WORK (below,
#                          handing the halves to two threads costs more than it saves; a step's fixed cost is
#                          about 4,096 multiply-adds; bench/results/posterior_halves.md)
HALVES_MAX_K = 128  # a long sequence (LONG_MIN_TOKENS+) runs so up to this many states, beyond it as a batch of
#                     chunks: each halves step is a matrix-vector product bound by streaming the matrix, while the
#                     chunk batches pass it once for many rows (since the chunked posterior writes in place:
#                     1.31x at 256 states, 1.63x at 512, 0.92x at 128; bench/results/long_posterior.md)
CHUNK_MIN_STATES = 128  # on CPU: below this a step is too short to be bound by streaming the matrix
CHUNK_ROWS_PER_THREAD = 8  # chunks per thread on the compiled engines (twice that for K > GROUPS_MAX_K)
MAX_CHUNKS = 64  # chunks (rows of the per-step GEMM) on the torch engine (GPU)
FUSED_MAX_TOKENS = LONG_MIN_TOKENS  # auto: wider (padded) batches score on the chain engine, which chunks long
#                                     sequences (the fused path runs, and graph-captures, every step in turn)

STORAGE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}  # of the matrices on the fused path
# what `ChainFamily.set_storage_dtype` takes: a storage dtype, or "tfloat32" (CUDA: float32 storage, TF32 products)
PRECISIONS = ("float32", "tfloat32", "bfloat16")
# Documented error bound of bfloat16 storage, on the fused CUDA path and blocked_hmm's CPU sweep (checked in
# tests/models/test_triton.py and test_blocked_kernels.py on random Dirichlet models):
# |log p(x_t | x_<t) (bfloat16 storage) - same (float64 reference)| per token, absolute.
BF16_TOKEN_ABS_BOUND = 2e-2

_FLOATS = (torch.float32, torch.float64)


def available(backend: Backend | str) -> bool:
    """Whether this machine has the engine at all (whether it can run a given call is `sum_product`'s
    or `max_product`'s to say)."""
    b = Backend(backend)
    if b in (Backend.AUTO, Backend.TORCH):
        return True
    if b is Backend.CUDA_FUSED:
        return _fused_ready("cuda")
    return HAVE_NUMBA and (b is not Backend.LOCKSTEP or HAVE_GEMM)


def _grad(*tensors: Tensor) -> bool:
    return torch.is_grad_enabled() and any(x.requires_grad for x in tensors)


def compiled_ok(emit, trans, *more: Tensor) -> bool:
    """Whether a compiled sum-product engine can run: a shared matrix on CPU, float32/float64 throughout, no
    autograd through any argument, numba present. (`emit`: a tensor or a `chain.RowLookup`.)"""
    return (HAVE_NUMBA and isinstance(trans, Tensor) and emit.device.type == "cpu" and trans.device.type == "cpu"
            and emit.dtype in _FLOATS and trans.dtype == emit.dtype and not _grad(emit, trans, *more))


def _refuse(b: Backend, why: str) -> ValueError:
    return ValueError(f"backend {b.value!r} cannot run this call: {why}")


def _fused_ready(device: torch.device | str) -> bool:
    """Whether `triton_chain`'s kernels run on `device` (CUDA with triton; CPU only under TRITON_INTERPRET=1)."""
    from latentlm.models import triton_chain  # (triton itself is imported lazily there)

    return triton_chain.available(device)


def storage_dtype(value: torch.dtype | str | None) -> torch.dtype:
    """The storage dtype of the fused scoring path from a name ("float32", "bfloat16") or dtype; None: float32."""
    if value is None:
        return torch.float32
    if isinstance(value, torch.dtype):
        if value in STORAGE_DTYPES.values():
            return value
    elif value.lower() in STORAGE_DTYPES:
        return STORAGE_DTYPES[value.lower()]
    raise ValueError(f"storage dtype: expected one of {sorted(STORAGE_DTYPES)}, got {value!r}")


_NOT_CHAIN = "it scores whole families (rank_hmm, blocked_hmm: `family.score(batch, backend=...)`), not chain calls"
_FUSED_WHY = "it runs on CUDA tensors and the model is on {}; (TRITON_INTERPRET=1 runs its kernels on CPU in " \
             "Triton's interpreter, for tests)"


def score(backend: Backend | str, *, device: torch.device | str, dtype: torch.dtype, fused: bool,
          grad: bool = False, width: int = 0, ready: bool | None = None) -> Backend:
    """The engine of a family's `score` (log p(x) and log_cond, nothing per state): "cuda_fused" or what the
    chain engine gets (`backend` itself; "auto" is then decided per call by `sum_product`).

    `fused`: the family has a fused path (rank_hmm, blocked_hmm); `grad`: autograd runs through the model's
    tensors; `width`: the batch's padded length; `ready`: whether `triton_chain` runs on `device` (asked
    when None; tests pass it). auto: "cuda_fused" on a CUDA device for a float32 model without autograd when
    triton is there and width < FUSED_MAX_TOKENS; else the chain engine. An explicit "cuda_fused" raises
    ValueError saying why where it cannot run (any width)."""
    b = Backend(backend)
    device = torch.device(device)
    if b is Backend.AUTO:
        if (device.type == "cuda" and fused and dtype == torch.float32 and not grad and width < FUSED_MAX_TOKENS
                and (ready if ready is not None else _fused_ready(device))):
            return Backend.CUDA_FUSED
        return b
    if b is not Backend.CUDA_FUSED:
        return b
    if not fused:
        raise _refuse(b, "this family has no fused scoring path (rank_hmm and blocked_hmm have)")
    if not (ready if ready is not None else _fused_ready(device)):
        if device.type != "cuda":
            raise _refuse(b, _FUSED_WHY.format(device))
        raise _refuse(b, f"triton is not importable or CUDA is not available here (device {device})")
    if dtype != torch.float32:
        raise _refuse(b, f"it needs a float32 model (this one is {dtype}; the fused path writes float32)")
    if grad:
        raise _refuse(b, "it does not run under autograd (the model's tensors require grad)")
    return b


def sum_product(backend: Backend | str, emit, trans, *more: Tensor, rows: int, marginals: bool = False,
                last: bool = False) -> Backend:
    """The engine of one sum-product call over `rows` sequences: `marginals` when it keeps the filtered
    marginals or runs backward, `last` when it writes each sequence's last marginal.

    auto: "torch" where no compiled engine can run (GPU, autograd, per-step matrices, mixed dtypes);
    "single" for one sequence wanting only log_cond, "groups" for one sequence wanting more; "lockstep" where
    BLAS is callable and there are at least LOCKSTEP_MIN_ROWS rows or more than GROUPS_MAX_K states (unless
    `models.calibrate` measured another engine faster for this matrix size: `CHOICES`); else "groups" up to
    GROUPS_MAX_K states; else "torch" (one BLAS GEMM per step)."""
    b = Backend(backend)
    if b is Backend.TORCH:
        return b
    if b is Backend.CUDA_FUSED:
        raise _refuse(b, _NOT_CHAIN)
    ok = compiled_ok(emit, trans, *more)
    one = rows == 1 and not marginals
    if b is Backend.AUTO:
        if not ok:
            return Backend.TORCH
        if one and not last:
            return Backend.SINGLE
        if rows == 1:  # one sequence with marginals: the calibration measured batches, and its choice (a
            return Backend.GROUPS  # one-row GEMM per step on one thread) ran 3-4x slower than "groups" here
        K = trans.shape[-1]
        if (rows >= LOCKSTEP_MIN_ROWS or K > GROUPS_MAX_K) and (chosen := _chosen(K, trans.dtype, marginals)):
            return chosen  # measured on this machine for this matrix (`models.calibrate`)
        if HAVE_GEMM and (rows >= LOCKSTEP_MIN_ROWS or K > GROUPS_MAX_K):
            return Backend.LOCKSTEP
        return Backend.GROUPS if K <= GROUPS_MAX_K or one else Backend.TORCH
    if not ok:
        raise _refuse(b, "it needs numba and a shared matrix on CPU in the emissions' float dtype, no autograd")
    if b is Backend.LOCKSTEP and not HAVE_GEMM:
        raise _refuse(b, "torch's BLAS is not callable here")
    if b is Backend.SINGLE and not (one and not last):
        raise _refuse(b, "it scores one sequence, without marginals")
    return b


def max_product(backend: Backend | str, scores: Tensor, log_trans, *, rows: int, steps: int | None = None
                ) -> Backend:
    """The engine of a Viterbi recursion over `rows` sequences of `steps` positions, or (steps None) of one
    (max, +) product over `rows` rows. auto: "single" for one sequence whose T K^2 reaches
    NATIVE_MAXPLUS_MIN_WORK (the whole recursion compiled), "groups" (the compiled (max, +) product) where
    B K^2 does, else "torch". Compiled engines only on CPU in float32/float64 with numba and a shared matrix."""
    b = Backend(backend)
    if b is Backend.TORCH:
        return b
    ok = (HAVE_NUMBA and isinstance(log_trans, Tensor) and scores.device.type == "cpu"
          and log_trans.device.type == "cpu" and scores.dtype in _FLOATS and log_trans.dtype == scores.dtype)
    if b is Backend.AUTO:
        if not ok:
            return Backend.TORCH
        K = log_trans.shape[-1]
        if rows == 1 and steps is not None and steps * K * K >= NATIVE_MAXPLUS_MIN_WORK:
            return Backend.SINGLE
        return Backend.GROUPS if rows * K * K >= NATIVE_MAXPLUS_MIN_WORK else Backend.TORCH
    if b is Backend.LOCKSTEP:
        raise _refuse(b, "a max-product has no GEMM; use 'groups'")
    if b is Backend.CUDA_FUSED:
        raise _refuse(b, _NOT_CHAIN)
    if not ok:
        raise _refuse(b, "it needs numba and a shared matrix on CPU in the scores' float dtype")
    if b is Backend.SINGLE and (rows != 1 or steps is None):
        raise _refuse(b, "it decodes one whole sequence")
    return b


def threads(engine: Backend, rows: int, T: int, K: int) -> int:
    """Threads for a compiled sum-product call (torch's intra-op thread count at most): "single" splits one
    sequence over two threads only from SPLIT_MIN_K states and SPLIT_MIN_WORK = T K^2; "lockstep" gives
    each thread at least LOCKSTEP_MIN_ROWS rows; "groups" takes them all (its driver gives each a group)."""
    n = torch.get_num_threads()
    if engine is Backend.SINGLE:
        return 2 if n >= 2 and K >= SPLIT_MIN_K and T * K * K >= SPLIT_MIN_WORK else 1
    if engine is Backend.LOCKSTEP:
        return max(1, min(n, rows // LOCKSTEP_MIN_ROWS))
    return n


def blocked_threads(rows: int, tokens: int, k: int) -> int:
    """Threads for a blocked HMM's compiled sweep (`kernels.blocked`; rows split by token count, no meeting):
    torch's intra-op thread count at most, one per row at most, and one until tokens k^2 reaches
    BLOCKED_SPLIT_MIN_WORK."""
    if tokens * k * k < BLOCKED_SPLIT_MIN_WORK:
        return 1
    return max(1, min(torch.get_num_threads(), rows))


def posterior_halves(engine: Backend, rows: int, T: int, K: int) -> bool:
    """Whether the posterior of one sequence on the compiled "groups" engine runs on two threads meeting in the
    middle (`kernels.sum_product.posterior_halves`): two threads allowed and T (K^2 + HALVES_STEP_COST) of at
    least HALVES_MIN_WORK. (Whether a long sequence runs so or as a batch of chunks is `chain.posterior`'s,
    by HALVES_MAX_K.)"""
    return (engine is Backend.GROUPS and rows == 1 and torch.get_num_threads() >= 2
            and T * (K * K + HALVES_STEP_COST) >= HALVES_MIN_WORK)


def max_product_threads(rows: int, T: int, K: int) -> int:
    """Threads for a compiled Viterbi (torch's intra-op thread count at most): the sequences are split
    between threads with no synchronisation, so each thread needs one; one sequence is cut into a chunk per
    thread (`kernels.maxplus.viterbi_chunks`: no meeting per step) once each gets VITERBI_CHUNK_MIN_STEPS
    steps."""
    n = torch.get_num_threads()
    if rows == 1:
        return max(1, min(n, T // VITERBI_CHUNK_MIN_STEPS))
    return max(1, min(n, rows))


def packs(engine: Backend, dtype: torch.dtype, K: int, marginals: bool = False) -> bool:
    """Whether a lockstep call runs on the matrix packed once by MKL (float32, K >= PACK_MIN_K, packed API
    exported, MKL the BLAS of the call)."""
    return (engine is Backend.LOCKSTEP and HAVE_PACK and dtype == torch.float32 and K >= PACK_MIN_K
            and provider(K, dtype, marginals) == "mkl")


# -- the measured choice (`models.calibrate`) -----------------------------------------------------------------
class Choice(NamedTuple):
    """The batch sum-product engine and BLAS measured fastest for one matrix size and dtype on this machine,
    with what each candidate took (milliseconds, for /v1/models and the logs)."""
    engine: Backend
    provider: str  # the BLAS of lockstep GEMMs ("mkl", "openblas"; "" where the engine calls none)
    timings_ms: dict[str, float]


# (K, dtype, marginals) -> Choice, written by `models.calibrate`: one for calls that only score (forward,
# log_cond), one for those that keep marginals (posteriors, backward), since the fastest engine can differ
CHOICES: dict[tuple[int, torch.dtype, bool], Choice] = {}


def provider(K: int, dtype: torch.dtype, marginals: bool = False) -> str:
    """The BLAS of a lockstep call on a K x K matrix: the measured choice for (K, dtype, marginals), else the
    default."""
    choice = CHOICES.get((K, dtype, marginals))
    return choice.provider if choice is not None and choice.provider else DEFAULT_PROVIDER


def _chosen(K: int, dtype: torch.dtype, marginals: bool) -> Backend | None:
    choice = CHOICES.get((K, dtype, marginals))
    return choice.engine if choice is not None else None


def chunk_long(backend: Backend | str, emit, trans, *more: Tensor, wants_states: bool) -> bool:
    """Whether `forward` / `posterior` may score their sequences of LONG_MIN_TOKENS+ positions as batches of
    chunks: a shared matrix, no per-position outputs besides log_cond (`wants_states`), no autograd, not the
    "single" engine, and on CPU at least CHUNK_MIN_STATES states (on fewer a step is too short to be bound by
    streaming the matrix, which is what chunking saves)."""
    if wants_states or emit.shape[1] < LONG_MIN_TOKENS or not isinstance(trans, Tensor):
        return False  # (no tensor op on the common path: a busy server's inference thread waits for the GIL)
    if Backend(backend) is Backend.SINGLE or (trans.device.type == "cpu" and trans.shape[0] < CHUNK_MIN_STATES):
        return False
    return not _grad(trans, emit, *more)


def default_chunks(engine: Backend, K: int) -> int:
    """Chunks per long sequence when the chunk batches run on `engine` (measured,
    bench/results/hmm_inference_*.md): on the compiled engines CHUNK_ROWS_PER_THREAD rows per thread, twice that
    once the matrix outgrows a core's cache (K > GROUPS_MAX_K: each GEMM step streams it, so more rows per
    pass pay); MAX_CHUNKS rows for one BLAS GEMM per step on torch ops."""
    if engine is Backend.TORCH:
        return MAX_CHUNKS
    per_thread = CHUNK_ROWS_PER_THREAD if K <= GROUPS_MAX_K else 2 * CHUNK_ROWS_PER_THREAD
    return per_thread * max(1, torch.get_num_threads())
