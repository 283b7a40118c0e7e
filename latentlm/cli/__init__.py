"""The `latentlm` command line: thin wrappers over `latentlm.ops`, `latentlm.service` and `latentlm.training`.

Subcommands, each module imported explicitly: `infer` (score, decode, posterior, embed, sample, list),
`imports` (one per importer a family declares: import-hmm, import-ctrlg, import-arpa, import-pcfg), `train` (train,
eval, train-tagger), `distill`, `serve` (serve, worker). Errors print one line naming the field and exit with
status 2.
"""

from __future__ import annotations

import argparse
import sys

import latentlm

TRAINING_COMMANDS = ("train", "train-tagger", "distill")
# the commands that load no model (they list the store or import files); every other command, the operations
# included (`latentlm.ops.spec`, not imported here: it loads torch), loads one to answer requests
STORE_COMMANDS = ("list",)  # and every importer, `import-*`


def loads_a_model(command: str) -> bool:
    """Whether `command` loads a model (an operation, eval, serve, worker, export-onnx) or trains one."""
    return bool(command) and not command.startswith(("-", "import-")) and command not in STORE_COMMANDS


# before torch loads (the subcommands import it): the training commands' OpenMP and denormal settings, and huge
# pages for both kinds. Only when this process runs that command: importing this module elsewhere (a test process)
# changes nothing
_command = sys.argv[1] if len(sys.argv) > 1 else ""
if loads_a_model(_command):  # see `latentlm.huge_pages`
    latentlm.huge_pages()
if _command in TRAINING_COMMANDS:
    latentlm.tune_openmp_for_training()
    latentlm.flush_denormals_for_training()  # before torch's threads exist: they inherit it

from latentlm.cli import distill, imports, infer, serve, train  # noqa: E402
from latentlm.models.errors import LatentLMError  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="latentlm", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in (imports, infer, train, distill, serve):
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        args.func(args)
    except LatentLMError as e:
        print(f"latentlm {args.command}: error: {e.message}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        return 0
    return 0
