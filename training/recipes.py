"""The training recipes and the loops that train them.

A recipe (`latentlm train --family NAME`) is declared, as data, on its family (`Family.recipes`,
`models.family.Recipe`): its defaults, checks, shape settings, the modules it needs and the module holding its
training loop (`Recipe.trainer`). That module registers its loop here, once, by decorating it:

    @trainer("blocked_hmm", "rank_hmm")
    def train(settings: TrainSettings) -> Path: ...

`trainer_for(name)` imports the recipe's module only when the recipe trains (so a serving install without the
`[train]` extra can still list and check recipes). Adding a family touches its model module (the recipe), its
trainer (the decorator) and its tests; nothing here.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from latentlm.models.family import Recipe
from latentlm.models.registry import FAMILIES

if TYPE_CHECKING:
    from latentlm.training.options import TrainSettings

Trainer = Callable[["TrainSettings"], Path]
TRAINERS: dict[str, Trainer] = {}
"""Recipe name -> its training loop, filled by `trainer` as each trainer module is imported."""
DATA_PARALLEL: set[str] = set()
"""The recipes whose loop trains data-parallel under `torchrun` (`training.distributed`)."""


def trainer(*names: str, data_parallel: bool = False) -> Callable[[Trainer], Trainer]:
    """Register the decorated function as the training loop of the recipes `names` (it takes the run's validated
    `TrainSettings` and returns the artifact directory it wrote). `data_parallel`: the loop splits its work over
    the ranks `torchrun` starts (others refuse to run under more than one)."""
    def register(fn: Trainer) -> Trainer:
        for name in names:
            if TRAINERS.get(name, fn) is not fn:
                raise ValueError(f"recipe {name!r} already has a trainer ({TRAINERS[name].__module__})")
            TRAINERS[name] = fn
            if data_parallel:
                DATA_PARALLEL.add(name)
        return fn

    return register


def recipes() -> dict[str, Recipe]:
    """Every recipe of every registered family (`models.registry.FAMILIES`), by name: the `--family` values.
    `densehmm` is a recipe of the `hmm` family."""
    return {r.name: r for fam in FAMILIES.values() for r in fam.recipes}


def recipe_family(name: str) -> str:
    """The family whose artifact recipe `name` writes."""
    return next(fam for fam, cls in FAMILIES.items() for r in cls.recipes if r.name == name)


def recipes_with(option: str) -> list[str]:
    """The recipes that take the recipe-specific training option `option` (`Recipe.options`)."""
    return [name for name, r in recipes().items() if option in r.options]


def data_parallel_recipes() -> list[str]:
    """The recipes whose loop trains data-parallel (`trainer(..., data_parallel=True)`), importing every trainer
    module that imports here (a recipe whose module needs a missing extra is left out)."""
    for name in recipes():
        try:
            trainer_for(name)
        except (ImportError, LookupError):
            continue
    return sorted(DATA_PARALLEL)


def trainer_for(name: str) -> Trainer:
    """The training loop of recipe `name`, importing its module (`Recipe.trainer`) on first use."""
    if name not in TRAINERS:
        module = recipes()[name].trainer
        if module:
            importlib.import_module(module)
    if name not in TRAINERS:
        raise LookupError(f"recipe {name!r}: no training loop registered (decorate it with "
                          f"latentlm.training.recipes.trainer({name!r}) in {recipes()[name].trainer or 'its module'})")
    return TRAINERS[name]
