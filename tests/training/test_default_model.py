"""The default model (`latentlm serve` on an empty store): its settings resolve and validate, and a shrunken
run of the same recipe trains and saves an artifact that loads and answers every operation the README shows
the default model with (score, posterior, decode viterbi + mbr, sample)."""

from __future__ import annotations

import math

from latentlm import ops
from latentlm.training import default
from latentlm.training.settings import resolve_settings


def test_default_settings_resolve_and_validate(tmp_path):
    ns = resolve_settings(default.default_args(tmp_path, progress=False))
    assert ns.name == default.DEFAULT_NAME == "ptb-hmm"  # the name the service and the README use
    for key, value in default.DEFAULT_SETTINGS.items():
        assert getattr(ns, key) == value, key
    assert ns.family == "blocked_hmm" and ns.data == ("ptb",) and not ns.resume
    assert ns.max_steps == 0 and ns.train_sentences == 0  # the full recipe: no caps
    assert 0 < ns.time_limit <= 5  # the build is capped below the 5 minutes the README promises


def test_shrunken_default_recipe_trains_a_loadable_model(tmp_path):
    path = default.build_default_model(tmp_path, progress=False, max_steps=2, train_sentences=400,
                                       valid_sentences=20)
    assert path.name == "ptb-hmm"
    m = ops.load_model(tmp_path, "ptb-hmm")
    assert m.family == "blocked_hmm" and len(m.vocab) == 10000
    assert m.artifact.manifest["preprocessing"]["add_eos"] is True
    assert m.artifact.config["num_states"] == 4096 and m.artifact.config["num_clusters"] == 128
    seqs = ops.encode_inputs(m.vocab, ["the company said it expects", "prices rose"])
    (score, _) = ops.run(m, "score", seqs)
    assert math.isfinite(score["logprob"]) and 1 < score["perplexity"] < 2 * len(m.vocab)
    (post, _) = ops.run(m, "posterior", seqs, top_k=3)
    assert len(post["marginals"]) == len(seqs[0]) and len(post["marginals"][0]["probs"]) == 3
    for method in ("viterbi", "mbr"):
        (dec, _) = ops.run(m, "decode", seqs, method=method)
        assert len(dec["states"]) == len(seqs[0]) and all(0 <= z < 4096 for z in dec["states"])
    (smp,) = ops.sample(m, n=1, max_tokens=5, seed=0)
    assert 1 <= len(smp["ids"]) <= 5
