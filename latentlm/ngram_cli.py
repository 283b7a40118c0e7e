"""`latentlm import-arpa`: a backoff n-gram model in ARPA format (e.g. KenLM's `lmplz`) -> an `ngram` artifact."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from latentlm.models.errors import ArtifactError
from latentlm.models.ngram import ARPA_UNK, read_arpa
from latentlm.models.store import check_name, default_store, save_artifact


def import_arpa(path: Path, name: str, store: Path, unk_token: str = ARPA_UNK, force: bool = False,
                progress: bool = False) -> Path:
    """Parse, validate and store an ARPA file as `<store>/<name>`; raises (writing nothing) on any problem."""
    check_name(name)
    if (store / name).exists() and not force:
        raise ArtifactError(f"model {name!r} already exists in {store} (use --force to replace it)", param="name")
    tensors, vocab, config = read_arpa(path, unk_token, progress=progress)
    return save_artifact(store, name, "ngram", tensors, vocab, config=config,
                         provenance={"source": "import-arpa", "file": path.name})


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("import-arpa", help="import a backoff n-gram model from an ARPA file (e.g. KenLM's "
                                                  "lmplz); score only")
    p.add_argument("file", metavar="FILE.arpa")
    p.add_argument("--name", required=True)
    p.add_argument("--store", type=Path, default=default_store(),
                   help="model store directory (default: $LATENTLM_STORE or ./artifacts)")
    p.add_argument("--unk-token", default=ARPA_UNK,
                   help="the ARPA word that is the vocabulary's <unk> (default <unk>; e.g. _unk_ when <unk> was "
                        "renamed before lmplz)")
    p.add_argument("--force", action="store_true", help="replace an existing model of that name")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> None:
    path = import_arpa(Path(args.file), args.name, Path(args.store), args.unk_token, force=args.force,
                       progress=True)
    print(f"imported {args.name} into {path}", file=sys.stderr)
