"""`latentlm <operation> | list | export-onnx`: one subcommand per operation of `latentlm.ops.spec.OPERATIONS`, its
flags derived from the operation's request model; one JSON object per input line (or per sample), through the same
`spec.prepare` / `Operation.run` the service runs."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from latentlm import ops
from latentlm.cli.common import (
    CLIError,
    add_backend,
    add_model_args,
    add_store,
    emit_json,
    load,
    positive_int,
    require_extra,
)
from latentlm.models.errors import LatentLMError
from latentlm.models.store import list_models
from latentlm.ops import spec


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


def _ids(text: str, flag: str) -> list[int]:
    try:
        return [int(t) for t in text.split()]
    except ValueError:
        raise CLIError(f"{flag}: expected space-separated token ids with --ids, got {text!r}", param=flag) from None


def request(op: spec.Operation, args: argparse.Namespace, **fields: Any):
    """The operation's request model from its flags (validated as a REST body is; errors name the flag)."""
    body = {f.name: getattr(args, f.name) for f in spec.cli_flags(op)}
    if getattr(args, "ids", False):  # text options given as token ids
        if isinstance(body.get("prefix"), str):
            body["prefix"] = _ids(body["prefix"], "--prefix")
        if body.get("stop"):
            body["stop"] = [_ids(s, "--stop") for s in body["stop"]]
    try:
        return op.request.model_validate({"model": args.model, **{k: v for k, v in body.items() if v is not None},
                                          **fields})
    except ValidationError as e:
        err = e.errors()[0]
        name = str(err["loc"][0]) if err.get("loc") else "body"
        flag = next((f.flag for f in spec.cli_flags(op) if f.name == name), name)
        raise CLIError(f"{flag}: {err['msg']}", param=name) from None


REMOTE_LINES = 256  # input lines per request in `--server` mode (well inside the service's default body limits)


def remote(op: spec.Operation, req, args: argparse.Namespace) -> None:
    """`--server URL`: the same operation answered by a running service over REST (`latentlm.client`), one request
    per REMOTE_LINES input lines (texts, or token-id lists with --ids); the same output lines as a local run, their
    `index` counting input lines. A service error exits non-zero naming its field (a line as `line N`)."""
    from latentlm.client import APIError, Client

    body = req.model_dump(mode="json", exclude_unset=True)
    try:
        with Client(args.server, api_key=args.api_key, timeout=600.0) as client:
            if not op.takes_input:
                emit_json(client.operation(op.name, body)["data"])
                return
            lines = read_inputs(args.input)
            if not lines:
                raise CLIError("no input lines", param="FILE")
            for lo in range(0, len(lines), REMOTE_LINES):
                part = lines[lo: lo + REMOTE_LINES]
                inputs = [_ids(ln, f"line {lo + i + 1}") for i, ln in enumerate(part)] if args.ids else part
                try:
                    data = client.operation(op.name, {**body, "input": inputs})["data"]
                except APIError as e:
                    raise _remote_error(e, lo) from None
                emit_json([{**item, "index": item["index"] + lo} for item in data])
    except APIError as e:
        raise CLIError(f"{args.server}: {e.message}", param=e.param or "server") from None


def _remote_error(e, offset: int) -> CLIError:
    """A service error about `input[i]` of a request as the CLI names it: line offset + i + 1."""
    msg, param = e.message, e.param or "server"
    if msg.startswith("input[") and "]" in msg:
        i = int(msg[6: msg.index("]")])
        msg, param = f"line {offset + i + 1}" + msg[msg.index("]") + 1:], "input"
    return CLIError(msg, param=param)


def cmd_operation(args: argparse.Namespace) -> None:
    op = spec.OPERATIONS[args.command]
    if args.server:
        remote(op, request(op, args, **({"input": [[0]]} if op.takes_input else {})), args)
        return
    if op.takes_input:
        req = request(op, args, input=[[0]])  # options checked before the model loads
        model = load(args)
        seqs = encode_lines(model, read_inputs(args.input), args.ids)
        if not seqs:
            raise CLIError("no input lines", param="FILE")
        req = req.model_copy(update={"input": seqs})
        call = spec.prepare(model, op, req)
        emit_json(op.run(call, args.batch_tokens))
    else:
        req = request(op, args)
        model = load(args)
        emit_json(op.run(spec.prepare(model, op, req), None))


def cmd_list(args: argparse.Namespace) -> None:
    for name in list_models(args.store):
        try:
            emit_json([spec.describe(ops.load_model(args.store, name))])
        except LatentLMError as e:
            emit_json([{"id": name, "error": e.message}])


def cmd_export_onnx(args: argparse.Namespace) -> None:
    require_extra("onnx", ["onnx", "onnxruntime"], "export-onnx")
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
    for op in spec.OPERATIONS.values():
        if not op.route:  # served by a route of its own (completions: OpenAI's), no subcommand
            continue
        p = sub.add_parser(op.name, help=op.help + (" (one JSON object per input line)" if op.takes_input else ""))
        if op.takes_input:
            p.add_argument("input", nargs="?", default="-", metavar="FILE|-",
                           help="one input per line (default stdin)")
        add_model_args(p)
        p.add_argument("--ids", action="store_true", help="lines are space-separated token ids (taken as is)"
                       if op.takes_input else "text options (--prefix, --stop) are space-separated token ids")
        if op.takes_input:
            p.add_argument("--batch-tokens", type=positive_int, default=16384, help="max padded tokens per batch")
        if op.cli_backend:
            add_backend(p)
        p.add_argument("--server", metavar="URL", default=None,
                       help="ask a running `latentlm serve` at URL (e.g. http://127.0.0.1:8000) instead of loading the "
                            "model here: the same output lines (--store, --device, --dtype, --backend then unused)")
        p.add_argument("--api-key", default=os.environ.get("LATENTLM_API_KEY") or None,
                       help="with --server: its bearer key (default $LATENTLM_API_KEY)")
        for f in spec.cli_flags(op):
            p.add_argument(f.flag, **f.kwargs)
        p.set_defaults(func=cmd_operation)
