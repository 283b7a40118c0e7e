"""`--resume` continues exactly where the checkpoint was taken: a run interrupted right after a mid-epoch
checkpoint and then resumed ends with the same parameters, history and export as an uninterrupted run."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from latentlm.models.kernels import gemm
from latentlm.training import baum_welch, common, densehmm, neural
from latentlm.training.settings import resolve_settings
from tests.training.helpers import train_args


class Interrupted(Exception):
    """Stands for the process being killed."""


def interrupt_after_checkpoint(monkeypatch, n: int) -> None:
    """Make the n-th checkpoint write complete and then kill the run (a crash right after saving)."""
    real, calls = common.save_checkpoint, [0]

    def save(path, tensors, state, *settings):
        real(path, tensors, state, *settings)
        calls[0] += 1
        if calls[0] == n:
            raise Interrupted

    monkeypatch.setattr(common, "save_checkpoint", save)


def tiny_corpus(tmp_path) -> str:
    """A 40-word synthetic corpus file (160 sentences): small vocabulary, so each run takes a second."""
    g = torch.Generator().manual_seed(0)
    words = [f"w{i}" for i in range(40)]
    lines = []
    for _ in range(160):
        n = int(torch.randint(3, 12, (1,), generator=g))
        start = int(torch.randint(0, 40, (1,), generator=g))
        steps = torch.randint(0, 4, (n,), generator=g).tolist()  # a random walk over the words
        lines.append(" ".join(words[(start + sum(steps[: i + 1]) * 3) % 40] for i in range(n)))
    path = tmp_path / "tiny.txt"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return str(path)


def _final(store, name):
    """(final parameters from the last checkpoint, exported tensors, history without wall times)."""
    ck = load_file(str(common.checkpoint_dir(store, name) / "tensors.safetensors"))
    params = {k: v for k, v in ck.items() if k.startswith(("model.", "avg.")) or k in ("start", "trans", "emit")}
    art = load_file(str(store / name / "weights.safetensors"))
    curve = json.loads((store / name / "manifest.json").read_text())["provenance"]["curve"]
    return params, art, [{k: v for k, v in r.items() if not k.endswith("seconds")} for r in curve]


FAMILIES = {
    "blocked_hmm": dict(states=16, clusters=4, hidden=8, state_dropout=0.5),
    "blocked_hmm_bptt": dict(states=16, clusters=4, hidden=8, state_dropout=0.5, bptt=12, batch=6),
    # every epoch reads the running text from another token (--bptt-rotate): a resumed epoch must draw the same
    "blocked_hmm_bptt_rotate": dict(states=16, clusters=4, hidden=8, state_dropout=0.5, bptt=12, batch=6,
                                    bptt_rotate=True),
    # every <eos> restarts the state from the start distribution (--reset-eos): the carry ends with a sentence
    "blocked_hmm_bptt_reset": dict(states=16, clusters=4, hidden=8, state_dropout=0.5, bptt=12, batch=6,
                                   reset_eos=True),
    # 8 states until epoch 1, then 16 (--split-at): the split must happen exactly once whatever the interruption
    "blocked_hmm_split": dict(states=16, clusters=4, hidden=8, state_dropout=0.5, split_at="1",
                              state_embedding="independent"),
    # the same split given as a share of the budget (half of the 2 epochs): due at the start of epoch 1
    "blocked_hmm_split_budget": dict(states=16, clusters=4, hidden=8, state_dropout=0.5, split_at="50%",
                                     state_embedding="independent"),
    # the same with the tied state embedding (one table for every role, its state axis first)
    "blocked_hmm_split_tied": dict(states=16, clusters=4, hidden=8, state_dropout=0.5, split_at="1",
                                   state_embedding="tied"),
    # the parameters' moving average (--weight-average), split with the model, and AdamW's weight decay
    "blocked_hmm_split_average": dict(states=16, clusters=4, hidden=8, state_dropout=0.5, split_at="1",
                                      state_embedding="tied", weight_average=0.9, weight_decay=0.1),
    "rank_hmm": dict(states=16, rank=4, hidden=8, dropout=0.3),
    "rank_hmm_average": dict(states=16, rank=4, hidden=8, dropout=0.3, weight_average=0.8),
    # the LR falls to 0 over the second half of the 2 epochs (--lr-anneal): the schedule must survive the resume
    "rank_hmm_anneal": dict(states=16, rank=4, hidden=8, dropout=0.3, lr_anneal=0.5),
}


# checkpoints at steps 3, 5 (eval), 6, 9, 10 (eval, the end of epoch 1), 12, ... of 10 batches per epoch: the 3rd
# is in epoch 1, the 5th at its end (before a split at epoch 1), the 6th in epoch 2 (after it)
@pytest.mark.parametrize("case,interrupt_at,mid", [("blocked_hmm", 6, True), ("blocked_hmm_bptt", 3, True),
                                                   ("blocked_hmm_bptt_rotate", 6, True),
                                                   ("blocked_hmm_bptt_reset", 3, True),
                                                   ("rank_hmm", 3, True), ("rank_hmm", 6, True),
                                                   ("rank_hmm_anneal", 6, True),
                                                   ("blocked_hmm_split", 5, False), ("blocked_hmm_split", 6, True),
                                                   ("blocked_hmm_split_budget", 6, True),
                                                   ("blocked_hmm_split_tied", 6, True),
                                                   ("blocked_hmm_split_average", 5, False),
                                                   ("blocked_hmm_split_average", 6, True),
                                                   ("rank_hmm_average", 3, True)])
def test_interrupted_then_resumed_equals_uninterrupted(tmp_path, monkeypatch, case, interrupt_at, mid):
    family = "rank_hmm" if case.startswith("rank_hmm") else "blocked_hmm"
    kw = {"data": [tiny_corpus(tmp_path)], "epochs": 2, "batch": 16, "lr": 0.02, "eval_every": 5,
          "checkpoint_every": 3, "patience": 3, **FAMILIES[case]}

    def run(name, resume=False):
        return neural.train(resolve_settings(train_args(tmp_path, family, name=name, resume=resume, **kw)))

    _check_interrupted_equals_whole(tmp_path, monkeypatch, run, interrupt_at, mid_epoch=mid)
    if "split" in case:  # and the split happened: 16 states at the end
        state_axis = 0 if FAMILIES[case]["state_embedding"] == "tied" else 1
        assert _final(tmp_path, "whole")[0]["model.state_emb"].shape[state_axis] == 16


def _check_interrupted_equals_whole(tmp_path, monkeypatch, run, interrupt_at: int, mid_epoch: bool) -> None:
    run("whole")
    with monkeypatch.context() as m:
        interrupt_after_checkpoint(m, interrupt_at)
        with pytest.raises(Interrupted):
            run("cut")
    state = json.loads((common.checkpoint_dir(tmp_path, "cut") / "state.json").read_text())
    assert (state["batch"] > 0) == mid_epoch  # where the interruption is
    run("cut", resume=True)
    (pa, aa, ha), (pb, ab, hb) = _final(tmp_path, "whole"), _final(tmp_path, "cut")
    assert pa and pa.keys() == pb.keys() and aa.keys() == ab.keys()
    for key in pa:
        assert torch.equal(pa[key], pb[key]), key
    for key in aa:
        assert torch.equal(aa[key], ab[key]), key
    assert ha == hb


# EM with 10 E-step batches per iteration, checkpoints at batches 4 and 8 and at each iteration's end:
# the 2nd checkpoint is inside iteration 1, the 5th inside iteration 2, the 3rd at the end of iteration 1
@pytest.mark.parametrize("family,fit,interrupt_at,mid", [("hmm", "em", 2, True), ("hmm", "em", 5, True),
                                                         ("densehmm", "em", 5, True), ("densehmm", "em", 3, False),
                                                         ("densehmm", "cooc", 2, False)])
def test_em_interrupted_then_resumed_equals_uninterrupted(tmp_path, monkeypatch, family, fit, interrupt_at, mid):
    trainer = baum_welch.train if family == "hmm" else densehmm.train
    kw = {"data": [tiny_corpus(tmp_path)], "states": 8, "epochs": 3, "batch": 16, "checkpoint_every": 4,
          "patience": 3, "fit": fit, "hidden": 4, "lr": 0.05, "smoothing": 0.01}

    def run(name, resume=False):
        return trainer(resolve_settings(train_args(tmp_path, family, name=name, resume=resume, **kw)))

    _check_interrupted_equals_whole(tmp_path, monkeypatch, run, interrupt_at, mid_epoch=mid)


def test_checkpoint_every_writes_position_and_generators(tmp_path):
    ns = resolve_settings(train_args(tmp_path, "rank_hmm", data=[tiny_corpus(tmp_path)], states=8, rank=4,
                                     hidden=8, epochs=1, batch=16, checkpoint_every=2,
                                     max_steps=2))
    neural.train(ns)
    ck = common.checkpoint_dir(tmp_path, ns.name)
    state = json.loads((ck / "state.json").read_text())
    assert (state["epoch"], state["batch"], state["step"]) == (0, 2, 2)
    tensors = load_file(str(ck / "tensors.safetensors"))
    assert tensors["rng"].dtype == tensors["torch_rng"].dtype == torch.uint8


# -- a checkpoint only continues the run that wrote it ----------------------------------------------------
@pytest.mark.parametrize("family,first,second,flag,message", [
    ("hmm", {"states": 8}, {"states": 12}, "states",
     "--states: the checkpoint of 'run' has 8 states, not 12; drop --resume or use --states 8"),
    ("densehmm", {"states": 8, "hidden": 4}, {"states": 8, "hidden": 6}, "hidden",
     "--hidden: the checkpoint of 'run' has hidden size 4, not 6; drop --resume or use --hidden 4"),
    ("rank_hmm", {"states": 8, "rank": 4, "hidden": 8}, {"states": 8, "rank": 2, "hidden": 8}, "rank",
     "--rank: the checkpoint of 'run' has rank 4, not 2; drop --resume or use --rank 4"),
    ("blocked_hmm", {"states": 16, "clusters": 4, "hidden": 8, "split_at": ""},
     {"states": 16, "clusters": 8, "hidden": 8, "split_at": ""},
     "clusters", "--clusters: the checkpoint of 'run' has 4 clusters, not 8; drop --resume or use --clusters 4"),
    ("blocked_hmm", {"states": 16, "clusters": 4, "hidden": 8, "split_at": ""},
     {"states": 16, "clusters": 4, "hidden": 8, "split_at": "1"}, "split_at",
     "--split-at: the checkpoint of 'run' has --split-at '', not 1; drop --resume or use --split-at ''"),
    # the rank-space PCFG's checkpoint records its sizes too (it used to die in load_state_dict)
    ("pcfg", {"nt": 2, "pt": 3, "rank": 2, "hidden": 8}, {"nt": 3, "pt": 3, "rank": 2, "hidden": 8}, "nt",
     "--nt: the checkpoint of 'run' has 2 nonterminals, not 3; drop --resume or use --nt 2"),
])
def test_resume_refuses_other_shape_settings(tmp_path, monkeypatch, family, first, second, flag, message):
    from latentlm.models.errors import InputError
    from latentlm.training import settings as cli

    trainer = cli.train
    data = tiny_corpus(tmp_path)
    kw = {"data": [data], "epochs": 2, "batch": 16, "max_steps": 2, "name": "run", "lr": 0.02}
    trainer(resolve_settings(train_args(tmp_path, family, **kw, **first)))
    ck = common.checkpoint_dir(tmp_path, "run")
    assert json.loads((ck / "state.json").read_text())["settings"] == {"family": family, **first}
    before = (ck / "tensors.safetensors").read_bytes()
    loaded = []
    monkeypatch.setattr(common, "load_checkpoint", lambda *a: loaded.append(a))  # refused before loading
    with pytest.raises(InputError) as e:
        trainer(resolve_settings(train_args(tmp_path, family, resume=True, **kw, **second)))
    assert str(e.value) == message and e.value.param == flag and not loaded
    assert (ck / "tensors.safetensors").read_bytes() == before  # the checkpoint is untouched
    monkeypatch.undo()
    # the same settings resume (the run was at its step limit: it exports the best parameters again)
    trainer(resolve_settings(train_args(tmp_path, family, resume=True, **kw, **first)))


def test_resume_refuses_another_family_and_old_checkpoints_by_their_shape(tmp_path, capsys):
    from latentlm.cli import main

    data = tiny_corpus(tmp_path)
    base = ["train", "--data", data, "--name", "run", "--store", str(tmp_path), "--epochs", "1",
            "--batch", "16", "--no-progress"]
    assert main([*base, "--family", "hmm", "--states", "8"]) == 0
    capsys.readouterr()
    assert main([*base, "--family", "densehmm", "--states", "8", "--hidden", "4", "--resume"]) == 2
    assert ("--family: the checkpoint of 'run' is a hmm run, not densehmm; drop --resume or use --family hmm"
            in capsys.readouterr().err)
    # a checkpoint written before the settings were recorded: the state count is read from its tensors
    state_file = common.checkpoint_dir(tmp_path, "run") / "state.json"
    state = json.loads(state_file.read_text())
    del state["settings"]
    state_file.write_text(json.dumps(state))
    assert main([*base, "--family", "hmm", "--states", "16", "--resume"]) == 2
    assert "--states: the checkpoint of 'run' has 8 states, not 16" in capsys.readouterr().err
    assert main([*base, "--family", "hmm", "--states", "8", "--resume"]) == 0


@pytest.mark.skipif("onednn" not in gemm.BACKENDS, reason="torch built without oneDNN")
@pytest.mark.parametrize("case", ["blocked_hmm_bptt", "rank_hmm"])
def test_a_resumed_run_keeps_its_gemm_library(tmp_path, monkeypatch, case):
    """The two GEMM libraries round differently: a run that measured oneDNN faster and is resumed with
    `--gemm auto` on a machine (or a moment) where torch's BLAS measures faster continues on oneDNN, and ends
    where the uninterrupted run ends; the checkpoint records the choice."""
    monkeypatch.setattr(gemm, "ONEDNN_MIN_MACS", 0)  # the tiny model's products through oneDNN too
    family = "rank_hmm" if case == "rank_hmm" else "blocked_hmm"
    # blocked_hmm at hidden 512: on an Intel Xeon (AVX-512) MKL and oneDNN give bit-identical products up to an
    # inner dimension of ~300 and differ from 512 on; at hidden 8 this test could not tell the libraries apart
    # there (rank_hmm's products differ at its own size)
    kw = {"data": [tiny_corpus(tmp_path)], "epochs": 2, "batch": 16, "lr": 0.02, "eval_every": 5,
          "checkpoint_every": 3, "patience": 3, **FAMILIES[case]}
    if family == "blocked_hmm":
        kw["hidden"] = 512
    faster = {"name": "onednn"}
    monkeypatch.setattr(gemm, "calibrate", lambda shapes, repeats=5: {
        b: (2.0 if b == faster["name"] else 1.0) for b in gemm.BACKENDS})

    def run(name, resume=False, library="auto"):
        return neural.train(resolve_settings(train_args(tmp_path, family, name=name, resume=resume, gemm=library,
                                                        **kw)))

    run("whole")
    with monkeypatch.context() as m:
        interrupt_after_checkpoint(m, 3)
        with pytest.raises(Interrupted):
            run("cut")
    state = json.loads((common.checkpoint_dir(tmp_path, "cut") / "state.json").read_text())
    assert state["gemm"] == "onednn" and gemm.backend() == "torch"  # recorded; the process's setting restored
    faster["name"] = "torch"
    run("cut", resume=True)
    run("torch-blas", library="torch")
    (pa, aa, ha), (pb, ab, hb), (pc, _, _) = (_final(tmp_path, n) for n in ("whole", "cut", "torch-blas"))
    assert all(torch.equal(pa[key], pb[key]) for key in pa) and all(torch.equal(aa[k], ab[k]) for k in aa)
    assert ha == hb
    assert not all(torch.equal(pa[key], pc[key]) for key in pa)  # the libraries differ: the test can tell
    manifest = json.loads((tmp_path / "whole" / "manifest.json").read_text())["provenance"]
    assert manifest["gemm"] == "onednn" and manifest["gemm_gflops"] == {b: (2.0 if b == "onednn" else 1.0)
                                                                         for b in gemm.BACKENDS}


def test_gemm_setting_is_validated(tmp_path):
    from latentlm.models.errors import InputError

    with pytest.raises(InputError, match="--gemm: expected auto or one of") as e:
        resolve_settings(train_args(tmp_path, "blocked_hmm", gemm="mkl2", states=16, clusters=4))
    assert e.value.param == "gemm"
