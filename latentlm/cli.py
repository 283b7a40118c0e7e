"""`latentlm` command line: thin wrappers over `latentlm.ops` (the same functions the service uses).

Built-in commands: import-hmm, list, score, decode, posterior, sample, embed. Other packages add theirs
through a `register(subparsers)` function listed in EXTENSIONS (training, serving, grammars, ...).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import torch

from latentlm import ops
from latentlm.models.errors import LatentLMError
from latentlm.models.store import check_name, default_store, list_models, save_artifact
from latentlm.models.vocab import Preprocessing, Vocabulary

EXTENSIONS = ["latentlm.training.cli", "latentlm.service.cli", "latentlm.pcfg_cli", "latentlm.embed_cli",
              "latentlm.ngram_cli"]


class CLIError(LatentLMError):
    pass


# -- import-hmm ---------------------------------------------------------------------------------------
def import_hmm(path: Path, name: str, store: Path, force: bool = False) -> Path:
    """Validate an hmmlearn-style npz (startprob [Z], transmat [Z, Z], emissionprob [Z, V], optional vocab)
    and write it as an `hmm` artifact. Raises CLIError naming the key and the problem; writes nothing then."""
    check_name(name)
    if not path.is_file():
        raise CLIError(f"{path}: no such file", param="FILE")
    try:
        npz = np.load(path, allow_pickle=False)
        arrays = {k: npz[k] for k in npz.files}
    except Exception as e:
        raise CLIError(f"{path}: not a readable .npz file ({e})", param="FILE") from None
    allowed = {"startprob", "transmat", "emissionprob", "vocab"}
    extra = sorted(set(arrays) - allowed)
    if extra:
        raise CLIError(f"{path}: unexpected key {extra[0]!r} (allowed: {', '.join(sorted(allowed))})", param=extra[0])
    for key in ("startprob", "transmat", "emissionprob"):
        if key not in arrays:
            raise CLIError(f"{path}: missing key {key!r}", param=key)
        a = arrays[key]
        if a.dtype.kind not in "fiu":
            raise CLIError(f"{key}: expected numbers, got dtype {a.dtype}", param=key)
    start, trans, emit = (arrays[k].astype(np.float64) for k in ("startprob", "transmat", "emissionprob"))
    if start.ndim != 1 or start.shape[0] == 0:
        raise CLIError(f"startprob: expected shape [Z] with Z >= 1, got {list(start.shape)}", param="startprob")
    Z = start.shape[0]
    if trans.shape != (Z, Z):
        raise CLIError(f"transmat: expected shape [{Z}, {Z}], got {list(trans.shape)}", param="transmat")
    if emit.ndim != 2 or emit.shape[0] != Z or emit.shape[1] == 0:
        raise CLIError(f"emissionprob: expected shape [{Z}, V], got {list(emit.shape)}", param="emissionprob")
    for key, a, axis in (("startprob", start, 0), ("transmat", trans, 1), ("emissionprob", emit, 1)):
        if not np.isfinite(a).all():
            pos = tuple(int(i) for i in np.argwhere(~np.isfinite(a))[0])
            raise CLIError(f"{key}: NaN or infinite entry at {list(pos)}", param=key)
        if (a < 0).any():
            pos = tuple(int(i) for i in np.argwhere(a < 0)[0])
            raise CLIError(f"{key}: negative entry {a[pos]:.6g} at {list(pos)}", param=key)
        sums = a.sum(axis=axis) if a.ndim > 1 else np.array([a.sum()])
        bad = np.flatnonzero(np.abs(sums - 1) > 1e-4)
        if len(bad):
            what = "sums" if a.ndim == 1 else f"row {int(bad[0])} sums"
            raise CLIError(f"{key}: {what} to {sums[bad[0]]:.6g}, not 1 (tolerance 1e-4)", param=key)
    V = emit.shape[1]
    if "vocab" in arrays:
        vocab_arr = arrays["vocab"]
        if vocab_arr.shape != (V,):
            raise CLIError(f"vocab: expected shape [{V}], got {list(vocab_arr.shape)}", param="vocab")
        tokens = [str(t) for t in vocab_arr.tolist()]
        bad_tok = next((t for t in tokens if not t or any(c.isspace() for c in t)), None)
        if bad_tok is not None:
            raise CLIError(f"vocab: token {bad_tok!r} is empty or contains whitespace", param="vocab")
        if len(set(tokens)) != V:
            raise CLIError("vocab: tokens are not unique", param="vocab")
    else:
        tokens = [str(i) for i in range(V)]
    pre = Preprocessing(lowercase=False, unk="<unk>" if "<unk>" in tokens else None,
                        eos="<eos>" if "<eos>" in tokens else None, add_eos="<eos>" in tokens)
    tensors = {"start": torch.from_numpy(start), "trans": torch.from_numpy(trans), "emit": torch.from_numpy(emit)}
    if (store / name).exists() and not force:
        raise CLIError(f"model {name!r} already exists in {store} (use --force to replace it)", param="name")
    return save_artifact(store, name, "hmm", tensors, Vocabulary(tokens, pre), config={"num_states": Z},
                         provenance={"source": "import-hmm", "file": path.name})


# -- shared input handling ----------------------------------------------------------------------------
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


def emit_json(rows: list[dict]) -> None:
    out = sys.stdout
    for r in rows:
        out.write(json.dumps(r, ensure_ascii=False) + "\n")
    out.flush()


def _load(args: argparse.Namespace) -> ops.LoadedModel:
    device = ops.resolve_device(getattr(args, "device", "cpu"))
    return ops.load_model(args.store, args.model, device=device, dtype=args.dtype)


def cmd_run(args: argparse.Namespace) -> None:
    model = _load(args)
    opts: dict = {}
    if args.command == "score":
        opts["token_logprobs"] = args.token_logprobs
    elif args.command == "decode":
        opts["method"] = args.method
    elif args.command == "posterior":
        opts["top_k"] = ops.parse_top_k(args.top_k)
    elif args.command == "embed":
        opts["causal"] = args.causal
    ops.check_supported(model, args.command, opts.get("method"))
    seqs = encode_lines(model, read_inputs(args.input), args.ids)
    if not seqs:
        raise CLIError("no input lines", param="FILE")
    emit_json(ops.run(model, args.command, seqs, max_batch_tokens=args.batch_tokens, **opts))


def cmd_sample(args: argparse.Namespace) -> None:
    model = _load(args)
    prefix = None
    if args.prefix is not None:
        prefix = [int(t) for t in args.prefix.split()] if args.ids else args.prefix
    emit_json(ops.sample(model, n=args.n, max_tokens=args.max_tokens, seed=args.seed, prefix=prefix,
                         temperature=args.temperature, stop_at_eos=not args.no_stop))


def cmd_import_hmm(args: argparse.Namespace) -> None:
    path = import_hmm(Path(args.file), args.name, Path(args.store), force=args.force)
    print(f"imported {args.name} into {path}", file=sys.stderr)


def cmd_list(args: argparse.Namespace) -> None:
    for name in list_models(args.store):
        try:
            m = ops.load_model(args.store, name)
            emit_json([m.describe()])
        except LatentLMError as e:
            emit_json([{"id": name, "error": e.message}])


# -- parser ---------------------------------------------------------------------------------------
def add_store(p: argparse.ArgumentParser) -> None:
    p.add_argument("--store", type=Path, default=default_store(),
                   help="model store directory (default: $LATENTLM_STORE or ./artifacts)")


def positive_int(s: str) -> int:
    v = int(s)
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {v}")
    return v


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="latentlm", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("import-hmm", help="import an hmmlearn-style .npz (startprob, transmat, emissionprob)")
    p.add_argument("file", metavar="FILE.npz")
    p.add_argument("--name", required=True)
    p.add_argument("--force", action="store_true", help="replace an existing model of that name")
    add_store(p)
    p.set_defaults(func=cmd_import_hmm)

    p = sub.add_parser("list", help="list the models in the store")
    add_store(p)
    p.set_defaults(func=cmd_list)

    helps = {"score": "log-likelihood, perplexity and per-token log-probs", "decode": "Viterbi or MBR decoding",
             "posterior": "per-token state marginals", "embed": "per-token embeddings"}
    for name, help_text in helps.items():
        p = sub.add_parser(name, help=help_text + " (one JSON object per input line)")
        p.add_argument("input", nargs="?", default="-", metavar="FILE|-", help="one input per line (default stdin)")
        common_model_args(p)
        p.add_argument("--ids", action="store_true", help="lines are space-separated token ids (taken as is)")
        p.add_argument("--batch-tokens", type=positive_int, default=16384, help="max padded tokens per batch")
        if name == "score":
            p.add_argument("--token-logprobs", action="store_true", help="add tokens and token_logprobs")
        if name == "decode":
            p.add_argument("--method", choices=["viterbi", "mbr"], default="viterbi")
        if name == "posterior":
            p.add_argument("--top-k", default="all", help="K most probable states per token, or 'all'")
        if name == "embed":
            p.add_argument("--causal", action="store_true", help="filtered (left-context) instead of smoothed")
        p.set_defaults(func=cmd_run)

    p = sub.add_parser("sample", help="sample sentences or continuations of --prefix")
    common_model_args(p)
    p.add_argument("--n", type=positive_int, default=1)
    p.add_argument("--max-tokens", type=positive_int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prefix", default=None, help="text (or ids with --ids) to continue")
    p.add_argument("--ids", action="store_true", help="--prefix is space-separated token ids")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--no-stop", action="store_true", help="do not stop a sample at <eos>")
    p.set_defaults(func=cmd_sample)

    for mod in EXTENSIONS:
        if importlib.util.find_spec(mod) is not None:
            importlib.import_module(mod).register(sub)
    return parser


def common_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="model name in the store")
    add_store(p)
    p.add_argument("--device", default="cpu", help="cpu, cuda or auto (default cpu)")
    p.add_argument("--dtype", choices=sorted(ops.DTYPES), default="float32")


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


if __name__ == "__main__":
    sys.exit(main())
