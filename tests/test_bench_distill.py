"""bench/distill.py's own measurements, checked exactly on tiny inputs (seconds): the HMM forward against
enumeration, the LM log-likelihood against one step at a time, the keyword check, detokenisation, keyword sets.
The stages themselves run with `python bench/distill.py all --tiny` (minutes: real `latentlm distill` runs)."""

from __future__ import annotations

import itertools
import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import distill as bench  # noqa: E402
import distill_task as task  # noqa: E402


def random_hmm(Z: int, V: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    start = torch.rand(Z, generator=g, dtype=torch.float64)
    trans = torch.rand(Z, Z, generator=g, dtype=torch.float64)
    emit = torch.rand(Z, V, generator=g, dtype=torch.float64)
    return start / start.sum(), trans / trans.sum(1, keepdim=True), emit / emit.sum(1, keepdim=True)


def brute_logprob(start, trans, emit, seq: list[int]) -> float:
    total = 0.0
    for zs in itertools.product(range(len(start)), repeat=len(seq)):
        p = start[zs[0]] * emit[zs[0], seq[0]]
        for t in range(1, len(seq)):
            p = p * trans[zs[t - 1], zs[t]] * emit[zs[t], seq[t]]
        total += float(p)
    return math.log(total)


def test_hmm_logprobs_match_enumeration():
    start, trans, emit = random_hmm(3, 5, 0)
    seqs = [[0, 4, 2, 1], [3], [1, 1, 0], [2, 2, 2, 2, 4]]  # different lengths in one batch
    got = bench.hmm_logprobs(start, trans, emit, seqs, batch=3)
    want = [brute_logprob(start, trans, emit, s) for s in seqs]
    assert got == pytest.approx(want, abs=1e-10)


def test_lm_logprobs_match_stepwise_softmax():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=11, n_positions=16, n_embd=8, n_layer=1, n_head=2,
                                       bos_token_id=10, eos_token_id=10)).eval()
    eos = 10
    seqs = [[1, 2, 3, eos], [4], [5, 6, 7, 8, 9, 1]]
    got = bench.lm_logprobs(model, eos, seqs, batch=2)  # right-padded batches
    for s, g in zip(seqs, got, strict=True):
        with torch.no_grad():
            logp = model(input_ids=torch.tensor([[eos, *s]])).logits[0].double().log_softmax(-1)
        assert g == pytest.approx(sum(float(logp[t, x]) for t, x in enumerate(s)), abs=1e-5)  # float32 LM
    draws, _ = bench.lm_sample(model, eos, 5, 6, 2, seed=1)
    assert len(draws) == 5 and all(1 <= len(d) <= 6 for d in draws)
    assert all(eos not in d[:-1] for d in draws)  # cut after the first eos


def test_unigram_and_parse_runs():
    lp = bench.unigram_logprobs([[0, 0, 1]], [[0, 2]], vocab=3, add=0.5)
    assert lp[0] == pytest.approx(math.log(2.5 / 4.5) + math.log(0.5 / 4.5))
    assert bench.parse_runs("256:lvd,1024:random:60") == [(256, "lvd", []), (1024, "random", ["--time-limit", "60"])]
    assert bench.parse_runs("64:lvd::30") == [(64, "lvd", ["--em-steps", "30"])]
    with pytest.raises(SystemExit):
        bench.parse_runs("256:kmeans")


def test_detokenize_and_whole_words():
    assert bench.detokenize("we do n't know what today 's $ N means".split()) == "we don't know what today's $N means"
    assert task.has_words("the company's shares fell", ["company", "fell"])
    assert not task.has_words("companys fell", ["company"])
    assert not task.has_words("a stockholder", ["stock"])


def test_keyword_sets():
    sets = task.keyword_sets(6, seed=3, top=2000)
    assert [len(s) for s in sets] == [3, 4, 3, 4, 3, 4]
    assert sets == task.keyword_sets(6, seed=3, top=2000)
    words = {w for s in sets for w in s}
    assert all(w.isalpha() and len(w) >= 3 and w not in task.STOPWORDS for w in words)
