"""`latentlm distill`: an HMM distilled from a local `transformers` causal LM (`latentlm.training.distill`)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from latentlm.cli.common import add_store, positive_int, require_extra
from latentlm.training import distributed


def cmd_distill(args: argparse.Namespace) -> None:
    """The [distill] extra checked (transformers, matplotlib for the curve, scipy for blocked_hmm's Brown
    clusters), then the run."""
    require_extra("distill", ["transformers", "matplotlib", *(["scipy"] if args.family == "blocked_hmm" else [])],
                  "latentlm distill")
    from latentlm.training.distill import DistillSettings, distill

    keys = DistillSettings.__dataclass_fields__
    path = distill(DistillSettings(**{k: v for k, v in vars(args).items() if k in keys}))
    if distributed.launched_rank() == 0:  # under torchrun rank 0 wrote it
        print(f"wrote {args.name} to {path}", file=sys.stderr)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("distill", help="distil an HMM over a local transformers causal LM's tokens: sample it, "
                                       "then a dense hmm by EM (initialised by k-means of its hidden states, LVD) "
                                       "or a blocked_hmm by the gradient trainer over Brown clusters of its tokens")
    p.add_argument("--lm", type=Path, required=True, metavar="DIR",
                   help="the LM: a local save_pretrained directory (AutoModelForCausalLM + its fast tokenizer)")
    p.add_argument("--name", required=True, help="model name in the store")
    add_store(p)
    p.add_argument("--states", type=positive_int, required=True, metavar="Z", help="hidden states of the HMM")
    p.add_argument("--samples", type=positive_int, required=True, metavar="N", help="training samples drawn")
    p.add_argument("--max-length", type=positive_int, required=True, metavar="L",
                   help="tokens per sample (a sample ends earlier at the LM's EOS)")
    p.add_argument("--seed", type=int, default=0, help="seeds sampling (per shard), initialisation and k-means")
    p.add_argument("--family", choices=["hmm", "blocked_hmm"], default="hmm",
                   help="hmm: dense, by EM (the default); blocked_hmm: a VL-HMM over Brown clusters of the token ids, "
                        "by the gradient trainer of `latentlm train --family blocked_hmm` (Z^2 + V Z/M parameters "
                        "instead of Z (Z + V): for large state counts)")
    p.add_argument("--prompts", type=Path, default=None, metavar="FILE",
                   help="one prompt per line: samples continue them (cycled over the samples; the prompt is not "
                        "part of a sample)")
    p.add_argument("--time-limit", type=float, default=None, metavar="MIN",
                   help="minutes from the start: EM (or the blocked_hmm's training, after its Brown clustering) "
                        "stops cleanly when they are up (sampling is never cut) and the model is exported")
    p.add_argument("--device", default="auto", help="auto (CUDA when present), cpu or cuda[:N]")
    p.add_argument("--valid-samples", type=int, default=None, metavar="N",
                   help="held-out samples for validation perplexity (default: samples/10, within [100, 20000])")
    p.add_argument("--em-steps", type=int, default=None,
                   help="hmm: EM steps over all training samples (default 10)")
    p.add_argument("--pseudocount", type=float, default=None,
                   help="hmm: added to each distribution's counts in the M-step, spread over its entries "
                        "(default 0.1)")
    p.add_argument("--init", choices=["lvd", "random"], default=None,
                   help="hmm: lvd: k-means of the LM's hidden states (default); random")
    p.add_argument("--lvd-samples", type=positive_int, default=None, metavar="N",
                   help="hmm: training samples whose hidden states LVD clusters (default 10000)")
    p.add_argument("--kmeans-iters", type=int, default=None, help="hmm: Lloyd iterations of LVD's k-means (default 25)")
    p.add_argument("--batch-size", type=int, default=None, metavar="B",
                   help="hmm: E-step rows per batch (default 0: sized to the device)")
    p.add_argument("--clusters", type=int, default=None, metavar="M",
                   help="blocked_hmm: Brown clusters of the token ids; divides --states (default: the largest "
                        "divisor of Z up to min(128, Z/16))")
    p.add_argument("--epochs", type=int, default=None,
                   help="blocked_hmm: passes over the training samples (default 10; early stopping after 2 "
                        "evaluations without improvement)")
    p.add_argument("--lr", type=float, default=None, help="blocked_hmm: AdamW's learning rate (default 0.01)")
    p.add_argument("--sample-batch", type=positive_int, default=64, metavar="B",
                   help="rows per LM generate call (default 64; part of what identifies the samples)")
    p.add_argument("--shard-size", type=positive_int, default=10000, metavar="N",
                   help="samples per shard file (default 10000)")
    p.add_argument("--work-dir", type=Path, default=None, metavar="DIR",
                   help="samples and checkpoints (default <store>/.distill/<name>); a rerun continues there")
    p.add_argument("--max-memory", type=float, default=None, metavar="GiB",
                   help="memory the run may use (default: what the device has available now)")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True, help="progress bars")
    p.set_defaults(func=cmd_distill)
