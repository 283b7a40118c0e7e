"""The BLAS libraries this process can call from compiled kernels, and the matrices derived for them.

Two providers, whichever load (`PROVIDERS`, by name):
- "mkl": torch's x86 wheels link MKL into libtorch_cpu.so and export its symbols. `BLAS` binds them with
  ctypes: sgemm_/dgemm_ (Fortran interface, 32-bit integers), MKL_Set_Num_Threads_Local, and MKL's
  packed-matrix float32 API (cblas_sgemm_pack_get_size / _pack / _compute) where exported;
- "openblas": the OpenBLAS numpy's wheels bundle (numpy.libs/libscipy_openblas64_*.so; 64-bit integers:
  scipy_sgemm_64_ / scipy_dgemm_64_, openblas_set_num_threads_local). On AMD CPUs it often beats MKL
  (which takes slower code paths there), on Intel the reverse; `models.calibrate` measures which is faster
  for a model's shapes on this machine.
`HAVE_GEMM` is False where neither loads (then the engine never picks the lockstep kernels). Compiled code
calls a GEMM through `gemm_rows`, by address: the address is an argument, not a constant, so the calling
kernels stay in numba's on-disk cache; the integer width travels as the dtype of the `dims` array.

`packed_matrix` / `transposed` cache what a lockstep call derives from a model's matrix (MKL's packed copy,
a transposed copy) while the tensor lives and is not modified in place.
"""

from __future__ import annotations

import ctypes
import glob
import os
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
import torch
from torch import Tensor

from latentlm.models.kernels.jit import HAVE_NUMBA, njit


class TorchBlas(NamedTuple):
    sgemm: Any
    dgemm: Any
    local_threads: Any  # MKL_Set_Num_Threads_Local(n) -> previous n (0: the global setting)
    pack_size: Any  # the three below: None without MKL's packed API
    pack: Any
    compute: Any


def _torch_blas() -> TorchBlas | None:
    """Bind torch's BLAS symbols, or None where libtorch_cpu does not export them."""
    vp, ci = ctypes.c_void_p, ctypes.c_int
    try:
        lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"))
        gemms = [getattr(lib, name) for name in ("sgemm_", "dgemm_")]
        # through PyDLL: an instant call that keeps the GIL (a ctypes call releases it, and in a busy server
        # each reacquisition can wait a whole switch interval)
        local = ctypes.PyDLL(lib._name).MKL_Set_Num_Threads_Local
    except (OSError, AttributeError):
        return None
    for f in gemms:  # Fortran interface: every argument by reference
        f.restype, f.argtypes = None, [vp] * 13
    local.restype, local.argtypes = ci, [ci]
    try:
        size, pack, compute = lib.cblas_sgemm_pack_get_size, lib.cblas_sgemm_pack, lib.cblas_sgemm_compute
    except AttributeError:
        return TorchBlas(gemms[0], gemms[1], local, None, None, None)
    size.restype, size.argtypes = ctypes.c_size_t, [ci] * 4
    pack.restype, pack.argtypes = None, [ci] * 6 + [ctypes.c_float, vp, ci, vp]
    compute.restype, compute.argtypes = None, [ci] * 6 + [vp, ci, vp, ci, ctypes.c_float, vp, ci]
    return TorchBlas(gemms[0], gemms[1], local, size, pack, compute)


class Provider(NamedTuple):
    """A BLAS the compiled kernels can call: its GEMM symbols, integer width and per-thread thread setter."""
    name: str
    sgemm: Any
    dgemm: Any
    int_dtype: type  # np.int32 (LP64) or np.int64 (ILP64): the dtype of the `dims` array handed to the GEMM
    local_threads: Callable[[int], int]  # (n; 0: the global setting) -> the previous setting
    packed: bool  # MKL's packed-matrix API is available (only "mkl")


def _numpy_openblas() -> Provider | None:
    """numpy's bundled OpenBLAS (ILP64, symbols prefixed scipy_ and suffixed 64_), or None."""
    libs = glob.glob(os.path.join(os.path.dirname(np.__file__), os.pardir, "numpy.libs", "libscipy_openblas64_*.so"))
    if not libs:
        return None
    vp, ci = ctypes.c_void_p, ctypes.c_int
    try:
        lib = ctypes.CDLL(libs[0])
        gemms = [getattr(lib, name) for name in ("scipy_sgemm_64_", "scipy_dgemm_64_")]
        pylib = ctypes.PyDLL(lib._name)
        local, total = pylib.openblas_set_num_threads_local, pylib.scipy_openblas_get_num_threads64_
    except (OSError, AttributeError):
        return None
    for f in gemms:
        f.restype, f.argtypes = None, [vp] * 13
    local.restype, local.argtypes = ci, [ci]
    total.restype, total.argtypes = ci, []

    def set_local(n: int) -> int:
        return local(n if n > 0 else total())

    return Provider("openblas", gemms[0], gemms[1], np.int64, set_local, False)


BLAS = _torch_blas() if HAVE_NUMBA else None
PROVIDERS: dict[str, Provider] = {}
if BLAS is not None:
    PROVIDERS["mkl"] = Provider("mkl", BLAS.sgemm, BLAS.dgemm, np.int32, BLAS.local_threads, BLAS.pack is not None)
if HAVE_NUMBA and (_openblas := _numpy_openblas()) is not None:
    PROVIDERS["openblas"] = _openblas
DEFAULT_PROVIDER = next(iter(PROVIDERS), "")  # MKL where torch exports it (the measured choice may differ)
HAVE_GEMM = bool(PROVIDERS)  # the lockstep kernels can run
HAVE_PACK = BLAS is not None and BLAS.pack is not None  # ... and on a float32 matrix packed once (MKL)


def address(fn) -> int:
    """The address of a ctypes function (what compiled code calls)."""
    return ctypes.cast(fn, ctypes.c_void_p).value or 0


def as_array(x: Tensor) -> np.ndarray:
    """A C-contiguous numpy view (a copy only where `x` is not contiguous) of a CPU tensor."""
    return np.ascontiguousarray(x.detach().numpy())


_DERIVED: dict = {}  # (id(trans), kind) -> (weakref to trans, its version counter, derived array)


def _derived(trans: Tensor, kind: str, build: Callable[[], np.ndarray]) -> np.ndarray:
    """`build()`, an array derived from `trans`, cached while the tensor lives and is not modified in place
    (torch's version counter): a model's matrix is transposed or packed once, not on every call."""
    key = (id(trans), kind)
    hit = _DERIVED.get(key)
    if hit is not None and hit[0]() is trans and hit[1] == trans._version:
        return hit[2]
    value = build()
    _DERIVED[key] = (weakref.ref(trans, lambda _ref: _DERIVED.pop(key, None)), trans._version, value)
    return value


def packed_matrix(trans: Tensor, transpose: bool) -> np.ndarray:
    """trans (K, K) float32 (or trans^T) packed by MKL as the B operand of row-major GEMMs (cached: packing a
    4 MiB matrix costs as much as several steps). Needs `HAVE_PACK`."""
    def build() -> np.ndarray:
        assert BLAS is not None and BLAS.pack is not None
        K = trans.shape[0]
        mat = as_array(trans)
        packed = np.empty(BLAS.pack_size(162, 32, K, K) // 4 + 16, dtype=np.float32)  # 162: B operand; 32: a hint
        BLAS.pack(101, 162, 112 if transpose else 111, 32, K, K, 1.0, mat.ctypes.data, K, packed.ctypes.data)
        return packed

    return _derived(trans, f"packed{int(transpose)}", build)


def aligned_empty(shape: tuple[int, ...], dtype: np.dtype, align: int = 64) -> np.ndarray:
    """An uninitialised C-contiguous array whose data starts on an `align`-byte boundary. numpy's own
    allocations may start 16, 32 or 48 bytes past one, and then every 64-byte vector load of a row spans two
    cache lines (in the kernels up to 1.06x on AMD EPYC Zen 5: bench/results/kernel_refcounts.md)."""
    dtype = np.dtype(dtype)
    n = int(np.prod(shape))
    raw = np.empty(n * dtype.itemsize + align, dtype=np.uint8)
    start = -raw.ctypes.data % align
    return raw[start : start + n * dtype.itemsize].view(dtype).reshape(shape)


def transposed(trans: Tensor) -> np.ndarray:
    """trans^T as a contiguous, 64-byte-aligned array (cached)."""
    def build() -> np.ndarray:
        mat = as_array(trans)
        out = aligned_empty(mat.shape[::-1], mat.dtype)
        out[:] = mat.T
        return out

    return _derived(trans, "T", build)


def column_max(trans: Tensor) -> np.ndarray:
    """max_i trans[i, j] (K,) (cached): the pruning bound of the compiled (max, +) product."""
    return _derived(trans, "colmax", lambda: np.ascontiguousarray(trans.detach().numpy().max(axis=0)))


def row_stride(K: int, itemsize: int) -> int:
    """The row stride (elements) of `padded_rows`: K rounded up to whole cache lines, plus one line where a
    row is a multiple of 2 KiB. Rows 4 KiB apart (K = 1,024 float32) all start in the same L1 set, so the 16
    rows a (max, +) chunk reads at once evict each other from an 8-way cache; one line more spreads them over
    the sets (1.06-1.45x on Viterbi at K = 1,024, 1.02-1.11x at 512, AMD EPYC). Narrower rows spread already,
    and there the extra line only costs (0.90-0.97x at K = 256)."""
    line = 64 // itemsize
    stride = -(-K // line) * line
    return stride + line if (stride * itemsize) % 2048 == 0 else stride


def padded_array(mat: np.ndarray) -> np.ndarray:
    """mat (K, K) in rows of `row_stride` elements (the padding is -inf and never read): mat itself where the
    stride is its width, else a copy."""
    K = mat.shape[0]
    stride = row_stride(mat.shape[1], mat.itemsize)
    if stride == mat.shape[1] and mat.flags.c_contiguous:
        return mat
    out = aligned_empty((K, stride), mat.dtype)  # every row starts on a cache line
    out[:] = -np.inf
    out[:, : mat.shape[1]] = mat
    return out


def padded_rows(trans: Tensor) -> np.ndarray:
    """trans (K, K) with padded rows (`padded_array`; cached): the layout of the (max, +) kernels."""
    return _derived(trans, "padded", lambda: padded_array(as_array(trans)))


def gemm_addresses(dtype: np.dtype, provider: str = "") -> tuple[int, int]:
    """(address of `provider`'s sgemm or dgemm for `dtype`, address of MKL's packed compute or 0).
    provider "": DEFAULT_PROVIDER."""
    p = PROVIDERS[provider or DEFAULT_PROVIDER]
    compute = address(BLAS.compute) if p.packed and BLAS is not None and BLAS.compute is not None else 0
    return address(p.sgemm if dtype == np.float32 else p.dgemm), compute


def dims_template(provider: str = "") -> np.ndarray:
    """A (6,) array in the integer width of `provider`'s GEMM (the lockstep kernels copy it for their
    dimensions)."""
    return np.zeros(6, dtype=PROVIDERS[provider or DEFAULT_PROVIDER].int_dtype)


def set_local_threads(n: int, provider: str = "") -> int:
    """Hold `provider`'s BLAS calls made by this thread to n threads (0: the global setting); returns the
    previous value."""
    return PROVIDERS[provider or DEFAULT_PROVIDER].local_threads(n)


if HAVE_GEMM:
    from llvmlite import ir
    from numba.core import types
    from numba.core.extending import intrinsic

    @intrinsic
    def _fortran_gemm(typingctx, addr, op, dims, coef, a, b, c):  # pragma: no cover - compiled
        """Call the Fortran ?gemm_ at address `addr` (int64): c = op(a) op(b), column-major, transposes op[0]
        and op[1] ('N' or 'T'), (M, N, K, lda, ldb, ldc) = dims, (alpha, beta) = coef."""
        def codegen(context, builder, sig, args):
            i8p = ir.IntType(8).as_pointer()

            def at(i, k):  # pointer to element k of array argument i
                data = context.make_array(sig.args[i])(context, builder, args[i]).data
                return builder.bitcast(builder.gep(data, [ir.Constant(ir.IntType(64), k)]), i8p)

            argv = [at(1, 0), at(1, 1), at(2, 0), at(2, 1), at(2, 2), at(3, 0), at(4, 0), at(2, 3), at(5, 0),
                    at(2, 4), at(3, 1), at(6, 0), at(2, 5)]
            fn = builder.inttoptr(args[0], ir.FunctionType(ir.VoidType(), [i8p] * 13).as_pointer())
            builder.call(fn, argv)
            return context.get_dummy_value()
        return types.void(addr, op, dims, coef, a, b, c), codegen

    @intrinsic
    def _packed_sgemm(typingctx, addr, m, k, a, packed, c):  # pragma: no cover - compiled
        """Call MKL's cblas_sgemm_compute at address `addr`: c[:m] = a[:m] @ B, row-major float32 with B
        (k x k) packed by cblas_sgemm_pack into `packed`."""
        def codegen(context, builder, sig, args):
            i8p, i32 = ir.IntType(8).as_pointer(), ir.IntType(32)

            def ptr(i):
                return builder.bitcast(context.make_array(sig.args[i])(context, builder, args[i]).data, i8p)

            m32, k32 = builder.trunc(args[1], i32), builder.trunc(args[2], i32)
            row_major, no_trans, packed_b = (ir.Constant(i32, v) for v in (101, 111, 151))
            argv = [row_major, no_trans, packed_b, m32, k32, k32, ptr(3), k32, ptr(4), k32,
                    ir.Constant(ir.FloatType(), 0.0), ptr(5), k32]
            fnty = ir.FunctionType(ir.VoidType(), [i32] * 6 + [i8p, i32, i8p, i32, ir.FloatType(), i8p, i32])
            builder.call(builder.inttoptr(args[0], fnty.as_pointer()), argv)
            return context.get_dummy_value()
        return types.void(addr, m, k, a, packed, c), codegen

    @njit(nogil=True, inline="always", cache=True)
    def gemm_rows(gemm, compute, packed, x, mat, out, n, dims, coef, op):  # pragma: no cover - compiled
        """out[:n] = x[:n] @ mat, or x[:n] @ mat^T when op[0] is 'T' (row-major; x, out (m, K), mat (K, K));
        gemm, compute: function addresses. With `packed` non-empty, by MKL's gemm_compute on the operand
        packed once; otherwise by Fortran GEMM: in column-major terms out^T = op(mat^T) x^T, as a row-major
        matrix read column-major is its transpose."""
        if packed.shape[0] > 0:
            _packed_sgemm(compute, n, mat.shape[0], x, packed, out)
            return
        dims[1] = n
        _fortran_gemm(gemm, op, dims, coef, mat, x, out)
