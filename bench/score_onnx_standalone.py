"""Score token-id lines with an exported latentlm .onnx file, using onnxruntime and numpy only.

    python bench/score_onnx_standalone.py MODEL.onnx [FILE|-] [--hash SHA256] [--token-logprobs]
        [--batch 64] [--threads N]

Each input line is whitespace-separated token ids; each output line is JSON
{"index", "logprob", "num_tokens"[, "token_logprobs"]} (null = probability 0), like `latentlm score --ids`.
This file imports nothing from latentlm and never imports torch (asserted at exit): the .onnx file is a
self-contained scoring artifact, servable e.g. by Triton Inference Server's onnxruntime backend with the
inputs ids (B, T) int64, lengths (B,) int64 and outputs logprob (B,) float64, token_logprobs (B, T) float32.
"""

from __future__ import annotations

import argparse
import json
import math
import sys

import numpy as np
import onnxruntime as ort


def _f(x: float) -> float | None:
    return x if math.isfinite(x) else None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model")
    ap.add_argument("input", nargs="?", default="-")
    ap.add_argument("--hash", help="refuse the file unless its latentlm.content_hash equals this")
    ap.add_argument("--token-logprobs", action="store_true")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--threads", type=int, default=0)
    a = ap.parse_args(argv)

    opts = ort.SessionOptions()
    if a.threads:
        opts.intra_op_num_threads = a.threads
    sess = ort.InferenceSession(a.model, sess_options=opts, providers=["CPUExecutionProvider"])
    meta = sess.get_modelmeta().custom_metadata_map
    if a.hash is not None and meta.get("latentlm.content_hash") != a.hash:
        print(f"error: {a.model}: content hash {meta.get('latentlm.content_hash')!r} != {a.hash!r}", file=sys.stderr)
        return 2
    V = int(meta["latentlm.vocab_size"])

    stream = sys.stdin if a.input == "-" else open(a.input, encoding="utf-8")
    seqs = []
    for n, line in enumerate(stream, 1):
        if not line.strip():
            continue
        ids = [int(tok) for tok in line.split()]
        if any(i < 0 or i >= V for i in ids):
            print(f"error: line {n}: token id outside [0, {V})", file=sys.stderr)
            return 2
        seqs.append(ids)

    for start in range(0, len(seqs), a.batch):
        chunk = seqs[start : start + a.batch]
        lengths = np.array([len(s) for s in chunk], dtype=np.int64)
        ids = np.zeros((len(chunk), int(lengths.max())), dtype=np.int64)
        for r, s in enumerate(chunk):
            ids[r, : len(s)] = s
        logprob, tok = sess.run(None, {"ids": ids, "lengths": lengths})
        for r, s in enumerate(chunk):
            out = {"index": start + r, "logprob": _f(float(logprob[r])), "num_tokens": len(s)}
            if a.token_logprobs:
                out["token_logprobs"] = [_f(float(v)) for v in tok[r, : len(s)]]
            print(json.dumps(out))

    assert "torch" not in sys.modules, "torch was imported"
    return 0


if __name__ == "__main__":
    sys.exit(main())
