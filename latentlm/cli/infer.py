"""`latentlm score | decode | posterior | embed | sample | list`: one JSON object per input line, through
`latentlm.ops` (the functions the service runs)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from latentlm import ops
from latentlm.cli.common import CLIError, add_backend, add_model_args, add_store, emit_json, load, positive_int
from latentlm.models.errors import LatentLMError
from latentlm.models.family import DECODE_METHODS, OPERATIONS
from latentlm.models.store import list_models

HELP = {"score": "log-likelihood, perplexity and per-token log-probs", "decode": "Viterbi or MBR decoding",
        "posterior": "per-token state marginals", "embed": "per-token embeddings",
        "sample": "sample sentences or continuations of --prefix"}


def read_inputs(source: str) -> list[str]:
    """One input per line from FILE or '-' (stdin); trailing newline stripped, nothing else."""
    if source == "-":
        text = sys.stdin.read()
    else:
        p = Path(source)
        if not p.is_file():
            raise CLIError(f"{source}: no such file", param="FILE")
        text = p.read_text(encoding="utf-8")
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    return [ln.rstrip("\r") for ln in lines]


def encode_lines(model: ops.LoadedModel, lines: list[str], as_ids: bool) -> list[list[int]]:
    """Like ops.encode_inputs but errors name the 1-based line number."""
    try:
        return ops.encode_inputs(model.vocab, lines, as_ids=as_ids, where="line")
    except LatentLMError as e:
        msg = e.message
        if msg.startswith("line["):
            i = int(msg[5 : msg.index("]")])
            msg = f"line {i + 1}" + msg[msg.index("]") + 1 :]
        raise CLIError(msg, param=e.param) from None


def options(args: argparse.Namespace) -> dict:
    """The operation's options from its flags (the same names the API's request bodies use)."""
    return {"score": lambda: {"token_logprobs": args.token_logprobs},
            "decode": lambda: {"method": args.method},
            "posterior": lambda: {"top_k": ops.parse_top_k(args.top_k)},
            "embed": lambda: {"causal": args.causal}}[args.command]()


def cmd_run(args: argparse.Namespace) -> None:
    model = load(args)
    opts = options(args)
    if args.command == "decode" and opts["method"] is None:
        opts["method"] = ops.default_method(model)
    ops.check_supported(model, args.command, opts.get("method"))
    seqs = encode_lines(model, read_inputs(args.input), args.ids)
    if not seqs:
        raise CLIError("no input lines", param="FILE")
    emit_json(ops.run(model, args.command, seqs, max_batch_tokens=args.batch_tokens, **opts))


def cmd_sample(args: argparse.Namespace) -> None:
    model = load(args)
    prefix = None
    if args.prefix is not None:
        prefix = [int(t) for t in args.prefix.split()] if args.ids else args.prefix
    stop = None
    if args.stop:
        stop = [[int(t) for t in s.split()] for s in args.stop] if args.ids else args.stop
    emit_json(ops.sample(model, n=args.n, max_tokens=args.max_tokens, seed=args.seed, prefix=prefix,
                         temperature=args.temperature, stop_at_eos=not args.no_stop, stop=stop, top_k=args.top_k,
                         top_p=args.top_p))


def cmd_list(args: argparse.Namespace) -> None:
    for name in list_models(args.store):
        try:
            emit_json([ops.load_model(args.store, name).describe()])
        except LatentLMError as e:
            emit_json([{"id": name, "error": e.message}])


def cmd_export_onnx(args: argparse.Namespace) -> None:
    from latentlm import onnx_backend

    model = ops.load_model(args.store, args.model)
    out = args.out or Path(f"{args.model}.onnx")
    try:
        onnx_backend.export_model(model, out)
    except ValueError as e:
        raise CLIError(f"--model: {e}", param="model") from None
    print(f"wrote the scoring graph of {args.model} (family {model.family}, content hash "
          f"{model.content_hash[:12]}...) to {out}", file=sys.stderr)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("list", help="list the models in the store")
    add_store(p)
    p.set_defaults(func=cmd_list)
    p = sub.add_parser("export-onnx", help="write a model's scoring graph (log p(x), per-token log-probs over a "
                                           "padded batch) as ONNX, for onnxruntime without torch")
    p.add_argument("--model", required=True, help="model name in the store (hmm, blocked_hmm or rank_hmm)")
    add_store(p)
    p.add_argument("--out", type=Path, default=None, help="output file (default NAME.onnx)")
    p.set_defaults(func=cmd_export_onnx)
    for op in OPERATIONS:
        if op == "sample":
            continue
        p = sub.add_parser(op, help=HELP[op] + " (one JSON object per input line)")
        p.add_argument("input", nargs="?", default="-", metavar="FILE|-", help="one input per line (default stdin)")
        add_model_args(p)
        p.add_argument("--ids", action="store_true", help="lines are space-separated token ids (taken as is)")
        p.add_argument("--batch-tokens", type=positive_int, default=16384, help="max padded tokens per batch")
        if op == "score":
            p.add_argument("--token-logprobs", action="store_true", help="add tokens and token_logprobs")
            add_backend(p)
        if op == "decode":
            p.add_argument("--method", choices=DECODE_METHODS, default=None,
                           help="default: the family's (viterbi for HMMs, mbr for PCFGs)")
        if op == "posterior":
            p.add_argument("--top-k", default="all", help="K most probable states per token, or 'all'")
        if op == "embed":
            p.add_argument("--causal", action="store_true", help="filtered (left-context) instead of smoothed")
        p.set_defaults(func=cmd_run)

    p = sub.add_parser("sample", help=HELP["sample"])
    add_model_args(p)
    p.add_argument("--n", type=positive_int, default=1)
    p.add_argument("--max-tokens", type=positive_int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prefix", default=None, help="text (or ids with --ids) to continue")
    p.add_argument("--ids", action="store_true", help="--prefix is space-separated token ids")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-k", type=positive_int, default=None,
                   help="draw each token from the next-token distribution cut to its K most probable tokens")
    p.add_argument("--top-p", type=float, default=None,
                   help="draw each token from the fewest most probable next tokens whose mass reaches P")
    p.add_argument("--no-stop", action="store_true", help="do not stop a sample at <eos>")
    p.add_argument("--stop", action="append", metavar="TEXT",
                   help=f"end a sample before this text (ids with --ids; repeatable, at most "
                        f"{ops.MAX_STOP_SEQUENCES}); chain families")
    p.set_defaults(func=cmd_sample)
