"""Adding a family touches its model module (the family and its `Recipe`), its trainer (registered with
`@recipes.trainer`) and its tests: here all three live in this one module, and `latentlm train --family toy`
takes the new recipe (its defaults, checks and shape settings) with nothing else changed; the registries are
left as they were."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor

from latentlm.cli import main
from latentlm.models.checks import check_distribution, check_shape
from latentlm.models.family import Family, Recipe
from latentlm.models.registry import FAMILIES, save_artifact
from latentlm.training import common
from latentlm.training.data import load_training_split
from latentlm.training.options import TrainSettings
from latentlm.training.recipes import TRAINERS, recipes, trainer

MISSING = "a_module_no_install_has_4d1c"  # what a recipe needing an uninstalled extra names


class Unigram(Family):
    """The toy family: one distribution over the vocabulary (`unigram` (V,))."""

    family = "toy"
    recipes = (Recipe("toy", {"states": 2, "epochs": 1}, positive=("states", "epochs"), shape=("states",),
                      needs=(), trainer=__name__),
               Recipe("toy-needy", {"states": 2}, needs=(MISSING,), trainer=__name__))

    def __init__(self, unigram: Tensor):
        self.unigram = unigram

    @staticmethod
    def validate_tensors(tensors: dict[str, Tensor], config: dict[str, Any], vocab_size: int, where: str) -> None:
        check_distribution(check_shape(tensors, "unigram", (vocab_size,), where), "unigram", 0, where)

    @classmethod
    def from_tensors(cls, tensors, config, *, device="cpu", dtype=torch.float32, storage_dtype=None) -> Unigram:
        return cls(tensors["unigram"].to(device=device, dtype=dtype))

    @property
    def num_states(self) -> int:
        return 1


seen: list[TrainSettings] = []


def train_toy(ns: TrainSettings) -> Path:
    """Add-one unigram counts of the training split; a checkpoint with the run's shape settings."""
    common.check_resume(ns)
    seen.append(ns)
    vocab, train_seqs, _ = load_training_split(ns)
    counts = torch.ones(len(vocab), dtype=torch.float64)
    for s in train_seqs:
        counts.index_add_(0, torch.tensor(s), torch.ones(len(s), dtype=torch.float64))
    common.save_checkpoint(common.checkpoint_dir(ns.store, ns.name), {"counts": counts}, {"epoch": 1}, ns)
    return save_artifact(ns.store, ns.name, "toy", {"unigram": counts / counts.sum()}, vocab,
                         config={"states": ns.states})


def test_a_family_registered_in_one_module_trains_through_the_cli(tmp_path, monkeypatch, capsys):
    data = tmp_path / "corpus.txt"
    data.write_text("the dog barks\na cat sleeps\nthe cat sees a dog\n" * 5, encoding="utf-8")
    argv = ["train", "--family", "toy", "--data", str(data), "--name", "u", "--store", str(tmp_path), "--no-progress"]
    seen.clear()
    with monkeypatch.context() as m:
        m.setitem(FAMILIES, "toy", Unigram)
        trainer("toy", "toy-needy")(train_toy)
        try:
            assert {"toy", "toy-needy"} <= set(recipes())
            assert main(argv) == 0, capsys.readouterr().err
            assert [ns.states for ns in seen] == [2]  # the recipe's default
            manifest = json.loads((tmp_path / "u" / "manifest.json").read_text())
            assert manifest["family"] == "toy" and manifest["config"] == {"states": 2}
            capsys.readouterr()
            # the recipe's checks and shape settings apply to it as to every family
            assert main([*argv, "--states", "0"]) == 2
            assert "--states: must be a positive integer, got 0" in capsys.readouterr().err
            assert main([*argv, "--resume", "--states", "3"]) == 2
            assert "--states: the checkpoint of 'u' has 2 states, not 3" in capsys.readouterr().err
            assert main([*argv, "--resume"]) == 0 and len(seen) == 2
            # options of other recipes are refused, naming the recipes that take them
            assert main([*argv, "--weight-average", "0.9"]) == 2
            assert "--weight-average: only for --family blocked_hmm or rank_hmm" in capsys.readouterr().err
            # a recipe whose modules are not installed says so before its trainer runs
            assert main(["train", "--family", "toy-needy", *argv[3:]]) == 2 and len(seen) == 2
            err = capsys.readouterr().err
            assert f"training toy-needy needs {MISSING}, which is not installed" in err
            assert "pip install 'latentlm[train]'" in err and len(err.strip().splitlines()) == 1
        finally:
            TRAINERS.pop("toy", None)
            TRAINERS.pop("toy-needy", None)
    assert "toy" not in recipes() and "toy" not in TRAINERS and "toy" not in FAMILIES
    with pytest.raises(SystemExit):  # an unknown --family again
        main(argv)


def test_a_recipe_finds_its_registered_trainer_by_importing_its_module():
    from latentlm.training import lds, neural
    from latentlm.training.recipes import trainer_for

    assert trainer_for("lds") is lds.train
    assert trainer_for("blocked_hmm") is trainer_for("rank_hmm") is neural.train
    with pytest.raises(ValueError, match="already has a trainer"):
        trainer("lds")(lambda ns: Path())
