"""Checks every family's artifact schema uses: tensor shapes, probability distributions, config values.

`Validator` is the signature of a family's `validate_tensors(tensors, config, vocab_size, where)`: it raises
`ArtifactError` naming the file (`where`), the tensor and the problem.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from latentlm.models.errors import ArtifactError
from latentlm.models.kernels import stats
from latentlm.models.kernels.jit import HAVE_NUMBA

NORMALISATION_TOL = 1e-4
Validator = Callable[[dict[str, torch.Tensor], dict[str, Any], int, str], None]


def check_shape(tensors: dict[str, torch.Tensor], key: str, shape: tuple[int, ...], where: str) -> torch.Tensor:
    if key not in tensors:
        raise ArtifactError(f"{where}: missing tensor {key!r}", param=key)
    t = tensors[key]
    if tuple(t.shape) != tuple(shape):
        raise ArtifactError(f"{where}: tensor {key!r} has shape {list(t.shape)}, expected {list(shape)}", param=key)
    return t


CHECK_CHUNK = 1 << 22  # entries per slice of a check: its temporaries stay ~30 MB whatever the model's size


def slices(t: torch.Tensor, keep: int | None = None) -> tuple[int | None, tuple[torch.Tensor, ...]]:
    """`t` cut into views of about CHECK_CHUNK entries along one dimension other than `keep` (the largest;
    whole when it is small or 1-D): checks over the slices need temporaries of a slice's size, not of a
    model's. Returns (the dimension cut, or None, the views)."""
    other = [d for d in range(t.dim()) if d != keep]
    if t.numel() <= CHECK_CHUNK or not other:
        return None, (t,)
    cut = max(other, key=lambda d: t.shape[d])
    step = max(1, CHECK_CHUNK * t.shape[cut] // t.numel())
    return cut, t.split(step, cut)


COMPILED_MIN_ENTRIES = 1 << 20  # from this size a tensor's entries are screened by row statistics (`row_stats`)


def row_stats(x: torch.Tensor) -> tuple[torch.Tensor, float]:
    """(float64 sums over the last dimension (x.shape[:-1]), the smallest entry (inf when empty)) of x, at
    least 1-D: one compiled pass over a contiguous CPU tensor (`kernels.stats.row_sums_and_min`, rows over
    threads), torch otherwise. A NaN or infinite entry makes its row's sum non-finite (the minimum may skip a
    NaN); so do float64 sums that overflow, which float32 entries cannot reach."""
    if _compiled_reads(x):
        return stats.row_sums_and_min(x.detach(), torch.get_num_threads())
    low = float(x.detach().min()) if x.numel() else float("inf")
    return x.detach().double().sum(-1).cpu(), low


def _compiled_reads(x: torch.Tensor) -> bool:
    """Whether `kernels.stats.row_sums_and_min` reads x in place."""
    return HAVE_NUMBA and x.device.type == "cpu" and x.dtype in stats.DTYPES and x.is_contiguous() and x.dim() >= 1


STORED_STATS = "stored_stats"  # attribute of a tensor the artifact reader took statistics of (`mark_stored_stats`)


def mark_stored_stats(t: torch.Tensor, sums: torch.Tensor, low: float) -> None:
    """Record on `t` the `row_stats` of its values as stored in the artifact file (float64 sums over its last
    dimension, smallest entry), which the artifact reader takes from each slab as it reads it (cache-hot, no
    second pass over a multi-GB matrix), also for a tensor read into a narrower dtype (bfloat16 from float32:
    its stored rows are checked, not their rounding). `all_finite` and `check_distribution` use them. The mark
    is the tensor object's own: views and copies do not carry it; `unmark_stored_stats` removes it."""
    setattr(t, STORED_STATS, (sums, low))


def unmark_stored_stats(t: torch.Tensor) -> None:
    if hasattr(t, STORED_STATS):
        delattr(t, STORED_STATS)


def screened_stats(t: torch.Tensor) -> tuple[torch.Tensor, float] | None:
    """`t`'s stored statistics (`mark_stored_stats`), else its `row_stats` by the compiled pass when that reads
    it in place and it is large enough (`COMPILED_MIN_ENTRIES`) for one pass to beat torch's slices, else None
    (never a whole-tensor temporary)."""
    marked = getattr(t, STORED_STATS, None)
    if marked is not None:
        return marked
    if t.numel() >= COMPILED_MIN_ENTRIES and _compiled_reads(t):
        return row_stats(t)
    return None


def _finite_slices(t: torch.Tensor) -> bool:
    return all(bool(torch.isfinite(p).all()) for p in slices(t)[1])


def all_finite(t: torch.Tensor) -> bool:
    """No NaN or infinite entry: finite row sums (`screened_stats`) prove it; otherwise, or when they do not,
    checked slice by slice (`slices`)."""
    stats_ = screened_stats(t)
    return (stats_ is not None and bool(torch.isfinite(stats_[0]).all())) or _finite_slices(t)


def check_distribution(t: torch.Tensor, key: str, dim: int, where: str, tol: float = NORMALISATION_TOL) -> None:
    """Entries finite and >= 0, and every distribution along `dim` sums to 1 within `tol`. From the row
    statistics where there are some (`screened_stats`: taken as the artifact was read, or one pass over a large
    tensor; the sums serve when `dim` is the last), otherwise slice by slice, so a multi-GB matrix is checked
    with ~30 MB of temporaries."""
    if not t.is_floating_point():
        raise ArtifactError(f"{where}: tensor {key!r} must be floating point, got {t.dtype}", param=key)
    stats_ = screened_stats(t)
    finite = stats_ is not None and bool(torch.isfinite(stats_[0]).all())
    if not finite and not _finite_slices(t):
        raise ArtifactError(f"{where}: tensor {key!r} has NaN or infinite entries", param=key)
    cut, parts = slices(t, keep=dim)
    if (stats_[1] < 0) if stats_ is not None else any(bool((p < 0).any()) for p in parts):
        raise ArtifactError(f"{where}: tensor {key!r} has negative entries", param=key)
    if stats_ is not None and dim % max(1, t.dim()) == t.dim() - 1:
        sums = stats_[0]
    else:
        part_sums = [p.double().sum(dim) for p in parts]
        sums = part_sums[0] if cut is None else torch.cat(part_sums, cut if cut < dim else cut - 1)
    bad = (sums - 1).abs() > tol
    if bool(bad.any()):
        idx = bad.nonzero()[0].tolist()
        raise ArtifactError(
            f"{where}: tensor {key!r} is not normalised: entry {idx} sums to {sums[tuple(idx)].item():.6g} "
            f"(tolerance {tol})",
            param=key,
        )


def check_config(where: str, key: str, declared: Any, actual: Any) -> None:
    """A manifest config value (e.g. `num_states`) must agree with the tensors."""
    if declared != actual:
        raise ArtifactError(f"{where}: config {key}={declared!r} does not match the tensors ({actual!r})", param=key)


def check_positive_ints(config: dict[str, Any], keys: tuple[str, ...], where: str) -> None:
    """Every key of `config` a positive integer; `max_length` (optional) too."""
    for key in keys + (("max_length",) if "max_length" in config else ()):
        v = config.get(key)
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise ArtifactError(f"{where}: config needs a positive integer {key!r}, got {v!r}", param=key)
