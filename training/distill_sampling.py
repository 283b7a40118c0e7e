"""`latentlm distill`, its first half: the user's language model (a local `save_pretrained` directory read with
`transformers`, imported here only), its samples in resumable shards, and its hidden states for LVD.

Samples: ancestral sampling (temperature 1, no top-k / top-p: the LM's own distribution, whatever its
`generation_config.json` says), `max_new_tokens = L` from the LM's BOS (its EOS where it has no BOS) or from a
prompt (`--prompts`, cycled over the rows; the prompt is not part of the sample, as in GeLaTo). A sample ends at
the LM's first EOS (kept: the HMM learns where text ends) or is cut at L (no EOS: trained on as a prefix, see
`training.distill`). Stored as `.npy` int32 [n, L], -1 after the end, one file per shard of `shard_size` rows,
written atomically; shard i of split s is drawn with the torch seed `shard_seed(seed, s, i)`, so a killed run
continues with the shards it has and gives the samples an uninterrupted run would (on the same device type)."""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from latentlm.models.errors import InputError
from latentlm.models.tokenizer import TOKENIZER_FILE, TextTokenizer, vocab_for
from latentlm.models.vocab import Vocabulary
from latentlm.training import distributed

SPLITS = {"train": 0, "valid": 1}
PAD = -1


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@dataclass
class LMInfo:
    """What `inspect_lm` reads from the directory before any work: no weights loaded."""

    path: Path
    model_type: str
    vocab_size: int  # the LM's output size: the HMM's vocabulary
    hidden_size: int
    start_id: int  # the token generation starts from (BOS, else EOS)
    eos_ids: tuple[int, ...]  # a sample ends at the first of these (empty: every sample runs to L)
    vocab: Vocabulary = field(repr=False)  # the HMM's: V lines, the tokenizer attached (`models.tokenizer.vocab_for`)
    config_sha256: str
    tokenizer_sha256: str
    tokenizer_json: bytes = field(repr=False)
    tokenizer: Any = field(repr=False)  # the transformers tokenizer
    weight_files: dict[str, list[int]] = field(default_factory=dict)  # name -> [size, mtime_ns]

    def provenance(self) -> dict[str, Any]:
        return {"dir": str(self.path), "model_type": self.model_type, "vocab_size": self.vocab_size,
                "config_sha256": self.config_sha256, "tokenizer_sha256": self.tokenizer_sha256,
                "eos_ids": list(self.eos_ids), "start_id": self.start_id}


def transformers_quiet():
    """`transformers`, its progress bars and warnings off (sampling has its own bar)."""
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    return transformers


def inspect_lm(path: Path) -> LMInfo:
    """Check `path` is a causal LM's `save_pretrained` directory with a fast tokenizer and read what distillation
    needs (sizes, BOS/EOS, hashes). Raises InputError(param="lm") naming the directory and the problem."""
    path = Path(path).resolve()
    where = f"--lm {path}"
    if not path.is_dir():
        raise InputError(f"{where}: no such directory", param="lm")
    if not (path / "config.json").is_file():
        raise InputError(f"{where}: no config.json (not a save_pretrained model directory)", param="lm")
    transformers = transformers_quiet()
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    try:
        config = transformers.AutoConfig.from_pretrained(path, local_files_only=True)
    except Exception as e:  # transformers raises ValueError, OSError, KeyError... on a bad config
        raise InputError(f"{where}: config.json cannot be read ({str(e).splitlines()[0]})", param="lm") from None
    if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        raise InputError(f"{where}: model type {config.model_type!r} is not a causal language model "
                         "(AutoModelForCausalLM cannot load it)", param="lm")
    try:
        tok = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as e:
        raise InputError(f"{where}: no tokenizer could be loaded ({str(e).splitlines()[0]})", param="lm") from None
    if (path / TOKENIZER_FILE).is_file():
        text_tok = TextTokenizer.from_file(path / TOKENIZER_FILE, error=InputError)
    elif hasattr(tok, "backend_tokenizer"):
        text_tok = TextTokenizer.from_hf(tok)
    else:
        raise InputError(f"{where}: the tokenizer is not a fast (`tokenizers`) tokenizer: the model needs its "
                         "tokenizer.json", param="lm")
    text = config.get_text_config()
    V, d = int(text.vocab_size), int(text.hidden_size)
    eos = tok.eos_token_id if tok.eos_token_id is not None else text.eos_token_id
    eos_ids = tuple(int(e) for e in (eos if isinstance(eos, list | tuple) else [] if eos is None else [eos]))
    bos = tok.bos_token_id if tok.bos_token_id is not None else text.bos_token_id
    start = bos if bos is not None else (eos_ids[0] if eos_ids else None)
    if start is None:
        raise InputError(f"{where}: the LM has neither a BOS nor an EOS token to start sampling from; give "
                         "--prompts", param="lm")
    for what, i in [("BOS/start", start), *(("EOS", e) for e in eos_ids)]:
        if not 0 <= i < V:
            raise InputError(f"{where}: {what} id {i} is outside the vocabulary [0, {V})", param="lm")
    if text_tok.vocab_size > V:
        raise InputError(f"{where}: the tokenizer has {text_tok.vocab_size} token ids, the model's output only "
                         f"{V} (vocab_size in config.json)", param="lm")
    vocab = vocab_for(text_tok, V, eos_ids[0] if eos_ids else None, add_eos=bool(eos_ids))
    tok_json = text_tok.to_json_bytes()
    weights = {p.name: [p.stat().st_size, p.stat().st_mtime_ns] for p in sorted(path.iterdir())
               if p.suffix in (".safetensors", ".bin", ".pt", ".pth")}
    if not weights:
        raise InputError(f"{where}: no weights (model.safetensors or pytorch_model.bin)", param="lm")
    return LMInfo(path, config.model_type, V, d, int(start), eos_ids, vocab,
                  _sha256((path / "config.json").read_bytes()), _sha256(tok_json), tok_json, tok, weights)


def load_model(info: LMInfo, device: torch.device):
    """The LM itself, in eval mode on `device`."""
    transformers = transformers_quiet()
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(info.path, local_files_only=True)
    except Exception as e:  # OSError, ValueError, RuntimeError (shapes)... from transformers
        raise InputError(f"--lm {info.path}: the model cannot be loaded ({str(e).splitlines()[0]})",
                         param="lm") from None
    out = model.get_output_embeddings()
    if out is not None and out.weight.shape[0] != info.vocab_size:
        raise InputError(f"--lm {info.path}: the output layer has {out.weight.shape[0]} rows, config.json says "
                         f"vocab_size {info.vocab_size}", param="lm")
    return model.to(device).eval()


def read_prompts(path: Path, info: LMInfo) -> tuple[list[list[int]], str]:
    """`--prompts FILE`: one prompt per non-empty line, encoded by the LM's tokenizer as the LM expects (its special
    tokens, e.g. a BOS, added); returns (prompts, sha256 of the file)."""
    try:
        data = Path(path).read_bytes()
        lines = [ln for ln in data.decode("utf-8").splitlines() if ln.strip()]
    except (OSError, UnicodeDecodeError) as e:
        raise InputError(f"--prompts {path}: cannot be read ({e})", param="prompts") from None
    if not lines:
        raise InputError(f"--prompts {path}: no prompts (one per line)", param="prompts")
    prompts = [list(info.tokenizer(ln)["input_ids"]) for ln in lines]
    empty = next((i for i, p in enumerate(prompts) if not p), None)
    if empty is not None:
        raise InputError(f"--prompts {path}: line {empty + 1} encodes to no tokens", param="prompts")
    return prompts, _sha256(data)


def shard_seed(seed: int, split: str, index: int) -> int:
    """The torch seed of shard `index` of `split`, a function of (seed, split, index) only."""
    return int(np.random.SeedSequence([seed, SPLITS[split], index]).generate_state(1, np.uint64)[0] >> 1)


def sample_key(info: LMInfo, *, max_length: int, seed: int, shard_size: int, batch: int,
               prompts_sha: str | None) -> str:
    """What the samples depend on, hashed: a sample directory is reused only by runs that would draw the same."""
    what = {"config": info.config_sha256, "tokenizer": info.tokenizer_sha256, "weights": info.weight_files,
            "max_length": max_length, "seed": seed, "shard_size": shard_size, "batch": batch, "prompts": prompts_sha}
    return _sha256(json.dumps(what, sort_keys=True).encode())[:16]


def _left_pad(rows: list[list[int]], pad: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefixes left-padded to one length: (ids (B, P), attention mask (B, P))."""
    P = max(len(r) for r in rows)
    ids = torch.tensor([[pad] * (P - len(r)) + r for r in rows], dtype=torch.long, device=device)
    mask = torch.tensor([[0] * (P - len(r)) + [1] * len(r) for r in rows], dtype=torch.long, device=device)
    return ids, mask


def end_samples(new: np.ndarray, L: int, eos_ids: tuple[int, ...]) -> np.ndarray:
    """Generated ids (B, <= L) -> int32 (B, L): each row kept up to and including its first EOS, PAD after."""
    out = np.full((new.shape[0], L), PAD, dtype=np.int32)
    out[:, : new.shape[1]] = new
    if eos_ids:
        is_eos = np.isin(out, eos_ids)
        first = np.where(is_eos.any(1), is_eos.argmax(1), L)
        out[np.arange(L)[None, :] > first[:, None]] = PAD
    return out


def _write_atomic(path: Path, array: np.ndarray) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        np.save(f, array, allow_pickle=False)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


@dataclass
class SamplingStats:
    """What one `sample_split` call did: shards reused and drawn, tokens drawn and the seconds it took."""

    reused: int = 0
    drawn: int = 0
    tokens: int = 0
    seconds: float = 0.0

    @property
    def tokens_per_s(self) -> float | None:
        return self.tokens / self.seconds if self.seconds > 0 else None


def shard_path(directory: Path, index: int) -> Path:
    return directory / f"shard-{index:05d}.npy"


def shard_rows(count: int, shard_size: int) -> list[int]:
    """Rows of each shard: full shards, then the rest."""
    return [min(shard_size, count - i) for i in range(0, count, shard_size)]


def complete(path: Path, rows: int, L: int) -> bool:
    """Whether `path` holds a finished shard of exactly `rows` x `L` (a shard of another size is drawn again: its
    samples would differ from an uninterrupted run's)."""
    try:
        a = np.load(path, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError):
        return False
    return a.shape == (rows, L) and a.dtype == np.int32


def sample_split(model, info: LMInfo, directory: Path, split: str, *, count: int, shard_size: int, max_length: int,
                 seed: int, batch: int, prompts: list[list[int]] | None, device: torch.device, bar,
                 world: distributed.World | None = None) -> SamplingStats:
    """Draw the missing shards of `split` (`count` samples) into `directory`; `bar` (tqdm) advances by samples.
    Generation: `model.generate` in batches of `batch` rows. O(count L) LM steps. With a `world` of W ranks this
    rank draws shards rank, rank + W, ... (each seeded by its index, so the samples do not depend on W)."""
    directory.mkdir(parents=True, exist_ok=True)
    stats = SamplingStats()
    gen_config = _generation_config(info, max_length)
    for index, rows in (world or distributed.World()).mine(enumerate(shard_rows(count, shard_size))):
        path = shard_path(directory, index)
        if complete(path, rows, max_length):
            stats.reused += 1
            bar.update(rows)
            continue
        t0 = time.perf_counter()
        torch.manual_seed(shard_seed(seed, split, index))  # seeds CUDA too
        parts = []
        for b0 in range(0, rows, batch):
            n = min(batch, rows - b0)
            first = index * shard_size + b0  # prompts cycle over the split's rows
            prefixes = [prompts[(first + r) % len(prompts)] for r in range(n)] if prompts else [[info.start_id]] * n
            ids, mask = _left_pad(prefixes, info.eos_ids[0] if info.eos_ids else 0, device)
            with torch.no_grad():
                out = model.generate(input_ids=ids, attention_mask=mask, generation_config=gen_config)
            part = end_samples(out[:, ids.shape[1]:].cpu().numpy(), max_length, info.eos_ids)
            parts.append(part)
            stats.tokens += int((part != PAD).sum())
            bar.update(n)
        _write_atomic(path, np.concatenate(parts))
        stats.drawn += 1
        stats.seconds += time.perf_counter() - t0
    return stats


def _generation_config(info: LMInfo, max_length: int):
    transformers = transformers_quiet()
    pad = info.eos_ids[0] if info.eos_ids else info.start_id
    return transformers.GenerationConfig(do_sample=True, max_new_tokens=max_length, min_new_tokens=0, top_k=0,
                                         top_p=1.0, temperature=1.0, num_beams=1, pad_token_id=pad,
                                         eos_token_id=list(info.eos_ids) or None, use_cache=True)


def read_split(directory: Path, count: int, shard_size: int, max_length: int) -> Iterator[np.ndarray]:
    """The shards of a split, in order, as int32 (rows, L) arrays (memory-mapped)."""
    for index, rows in enumerate(shard_rows(count, shard_size)):
        path = shard_path(directory, index)
        if not complete(path, rows, max_length):
            raise InputError(f"{path}: missing or incomplete sample shard", param="work_dir")
        yield np.load(path, mmap_mode="r", allow_pickle=False)


def hidden_states(model, info: LMInfo, samples: np.ndarray, *, prompts: list[list[int]] | None, first_row: int,
                  batch: int, device: torch.device) -> torch.Tensor:
    """The LM's last hidden state before each sample token, the state that predicts it (as Ctrl-G's LVD takes it):
    (number of tokens, d) float32 on `device`, rows in the order of `samples[samples != PAD]` (row-major).
    `first_row`: the split's index of `samples[0]`, to pick its prompt. One forward pass per batch, O(n L) LM
    positions."""
    out = []
    for b0 in range(0, len(samples), batch):
        block = samples[b0 : b0 + batch]
        lengths = (block != PAD).sum(1)
        rows = []
        for r, (s, n) in enumerate(zip(block, lengths, strict=True)):
            prefix = prompts[(first_row + b0 + r) % len(prompts)] if prompts else [info.start_id]
            rows.append((prefix, [int(t) for t in s[: n - 1]]))
        full = [p + s for p, s in rows]
        width = max(len(x) for x in full)
        ids = torch.tensor([[0] * (width - len(x)) + x for x in full], dtype=torch.long, device=device)
        mask = (torch.arange(width, device=device)[None, :] >= torch.tensor(
            [width - len(x) for x in full], device=device)[:, None]).long()
        kwargs = {}
        if not bool(mask.all()):  # left padding: positions count from each row's first real token
            kwargs["position_ids"] = (mask.cumsum(1) - 1).clamp_min(0)
        with torch.no_grad():
            h = model.base_model(input_ids=ids, attention_mask=mask, **kwargs).last_hidden_state
        for r, (_, s) in enumerate(rows):
            start = width - len(s) - 1  # the position of the prefix's last token
            out.append(h[r, start:].float())
    return torch.cat(out)
