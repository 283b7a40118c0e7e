"""Data-parallel training under `torchrun` (gloo, CPU): W ranks on the config's global batch train what one process
trains (validation perplexity equal within 1e-3 relative, float summation order aside), a checkpoint written by 2
ranks resumes in 1 with the uninterrupted trajectory, distillation's ranks draw the one-process samples, and a rank
that raises stops the whole job with its error. Each launch is a real `torchrun --standalone` of `latentlm`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from latentlm.cli import main
from latentlm.models.errors import InputError
from latentlm.training import distributed, settings
from tests.training.test_resume import tiny_corpus

QUIET = ["--no-progress"]
TIMEOUT = 240  # seconds for one torchrun job: a hung rank fails the test instead of the suite


def torchrun(args: list[str], ranks: int = 2, cwd: Path | None = None, script: Path | None = None
             ) -> subprocess.CompletedProcess:
    """`torchrun --standalone --nproc-per-node RANKS -m latentlm.cli ARGS` (or `script ARGS`), one thread a rank."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "LATENTLM_DIST_TIMEOUT_MINUTES": "3"}
    env.pop("WORLD_SIZE", None)
    target = [str(script)] if script else ["-m", "latentlm.cli"]
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                           str(ranks), *target, *args], capture_output=True, text=True, timeout=TIMEOUT, cwd=cwd,
                          env=env)


def provenance(store: Path, name: str) -> dict:
    return json.loads((store / name / "manifest.json").read_text())["provenance"]


def curve(store: Path, name: str) -> list[float]:
    return [r["valid_ppl"] for r in provenance(store, name)["curve"]]


def assert_close(a: list[float], b: list[float], rel: float = 1e-3) -> None:
    assert len(a) == len(b)
    assert np.allclose(a, b, rtol=rel, atol=0), (a, b)


CASES = {
    # BPTT over the running text: 6 streams, 3 a rank, the carry of each stream on its rank
    "blocked_hmm_bptt": ["--family", "blocked_hmm", "--states", "16", "--clusters", "4", "--hidden", "8",
                         "--state-dropout", "0.5", "--bptt", "12", "--batch", "6", "--epochs", "3",
                         "--evals-per-epoch", "2"],
    # length buckets of 7 sentences split 4 / 3, dropout drawn alike on both ranks
    "rank_hmm": ["--family", "rank_hmm", "--states", "16", "--rank", "4", "--hidden", "8", "--dropout", "0.3",
                 "--batch", "7", "--epochs", "2"],
    # EM: the E-step's batches shared, the counts summed, a mid-pass checkpoint every 4 batches
    "hmm": ["--family", "hmm", "--states", "12", "--epochs", "3", "--batch", "7", "--checkpoint-every", "4"],
}


@pytest.mark.parametrize("case", list(CASES))
def test_two_ranks_train_what_one_process_trains(tmp_path, case):
    data = tiny_corpus(tmp_path)
    args = [*CASES[case], "--data", data, "--name", "m", *QUIET]
    assert main(["train", *args, "--store", str(tmp_path / "one")]) == 0
    done = torchrun(["train", *args, "--store", str(tmp_path / "two")])
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stderr.count("wrote m to") == 1  # rank 0 alone reports
    one, two = provenance(tmp_path / "one", "m"), provenance(tmp_path / "two", "m")
    assert two["world_size"] == 2 and one["world_size"] == 1
    assert len(one["curve"]) >= 3
    assert_close(curve(tmp_path / "one", "m"), curve(tmp_path / "two", "m"))


def test_two_machines_meet_at_a_rendezvous_endpoint_and_train_what_one_process_trains(tmp_path):
    """The several-machines command of docs/distributed.md, both "machines" on this host: two torchrun agents
    (--nnodes 2, one rank each) meet at a c10d rendezvous endpoint."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    data = tiny_corpus(tmp_path)
    args = ["-m", "latentlm.cli", "train", *CASES["rank_hmm"], "--data", data, "--name", "m", *QUIET]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "LATENTLM_DIST_TIMEOUT_MINUTES": "3"}

    def node(rank: int, store: str) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
                                 "--nproc-per-node", "1", "--node-rank", str(rank), "--rdzv-backend", "c10d",
                                 "--rdzv-endpoint",
                                 f"127.0.0.1:{port}", "--rdzv-id", "job", *args, "--store", str(tmp_path / store)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)

    nodes = [node(0, "two"), node(1, "two")]
    outs = [n.communicate(timeout=TIMEOUT) for n in nodes]
    assert [n.returncode for n in nodes] == [0, 0], [err[-2000:] for _, err in outs]
    assert main(["train", *args[3:], "--store", str(tmp_path / "one")]) == 0
    assert provenance(tmp_path / "two", "m")["world_size"] == 2
    assert_close(curve(tmp_path / "one", "m"), curve(tmp_path / "two", "m"))


def test_a_two_rank_checkpoint_resumes_in_one_process_on_the_same_trajectory(tmp_path):
    """2 ranks train 20 steps (a check and a checkpoint at step 20, the BPTT carry of all 6 streams gathered into
    it); one process resumes to 40. Its history equals an uninterrupted one-process run's."""
    data = tiny_corpus(tmp_path)
    args = [*CASES["blocked_hmm_bptt"], "--data", data, "--name", "m", "--eval-every", "10", *QUIET]
    first = torchrun(["train", *args, "--store", str(tmp_path / "run"), "--max-steps", "20"])
    assert first.returncode == 0, first.stderr[-3000:]
    state = json.loads((tmp_path / "run" / ".train" / "m" / "state.json").read_text())
    assert state["world_size"] == 2 and state["step"] == 20 and state["batch"] > 0  # mid-epoch: a carry is kept
    assert main(["train", *args, "--store", str(tmp_path / "run"), "--max-steps", "40", "--resume"]) == 0
    assert main(["train", *args, "--store", str(tmp_path / "whole"), "--max-steps", "40"]) == 0
    resumed, whole = provenance(tmp_path / "run", "m"), provenance(tmp_path / "whole", "m")
    assert [r["step"] for r in resumed["curve"]] == [r["step"] for r in whole["curve"]] == [0, 10, 20, 30, 40]
    assert_close(curve(tmp_path / "run", "m"), curve(tmp_path / "whole", "m"))
    assert resumed["world_size"] == 1


KILLED_AFTER_PARTIAL_CHECKPOINT = """
import os, sys
from latentlm.training import common

real = common.save_checkpoint


def save(path, tensors, state, *settings):  # rank 0 dies right after writing a checkpoint inside an E-step pass
    real(path, tensors, state, *settings)
    if state.get("iteration") == 1 and state.get("batch"):
        os._exit(9)


common.save_checkpoint = save
from latentlm.cli import main

sys.exit(main(sys.argv[1:]))
"""


def test_em_resumes_a_two_rank_checkpoint_taken_inside_an_e_step_in_one_process(tmp_path):
    """Baum-Welch on 2 ranks writes a checkpoint in iteration 2's E-step (the counts of its first 4 batches, summed
    over both ranks) and dies; one process resumes there and ends where an uninterrupted run ends."""
    script = tmp_path / "killed.py"
    script.write_text(KILLED_AFTER_PARTIAL_CHECKPOINT, encoding="utf-8")
    data = tiny_corpus(tmp_path)
    args = [*CASES["hmm"], "--data", data, "--name", "m", *QUIET]
    died = torchrun(["train", *args, "--store", str(tmp_path / "run")], script=script)
    assert died.returncode != 0
    state = json.loads((tmp_path / "run" / ".train" / "m" / "state.json").read_text())
    assert state["world_size"] == 2 and state["iteration"] == 1 and state["batch"] == 4
    assert main(["train", *args, "--store", str(tmp_path / "run"), "--resume"]) == 0
    assert main(["train", *args, "--store", str(tmp_path / "whole")]) == 0
    assert_close(curve(tmp_path / "run", "m"), curve(tmp_path / "whole", "m"), rel=1e-9)


def test_distillation_ranks_draw_the_one_process_samples_and_sum_their_counts(tmp_path):
    from tests.training.tiny_lm import make_lm

    lm = make_lm(tmp_path / "lm")
    args = ["distill", "--lm", str(lm), "--name", "d", "--states", "8", "--samples", "400", "--max-length", "8",
            "--em-steps", "3", "--shard-size", "100", "--seed", "1", "--device", "cpu", *QUIET]
    assert main([*args, "--store", str(tmp_path / "one")]) == 0
    done = torchrun([*args, "--store", str(tmp_path / "two")])
    assert done.returncode == 0, done.stderr[-3000:]
    one, two = provenance(tmp_path / "one", "d"), provenance(tmp_path / "two", "d")
    assert two["world_size"] == 2 and two["sampling"]["ranks"] == 2
    assert two["sampling"]["shards_drawn"] == one["sampling"]["shards_drawn"] == 5  # 4 train + 1 valid
    shards = sorted((tmp_path / "one" / ".distill" / "d" / "samples").glob("*/*/shard-*.npy"))
    assert len(shards) == 5
    for path in shards:  # the same key, split and index: the same samples whatever the world size
        other = tmp_path / "two" / ".distill" / "d" / path.relative_to(tmp_path / "one" / ".distill" / "d")
        assert np.array_equal(np.load(path), np.load(other))
    assert_close(curve(tmp_path / "one", "d"), curve(tmp_path / "two", "d"), rel=1e-6)


def test_the_time_limit_stops_every_rank_at_the_same_step_and_exports(tmp_path):
    """A 0.3 s budget against 200 epochs: the ranks' clocks differ, yet all stop after the same step (a rank left
    waiting in the all-reduce would hang the job), and rank 0 exports the best evaluation."""
    data = tiny_corpus(tmp_path)
    args = [*CASES["rank_hmm"], "--epochs", "200", "--time-limit", "0.005"]
    done = torchrun(["train", *args, "--data", data, "--name", "m", "--store", str(tmp_path / "s"), *QUIET])
    assert done.returncode == 0, done.stderr[-3000:]
    prov = provenance(tmp_path / "s", "m")
    assert prov["world_size"] == 2 and 0 < prov["steps"] < 1000  # 200 epochs are about 4,400 steps


FAILING_RANK = """
import os, sys
from latentlm.training.neural import loop

if os.environ["RANK"] == "1":  # rank 1 fails at its 4th step; rank 0 is then waiting in the gradient all-reduce
    real = loop.step

    def step(run, *args, **kwargs):
        if run.pos.step == 3:
            raise RuntimeError("rank 1 lost its disk")
        return real(run, *args, **kwargs)

    loop.step = step

from latentlm.cli import main

sys.exit(main(sys.argv[1:]))
"""


def test_a_rank_that_raises_stops_the_others_with_its_error(tmp_path):
    script = tmp_path / "failing.py"
    script.write_text(FAILING_RANK, encoding="utf-8")
    data = tiny_corpus(tmp_path)
    done = torchrun(["train", *CASES["rank_hmm"], "--data", data, "--name", "m", "--store", str(tmp_path / "s"),
                     *QUIET], script=script)
    assert done.returncode != 0
    assert "rank 1 lost its disk" in done.stderr
    assert "rank: 1" in done.stderr  # torchrun names the failing rank
    assert not (tmp_path / "s" / "m").exists()  # nothing exported


def test_trainers_that_run_in_one_process_refuse_torchrun_naming_the_family(tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    ns = settings.resolve_settings(__import__("argparse").Namespace(
        family="lds", data=[tiny_corpus(tmp_path)], name="x", store=tmp_path, config=None, resume=False,
        progress=False))
    with pytest.raises(InputError, match="--family lds: its trainer runs in one process") as err:
        settings.train(ns)
    assert err.value.param == "family"
    assert "data-parallel: blocked_hmm, densehmm, hmm, pcfg, rank_hmm)" in str(err.value)  # what does


@pytest.mark.parametrize("n,size", [(7, 2), (3, 4), (16, 3), (0, 2)])
def test_shares_cover_every_row_once_in_order(n, size):
    rows = [list(range(n))[distributed.World(rank=r, size=size).share(n)] for r in range(size)]
    assert sum(rows, []) == list(range(n))
    assert max(map(len, rows)) - min(map(len, rows)) <= 1
