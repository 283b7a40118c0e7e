"""A blocked HMM's (VL-HMM's) scoring, posteriors and Viterbi on CPU: the compiled sweeps that
`BlockedHMM.score`, `.posterior` and `.viterbi` run by default (`kernels.blocked`: each step reads its k x k
block of the Z x Z matrix where it lies, rows split over threads) against the chain engine's torch steps they
replaced (`backend="torch"`, a gathered (B, k, k) block and a batched product per step), in one process,
interleaved.

    python bench/blocked_sweeps.py [--shapes 128x8,128x32,128x64] [--rounds 3] [--out FILE]
    python bench/blocked_sweeps.py --store DIR --model NAME [--rounds 3] [--out FILE]

With --store and --model, a trained blocked_hmm from the store (say the 2^15-state PTB model: a 4 GiB transition
matrix) is scored instead, on the batches the service sees: 64 x 50 random token ids (what bench/service_wrk.sh
sends, one request each), 256 PTB validation sentences, and 64 x 50 ids of the largest cluster's words (every step reads
the same block: no memory traffic). Next to tokens/s it gives the bytes of transition blocks read per second
(k^2 float32 per token) against this process's memory read bandwidth (one pass over the transition matrix, the
same threads): how close a sweep is to the memory limit; and the same with bfloat16 storage (opt-in, k^2 x 2 bytes).

Random blocked HMMs (`models.synthetic`, V = 10,000 words in M clusters of k states each), float32. Two
batches: "ptb-like" (256 sentences of 5-45 tokens, about PTB's validation sentences as training's checks and
`latentlm eval` score them) and "64 x 50". Both paths give the same numbers (tests/models/test_blocked_kernels.py);
only speed differs. Results are appended to --out (default bench/results/blocked_sweeps.md).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hmm_inference import append_section, interleaved, machine, run_heading, shown, timed  # noqa: E402

from latentlm import ops  # noqa: E402
from latentlm.models.base import Batch, ChainFamily  # noqa: E402
from latentlm.models.blocked_hmm import BlockedHMM  # noqa: E402
from latentlm.models.synthetic import random_blocked_hmm  # noqa: E402

V = 10_000


def batches(seed: int = 0) -> dict[str, Batch]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(5, 46, (256,), generator=g).tolist()
    ptb_like = Batch.from_lists([torch.randint(V, (n,), generator=g).tolist() for n in lengths])
    return {"ptb-like (256 x 5-45)": ptb_like,
            "64 x 50": Batch(torch.randint(V, (64, 50), generator=g), torch.full((64,), 50))}


def calls(m: BlockedHMM, b: Batch) -> dict[str, dict[str, object]]:
    """{operation: {path: call}}."""
    return {"score": {"compiled": lambda: m.score(b), "torch steps": lambda: m.score(b, backend="torch")},
            "posterior": {"compiled": lambda: m.posterior(b), "torch steps": lambda: ChainFamily.posterior(m, b)},
            "viterbi": {"compiled": lambda: m.viterbi(b), "torch steps": lambda: ChainFamily.viterbi(m, b)}}


def stored_batches(m: BlockedHMM, vocab, seed: int = 0) -> dict[str, Batch]:
    """The service's batches for a stored model: random ids, PTB validation sentences, one cluster's words."""
    from latentlm.training.data import eval_corpus

    g = torch.Generator().manual_seed(seed)
    V = m.emit.shape[0]
    valid = eval_corpus("ptb:valid", vocab)[:256]
    one = (m.word_cluster == torch.bincount(m.word_cluster).argmax()).nonzero().squeeze(1)  # the largest cluster
    return {"64 x 50 random ids": Batch(torch.randint(V, (64, 50), generator=g), torch.full((64,), 50)),
            "256 PTB valid sentences": Batch.from_lists(valid),
            "64 x 50 one cluster": Batch(one[torch.randint(len(one), (64, 50), generator=g)], torch.full((64,), 50))}


def stored(args: argparse.Namespace, info: dict[str, str]) -> None:
    """Scoring a stored blocked_hmm against the memory read bandwidth (see the module's docstring)."""
    loaded = ops.load_model(args.store, args.model)
    m = loaded.impl
    if not isinstance(m, BlockedHMM):
        raise SystemExit(f"--model {args.model}: a {loaded.family} model, this bench takes a blocked_hmm")
    read = m.trans.numel() * m.trans.element_size() / timed(lambda: m.trans.sum(), 1.0, 5)
    half = BlockedHMM(m.start, m.trans, m.emit, m.word_cluster, m.M)  # the same tensors, bfloat16 storage added
    half.set_storage_dtype("bfloat16")
    block = m.k * m.k * m.trans.element_size()
    lines = []
    for bname, b in stored_batches(m, loaded.vocab).items():
        tokens = int(b.lengths.sum())
        paths = {**calls(m, b)["score"], "bfloat16": lambda b=b: half.score(b)}
        sec = interleaved(paths, args.rounds)  # type: ignore[arg-type]
        fast, slow, bf16 = (tokens / sec[p] for p in ("compiled", "torch steps", "bfloat16"))
        moved = (tokens - b.ids.shape[0]) / sec["compiled"] * block  # one block per token after the first
        moved16 = (tokens - b.ids.shape[0]) / sec["bfloat16"] * block / 2
        shown(lines, f"| {bname} | {fast:,.0f} | {slow:,.0f} | {moved / 1e9:.1f} GB/s | {moved / read:.0%} | "
                     f"{bf16:,.0f} ({bf16 / fast:.2f}x) | {moved16 / 1e9:.1f} GB/s | {moved16 / read:.0%} |")
    text = [*run_heading(info),
            f"Command: `python bench/blocked_sweeps.py --store STORE --model {args.model} --rounds {args.rounds}`. "
            f"{m.M} clusters x {m.k} states = {m.M * m.k:,}, float32; score only. Memory read bandwidth in this "
            f"process (a sum over the {m.trans.numel() * m.trans.element_size() / 2**30:.1f} GiB transition matrix): "
            f"{read / 1e9:.1f} GB/s. Tokens/s, median of {args.rounds} interleaved rounds. The last three columns: "
            "the same sweep with bfloat16 storage (`LATENTLM_STORAGE_DTYPE=bfloat16`, opt-in: half the bytes per "
            "block, each entry widened to float32 as it is read).", "",
            "| batch | compiled sweep (default), tokens/s | torch steps, tokens/s | blocks read by the sweep | "
            "share of the read bandwidth | bfloat16 storage, tokens/s (x float32) | its blocks read | its share |",
            "|---|---|---|---|---|---|---|---|", *lines, ""]
    append_section(args.out, "Blocked HMM sweeps on CPU (`bench/blocked_sweeps.py`): compiled against torch steps",
                   text)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="128x8,128x32,128x64", help="M x k of each model")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--store", type=Path, help="with --model: score this store's trained blocked_hmm instead")
    ap.add_argument("--model")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "blocked_sweeps.md")
    args = ap.parse_args()
    info = machine()
    if args.store or args.model:
        if not (args.store and args.model):
            ap.error("--store and --model go together")
        return stored(args, info)
    lines = []
    for shape in args.shapes.split(","):
        M, k = (int(x) for x in shape.split("x"))
        t, c = random_blocked_hmm(M, k, V, seed=0)
        m = BlockedHMM.from_tensors(t, c, dtype=torch.float32)
        for bname, b in batches().items():
            tokens = int(b.lengths.sum())
            for op, paths in calls(m, b).items():
                sec = interleaved(paths, args.rounds)  # type: ignore[arg-type]
                fast, slow = (tokens / sec[p] for p in ("compiled", "torch steps"))
                shown(lines, f"| {M} x {k} = {M * k:,} | {bname} | {op} | {fast:,.0f} | {slow:,.0f} | "
                             f"{fast / slow:.1f}x |")
    text = [*run_heading(info),
            f"Command: `python bench/blocked_sweeps.py --shapes {args.shapes} --rounds {args.rounds}`. Tokens/s, "
            f"median of {args.rounds} interleaved rounds (alternating which path goes first), each round the "
            "median call over at least 0.5 s.", "",
            "| M x k = Z | batch | operation | compiled sweep (default) | torch steps | compiled / torch |",
            "|---|---|---|---|---|---|", *lines, ""]
    append_section(args.out, "Blocked HMM sweeps on CPU (`bench/blocked_sweeps.py`): compiled against torch steps",
                   text)


if __name__ == "__main__":
    main()
