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


def test_loading_keeps_one_copy_of_the_weights(tmp_path):
    """Peak memory of loading a 256 MiB model in a fresh process: one copy of the weights plus bounded
    temporaries (hashing and then loading held two copies; a float64 sum for the normalisation check two
    more)."""
    import subprocess
    import sys

    t, c = random_hmm(8192, 16)
    t = {k: v.float() for k, v in t.items()}  # trans: 8192^2 float32 = 256 MiB
    save_artifact(tmp_path, "big", "hmm", t, vocab(16), config=c)
    del t
    code = ("import sys; from latentlm import ops; from latentlm.models import registry;"
            "kib = lambda key: int(open('/proc/self/status').read().split(key + ':')[1].split()[0]);"
            "base = kib('VmRSS'); open('/proc/self/clear_refs', 'w').write('5');"
            "m = ops.load_model(sys.argv[1], 'big');"
            "print((kib('VmHWM') - base) / 1024, (kib('VmRSS') - base) / 1024)")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, check=True)
    peak_mib, kept_mib = (float(x) for x in out.stdout.split()[-2:])
    # one copy kept (two would be 512+): the rest is modules imported on first load and the allocator's cache
    assert 256 <= kept_mib < 256 * 1.5, kept_mib
    assert peak_mib < 256 * 1.75, peak_mib  # and no second copy at any moment (the old path peaked at 3x)
