"""`latentlm import-hmm | import-arpa | import-pcfg ...`: one subcommand per importer a family declares
(`Family.importers`); each reads the file, checks it against the family's schema and stores it atomically."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from latentlm.cli.common import CLIError, add_store
from latentlm.models.family import Family, Importer
from latentlm.models.registry import FAMILIES, save_artifact
from latentlm.models.store import check_name


def import_file(family: type[Family], importer: Importer, path: Path, name: str, store: Path, *,
                force: bool = False, **options) -> Path:
    """Read `path` with `importer`, check and write `<store>/<name>`; raises naming the problem, writes
    nothing then."""
    check_name(name)
    if (Path(store) / name).exists() and not force:
        raise CLIError(f"model {name!r} already exists in {store} (use --force to replace it)", param="name")
    tensors, vocab, config, *extra = importer.read(Path(path), **options)
    return save_artifact(store, name, family.family, tensors, vocab, config=config,
                         provenance={"source": importer.command, "file": Path(path).name},
                         extra_files=extra[0] if extra else None)


def register(sub: argparse._SubParsersAction) -> None:
    for family in FAMILIES.values():
        for importer in family.importers:
            p = sub.add_parser(importer.command, help=f"{importer.help} -> a {family.family} model")
            p.add_argument("file", metavar=importer.metavar)
            p.add_argument("--name", required=True)
            p.add_argument("--force", action="store_true", help="replace an existing model of that name")
            add_store(p)
            for opt in importer.options:
                p.add_argument("--" + opt.name.replace("_", "-"), dest=opt.name, default=opt.default, help=opt.help,
                               required=opt.required)
            p.set_defaults(func=_runner(family, importer))


def _runner(family: type[Family], importer: Importer):
    def run(args: argparse.Namespace) -> None:
        opts = {o.name: getattr(args, o.name) for o in importer.options}
        path = import_file(family, importer, Path(args.file), args.name, Path(args.store), force=args.force, **opts)
        print(f"imported {args.name} into {path}", file=sys.stderr)

    return run
