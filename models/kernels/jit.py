"""What every compiled kernel shares: numba's `njit` (or its absence) and the fast-math flags.

numba is a hard dependency, but the engine stays usable (plain PyTorch everywhere) if its LLVM build is
unavailable: then `HAVE_NUMBA` is False and no kernel module defines its compiled functions.
Kernels are compiled on first use and cached on disk (`cache=True`). numba invalidates a cached function
when its own source file changes, not when a function it calls in another module does: after editing a
kernel that others inline (`rows.py`, `blas.py`, `threads.py`), delete models/kernels/__pycache__.

`BORROWED` compiles a function without numba's reference counting: every array it touches belongs to its
caller (arguments and views of them), so taking a row `a[i]` costs nothing, where reference counting makes it
an atomic increment and decrement. In the small-state kernels those atomics took 17-35% of all samples
(`perf`, Z = 64: score, posteriors, Viterbi; bench/results/kernel_refcounts.md). Such a function cannot
allocate, return an array or assign one array to a slice of another (write the loop): numba refuses to
compile one that does. The recursions run in such functions; thin wrappers allocate their scratch.

`widen(x)` reads one stored matrix entry as a float inside a kernel: a float32/float64 entry as it is, a bfloat16
one (stored as its uint16 bits: numba has no bfloat16) as the float32 with those upper 16 bits (exact: bfloat16
is float32 with the low 16 mantissa bits dropped). Both compile to plain loads, so one kernel serves both
storages (the bfloat16 form vectorises as a zero-extend and a shift).
"""

from __future__ import annotations

try:
    from llvmlite import ir
    from numba import njit, types
    from numba.extending import intrinsic, overload

    HAVE_NUMBA = True
except ImportError:  # pragma: no cover
    njit = None
    HAVE_NUMBA = False


def widen(x):  # pragma: no cover - replaced inside compiled code by its overload below
    """A stored matrix entry as a float: float32/float64 as is, bfloat16 bits (uint16) as float32."""
    raise NotImplementedError("widen() runs only inside compiled kernels")


if HAVE_NUMBA:

    @intrinsic
    def _bf16_to_f32(typingctx, bits):
        """The float32 whose upper 16 bits are the uint16 `bits` and whose lower 16 are 0 (zero-extend, shift,
        bitcast: no rounding)."""
        if bits != types.uint16:
            return None

        def codegen(context, builder, signature, args):
            i32 = ir.IntType(32)
            wide = builder.shl(builder.zext(args[0], i32), ir.Constant(i32, 16))
            return builder.bitcast(wide, ir.FloatType())

        return types.float32(types.uint16), codegen

    @overload(widen, inline="always")
    def _widen(x):
        if isinstance(x, types.Float):
            return lambda x: x
        if x == types.uint16:
            return lambda x: _bf16_to_f32(x)
        return None

BORROWED = {"_nrt": False}  # numba's flag for "no runtime": no reference counting (and no allocation)
FASTMATH = {"contract", "reassoc"}  # vectorised reductions; never assumes finite values (-inf is data here)
