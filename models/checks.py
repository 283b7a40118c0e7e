"""Checks every family's artifact schema uses: tensor shapes, probability distributions, config values.

`Validator` is the signature of a family's `validate_tensors(tensors, config, vocab_size, where)`: it raises
`ArtifactError` naming the file (`where`), the tensor and the problem.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from latentlm.models.errors import ArtifactError

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


def all_finite(t: torch.Tensor) -> bool:
    """No NaN or infinite entry, checked slice by slice (`slices`)."""
    return all(bool(torch.isfinite(p).all()) for p in slices(t)[1])


STORED_SUMS = "stored_sums"  # attribute of a tensor narrowed as it was read (`mark_stored_sums`)


def mark_stored_sums(t: torch.Tensor, sums: torch.Tensor) -> None:
    """Record on `t`, a tensor read into a narrower dtype than its file's (bfloat16 from float32: the artifact
    reader's `cast`), the float64 sums over its last dimension of the values as stored: `check_distribution`
    checks those, so a narrowed matrix passes or fails exactly as its stored one would. The mark is the
    tensor object's own: views and copies do not carry it. `unmark_stored_sums` removes it after the checks."""
    setattr(t, STORED_SUMS, sums)


def unmark_stored_sums(t: torch.Tensor) -> None:
    if hasattr(t, STORED_SUMS):
        delattr(t, STORED_SUMS)


def check_distribution(t: torch.Tensor, key: str, dim: int, where: str, tol: float = NORMALISATION_TOL) -> None:
    """Entries finite and >= 0, and every distribution along `dim` sums to 1 within `tol`. Slice by slice,
    so a multi-GB matrix is checked with ~30 MB of temporaries. For a tensor narrowed as it was read
    (`mark_stored_sums`) and `dim` its last, the sums are those of the stored values."""
    if not t.is_floating_point():
        raise ArtifactError(f"{where}: tensor {key!r} must be floating point, got {t.dtype}", param=key)
    if not all_finite(t):
        raise ArtifactError(f"{where}: tensor {key!r} has NaN or infinite entries", param=key)
    cut, parts = slices(t, keep=dim)
    if any(bool((p < 0).any()) for p in parts):
        raise ArtifactError(f"{where}: tensor {key!r} has negative entries", param=key)
    stored = getattr(t, STORED_SUMS, None) if dim % max(1, t.dim()) == t.dim() - 1 else None
    if stored is not None:
        sums = stored
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
