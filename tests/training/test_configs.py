"""Every committed recipe in `configs/` resolves and validates as `latentlm train --config FILE` reads it (no
training): a config that names a bad key, value or combination is caught here, not an hour into a run."""

from __future__ import annotations

from pathlib import Path

import pytest

from latentlm.cli import build_parser
from latentlm.training import common
from latentlm.training.settings import resolve_settings

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.yaml"))


def test_configs_are_present():
    assert len(CONFIGS) >= 5


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_committed_config_resolves(path, tmp_path):
    args = build_parser().parse_args(["train", "--config", str(path), "--store", str(tmp_path)])
    ns = resolve_settings(args)
    assert ns.family in ("blocked_hmm", "rank_hmm") and ns.data == ("ptb",) and ns.name
    assert ns.epochs > 0 and ns.batch > 0 and ns.lr > 0
    if ns.family == "blocked_hmm":
        splits = common.split_plan(ns)  # checked: within the epochs or the budget, whole clusters at the start
        assert ns.states % (ns.clusters << len(splits)) == 0
