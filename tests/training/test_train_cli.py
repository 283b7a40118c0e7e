"""`latentlm train` / `latentlm eval`: settings from flags and config files, validation before any
work (exit 2, message naming the flag), dispatch of pcfg/lds, eval through the ops path."""

from __future__ import annotations

import json
import math

import pytest

from latentlm.cli import main
from latentlm.models.errors import InputError
from latentlm.training import settings as cli
from tests.training.helpers import train_args


def run_cli(argv, capsys):
    code = main(argv)
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize("extra,flag", [
    (["--family", "blocked_hmm", "--states", "100", "--clusters", "16"],
     "--states 100 must be divisible by --clusters 16"),
    (["--family", "hmm", "--states", "0"], "--states"),
    (["--family", "rank_hmm", "--rank", "-3"], "--rank"),
    (["--family", "hmm", "--data", "/nonexistent/file.txt"], "--data"),
    (["--family", "hmm", "--device", "tpu"], "--device"),
    (["--family", "blocked_hmm", "--state-dropout", "1.0"], "--state-dropout"),
    (["--family", "hmm", "--resume"], "--resume"),
    (["--family", "blocked_hmm", "--weight-average", "1"], "--weight-average: must be a decay in [0, 1)"),
    (["--family", "rank_hmm", "--weight-decay", "-0.1"], "--weight-decay: must be >= 0"),
    (["--family", "hmm", "--weight-decay", "0.1"], "--weight-decay: only for --family blocked_hmm or rank_hmm"),
    (["--family", "densehmm", "--weight-average", "0.9"], "--weight-average: only for --family blocked_hmm"),
])
def test_bad_settings_exit_2_before_any_work(tmp_path, capsys, extra, flag, monkeypatch):
    called = []
    monkeypatch.setattr(cli, "train", lambda ns: called.append(ns))
    argv = ["train", "--data", "ptb", "--name", "m", "--store", str(tmp_path)]
    argv += extra
    code, _, err = run_cli(argv, capsys)
    assert code == 2 and flag in err and not called


def test_bad_name_and_missing_family(tmp_path, capsys):
    code, _, err = run_cli(["train", "--data", "ptb", "--name", "../x", "--store", str(tmp_path),
                            "--family", "hmm"], capsys)
    assert code == 2 and "--name" in err
    code, _, err = run_cli(["train", "--data", "ptb", "--name", "x", "--store", str(tmp_path)], capsys)
    assert code == 2 and "--family" in err


def test_config_files_yaml_and_toml_flags_win(tmp_path, monkeypatch, capsys):
    seen = []
    monkeypatch.setattr(cli, "train", lambda ns: seen.append(ns) or tmp_path)
    (tmp_path / "c.yaml").write_text("family: blocked_hmm\nstates: 64\nclusters: 8\nmax-steps: 5\ndata: ptb\n")
    (tmp_path / "c.toml").write_text('family = "rank_hmm"\nrank = 16\nstates = 32\nlr = 0.5\n')
    assert main(["train", "--config", str(tmp_path / "c.yaml"), "--name", "a", "--store", str(tmp_path),
                 "--states", "128"]) == 0
    ns = seen[-1]
    assert (ns.family, ns.states, ns.clusters, ns.max_steps, ns.data) == ("blocked_hmm", 128, 8, 5, ("ptb",))
    assert ns.hidden == 256 and ns.state_dropout == 0.5  # family and global defaults
    assert main(["train", "--config", str(tmp_path / "c.toml"), "--data", "ptb", "--name", "b",
                 "--store", str(tmp_path)]) == 0
    assert (seen[-1].family, seen[-1].rank, seen[-1].lr, seen[-1].dropout) == ("rank_hmm", 16, 0.5, 0.1)
    (tmp_path / "bad.toml").write_text('family = "hmm"\nstatez = 3\n')
    code, _, err = run_cli(["train", "--config", str(tmp_path / "bad.toml"), "--data", "ptb", "--name", "c",
                            "--store", str(tmp_path)], capsys)
    assert code == 2 and "statez" in err


@pytest.mark.parametrize("family", ["pcfg", "lds"])
def test_pcfg_and_lds_dispatch_to_their_registered_trainers(tmp_path, monkeypatch, family):
    from latentlm.training import recipes

    calls = []
    fake = lambda ns: calls.append(ns) or tmp_path / "from-the-fake"  # noqa: E731 - not a path a real run returns
    monkeypatch.setitem(recipes.TRAINERS, family, fake)
    ns = cli.resolve_settings(train_args(tmp_path, family, nt=4, pt=8, dim=8, lags=2))
    assert cli.train(ns) == tmp_path / "from-the-fake" and calls == [ns]


def test_train_and_eval_end_to_end_through_the_cli(tmp_path, capsys):
    code, _, err = run_cli(["train", "--family", "hmm", "--data", "ptb", "--states", "8", "--epochs", "1",
                            "--train-sentences", "500", "--valid-sentences", "50", "--name", "tiny",
                            "--store", str(tmp_path), "--no-progress"], capsys)
    assert code == 0, err
    code, out, err = run_cli(["eval", "--model", "tiny", "--data", "ptb:test", "--store", str(tmp_path)], capsys)
    assert code == 0, err
    res = json.loads(out)
    assert res["num_tokens"] == 82430
    # bounds from two baselines computed here: the uniform model (perplexity V = 10,000; the noisy EM start
    # is above it, ~11,000) and the add-one unigram model of the same 500 training sentences (~950). One EM
    # iteration over 500 sentences lands at ~2,000: well below uniform, and no better than a model of
    # those sentences could be (a perplexity under half the unigram one means scores that do not sum to 1)
    from latentlm import ops
    from latentlm.training.baum_welch import unigram
    from latentlm.training.data import encode_corpus, ptb_sentences

    vocab = ops.load_model(tmp_path, "tiny").vocab
    uni = unigram(encode_corpus(ptb_sentences("train")[:500], vocab), len(vocab)).log()
    test = [w for s in encode_corpus(ptb_sentences("test"), vocab) for w in s]
    unigram_ppl = math.exp(-float(uni[test].sum()) / len(test))
    assert len(test) == 82430 and 800 < unigram_ppl < 1100
    assert unigram_ppl / 2 < res["perplexity"] < len(vocab) / 3, (res["perplexity"], unigram_ppl)
    code, _, err = run_cli(["eval", "--model", "tiny", "--data", "ptb:dev", "--store", str(tmp_path)], capsys)
    assert code == 2 and "split" in err


def test_validate_rejects_bad_types_from_config(tmp_path):
    (tmp_path / "c.yaml").write_text("family: hmm\nstates: many\n")
    ns = train_args(tmp_path, "hmm", config=tmp_path / "c.yaml")
    ns.family = None
    with pytest.raises(InputError, match="--states"):
        cli.resolve_settings(ns)


def test_lds_and_pcfg_sizes_are_checked_before_any_work(tmp_path, capsys):
    from latentlm.cli import main

    for argv, flag in ((["--family", "lds", "--data", "brown", "--dim", "0"], "--dim"),
                       (["--family", "pcfg", "--data", "ptb", "--nt", "0"], "--nt")):
        rc = main(["train", *argv, "--name", "x", "--store", str(tmp_path)])
        assert rc == 2 and f"{flag}: must be a positive integer" in capsys.readouterr().err
        assert not (tmp_path / "x").exists()
