"""`latentlm import-ctrlg DIR --tokenizer TOKDIR`: a Ctrl-G HMM checkpoint (Zhang et al. 2024, `ctrlg.HMM`'s
`save_pretrained` directory) -> a dense `hmm` over the LM's token ids carrying that LM's tokenizer.

The checkpoint: `config.json` {hidden_states H, vocab_size V, eos_token_id}; `model.safetensors` with `alpha_exp`
[H, H] transition probabilities (rows sum to 1), `beta` [H, V] log emission probabilities (rows log-sum to 0) and
`gamma` [H] initial logits (the start distribution is softmax(gamma)).

EOS: Ctrl-G pads its training samples with EOS, so its HMM has learnt EOS as absorbing (after the first EOS, EOS
again with probability near 1). latentlm ends a sequence at its eos instead; the imported model reads the
checkpoint's `eos_token_id` as that end: scoring "text + eos" is the probability that a sample is the text
followed by padding, and sampling stops at the first eos, as Ctrl-G's decoding does.

Memory: each tensor is read once in float32 and normalised in place (row sums in float64): about 1x the
checkpoint's size."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from latentlm.models.errors import InputError
from latentlm.models.tokenizer import as_text_tokenizer, tokenizer_files, vocab_for
from latentlm.models.vocab import Vocabulary

CONFIG, WEIGHTS = "config.json", "model.safetensors"
TENSORS = ("alpha_exp", "beta", "gamma")
TOLERANCE = 1e-3  # |row sum - 1| accepted in the checkpoint (float32 sums over 50k entries); renormalised on import


def _config(path: Path) -> tuple[int, int, int]:
    file = path / CONFIG
    if not file.is_file():
        raise InputError(f"{path}: no {CONFIG} (a Ctrl-G HMM checkpoint directory)", param="DIR")
    try:
        cfg = json.loads(file.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise InputError(f"{file}: not JSON ({e})", param="DIR") from None
    if not isinstance(cfg, dict):
        raise InputError(f"{file}: expected a JSON object", param="DIR")
    out = []
    for key in ("hidden_states", "vocab_size", "eos_token_id"):
        v = cfg.get(key)
        if isinstance(v, bool) or not isinstance(v, int) or v < (0 if key == "eos_token_id" else 1):
            raise InputError(f"{file}: {key} must be a {'non-negative' if key == 'eos_token_id' else 'positive'} "
                             f"integer, got {v!r}", param=key)
        out.append(v)
    H, V, eos = out
    if eos >= V:
        raise InputError(f"{file}: eos_token_id {eos} is outside the vocabulary [0, {V})", param="eos_token_id")
    return H, V, eos


def _tensors(path: Path, H: int, V: int) -> dict[str, Tensor]:
    from safetensors import SafetensorError, safe_open

    file = path / WEIGHTS
    if not file.is_file():
        raise InputError(f"{path}: no {WEIGHTS}", param="DIR")
    shapes = {"alpha_exp": (H, H), "beta": (H, V), "gamma": (H,)}
    out = {}
    try:
        with safe_open(str(file), framework="pt") as f:
            keys = set(f.keys())
            for key in TENSORS:
                if key not in keys:
                    raise InputError(f"{file}: missing tensor {key!r} (has: {', '.join(sorted(keys))})", param=key)
                t = f.get_tensor(key)
                if tuple(t.shape) != shapes[key]:
                    raise InputError(f"{key}: expected shape {list(shapes[key])} (config.json: hidden_states {H}, "
                                     f"vocab_size {V}), got {list(t.shape)}", param=key)
                if not t.is_floating_point():
                    raise InputError(f"{key}: expected floating-point numbers, got {t.dtype}", param=key)
                out[key] = t.float()
    except SafetensorError as e:
        raise InputError(f"{file}: not a readable safetensors file ({e})", param="DIR") from None
    return out


def _first(mask: Tensor) -> list[int]:
    return [int(i) for i in mask.nonzero()[0]]


def _normalise_rows(p: Tensor, key: str, what: str) -> Tensor:
    """Check that the rows of the probabilities `p` [H, N] (in place) sum to 1 within TOLERANCE, then renormalise them.
    Raises InputError naming `key` (the checkpoint's tensor) and the first bad row."""
    if torch.isnan(p).any() or torch.isinf(p).any():
        raise InputError(f"{key}: NaN or infinite {what} at {_first(~torch.isfinite(p))}", param=key)
    if (p < 0).any():
        raise InputError(f"{key}: negative {what} at {_first(p < 0)}", param=key)
    sums = p.sum(-1, dtype=torch.float64)
    bad = ((sums - 1).abs() > TOLERANCE).nonzero()
    if len(bad):
        row = int(bad[0, 0])
        raise InputError(f"{key}: row {row} of the {what} sums to {float(sums[row]):.6g}, not 1 (tolerance "
                         f"{TOLERANCE:g})", param=key)
    return p.div_(sums.unsqueeze(-1).to(p.dtype))


def read_ctrlg(path: Path, tokenizer: str | Path | None = None) -> tuple[dict[str, Tensor], Vocabulary, dict[str, Any],
                                                                        dict[str, bytes]]:
    """The `import-ctrlg` importer: (hmm tensors start/trans/emit float32, the tokenizer's vocabulary (V entries,
    `models.tokenizer.vocab_for`; ids the tokenizer lacks are placeholders), config, {tokenizer.json: bytes}).
    Raises InputError naming the tensor, key or option at fault; nothing is written. O(H (H + V))."""
    path = Path(path)
    if tokenizer is None:
        raise InputError("--tokenizer: required (the LM's save_pretrained directory holding tokenizer.json)",
                         param="tokenizer")
    if not path.is_dir():
        raise InputError(f"{path}: no such directory", param="DIR")
    H, V, eos = _config(path)
    if not Path(tokenizer).exists():
        raise InputError(f"--tokenizer {tokenizer}: no such directory or file", param="tokenizer")
    tok = as_text_tokenizer(Path(tokenizer))
    if tok.vocab_size > V:
        raise InputError(f"--tokenizer {tokenizer}: {tok.vocab_size} token ids, more than the checkpoint's "
                         f"vocab_size {V} (config.json): not this HMM's tokenizer", param="tokenizer")
    vocab = vocab_for(tok, V, eos)
    t = _tensors(path, H, V)
    gamma = t["gamma"]
    if torch.isnan(gamma).any() or (gamma == math.inf).any():
        raise InputError(f"gamma: NaN or +inf logit at {_first(torch.isnan(gamma) | (gamma == math.inf))}",
                         param="gamma")
    if (gamma == -math.inf).all():
        raise InputError("gamma: every initial logit is -inf", param="gamma")
    start = torch.softmax(gamma.double(), 0).float()
    trans = _normalise_rows(t.pop("alpha_exp"), "alpha_exp", "transition probabilities")
    beta = t.pop("beta")
    if torch.isnan(beta).any() or (beta == math.inf).any():
        raise InputError(f"beta: NaN or +inf log probability at {_first(torch.isnan(beta) | (beta == math.inf))}",
                         param="beta")
    emit = _normalise_rows(beta.exp_(), "beta", "emission probabilities (exp(beta))")
    return {"start": start, "trans": trans, "emit": emit}, vocab, {"num_states": H}, tokenizer_files(tok)
