"""ONNX Runtime scoring backend: parity with the torch engine for hmm, blocked_hmm and rank_hmm, padding
invariance, probability 0, metadata and the content-hash check, and the torch-free standalone scorer."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from latentlm import ops
from latentlm.models.base import Batch
from latentlm.models.blocked_hmm import BlockedHMM
from latentlm.models.errors import ArtifactError, InputError
from latentlm.models.hmm import DenseHMM
from latentlm.models.onnx_graph import OPSET, export_onnx, read_metadata
from latentlm.models.rank_hmm import RankHMM
from latentlm.models.registry import save_artifact
from latentlm.models.synthetic import random_blocked_hmm, random_hmm, random_rank_hmm
from latentlm.models.vocab import Vocabulary
from latentlm.onnx_backend import OnnxScorer, export_model
from latentlm.ops import dumps
from latentlm.ops.format import fields

pytestmark = pytest.mark.usefixtures("one_thread")

REPO = Path(__file__).resolve().parents[2]
FAMILIES = ["hmm", "blocked_hmm", "rank_hmm"]
V = 40


def make(family: str, seed: int = 0, V: int = V, conc: float = 1.0, size: str = "small"):
    big = size == "big"
    if family == "hmm":
        t, c = random_hmm(96 if big else 7, V, seed, conc)
        return DenseHMM.from_tensors(t, c), t, c
    if family == "blocked_hmm":
        t, c = random_blocked_hmm(8 if big else 3, 12 if big else 4, V, seed, conc)
        return BlockedHMM.from_tensors(t, c), t, c
    t, c = random_rank_hmm(64 if big else 9, 24 if big else 4, V, seed, conc)
    return RankHMM.from_tensors(t, c), t, c


def random_seqs(n: int, V: int, seed: int, max_len: int = 30) -> list[list[int]]:
    g = np.random.default_rng(seed)
    return [g.integers(0, V, size=int(g.integers(1, max_len + 1))).tolist() for _ in range(n)]


def torch_score(impl, seqs):
    lp, tok = impl.score(Batch.from_lists(seqs))
    tok = tok.double()
    return lp.tolist(), [tok[i, : len(s)].tolist() for i, s in enumerate(seqs)]


def assert_close(got, want, rel=1e-5, abs_=1e-6):
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        if math.isinf(w):
            assert g == w
        else:
            assert g == pytest.approx(w, rel=rel, abs=abs_)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    d = tmp_path_factory.mktemp("onnx")
    out = {}
    for fam in FAMILIES:
        for size in ("small", "big"):
            impl, _, _ = make(fam, seed=3, size=size, conc=0.5)
            out[fam, size] = impl, export_onnx(impl, d / f"{fam}-{size}.onnx", name=f"{fam}-{size}",
                                               content_hash=f"hash-{fam}-{size}")
    return out


@pytest.mark.parametrize("size", ["small", "big"])
@pytest.mark.parametrize("family", FAMILIES)
def test_parity_with_torch(exported, family, size):
    impl, path = exported[family, size]
    seqs = random_seqs(25, V, seed=1, max_len=60)
    lp, tok = OnnxScorer(path).score(seqs)
    ref_lp, ref_tok = torch_score(impl, seqs)
    assert_close(lp, ref_lp)
    for g, w in zip(tok, ref_tok, strict=True):
        assert_close(g, w)


@pytest.mark.parametrize("family", FAMILIES)
def test_raw_graph_outputs(exported, family):
    """The graph itself: padded positions give 0, logprob is float64 and the sum of the token terms."""
    impl, path = exported[family, "small"]
    seqs = [[1, 2, 3, 4, 5, 6], [7], [8, 9, 10]]
    b = Batch.from_lists(seqs)
    ids = b.ids.numpy().copy()
    ids[1, 1:] = 39  # any id at padding changes nothing
    lp, tok = OnnxScorer(path).run_padded(ids, b.lengths.numpy())
    assert lp.dtype == np.float64 and tok.dtype == np.float32 and tok.shape == (3, 6)
    assert (tok[1, 1:] == 0).all() and (tok[2, 3:] == 0).all()
    np.testing.assert_allclose(lp, tok.astype(np.float64).sum(1), rtol=1e-12)
    ref_lp, _ = impl.score(b)
    np.testing.assert_allclose(lp, ref_lp.numpy(), rtol=1e-5)


@pytest.mark.parametrize("family", FAMILIES)
def test_batch_equals_one_at_a_time(exported, family):
    _, path = exported[family, "big"]
    seqs = random_seqs(17, V, seed=2, max_len=45)
    scorer = OnnxScorer(path)
    lp, tok = scorer.score(seqs)
    for s, l_b, t_b in zip(seqs, lp, tok, strict=True):
        l1, t1 = scorer.score([s])
        assert l1[0] == pytest.approx(l_b, rel=1e-6)
        assert t1[0] == pytest.approx(t_b, rel=1e-5, abs=1e-6)
    # small token budget: many batches, same answers
    small = OnnxScorer(path, max_batch_tokens=50)
    lp2, _ = small.score(seqs)
    assert lp2 == pytest.approx(lp, rel=1e-6)


def test_long_sequence_matches_torch_chunked(tmp_path):
    """A 5,000-token sequence at 128 states: torch scores it in chunks, the graph step by step."""
    t, c = random_hmm(128, V, seed=5, concentration=0.5)
    impl = DenseHMM.from_tensors(t, c)
    path = export_onnx(impl, tmp_path / "long.onnx")
    seq = np.random.default_rng(4).integers(0, V, 5000).tolist()
    lp, _ = OnnxScorer(path).score([seq])
    ref, _ = torch_score(impl, [seq])
    assert lp[0] == pytest.approx(ref[0], rel=1e-5)


def test_float64_model_exports_as_float32(tmp_path):
    t, c = random_rank_hmm(9, 4, V, seed=1)
    impl64 = RankHMM.from_tensors(t, c, dtype=torch.float64)
    seqs = random_seqs(5, V, seed=3)
    lp, _ = OnnxScorer(export_onnx(impl64, tmp_path / "r.onnx")).score(seqs)
    ref, _ = torch_score(impl64, seqs)
    assert_close(lp, ref, rel=1e-5)


def test_probability_zero_gives_minus_inf_like_torch(tmp_path):
    """Token 2 is impossible from state 0 (which never leaves itself): -inf at that position and at every
    later real position, logprob -inf, padding still 0; op_score reports null."""
    t = {"start": torch.tensor([1.0, 0.0]), "trans": torch.tensor([[1.0, 0.0], [0.0, 1.0]]),
         "emit": torch.tensor([[0.5, 0.5, 0.0], [0.0, 0.5, 0.5]])}
    impl = DenseHMM.from_tensors(t, {"num_states": 2})
    seqs = [[0, 2, 0, 1], [0, 1], [2]]
    scorer = OnnxScorer(export_onnx(impl, tmp_path / "z.onnx"))
    lp, tok = scorer.score(seqs)
    ref_lp, ref_tok = torch_score(impl, seqs)
    assert lp == [-math.inf, pytest.approx(2 * math.log(0.5)), -math.inf]
    assert ref_lp[0] == ref_lp[2] == -math.inf
    assert tok[0] == [pytest.approx(math.log(0.5)), -math.inf, -math.inf, -math.inf] == ref_tok[0]
    assert tok[2] == [-math.inf] == ref_tok[2]
    assert not any(math.isnan(v) for row in tok for v in row)
    res = scorer.op_score(seqs, token_logprobs=True)
    first = fields(res[0])  # as the CLI and the service write it
    assert res[0].logprob == -math.inf and first["perplexity"] == math.inf
    assert res[0].token_logprobs[1:] == [-math.inf] * 3
    assert b'"logprob":null' in dumps(first) and b'"perplexity":null' in dumps(first)  # JSON: null
    assert res[1].logprob == pytest.approx(2 * math.log(0.5))


def test_blocked_zero_block_gives_minus_inf(tmp_path):
    t, c = random_blocked_hmm(3, 2, V, seed=0)
    wc = t["word_cluster"]
    trans = t["trans"].clone().view(3, 2, 3, 2)
    trans[0, :, 1, :] = 0  # cluster 0 never moves to cluster 1
    trans = trans.view(6, 6)
    t["trans"] = trans / trans.sum(1, keepdim=True)
    impl = BlockedHMM.from_tensors(t, c)
    a = int((wc == 0).nonzero()[0])
    b = int((wc == 1).nonzero()[0])
    seqs = [[a, b, a], [b, a], [a, a, b, b]]
    lp, tok = OnnxScorer(export_onnx(impl, tmp_path / "b.onnx")).score(seqs)
    ref_lp, ref_tok = torch_score(impl, seqs)
    assert lp[0] == lp[2] == -math.inf and math.isfinite(lp[1])
    assert_close(lp, ref_lp)
    for g, w in zip(tok, ref_tok, strict=True):
        assert_close(g, w)


def _vocab(n: int) -> Vocabulary:
    return Vocabulary([f"w{i}" for i in range(n - 2)] + ["<unk>", "<eos>"])


def test_store_model_metadata_and_hash_check(tmp_path):
    t, c = random_blocked_hmm(3, 4, V, seed=7)
    save_artifact(tmp_path / "store", "blk", "blocked_hmm", t, _vocab(V), config=c)
    m = ops.load_model(tmp_path / "store", "blk")
    path = export_model(m, tmp_path / "blk.onnx")
    meta = read_metadata(path)
    assert meta["latentlm.content_hash"] == m.content_hash
    assert meta["latentlm.family"] == "blocked_hmm" and meta["latentlm.name"] == "blk"
    assert meta["latentlm.opset"] == str(OPSET) and meta["latentlm.vocab_size"] == str(V)
    assert json.loads(meta["latentlm.vocab"]) == m.vocab.tokens
    scorer = OnnxScorer(path, expected_hash=m.content_hash)
    assert (scorer.family, scorer.name, scorer.content_hash) == ("blocked_hmm", "blk", m.content_hash)
    seqs = random_seqs(6, V, seed=0)
    got = scorer.op_score(seqs, token_logprobs=True)
    want = m.impl.op_score(seqs, token_logprobs=True)
    for g, w in zip(got, want, strict=True):
        assert g.num_tokens == w.num_tokens
        assert g.logprob == pytest.approx(w.logprob, rel=1e-5)
        assert fields(g)["perplexity"] == pytest.approx(fields(w)["perplexity"], rel=1e-4)
        assert g.token_logprobs == pytest.approx(w.token_logprobs, rel=1e-5, abs=1e-6)
    # the model is retrained (new weights, new hash): the old file is refused
    t2, _ = random_blocked_hmm(3, 4, V, seed=8)
    save_artifact(tmp_path / "store", "blk", "blocked_hmm", t2, _vocab(V), config=c)
    m2 = ops.load_model(tmp_path / "store", "blk")
    assert m2.content_hash != m.content_hash
    with pytest.raises(ArtifactError, match="content hash"):
        OnnxScorer(path, expected_hash=m2.content_hash)


def test_refusals(tmp_path, exported):
    _, path = exported["hmm", "small"]
    scorer = OnnxScorer(path)
    with pytest.raises(InputError, match=r"token id 40 at position 1 is outside \[0, 40\)"):
        scorer.score([[1, 40]])
    with pytest.raises(InputError, match="empty"):
        scorer.score([[1], []])
    with pytest.raises(InputError):
        scorer.score([])
    with pytest.raises(ArtifactError, match="no such"):
        OnnxScorer(tmp_path / "missing.onnx")
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"not a model")
    with pytest.raises(ArtifactError, match="cannot load"):
        OnnxScorer(bad)
    class Other:
        family = "pcfg"

    with pytest.raises(ValueError, match="not 'pcfg'"):
        export_onnx(Other(), tmp_path / "x.onnx")


def test_standalone_scorer_without_torch(tmp_path, exported):
    impl, path = exported["rank_hmm", "big"]
    seqs = random_seqs(7, V, seed=11)
    inp = tmp_path / "ids.txt"
    inp.write_text("".join(" ".join(map(str, s)) + "\n" for s in seqs))
    script = REPO / "bench" / "score_onnx_standalone.py"
    r = subprocess.run([sys.executable, str(script), str(path), str(inp), "--token-logprobs", "--batch", "3",
                        "--hash", "hash-rank_hmm-big"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    rows = [json.loads(line) for line in r.stdout.splitlines()]
    ref_lp, ref_tok = torch_score(impl, seqs)
    assert [row["index"] for row in rows] == list(range(7))
    assert_close([row["logprob"] for row in rows], ref_lp)
    for row, w in zip(rows, ref_tok, strict=True):
        assert_close(row["token_logprobs"], w)
    r = subprocess.run([sys.executable, str(script), str(path), str(inp), "--hash", "other"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "content hash" in r.stderr
