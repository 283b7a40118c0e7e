"""`latentlm train-tagger`: the tagging HMM on Brown (see `training.tagging`). `latentlm embed` itself is a
built-in command; `latentlm train --family lds` lives in `training.cli`."""

from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:
    from latentlm.training.tagging import add_arguments

    p = subparsers.add_parser("train-tagger", help="train a tagging_hmm on Brown and report tagging accuracy "
                                                   "against the most-frequent-tag baseline")
    add_arguments(p)
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> None:
    from latentlm.training.tagging import run

    run(args)
