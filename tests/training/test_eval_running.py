"""`latentlm eval --running-text`: the split as one token stream (sentences joined, each with its `<eos>`),
scored exactly, against a brute-force float64 forward over the same stream."""

from __future__ import annotations

import json
import math

import pytest
import torch

from latentlm.cli import main
from latentlm.models import chain
from latentlm.models.errors import InputError
from latentlm.models.registry import save_artifact
from latentlm.models.synthetic import random_hmm
from latentlm.models.vocab import Preprocessing, Vocabulary
from latentlm.training.data import encode_corpus, read_text_files, running_text
from latentlm.training.settings import corpus_perplexity

WORDS = [f"w{i}" for i in range(12)]
PRE = Preprocessing(lowercase=False, unk="<unk>", eos="<eos>", add_eos=True, tokenizer="whitespace")


def vocab() -> Vocabulary:
    return Vocabulary(["<eos>", "<unk>", *WORDS], PRE)


def write_text(path, n_sentences: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    lines = []
    for _ in range(n_sentences):
        n = int(torch.randint(1, 12, (1,), generator=g))
        words = [WORDS[int(i)] for i in torch.randint(0, len(WORDS), (n,), generator=g)]
        if n > 3:
            words[2] = "unseen"  # -> <unk>
        lines.append(" ".join(words))
    path.write_text("\n".join(lines) + "\n\n", encoding="utf-8")  # a blank line is skipped
    return path


def save_hmm(store, name: str, Z: int, seed: int = 0) -> dict[str, torch.Tensor]:
    t, cfg = random_hmm(Z, len(vocab()), seed=seed, concentration=0.3)  # peaked rows: a state worth carrying
    t = {k: v.float() for k, v in t.items()}
    save_artifact(store, name, "hmm", t, vocab(), config=cfg)
    return t


def brute_force_logprob(t: dict[str, torch.Tensor], ids: list[int]) -> float:
    """log p(ids) by the step-by-step scaled forward recursion in float64 on torch ops (never chunked)."""
    start, trans, emit = (t[k].double() for k in ("start", "trans", "emit"))
    x = torch.tensor([ids])
    log_cond, _ = chain.forward(start[None], emit.T[x], trans, torch.tensor([len(ids)]), backend="torch",
                                chunk_long=False)
    return float(log_cond.sum())


@pytest.mark.parametrize("Z,n_sentences,dtype,rtol", [
    (6, 40, "float64", 1e-12),  # a short stream: the step-by-step recursion
    (6, 40, "float32", 1e-5),
    (128, 900, "float64", 1e-9),  # >= 4,096 tokens at 128 states: the stream is scored as a batch of chunks
    (128, 900, "float32", 1e-5),
])
def test_running_text_equals_brute_force_forward(tmp_path, Z, n_sentences, dtype, rtol):
    store = tmp_path / "store"
    t = save_hmm(store, "m", Z)
    text = write_text(tmp_path / "text.txt", n_sentences)
    seqs = encode_corpus(read_text_files([text]), vocab())
    stream = running_text(seqs)
    assert len(stream) == sum(len(s) for s in seqs) and all(s[-1] == vocab().eos_id for s in seqs)
    if Z == 128:
        assert len(stream) >= 4096  # long enough for the chunked path
    want = brute_force_logprob(t, stream)

    run = corpus_perplexity(store, "m", str(text), dtype=dtype, running_text=True)
    assert run["mode"] == "running_text"
    assert run["num_tokens"] == len(stream) and run["num_sequences"] == len(seqs)
    assert run["logprob"] == pytest.approx(want, rel=rtol)
    assert run["perplexity"] == pytest.approx(math.exp(-want / len(stream)), rel=rtol * 10)

    sent = corpus_perplexity(store, "m", str(text), dtype=dtype)
    assert sent["mode"] == "sentences" and sent["num_tokens"] == len(stream)
    per_sentence = math.fsum(brute_force_logprob(t, s) for s in seqs)
    assert sent["logprob"] == pytest.approx(per_sentence, rel=rtol)
    # carrying the state across sentences is a different model of the text: not the sum of sentence scores
    assert abs(want - per_sentence) > 1.0
    assert run["logprob"] - sent["logprob"] == pytest.approx(want - per_sentence, abs=4 * rtol * abs(want))


def test_running_text_cli_prints_both_modes(tmp_path, capsys):
    store = tmp_path / "store"
    save_hmm(store, "m", 6)
    text = write_text(tmp_path / "text.txt", 30)
    out = {}
    for flags in ([], ["--running-text"]):
        assert main(["eval", "--model", "m", "--data", str(text), "--store", str(store), *flags]) == 0
        row = json.loads(capsys.readouterr().out)
        out[row["mode"]] = row
    assert set(out) == {"sentences", "running_text"}
    assert out["sentences"]["num_tokens"] == out["running_text"]["num_tokens"]
    assert out["sentences"]["logprob"] != out["running_text"]["logprob"]


def test_running_text_refused_for_families_without_a_carried_state(tmp_path, capsys):
    from latentlm.models.pcfg import random_pcfg

    store = tmp_path / "store"
    t, cfg = random_pcfg(3, 4, 4, len(vocab()), seed=0)
    save_artifact(store, "g", "pcfg", {k: v.float() for k, v in t.items()}, vocab(), config=cfg)
    text = write_text(tmp_path / "text.txt", 5)
    with pytest.raises(InputError, match="--running-text") as e:
        corpus_perplexity(store, "g", str(text), running_text=True)
    assert e.value.param == "running_text" and "pcfg" in str(e.value)
    assert corpus_perplexity(store, "g", str(text))["mode"] == "sentences"  # sentence level still works
    rc = main(["eval", "--model", "g", "--data", str(text), "--store", str(store), "--running-text"])
    assert rc != 0
    assert "--running-text" in capsys.readouterr().err


def test_eval_storage_dtype_scores_blocked_hmm_in_bfloat16_and_says_what_ran(tmp_path, capsys):
    """`--storage-dtype bfloat16`: a blocked_hmm scores on CPU from its bfloat16 matrix (within the documented bound
    per token of the float32 figure) and the output says so; an hmm has no such path and says float32; an unknown
    precision is refused naming the field."""
    from latentlm import ops
    from latentlm.models import backend as dispatch
    from latentlm.models.synthetic import random_blocked_hmm

    store = tmp_path / "store"
    t, cfg = random_blocked_hmm(3, 4, len(vocab()), seed=1, concentration=0.3)
    save_artifact(store, "blk", "blocked_hmm", {k: v.float() if v.is_floating_point() else v for k, v in t.items()},
                  vocab(), config=cfg)
    save_hmm(store, "h", 6)
    text = write_text(tmp_path / "text.txt", 30)
    rows = {}
    for name, precision in (("blk", "float32"), ("blk", "bfloat16"), ("h", "bfloat16")):
        assert main(["eval", "--model", name, "--data", str(text), "--store", str(store),
                     "--storage-dtype", precision]) == 0
        rows[name, precision] = json.loads(capsys.readouterr().out)
    f32, bf16 = rows["blk", "float32"], rows["blk", "bfloat16"]
    assert "storage_dtype" not in f32 and bf16["storage_dtype"] == "bfloat16"
    assert bf16["logprob"] != f32["logprob"]
    assert abs(bf16["logprob"] - f32["logprob"]) <= dispatch.BF16_TOKEN_ABS_BOUND * f32["num_tokens"]
    assert rows["h", "bfloat16"]["storage_dtype"] == "float32"
    with pytest.raises(InputError, match="storage_dtype") as e:
        ops.load_model(store, "blk", storage_dtype="float8")
    assert e.value.param == "storage_dtype"
    with pytest.raises(SystemExit) as exit_:
        main(["eval", "--model", "blk", "--data", str(text), "--store", str(store), "--storage-dtype", "float8"])
    assert exit_.value.code == 2 and "--storage-dtype" in capsys.readouterr().err
