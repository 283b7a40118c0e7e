"""Artifacts: round trip, and every corruption refused with a message naming the file and the problem."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from latentlm.models.errors import ArtifactError, ModelNotFound
from latentlm.models.registry import load_artifact, save_artifact
from latentlm.models.store import MANIFEST, VOCAB, WEIGHTS, list_models
from latentlm.models.synthetic import random_blocked_hmm, random_hmm, random_rank_hmm
from latentlm.models.vocab import Preprocessing, Vocabulary


def vocab(V: int) -> Vocabulary:
    return Vocabulary([f"w{i}" for i in range(V - 2)] + ["<unk>", "<eos>"], Preprocessing(lowercase=True))


@pytest.mark.parametrize("maker,family", [(lambda: random_hmm(4, 8), "hmm"),
                                          (lambda: random_blocked_hmm(2, 3, 8), "blocked_hmm"),
                                          (lambda: random_rank_hmm(5, 3, 8), "rank_hmm")])
def test_round_trip(tmp_path, maker, family):
    t, c = maker()
    path = save_artifact(tmp_path, "m1", family, t, vocab(8), config=c, provenance={"source": "test"})
    art = load_artifact(path)
    assert art.family == family and art.vocab.tokens == vocab(8).tokens
    assert art.vocab.preprocessing.lowercase is True
    for k, v in t.items():
        assert torch.equal(art.tensors[k], v)
    m = json.loads((path / MANIFEST).read_text())
    assert set(m["files"]) == {VOCAB, WEIGHTS} and m["provenance"]["source"] == "test"
    assert list_models(tmp_path) == ["m1"]


def saved(tmp_path):
    t, c = random_hmm(3, 8)
    return save_artifact(tmp_path, "m", "hmm", t, vocab(8), config=c), t


def test_hash_mismatch_names_the_file(tmp_path):
    path, t = saved(tmp_path)
    (path / VOCAB).write_text((path / VOCAB).read_text().replace("w0", "zz"))
    with pytest.raises(ArtifactError, match=r"vocab.txt: SHA-256 mismatch"):
        load_artifact(path)


def rewrite_weights(path, tensors):
    """Replace the weights and fix the recorded hash, so only the content checks can catch it."""
    save_file(tensors, str(path / WEIGHTS))
    from latentlm.models.store import sha256_file

    m = json.loads((path / MANIFEST).read_text())
    m["files"][WEIGHTS] = sha256_file(path / WEIGHTS)
    m["shapes"] = {k: list(v.shape) for k, v in tensors.items()}
    (path / MANIFEST).write_text(json.dumps(m))


def test_unnormalised_rows_are_refused(tmp_path):
    path, t = saved(tmp_path)
    bad = dict(t)
    bad["trans"] = t["trans"].clone()
    bad["trans"][1] *= 1.01
    rewrite_weights(path, bad)
    with pytest.raises(ArtifactError, match=r"weights.safetensors: tensor 'trans' is not normalised: entry \[1\]"):
        load_artifact(path)


def test_nan_and_negative_are_refused(tmp_path):
    path, t = saved(tmp_path)
    bad = dict(t)
    bad["emit"] = t["emit"].clone()
    bad["emit"][0, 0] = float("nan")
    rewrite_weights(path, bad)
    with pytest.raises(ArtifactError, match="'emit' has NaN"):
        load_artifact(path)
    bad["emit"] = t["emit"].clone()
    bad["emit"][0, 0] = -bad["emit"][0, 0]
    rewrite_weights(path, bad)
    with pytest.raises(ArtifactError, match="'emit' has negative"):
        load_artifact(path)


def test_shape_mismatch_against_manifest(tmp_path):
    path, t = saved(tmp_path)
    m = json.loads((path / MANIFEST).read_text())
    m["shapes"]["trans"] = [3, 4]
    (path / MANIFEST).write_text(json.dumps(m))
    with pytest.raises(ArtifactError, match=r"'trans' has shape \[3, 3\], manifest says \[3, 4\]"):
        load_artifact(path)


def test_missing_files_and_bad_manifest(tmp_path):
    path, _ = saved(tmp_path)
    (path / WEIGHTS).unlink()
    with pytest.raises(ArtifactError, match="weights.safetensors: file listed in the manifest is missing"):
        load_artifact(path)
    (path / MANIFEST).write_text("{not json")
    with pytest.raises(ArtifactError, match="manifest.json: not valid JSON"):
        load_artifact(path)
    with pytest.raises(ModelNotFound):
        load_artifact(tmp_path / "nope")


def test_rank_factors_must_match_cached_matrices(tmp_path):
    t, c = random_rank_hmm(5, 3, 8)
    t["rank_trans"] = t["rank_trans"][[1, 0, 2]]  # still row-stochastic, but not V U^T any more
    with pytest.raises(ArtifactError, match="'rank_trans' does not match the product"):
        save_artifact(tmp_path, "r", "rank_hmm", t, vocab(8), config=c)
    assert list_models(tmp_path) == []


def test_blocked_emission_normalised_per_state(tmp_path):
    t, c = random_blocked_hmm(2, 2, 8)
    t["emit"] = t["emit"].clone()
    t["emit"][0] *= 2
    with pytest.raises(ArtifactError, match=r"'emit' is not normalised: state \d+ \(cluster \d\)"):
        save_artifact(tmp_path, "b", "blocked_hmm", t, vocab(8), config=c)


def test_invalid_name(tmp_path):
    t, c = random_hmm(2, 8)
    with pytest.raises(ArtifactError, match="invalid model name"):
        save_artifact(tmp_path, "../evil", "hmm", t, vocab(8), config=c)


def test_tokenisation_follows_preprocessing():
    v = vocab(8)
    assert v.encode("W0 nothing w1") == [0, 6, 1, 7]
    v2 = Vocabulary(["a", "b"], Preprocessing(unk=None, eos=None, add_eos=False))
    from latentlm.models.errors import InputError

    with pytest.raises(InputError, match="word 'c' at position 1 is not in the vocabulary"):
        v2.encode("a c")
    with pytest.raises(InputError, match="empty sequence"):
        v2.encode("   ")


def test_read_weights_matches_safetensors_and_hashes_what_it_reads(tmp_path):
    """The single-pass reader gives exactly safetensors' own tensors (every dtype the families use, empty and
    0-d tensors, tensors larger than one read chunk) and checks the SHA-256 of the bytes it loaded."""
    from safetensors.torch import load_file

    from latentlm.models import store

    g = torch.Generator().manual_seed(0)
    tensors = {"big": torch.randn(3, store.READ_CHUNK // 4 // 3 + 5, generator=g),
               "f64": torch.randn(7, dtype=torch.float64, generator=g), "ids": torch.arange(11),
               "bf": torch.randn(4, 2, generator=g).to(torch.bfloat16), "scalar": torch.tensor(2.5),
               "empty": torch.zeros(0, 3), "flags": torch.tensor([True, False])}
    f = tmp_path / WEIGHTS
    save_file(tensors, str(f))
    digest = store.sha256_file(f)
    ref = load_file(str(f))
    devices = [("cpu", False), ("cpu", True)] + [("cuda", None)] * torch.cuda.is_available()
    for device, staged in devices:  # direct reads, and the staging copy accelerators use
        got = store.read_weights(f, digest, device, staged=staged)
        assert set(got) == set(ref)
        for k, v in ref.items():
            assert got[k].device.type == device, k
            assert got[k].dtype == v.dtype and got[k].shape == v.shape and torch.equal(got[k].cpu(), v), k
    with pytest.raises(ArtifactError, match="SHA-256 mismatch"):
        store.read_weights(f, "0" * 64)


def test_read_weights_refuses_malformed_files(tmp_path):
    from latentlm.models import store

    f = tmp_path / WEIGHTS
    save_file({"a": torch.ones(4), "b": torch.ones(2)}, str(f))
    good = f.read_bytes()
    n = int.from_bytes(good[:8], "little")
    cases = {
        "truncated": (good[:-3], "file ended inside tensor|runs past the end"),
        "trailing": (good + b"\0\0\0\0", "4 bytes after the last tensor"),
        "short": (good[:5], "shorter than the 8-byte header length"),
        "header length": ((10**9).to_bytes(8, "little") + good[8:], "header length 1000000000 exceeds the file"),
        "not json": (good[:8] + b"{" * n + good[8 + n:], "header is not JSON"),
    }
    header = json.loads(good[8: 8 + n])
    header["a"]["dtype"] = "C64"
    raw = json.dumps(header, separators=(",", ":")).encode().ljust(n)
    cases["dtype"] = (good[:8] + raw + good[8 + n:], "dtype 'C64' is not supported")
    header["a"]["dtype"], header["a"]["data_offsets"] = "F32", [0, 12]
    raw = json.dumps(header, separators=(",", ":")).encode().ljust(n)
    cases["hole"] = (good[:8] + raw + good[8 + n:], "12 bytes for shape|holes or overlaps")
    for data, message in cases.values():
        f.write_bytes(data)
        for staged in (False, True):
            with pytest.raises(ArtifactError, match=message):
                store.read_weights(f, store.sha256_file(f), staged=staged)


def load_memory_mib(store, name: str, storage_dtype: str | None = None) -> tuple[float, float]:
    """(peak, kept) MiB of resident memory that `ops.load_model(store, name, storage_dtype=...)` adds in a fresh
    process (VmHWM reset just before the load, VmRSS after it)."""
    import subprocess
    import sys

    code = ("import sys; from latentlm import ops; from latentlm.models import registry;"
            "kib = lambda key: int(open('/proc/self/status').read().split(key + ':')[1].split()[0]);"
            "base = kib('VmRSS'); open('/proc/self/clear_refs', 'w').write('5');"
            "m = ops.load_model(sys.argv[1], sys.argv[2], storage_dtype=sys.argv[3] or None);"
            "print((kib('VmHWM') - base) / 1024, (kib('VmRSS') - base) / 1024)")
    out = subprocess.run([sys.executable, "-c", code, str(store), name, storage_dtype or ""], capture_output=True,
                         text=True, check=True)
    peak_mib, kept_mib = (float(x) for x in out.stdout.split()[-2:])
    return peak_mib, kept_mib


def test_loading_keeps_one_copy_of_the_weights(tmp_path):
    """Peak memory of loading a 256 MiB model in a fresh process: one copy of the weights plus bounded
    temporaries (hashing and then loading held two copies; a float64 sum for the normalisation check two
    more)."""
    t, c = random_hmm(8192, 16)
    t = {k: v.float() for k, v in t.items()}  # trans: 8192^2 float32 = 256 MiB
    save_artifact(tmp_path, "big", "hmm", t, vocab(16), config=c)
    del t
    peak_mib, kept_mib = load_memory_mib(tmp_path, "big")
    # one copy kept (two would be 512+): the rest is modules imported on first load and the allocator's cache
    assert 256 <= kept_mib < 256 * 1.5, kept_mib
    assert peak_mib < 256 * 1.75, peak_mib  # and no second copy at any moment (the old path peaked at 3x)


def test_read_weights_casts_as_it_reads(tmp_path):
    """`cast` converts tensors as they are read, a slab of rows at a time: exactly `tensor.to(dtype)` for
    tensors of one row, several slabs, rows wider than a slab, 0-d and empty; every floating tensor carries
    the float64 sums of its stored rows and its smallest stored entry, read into its own dtype or another,
    directly or through the staging slab; the hash, truncation and dtype checks hold on that path too."""
    from latentlm.models import checks, store

    g = torch.Generator().manual_seed(1)
    wide = store.READ_CHUNK // 4 + 3  # one float32 row is more than a read chunk
    tensors = {"slabs": torch.rand(3 * (store.READ_CHUNK // 4 // 1000) + 7, 1000, generator=g),
               "wide": torch.rand(2, wide, generator=g), "vec": torch.rand(5, generator=g),
               "scalar": torch.tensor(0.25), "empty": torch.zeros(0, 4), "empty_rows": torch.zeros(3, 0),
               "empty_1d": torch.zeros(0), "f64": torch.rand(3, 4, dtype=torch.float64, generator=g),
               "ids": torch.arange(6)}
    f = tmp_path / WEIGHTS
    save_file(tensors, str(f))
    digest = store.sha256_file(f)
    for target, staged in [(None, False), (None, True), (torch.bfloat16, False), (torch.float64, False),
                           (torch.float16, True)]:
        cast = {k: target for k, v in tensors.items() if v.is_floating_point()} if target else None
        got = store.read_weights(f, digest, cast=cast, staged=staged)
        assert torch.equal(got["ids"], tensors["ids"]) and not hasattr(got["ids"], checks.STORED_STATS)
        for k, v in tensors.items():
            if not v.is_floating_point():
                continue
            assert got[k].dtype == (target or v.dtype) and torch.equal(got[k], v.to(target or v.dtype)), (k, target)
            sums, low = getattr(got[k], checks.STORED_STATS)
            want = v.double().sum(-1) if v.dim() else v.double()
            assert sums.shape == want.shape and torch.allclose(sums, want, rtol=1e-12, atol=0), k
            assert low == (v.min().item() if v.numel() else float("inf")), k
    with pytest.raises(ArtifactError, match="SHA-256 mismatch"):
        store.read_weights(f, "0" * 64, cast={"slabs": torch.bfloat16})
    with pytest.raises(ArtifactError, match=r"tensor 'ids': cannot be read as torch.float32"):
        store.read_weights(f, digest, cast={"ids": torch.float32})
    good = f.read_bytes()
    f.write_bytes(good[: len(good) // 2])  # ends inside "slabs" or "wide", the largest tensors
    with pytest.raises(ArtifactError, match="file ended inside tensor|runs past the end"):
        store.read_weights(f, store.sha256_file(f), cast={"slabs": torch.bfloat16, "wide": torch.bfloat16})


def uniform_blocked(M: int, k: int, V: int, row_scale: float = 1.0):
    """A blocked model whose transition rows are uniform (1/Z each): 1/6 rounds to 0.16699 in bfloat16, so
    the rounded rows of a 6-state model sum to 1.00195, outside the 1e-4 normalisation tolerance."""
    t, c = random_blocked_hmm(M, k, V)
    Z = M * k
    t = {n: v.float() if v.is_floating_point() else v for n, v in t.items()}
    t["trans"] = torch.full((Z, Z), 1.0 / Z)
    t["trans"][1] *= row_scale
    return t, c


def test_bfloat16_load_checks_the_stored_rows(tmp_path):
    """Loaded for bfloat16 storage on CPU, blocked_hmm's matrix is read straight into bfloat16 and its rows
    are checked as stored: a matrix that is normalised in float32 loads (its bfloat16 rounding alone would
    fail the check), one that is not is refused with the float32 load's very message."""
    from latentlm import ops
    from latentlm.models import checks

    t, c = uniform_blocked(2, 3, 8)
    save_artifact(tmp_path, "uniform", "blocked_hmm", t, vocab(8), config=c)
    with pytest.raises(ArtifactError, match="not normalised"):  # what an unmarked bfloat16 matrix would meet
        checks.check_distribution(t["trans"].to(torch.bfloat16), "trans", 1, "here")
    m = ops.load_model(tmp_path, "uniform", storage_dtype="bfloat16").impl
    assert m.trans.dtype == torch.bfloat16 and torch.equal(m.trans, t["trans"].to(torch.bfloat16))
    assert not hasattr(m.trans, checks.STORED_STATS)  # the mark is dropped once checked
    assert m.dtype == torch.float32 and m.start.dtype == torch.float32

    bad, c = uniform_blocked(2, 3, 8, row_scale=1.001)
    save_artifact(tmp_path, "bad", "blocked_hmm", t, vocab(8), config=c)
    rewrite_weights(tmp_path / "bad", bad)
    messages = []
    for storage in ("float32", "bfloat16"):
        with pytest.raises(ArtifactError, match=r"tensor 'trans' is not normalised: entry \[1\]") as e:
            ops.load_model(tmp_path, "bad", storage_dtype=storage)
        messages.append(str(e.value))
    assert messages[0] == messages[1]


@pytest.mark.parametrize("dtype,storage", [("float32", "bfloat16"), ("float64", None), ("float32", "tfloat32")])
def test_loading_in_another_precision_equals_converting_after(tmp_path, dtype, storage):
    """Read straight into the precision the model keeps (`Family.read_dtypes`): the same matrices and the same
    scores as loading as stored and converting afterwards (`from_tensors`, `set_storage_dtype`)."""
    from latentlm import ops
    from latentlm.models.blocked_hmm import BlockedHMM
    from latentlm.models.store import read_artifact

    t, c = random_blocked_hmm(4, 3, 20, seed=3)
    t = {n: v.float() if v.is_floating_point() else v for n, v in t.items()}
    path = save_artifact(tmp_path, "b", "blocked_hmm", t, vocab(20), config=c)
    loaded = ops.load_model(tmp_path, "b", dtype=dtype, storage_dtype=storage).impl
    as_stored = read_artifact(path, lambda f: BlockedHMM.validate_tensors).tensors
    assert as_stored["trans"].dtype == torch.float32
    ref = BlockedHMM.from_tensors(as_stored, c, dtype=getattr(torch, dtype))
    ref.set_storage_dtype(storage)
    assert loaded.trans.dtype == ref.trans.dtype and torch.equal(loaded.trans, ref.trans)
    assert loaded.dtype == ref.dtype == getattr(torch, dtype)
    seqs = [[1, 5, 7, 2], [3], [19, 0, 4, 4, 8, 11]]
    assert loaded.op_score(seqs, token_logprobs=True) == ref.op_score(seqs, token_logprobs=True)


def test_bfloat16_load_never_holds_the_float32_matrix(tmp_path):
    """Peak memory of loading a blocked model with a 256 MiB float32 matrix for bfloat16 storage, in a fresh
    process: the 128 MiB bfloat16 matrix plus bounded temporaries. Reading it as stored and converting after
    held both (384 MiB)."""
    M, k = 32, 256  # 8,192 states
    t, c = random_blocked_hmm(M, k, 64)
    t = {n: v.float() if v.is_floating_point() else v for n, v in t.items()}
    save_artifact(tmp_path, "big", "blocked_hmm", t, vocab(64), config=c)
    del t
    peak_mib, kept_mib = load_memory_mib(tmp_path, "big", "bfloat16")
    # the bfloat16 matrix (128) and what loading imports (the compiled checks: ~70 MiB), not the float32 one (256)
    assert 128 <= kept_mib < 256, kept_mib
    assert peak_mib < 256, peak_mib  # less than the float32 matrix alone: it is never held whole


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("flaw", ["none", "nan", "inf", "-inf", "inf and -inf", "negative", "-0.0", "unnormalised"])
def test_compiled_screen_gives_the_torch_checks_verdict(monkeypatch, dtype, flaw):
    """`check_distribution` and `all_finite` from row statistics (the compiled pass, forced down to tiny
    tensors, or the marks the artifact reader leaves) accept and refuse exactly what the torch slices do, with
    the same message: NaN, infinities (also both in one row, whose sum is NaN), negative entries, -0.0 (not
    negative) and rows off by more than the tolerance, in every dtype the pass reads."""
    from latentlm.models import checks

    if not checks.HAVE_NUMBA:
        pytest.skip("the compiled pass needs numba")
    g = torch.Generator().manual_seed(0)
    t = torch.rand(7, 33, generator=g, dtype=torch.float64) + 0.01
    t = t / t.sum(1, keepdim=True)
    put = {"nan": [(2, 5, float("nan"))], "inf": [(4, 0, float("inf"))], "-inf": [(1, 32, float("-inf"))],
           "inf and -inf": [(3, 1, float("inf")), (3, 2, float("-inf"))], "negative": [(6, 7, -1e-3)],
           "-0.0": [(0, 3, -0.0)], "unnormalised": [(5, 9, 0.5)], "none": []}[flaw]
    for r, c, v in put:
        t[r, c] = v
    if flaw == "-0.0":
        t[0] /= t[0].sum()  # still -0.0 there, the row normalised again
    t = t.to(dtype)
    verdicts = []
    for how in ("compiled", "marked", "slices"):
        monkeypatch.setattr(checks, "COMPILED_MIN_ENTRIES", 1 if how == "compiled" else 1 << 62)
        if how == "marked":
            checks.mark_stored_stats(t, *checks.row_stats(t))
        else:
            checks.unmark_stored_stats(t)
        assert (checks.screened_stats(t) is not None) == (how != "slices")
        try:
            checks.check_distribution(t, "m", 1, "here", tol=1e-2 if dtype == torch.bfloat16 else 1e-4)
            verdicts.append(("ok", checks.all_finite(t)))
        except ArtifactError as e:
            verdicts.append((str(e), checks.all_finite(t)))
    assert verdicts[0] == verdicts[1] == verdicts[2]
    want = {"nan": "NaN or infinite", "inf": "NaN or infinite", "-inf": "NaN or infinite",
            "inf and -inf": "NaN or infinite", "negative": "negative entries", "unnormalised": "entry [5]"}
    assert want.get(flaw, "ok") in verdicts[0][0]
    assert verdicts[0][1] == (flaw not in ("nan", "inf", "-inf", "inf and -inf"))
