"""A checkpoint carried between machines in small shards (bench/gpu_params.py) and exported again with
`--resume --export-only` gives the same artifact as the run that wrote it, without training a step."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from latentlm.models.errors import InputError
from latentlm.models.registry import load_artifact
from latentlm.training import neural
from latentlm.training.settings import resolve_settings
from tests.training.helpers import train_args

ROOT = Path(__file__).resolve().parents[2]


def gpu_params():
    spec = importlib.util.spec_from_file_location("gpu_params", ROOT / "bench" / "gpu_params.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("family,kw", [("rank_hmm", {"states": 32, "rank": 8}),
                                       ("blocked_hmm", {"states": 16, "clusters": 4, "bptt": 8})])
def test_sharded_checkpoint_exports_the_same_artifact(tmp_path, family, kw):
    settings = dict(hidden=8, epochs=1, max_steps=6, train_sentences=400, valid_sentences=50, batch=8, **kw)
    first = neural.train(resolve_settings(train_args(tmp_path / "a", family, **settings)))
    name = first.name
    shards = gpu_params().pack(tmp_path / "a", name, tmp_path / "carry", max_mb=0.05)
    assert len(shards) > 1 and all(p.stat().st_size < 0.2 * 2**20 for p in shards)
    gpu_params().unpack(tmp_path / "carry", tmp_path / "b", name)
    again = neural.train(resolve_settings(train_args(tmp_path / "b", family, resume=True, export_only=True,
                                                     **settings)))
    a, b = load_artifact(first), load_artifact(again)
    for key, t in a.tensors.items():
        assert torch.equal(t, b.tensors[key]), key
    steps = json.loads((again / "manifest.json").read_text())["provenance"]["steps"]
    assert steps == 6  # nothing was trained


def test_export_only_needs_resume(tmp_path):
    with pytest.raises(InputError) as e:
        resolve_settings(train_args(tmp_path, "rank_hmm", export_only=True))
    assert e.value.param == "export_only"


@pytest.mark.parametrize("dtype", [None, "float16"])
def test_best_parameters_alone_export_the_artifact(tmp_path, dtype):
    """What a GPU run brings back (`pack --best-only [--dtype float16]`: no optimizer state, no generators)
    exports with `--export-only`: the same artifact in float32, within float16's rounding in float16."""
    settings = dict(hidden=8, epochs=1, max_steps=6, train_sentences=400, valid_sentences=50, batch=8,
                    states=32, rank=8)
    first = neural.train(resolve_settings(train_args(tmp_path / "a", "rank_hmm", **settings)))
    name = first.name
    gpu_params().pack(tmp_path / "a", name, tmp_path / "carry", max_mb=15, best_only=True, dtype=dtype)
    carried = gpu_params().load_file(str(tmp_path / "carry" / "checkpoint-000.safetensors"))
    assert carried and all(k.startswith("best.") for k in carried)
    assert all(v.dtype == (torch.float16 if dtype else torch.float32) for v in carried.values())
    gpu_params().unpack(tmp_path / "carry", tmp_path / "b", name)
    again = neural.train(resolve_settings(train_args(tmp_path / "b", "rank_hmm", resume=True, export_only=True,
                                                     **settings)))
    a, b = load_artifact(first), load_artifact(again)
    for key, t in a.tensors.items():
        if dtype is None:
            assert torch.equal(t, b.tensors[key]), key
        else:  # parameters rounded to 11 significant bits: probabilities within ~1% of the float32 export
            assert torch.allclose(t, b.tensors[key], rtol=2e-2, atol=1e-7), key
            assert not torch.equal(t, b.tensors[key]), key
