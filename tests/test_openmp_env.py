"""What each command sets in the environment before torch loads. `latentlm train` and `train-tagger` start torch with
GOMP_SPINCOUNT set (`latentlm.tune_openmp_for_training`): the setting reaches libgomp only if it is in the environment
before torch is imported, and a value the user set wins. Other commands (the service) keep libgomp's default. Every
command that loads or trains a model asks torch's allocator for huge pages (`latentlm.huge_pages`)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import latentlm

PROBE = ("import sys; var = sys.argv.pop(1); sys.argv = ['latentlm'] + sys.argv[1:]; import latentlm.cli, os; "
         "print(os.environ.get(var))")
TORCH_FIRST = "import sys; sys.argv = ['latentlm', 'train']; import latentlm; assert 'torch' not in sys.modules"


def _probe(*args: str, env: dict[str, str] | None = None, var: str = "GOMP_SPINCOUNT") -> str:
    """`var` in the environment once `latentlm.cli` is imported by a process running `latentlm ARGS` (`var`
    removed from the inherited environment, then `env` added)."""
    env = {k: v for k, v in os.environ.items() if k != var} | (env or {})
    out = subprocess.run([sys.executable, "-c", PROBE, var, *args], capture_output=True, text=True, env=env,
                         check=True)
    return out.stdout.strip()


@pytest.mark.parametrize("command", ["train", "train-tagger"])
def test_training_commands_set_the_spin_count(command):
    assert _probe(command) == latentlm.TRAINING_GOMP_SPINCOUNT


def test_other_commands_and_user_values_are_left_alone():
    assert _probe("serve") == "None"
    assert _probe("train", env={"GOMP_SPINCOUNT": "123"}) == "123"


def test_the_package_root_does_not_load_torch():
    subprocess.run([sys.executable, "-c", TORCH_FIRST], check=True)


DENORMALS = ("import sys; sys.argv = ['latentlm'] + sys.argv[1:]; import latentlm.cli, torch; "
             "torch.set_num_threads(2); a = torch.full((256, 4096), 1e-39); "
             "print(int((a @ torch.ones(4096, 256) != 0).sum()), int((a * 1.0 != 0).sum()))")


@pytest.mark.parametrize("command,flushed", [("train", True), ("train-tagger", True), ("serve", False)])
def test_training_commands_flush_denormals_on_every_torch_thread(command, flushed):
    """In `latentlm train` (and train-tagger) every thread torch computes on treats float32 denormals as zero
    (`latentlm.flush_denormals_for_training`, set before torch's threads exist): a GEMM and an elementwise
    product over denormal inputs, both split over two threads, give exact zeros; in other commands they do not."""
    out = subprocess.run([sys.executable, "-c", DENORMALS, command], capture_output=True, text=True, check=True)
    nonzero_gemm, nonzero_mul = (int(x) for x in out.stdout.split())
    if flushed:
        assert nonzero_gemm == 0 and nonzero_mul == 0
    else:
        assert nonzero_gemm == 256 * 256 and nonzero_mul == 256 * 4096


def _thp(*args: str, env: dict[str, str] | None = None) -> str:
    return _probe(*args, env=env, var="THP_MEM_ALLOC_ENABLE")


@pytest.mark.parametrize("command", ["serve", "worker", "score", "eval", "train", "train-tagger"])
def test_model_commands_ask_torch_for_huge_pages(command):
    """`latentlm.huge_pages`: set before torch loads in the commands that load or train a model; a value the user
    set wins."""
    assert _thp(command) == "1"
    assert _thp(command, env={"THP_MEM_ALLOC_ENABLE": "0"}) == "0"


def test_every_command_is_classified_and_a_test_process_is_left_alone():
    """Each subcommand is a training command, a model-loading one or one that loads no model (the
    store listing, the importers); a process that imports the CLI to run something else (pytest here) gets none
    of the settings."""
    import argparse

    import latentlm.cli as cli

    sub = next(a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    rest = {c for c in sub.choices if not cli.loads_a_model(c)}
    assert set(cli.TRAINING_COMMANDS) <= set(sub.choices) - rest
    assert {"score", "posterior", "decode", "sample", "embed", "eval", "serve", "worker", "export-onnx"} <= (
        set(sub.choices) - rest)
    assert all(c == "list" or c.startswith("import-") for c in rest), rest
    assert _thp("list") == "None" and _thp("--help-not-a-command") == "None"
