"""Weights mapped from a verified snapshot (`store.map_weights`), as several API workers share one copy."""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import pytest
import torch

from latentlm import ops
from latentlm.models.errors import ArtifactError
from latentlm.models.registry import save_artifact
from latentlm.models.store import WEIGHTS, map_weights, prune_snapshots, read_manifest, read_weights
from latentlm.models.synthetic import random_blocked_hmm, random_hmm
from latentlm.models.vocab import Vocabulary

VOCAB = Vocabulary([*(f"w{i}" for i in range(30)), "<unk>", "<eos>"])


def _model(store: Path, name: str = "m", kind: str = "hmm") -> tuple[Path, str]:
    t, c = random_hmm(24, len(VOCAB), seed=3) if kind == "hmm" else random_blocked_hmm(4, 6, len(VOCAB), seed=3)
    t = {k: v.float() if v.is_floating_point() else v for k, v in t.items()}  # as training exports them
    save_artifact(store, name, kind, t, VOCAB, config=c)
    path = store / name
    return path / WEIGHTS, read_manifest(path)["files"][WEIGHTS]


def _mapped_range(path: Path) -> list[tuple[int, int]]:
    """Address ranges at which this process maps `path`."""
    out = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        if line.rstrip().endswith(str(path)):
            lo, hi = line.split()[0].split("-")
            out.append((int(lo, 16), int(hi, 16)))
    return out


def test_mapped_tensors_equal_read_ones_and_live_in_the_snapshot(tmp_path):
    fpath, digest = _model(tmp_path / "store", kind="blocked_hmm")
    snaps = tmp_path / "snaps"
    read = read_weights(fpath, digest)
    mapped = map_weights(fpath, digest, snaps)
    assert set(read) == set(mapped)
    snap = snaps / f"{digest}.safetensors"
    assert snap.is_file() and not os.access(snap, os.W_OK) or os.geteuid() == 0
    assert oct(snap.stat().st_mode & 0o777) == oct(0o444)
    ranges = _mapped_range(snap)
    assert ranges, "the snapshot is not mapped"
    for name, t in mapped.items():
        assert t.dtype == read[name].dtype and torch.equal(t, read[name]), name
        if t.numel():
            assert any(lo <= t.data_ptr() < hi for lo, hi in ranges), f"{name} is a private copy"


def test_a_loaded_model_answers_the_same_from_a_snapshot(tmp_path):
    store = tmp_path / "store"
    _model(store)
    a = ops.load_model(store, "m")
    b = ops.load_model(store, "m", snapshots=tmp_path / "snaps")
    ranges = _mapped_range(next((tmp_path / "snaps").glob("*.safetensors")))
    assert any(lo <= b.impl.trans.data_ptr() < hi for lo, hi in ranges)
    ids = torch.randint(0, 30, (3, 9), generator=torch.Generator().manual_seed(0))
    from latentlm.models.base import Batch

    batch = Batch(ids=ids, lengths=torch.tensor([9, 4, 7]))
    assert torch.equal(a.impl.score(batch)[0], b.impl.score(batch)[0])


def test_a_changed_model_file_is_refused_and_makes_no_snapshot(tmp_path):
    fpath, digest = _model(tmp_path / "store")
    raw = bytearray(fpath.read_bytes())
    raw[-3] ^= 0xFF
    fpath.write_bytes(bytes(raw))
    with pytest.raises(ArtifactError, match="SHA-256 mismatch"):
        map_weights(fpath, digest, tmp_path / "snaps")
    assert [p for p in (tmp_path / "snaps").iterdir() if not p.name.endswith(".lock")] == []  # nor a partial one


def test_a_damaged_snapshot_is_made_again(tmp_path):
    fpath, digest = _model(tmp_path / "store")
    snaps = tmp_path / "snaps"
    good = read_weights(fpath, digest)
    map_weights(fpath, digest, snaps)
    snap = snaps / f"{digest}.safetensors"
    os.chmod(snap, 0o644)
    raw = bytearray(snap.read_bytes())
    raw[-5] ^= 0x55
    snap.write_bytes(bytes(raw))
    again = map_weights(fpath, digest, snaps)
    assert all(torch.equal(again[k], good[k]) for k in good)


def test_serving_survives_the_model_file_truncated_in_place(tmp_path):
    """The snapshot is the service's: a user's file truncated under a serving process does not touch its pages
    (a mapping of the user's file would die of SIGBUS on the next read)."""
    fpath, digest = _model(tmp_path / "store")
    mapped = map_weights(fpath, digest, tmp_path / "snaps")
    expected = {k: v.clone() for k, v in mapped.items()}
    with open(fpath, "r+b") as f:
        f.truncate(16)
    assert all(torch.equal(mapped[k], expected[k]) for k in expected)
    assert float(mapped["trans"].sum()) == pytest.approx(24.0, rel=1e-5)


def test_writing_a_mapped_tensor_stays_private(tmp_path):
    """Copy-on-write: an in-place write (none is made by the families, but a bug must not corrupt the others'
    weights or crash) changes this process's page only, never the snapshot file."""
    fpath, digest = _model(tmp_path / "store")
    snaps = tmp_path / "snaps"
    mapped = map_weights(fpath, digest, snaps)
    mapped["trans"][0, 0] = 123.0
    fresh = map_weights(fpath, digest, snaps)
    assert float(fresh["trans"][0, 0]) != 123.0
    with open(snaps / f"{digest}.safetensors", "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        assert mm[:8] == (snaps / f"{digest}.safetensors").read_bytes()[:8]


def test_prune_keeps_only_the_named_digests(tmp_path):
    store, snaps = tmp_path / "store", tmp_path / "snaps"
    f1, d1 = _model(store, "a")
    f2, d2 = _model(store, "b", kind="blocked_hmm")
    map_weights(f1, d1, snaps)
    map_weights(f2, d2, snaps)
    assert prune_snapshots(snaps, {d2}) == [d1]
    assert [p.stem for p in snaps.glob("*.safetensors")] == [d2]
