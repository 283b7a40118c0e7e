"""`latentlm import-ctrlg`: a Ctrl-G HMM checkpoint written here (random parameters in Ctrl-G's format) becomes a
served dense `hmm` carrying the LM's tokenizer; its scores equal a plain log-space forward pass over the
checkpoint's own tensors (numpy, float64); malformed checkpoints are refused naming the tensor or key."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from latentlm import ops
from latentlm.cli import main
from tests.helpers_tokenizer import EOS, make_bpe_tokenizer

H = 5


@pytest.fixture(scope="module")
def tokdir(tmp_path_factory):
    """A save_pretrained-style directory holding tokenizer.json (300 ids, <|endoftext|> = 0)."""
    d = tmp_path_factory.mktemp("tok")
    make_bpe_tokenizer(300).save(str(d / "tokenizer.json"))
    return d


def checkpoint(path, V: int = 300, eos: int = 0, seed: int = 0, **overrides) -> dict[str, torch.Tensor]:
    """Ctrl-G's format: config.json (hidden_states, vocab_size, eos_token_id); model.safetensors with alpha_exp
    (rows sum to 1), beta (log emissions), gamma (initial logits, not normalised here: the importer softmaxes)."""
    g = torch.Generator().manual_seed(seed)
    t = {"alpha_exp": torch.softmax(2 * torch.randn(H, H, generator=g), 1),
         "beta": torch.log_softmax(3 * torch.randn(H, V, generator=g), 1),
         "gamma": torch.randn(H, generator=g)}
    t.update(overrides)
    path.mkdir(parents=True, exist_ok=True)
    save_file(t, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps({"hidden_states": H, "vocab_size": V, "eos_token_id": eos}))
    return t


def numpy_logprob(t: dict[str, torch.Tensor], x: list[int]) -> float:
    """log p(x) by the forward recursion in log space (float64) over the checkpoint's tensors."""
    log_trans = np.log(t["alpha_exp"].double().numpy())
    log_emit = t["beta"].double().numpy()
    gamma = t["gamma"].double().numpy()
    log_start = gamma - np.logaddexp.reduce(gamma)
    a = log_start + log_emit[:, x[0]]
    for xt in x[1:]:
        a = np.logaddexp.reduce(a[:, None] + log_trans, axis=0) + log_emit[:, xt]
    return float(np.logaddexp.reduce(a))


def test_imported_scores_equal_a_plain_forward_pass(tmp_path, tokdir):
    t = checkpoint(tmp_path / "ck")
    assert main(["import-ctrlg", str(tmp_path / "ck"), "--tokenizer", str(tokdir), "--name", "c",
                 "--store", str(tmp_path / "store")]) == 0
    seqs = [[5, 17, 200, 0], [0], [299, 3, 3, 3, 3, 3, 3, 3, 3, 0], [42, 43]]
    for dtype, tol in (("float32", 2e-5), ("float64", 1e-6)):  # the stored float32 weights bound float64's error
        model = ops.load_model(tmp_path / "store", "c", dtype=dtype)
        got = [r["logprob"] for r in ops.run(model, "score", seqs)]
        want = [numpy_logprob(t, s) for s in seqs]
        np.testing.assert_allclose(got, want, rtol=0, atol=tol * max(len(s) for s in seqs))
    # the store carries the tokenizer; text is read with it and ends with the checkpoint's eos
    store = tmp_path / "store" / "c"
    assert (store / "tokenizer.json").read_bytes() == (tokdir / "tokenizer.json").read_bytes()
    m = json.loads((store / "manifest.json").read_text())
    assert m["preprocessing"] == {"lowercase": False, "unk": None, "eos": EOS, "add_eos": True,
                                  "tokenizer": "tokenizer.json"}
    assert m["family"] == "hmm" and m["config"] == {"num_states": H} and m["vocab_size"] == 300
    ids = model.vocab.encode("the river")
    assert ids == make_bpe_tokenizer(300).encode("the river").ids + [0]
    (r,) = ops.run(model, "score", [ids])
    assert r["logprob"] == pytest.approx(numpy_logprob(t, ids), abs=1e-5)


def test_a_larger_hmm_vocabulary_gets_placeholders(tmp_path, tokdir):
    """An HMM over more ids than the tokenizer names (a model's padded output layer): placeholders in vocab.txt."""
    checkpoint(tmp_path / "ck", V=304, eos=0)
    assert main(["import-ctrlg", str(tmp_path / "ck"), "--tokenizer", str(tokdir / "tokenizer.json"), "--name", "c",
                 "--store", str(tmp_path)]) == 0
    lines = (tmp_path / "c" / "vocab.txt").read_text(encoding="utf-8").split("\n")[:-1]
    assert len(lines) == 304 and lines[0] == EOS and lines[300:] == [f"<|id:{i}|>" for i in range(300, 304)]


def _refused(capsys, tmp_path, tokdir, *extra) -> str:
    assert main(["import-ctrlg", str(tmp_path / "ck"), "--tokenizer", str(tokdir), "--name", "c",
                 "--store", str(tmp_path / "store"), *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert not (tmp_path / "store" / "c").exists()
    return err[0]


@pytest.mark.parametrize("overrides, expect", [
    ({"alpha_exp": torch.full((H, H), 0.3)}, "alpha_exp: row 0 of the transition probabilities sums to 1.5"),
    ({"beta": torch.full((H, 300), -5.0)}, "beta: row 0 of the emission probabilities (exp(beta)) sums to"),
    ({"beta": torch.zeros(H, 299)}, "beta: expected shape [5, 300]"),
    ({"gamma": torch.zeros(H + 1)}, "gamma: expected shape [5]"),
    ({"alpha_exp": -torch.eye(H)}, "alpha_exp: negative transition probabilities at [0, 0]"),
    ({"gamma": torch.tensor([0.0, float("nan"), 0, 0, 0])}, "gamma: NaN or +inf logit at [1]"),
])
def test_malformed_tensors_are_refused_naming_them(tmp_path, tokdir, capsys, overrides, expect):
    checkpoint(tmp_path / "ck", **overrides)
    assert expect in _refused(capsys, tmp_path, tokdir)


def test_bad_config_tokenizer_and_files_are_refused(tmp_path, tokdir, capsys):
    checkpoint(tmp_path / "ck", eos=300)
    assert "eos_token_id 300 is outside the vocabulary [0, 300)" in _refused(capsys, tmp_path, tokdir)
    checkpoint(tmp_path / "ck", V=299)  # the tokenizer names 300 ids
    assert "300 token ids, more than the checkpoint's vocab_size 299" in _refused(capsys, tmp_path, tokdir)
    checkpoint(tmp_path / "ck")
    assert "no such directory or file" in _refused(capsys, tmp_path, tmp_path / "nope")
    (tmp_path / "ck" / "model.safetensors").write_bytes(b"not safetensors")
    assert "not a readable safetensors file" in _refused(capsys, tmp_path, tokdir)
    (tmp_path / "ck" / "config.json").unlink()
    assert "no config.json" in _refused(capsys, tmp_path, tokdir)
    with pytest.raises(SystemExit) as e:  # --tokenizer is required
        main(["import-ctrlg", str(tmp_path / "ck"), "--name", "c", "--store", str(tmp_path)])
    assert e.value.code == 2
