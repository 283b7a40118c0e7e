"""Distilling HMMs from a language model, end to end on a CPU: train a small GPT-2-style LM with its own BPE
tokenizer on Penn Treebank text, distil dense HMMs from it with `latentlm distill`, and run a CommonGen-style
keyword task (LM alone with rejection sampling, LM + the HMM guide, the HMM alone, constrained).

    python bench/distill.py lm|distill|task|task1|steps|report|all [--work DIR] [--tiny] [--out FILE]
                            [--runs Z:lvd|random[:minutes[:em_steps]],...] [--force STAGE] [--seed S]

Stages: `lm` trains the LM (time-limited) and saves it with its tokenizer (save_pretrained); `distill` measures
the LM's sampling speed, runs `latentlm distill` once per HMM (subprocesses sharing one set of sample shards) and
scores fresh LM samples by the LM, each HMM and a unigram; `task` is the keyword task (bench/distill_task.py),
`task1` the same sets cut to one keyword, `steps` the guide's step by HMM size and precision; `report` writes the
results (bench/distill_report.py).

Each stage caches its output under --work (default ~/.cache/latentlm/bench-distill/, `--tiny`:
.../bench-distill-tiny/), so a rerun skips finished stages (`--force STAGE` reruns one). The stages run with one
torch thread (OMP_NUM_THREADS=1 unless set): the bench shares a 2-core VM. `report` writes the results file
(default bench/results/distill.md; `--tiny` writes nothing unless --out is given).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import platform
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

EOS = "<|endoftext|>"
ROOT = Path(__file__).resolve().parent.parent

# LM settings: (layers, width, heads, context, vocab, batch, minutes, valid tokens evaluated during training)
LM_FULL = {"layers": 4, "width": 256, "heads": 4, "context": 64, "vocab": 6000, "batch": 32, "minutes": 18.0,
           "lr": 1e-3, "eval_every_s": 120.0, "eval_tokens": 16384}
LM_TINY = {"layers": 1, "width": 32, "heads": 2, "context": 32, "vocab": 400, "batch": 8, "minutes": 0.05,
           "lr": 3e-3, "eval_every_s": 1.0, "eval_tokens": 1024, "train_sentences": 2000}


def cpu_name() -> str:
    """The lscpu model name (the VM's), else platform.processor()."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
        for line in out.splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def write_json(path: Path, obj: Any) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1, sort_keys=False))
    tmp.replace(path)


def log(msg: str) -> None:
    print(f"[{dt.datetime.now():%H:%M:%S}] {msg}", flush=True)


# ---------------------------------------------------------------- text
_CONTRACTIONS = ("'s", "n't", "'re", "'ll", "'ve", "'d", "'m")


def detokenize(words: list[str]) -> str:
    """PTB (Mikolov) word tokens -> plain text: contractions and possessives re-attached ("do n't" -> "don't",
    "today 's" -> "today's"), "$ N" -> "$N", "N %" ... PTB has no '%' (it spells "N N"); `<unk>` and `N` are
    kept as the literal strings "<unk>" and "N" (the tokenizer learns them as ordinary text; the keyword task
    never picks them). The text is lower-case as PTB is."""
    out: list[str] = []
    for w in words:
        if out and (w in _CONTRACTIONS or w == "'"):
            out[-1] += w
        elif out and out[-1] == "$":
            out[-1] += w
        else:
            out.append(w)
    return " ".join(out)


def ptb_texts(split: str) -> list[str]:
    from latentlm.training.data import ptb_sentences

    return [detokenize(s) for s in ptb_sentences(split)]


# ---------------------------------------------------------------- stage 1: the LM
def train_tokenizer(texts: list[str], vocab: int):
    """A byte-level BPE (GPT-2's pre-tokeniser and decoder) with `<|endoftext|>` as its only special token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=[EOS], min_frequency=2,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def encode_stream(tok, texts: list[str]) -> list[int]:
    """Every sentence followed by the eos id, concatenated (the LM learns to start a sentence after eos)."""
    eos = tok.token_to_id(EOS)
    ids: list[int] = [eos]
    for enc in tok.encode_batch(texts, add_special_tokens=False):
        ids.extend(enc.ids)
        ids.append(eos)
    return ids


def lm_eval(model, stream, context: int, max_tokens: int | None = None, batch: int = 32) -> float:
    """Mean next-token NLL (nats) over non-overlapping windows of `context` tokens of `stream` (a 1-D tensor)."""
    import torch

    n = (len(stream) - 1) // context
    if max_tokens is not None:
        n = min(n, max(1, max_tokens // context))
    x = stream[: n * context + 1]
    inp = x[:-1].view(n, context)
    tgt = x[1:].view(n, context)
    model.eval()
    tot = 0.0
    with torch.no_grad():
        for i in range(0, n, batch):
            logits = model(input_ids=inp[i:i + batch]).logits
            tot += float(torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                           tgt[i:i + batch].reshape(-1), reduction="sum"))
    model.train()
    return tot / (n * context)


def stage_lm(work: Path, tiny: bool, seed: int) -> dict:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

    cfg = dict(LM_TINY if tiny else LM_FULL)
    torch.manual_seed(seed)
    random.seed(seed)
    t0 = time.perf_counter()
    train_txt, valid_txt = ptb_texts("train"), ptb_texts("valid")
    if tiny:
        train_txt = train_txt[: cfg["train_sentences"]]
        valid_txt = valid_txt[:200]
    tok = train_tokenizer(train_txt, cfg["vocab"])
    t_tok = time.perf_counter() - t0
    train = torch.tensor(encode_stream(tok, train_txt), dtype=torch.long)
    valid = torch.tensor(encode_stream(tok, valid_txt), dtype=torch.long)
    log(f"tokenizer: {tok.get_vocab_size()} ids, train {len(train)} tokens, valid {len(valid)} tokens "
        f"({t_tok:.1f}s)")
    eos = tok.token_to_id(EOS)
    config = GPT2Config(vocab_size=tok.get_vocab_size(), n_positions=cfg["context"], n_embd=cfg["width"],
                        n_layer=cfg["layers"], n_head=cfg["heads"], bos_token_id=eos, eos_token_id=eos)
    model = GPT2LMHeadModel(config)
    n_params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], betas=(0.9, 0.95), weight_decay=0.1)
    C, B = cfg["context"], cfg["batch"]
    budget = cfg["minutes"] * 60.0
    warmup = 50
    n_windows = (len(train) - 1) // C
    curve: list[dict] = []
    step, tokens_seen, epoch = 0, 0, 0
    order = torch.randperm(n_windows)
    pos = 0
    t_start = time.perf_counter()
    last_eval = t_start
    run_loss, run_n = 0.0, 0
    while True:
        elapsed = time.perf_counter() - t_start
        if elapsed >= budget:
            break
        frac = elapsed / budget
        lr = cfg["lr"] * min(1.0, (step + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
        for g in opt.param_groups:
            g["lr"] = lr
        if pos + B > n_windows:
            order, pos, epoch = torch.randperm(n_windows), 0, epoch + 1
        idx = order[pos:pos + B] * C
        pos += B
        xb = torch.stack([train[i:i + C + 1] for i in idx.tolist()])
        logits = model(input_ids=xb[:, :-1]).logits  # the loss over all C next tokens (HF's `labels` drops one)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), xb[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        tokens_seen += B * C
        run_loss += float(loss.detach())
        run_n += 1
        now = time.perf_counter()
        if now - last_eval >= cfg["eval_every_s"]:
            v = lm_eval(model, valid, C, cfg["eval_tokens"])
            curve.append({"step": step, "seconds": round(now - t_start, 1), "tokens": tokens_seen,
                          "train_loss": run_loss / run_n, "valid_loss_subset": v, "lr": lr})
            log(f"step {step} {now - t_start:.0f}s train {run_loss / run_n:.3f} valid(sub) {v:.3f} "
                f"ppl {math.exp(v):.1f}")
            run_loss, run_n = 0.0, 0
            last_eval = time.perf_counter()
    train_seconds = time.perf_counter() - t_start
    t_ev = time.perf_counter()
    valid_loss = lm_eval(model, valid, C)
    eval_seconds = time.perf_counter() - t_ev
    log(f"done: {step} steps, {train_seconds:.0f}s, valid loss {valid_loss:.4f} ppl {math.exp(valid_loss):.2f}")
    lm_dir = work / "lm"
    model.eval()
    model.save_pretrained(lm_dir)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, bos_token=EOS, unk_token=None,
                                   pad_token=EOS)
    fast.save_pretrained(lm_dir)
    res = {
        "settings": cfg, "seed": seed, "parameters": n_params,
        "vocab_size": tok.get_vocab_size(), "eos_id": eos,
        "train_tokens": len(train), "valid_tokens": len(valid),
        "train_words": sum(len(t.split()) for t in train_txt), "valid_words": sum(len(t.split()) for t in valid_txt),
        "steps": step, "tokens_seen": tokens_seen, "epochs": tokens_seen / len(train),
        "train_seconds": train_seconds, "tokenizer_seconds": t_tok, "eval_seconds": eval_seconds,
        "valid_loss": valid_loss, "valid_ppl_token": math.exp(valid_loss),
        "valid_ppl_word": math.exp(valid_loss * len(valid) / (sum(len(t.split()) for t in valid_txt)
                                                              + len(valid_txt))),
        "curve": curve, "cpu": cpu_name(), "threads": torch.get_num_threads(), "torch": torch.__version__,
        "date": dt.datetime.now().isoformat(timespec="seconds"), "dir": str(lm_dir),
    }
    return res


# ---------------------------------------------------------------- shared measurements
def load_lm(lm_dir: Path):
    """(model, eos id) of a save_pretrained directory, in eval mode."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(lm_dir)
    model.eval()
    return model, AutoTokenizer.from_pretrained(lm_dir).eos_token_id


def lm_sample(model, eos: int, n: int, max_new: int, batch: int, seed: int) -> tuple[list[list[int]], float]:
    """n samples of up to max_new tokens after `eos` (plain ancestral sampling: no top-k/top-p), each cut after its
    first eos (kept); and the seconds taken. O(n max_new) LM steps in batches."""
    import torch

    torch.manual_seed(seed)
    out: list[list[int]] = []
    t0 = time.perf_counter()
    with torch.no_grad():
        for i in range(0, n, batch):
            b = min(batch, n - i)
            inp = torch.full((b, 1), eos, dtype=torch.long)
            gen = model.generate(inp, attention_mask=torch.ones_like(inp), do_sample=True, top_k=0, top_p=1.0,
                                 max_new_tokens=max_new, eos_token_id=eos, pad_token_id=eos)
            for row in gen[:, 1:].tolist():
                out.append(row[: row.index(eos) + 1] if eos in row else row)
    return out, time.perf_counter() - t0


def lm_logprobs(model, eos: int, seqs: list[list[int]], batch: int = 64) -> list[float]:
    """log p_LM(seq | eos) per sequence (natural log; the LM's prefix probability when seq does not end in eos)."""
    import torch

    out: list[float] = []
    with torch.no_grad():
        for i in range(0, len(seqs), batch):
            chunk = seqs[i:i + batch]
            L = max(len(s) for s in chunk)
            ids = torch.full((len(chunk), L + 1), eos, dtype=torch.long)
            mask = torch.zeros((len(chunk), L), dtype=torch.bool)
            for r, s in enumerate(chunk):
                ids[r, 1:1 + len(s)] = torch.tensor(s, dtype=torch.long)
                mask[r, :len(s)] = True
            logp = model(input_ids=ids[:, :-1]).logits.double().log_softmax(-1)
            tok = logp.gather(2, ids[:, 1:, None])[..., 0]
            out.extend((tok * mask).sum(1).tolist())
    return out


def hmm_logprobs(start, trans, emit, seqs: list[list[int]], batch: int = 512) -> list[float]:
    """log p_HMM(seq) per sequence by a scaled forward pass in float64 (prefix probability: no end term, as for the
    LM; a sequence ending in eos has eos as its last emitted token). start (Z,), trans (Z, Z), emit (Z, V).
    O(len Z^2) per sequence."""
    import torch

    start, trans = start.double(), trans.double()
    emit_t = emit.double().T.contiguous()
    out: list[float] = []
    for i in range(0, len(seqs), batch):
        chunk = seqs[i:i + batch]
        T = max(len(s) for s in chunk)
        lens = torch.tensor([len(s) for s in chunk])
        ids = torch.zeros((len(chunk), T), dtype=torch.long)
        for r, s in enumerate(chunk):
            ids[r, :len(s)] = torch.tensor(s, dtype=torch.long)
        alpha = start[None, :] * emit_t[ids[:, 0]]
        c = alpha.sum(1)
        ll = c.log()
        alpha = alpha / c[:, None]
        for t in range(1, T):
            new = (alpha @ trans) * emit_t[ids[:, t]]
            c = new.sum(1)
            live = t < lens
            ll = torch.where(live, ll + c.clamp_min(1e-300).log(), ll)
            alpha = torch.where(live[:, None], new / c.clamp_min(1e-300)[:, None], alpha)
        out.extend(ll.tolist())
    return out


def unigram_logprobs(train: list[list[int]], seqs: list[list[int]], vocab: int, add: float = 0.5) -> list[float]:
    """log p(seq) under the add-`add` unigram of `train`'s tokens (eos included)."""
    counts = [add] * vocab
    for s in train:
        for t in s:
            counts[t] += 1
    total = sum(counts)
    logp = [math.log(c / total) for c in counts]
    return [sum(logp[t] for t in s) for s in seqs]


def gemm_gflops(m: int, k: int, n: int, repeats: int = 5) -> float:
    """float32 torch.mm (m, k) @ (k, n) rate in this process (best of `repeats`), GFLOP/s."""
    import torch

    a, b = torch.randn(m, k), torch.randn(k, n)
    torch.mm(a, b)
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - t0)
    return 2 * m * k * n / best / 1e9


# ---------------------------------------------------------------- stage 2: distillation
# (states, init, extra CLI options) per run; the samples are shared: each run's --work-dir links `samples` to one
# directory (the CLI keys its shards by LM, length, seed, shard size and batch, so every run reads the same)
DISTILL_FULL = {"samples": 50_000, "max_length": 32, "eval": 2_000, "unigram": 50_000, "em_steps": 10,
                "common": ["--sample-batch", "256"], "runs": "256:lvd,256:random,1024:lvd:75:20"}
DISTILL_TINY = {"samples": 300, "max_length": 12, "eval": 50, "unigram": 300, "em_steps": 3,
                "common": ["--lvd-samples", "100", "--valid-samples", "100"], "runs": "8:lvd,8:random"}


def parse_runs(spec: str) -> list[tuple[int, str, list[str]]]:
    """"Z:init[:minutes[:em_steps]],..." -> [(states, init, extra CLI options)]: minutes -> --time-limit (empty:
    none), em_steps -> --em-steps (else the stage's default)."""
    out = []
    for part in spec.split(","):
        f = part.strip().split(":")
        if not 2 <= len(f) <= 4 or f[1] not in ("lvd", "random") or not f[0].isdigit() \
                or not all(x.isdigit() for x in f[2:] if x):
            raise SystemExit(f"--runs: expected Z:lvd|random[:minutes[:em_steps]], got {part!r}")
        extra = ["--time-limit", f[2]] if len(f) >= 3 and f[2] else []
        out.append((int(f[0]), f[1], extra + (["--em-steps", f[3]] if len(f) == 4 else [])))
    return out


def latentlm_cmd() -> list[str]:
    exe = Path(sys.executable).with_name("latentlm")
    return [str(exe)] if exe.exists() else [sys.executable, "-c", "import sys; from latentlm.cli import main; "
                                            "sys.exit(main())"]


def run_distill(work: Path, lm_dir: Path, states: int, init: str, extra: list[str], cfg: dict, seed: int) -> dict:
    """One `latentlm distill` subprocess (one thread), cached in distill-<name>.json; its output in <name>.log."""
    name = f"gpt-{states}-{init}"
    path = work / f"distill-{name}.json"
    if path.exists():
        return json.loads(path.read_text())
    run_dir = work / "runs" / name
    run_dir.mkdir(parents=True, exist_ok=True)
    (work / "samples").mkdir(exist_ok=True)
    if not (run_dir / "samples").exists():
        (run_dir / "samples").symlink_to(work / "samples", target_is_directory=True)
    steps = [] if "--em-steps" in extra else ["--em-steps", str(cfg["em_steps"])]
    cmd = [*latentlm_cmd(), "distill", "--lm", str(lm_dir), "--name", name, "--store", str(work / "store"),
           "--states", str(states), "--samples", str(cfg["samples"]), "--max-length", str(cfg["max_length"]),
           "--seed", str(seed), "--init", init, *steps, "--work-dir", str(run_dir), "--no-progress",
           *cfg["common"], *extra]
    log(f"distill: {' '.join(cmd)}")
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    t0 = time.perf_counter()
    started = dt.datetime.now().isoformat(timespec="seconds")
    with open(work / f"{name}.log", "w") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, check=False).returncode
    wall = time.perf_counter() - t0
    text = (work / f"{name}.log").read_text(errors="replace")
    res = {"name": name, "states": states, "init": init, "command": " ".join(cmd), "rc": rc, "wall_seconds": wall,
           "started": started, "log_tail": text[-3000:]}
    manifest = work / "store" / name / "manifest.json"
    if rc == 0 and manifest.exists():
        res["provenance"] = json.loads(manifest.read_text()).get("provenance", {})
    log(f"distill {name}: rc {rc}, {wall:.0f}s")
    record_run(work, {"stage": f"distill {name}", "command": " ".join(cmd), "started": started, "ok": rc == 0,
                      "seconds": wall, "error": None if rc == 0 else text.strip().splitlines()[-1:]})
    if rc != 0:  # a failed run is recorded, not cached: the next call tries again
        return res
    write_json(path, res)
    return res


def read_shards(work: Path, limit: int) -> list[list[int]]:
    """Up to `limit` distillation training samples from the CLI's shard files (.npy int32 [n, L], -1 padding)."""
    import numpy as np

    out: list[list[int]] = []
    for f in sorted((work / "samples").glob("*/train/*.npy")):
        for row in np.load(f, allow_pickle=False):
            out.append([int(t) for t in row if t >= 0])
            if len(out) >= limit:
                return out
    return out


def stage_distill(work: Path, tiny: bool, seed: int, runs: str | None = None) -> dict:
    import torch

    from latentlm import ops

    cfg = dict(DISTILL_TINY if tiny else DISTILL_FULL)
    if runs:
        cfg["runs"] = runs
    lm_dir = work / "lm"
    model, eos = load_lm(lm_dir)
    V = model.config.vocab_size
    L = cfg["max_length"]
    # the LM's sampling speed in this process, by batch size (one thread)
    speed = []
    for b in ((16, 64) if tiny else (64, 256, 1024)):
        seqs, sec = lm_sample(model, eos, b, L, b, seed + 7)
        speed.append({"batch": b, "sequences": len(seqs), "tokens": sum(map(len, seqs)), "seconds": sec,
                      "tokens_per_s": sum(map(len, seqs)) / sec})
        log(f"sampling: batch {b}: {speed[-1]['tokens_per_s']:.0f} tokens/s")
    runs = [run_distill(work, lm_dir, Z, init, extra, cfg, seed) for Z, init, extra in parse_runs(cfg["runs"])]
    # fresh LM samples (a seed the CLI never uses), scored by the LM, each HMM and a unigram
    eval_path = work / "eval_samples.json"
    if eval_path.exists():
        fresh = json.loads(eval_path.read_text())
    else:
        fresh, _ = lm_sample(model, eos, cfg["eval"], L, 256, seed + 1_000_003)
        write_json(eval_path, fresh)
    n_tok = sum(map(len, fresh))
    lm_ll = sum(lm_logprobs(model, eos, fresh))
    uni_train = read_shards(work, cfg["unigram"])
    uni_source = "the distillation's own training samples"
    if len(uni_train) < cfg["unigram"] // 2:
        uni_train, _ = lm_sample(model, eos, cfg["unigram"], L, 256, seed + 2_000_003)
        uni_source = "LM samples drawn for it"
    uni_ll = sum(unigram_logprobs(uni_train, fresh, V))
    evals = {"sequences": len(fresh), "tokens": n_tok, "lm_ppl": math.exp(-lm_ll / n_tok),
             "unigram_ppl": math.exp(-uni_ll / n_tok), "unigram_sequences": len(uni_train),
             "unigram_source": uni_source, "hmm": {}}
    for r in runs:
        if r["rc"] != 0:
            continue
        hmm = ops.load_model(work / "store", r["name"], dtype="float64")
        t0 = time.perf_counter()
        ll = sum(hmm_logprobs(hmm.impl.start, hmm.impl.trans, hmm.impl.emit, fresh))
        evals["hmm"][r["name"]] = {"ppl": math.exp(-ll / n_tok), "seconds": time.perf_counter() - t0}
        log(f"eval {r['name']}: ppl {evals['hmm'][r['name']]['ppl']:.2f} (LM {evals['lm_ppl']:.2f}, "
            f"unigram {evals['unigram_ppl']:.2f})")
    # the GEMM rate at each size's EM shapes (a batch of rows against the Z x Z transition), this process
    gemm = {Z: gemm_gflops(1024, Z, Z) for Z in sorted({r[0] for r in parse_runs(cfg["runs"])})}
    return {"settings": cfg, "sampling": speed, "runs": runs, "eval": evals, "gemm_gflops": gemm,
            "torch_threads": torch.get_num_threads(), "cpu": cpu_name(),
            "date": dt.datetime.now().isoformat(timespec="seconds")}


# ---------------------------------------------------------------- driver
STAGES = ("lm", "distill", "task", "task1", "steps")


def run_stage(name: str, work: Path, args) -> dict:
    path = work / f"{name}.json"
    if path.exists() and name not in (args.force or []):
        log(f"{name}: cached ({path})")
        return json.loads(path.read_text())
    log(f"{name}: running")
    t0 = time.perf_counter()
    if name in ("task", "task1", "steps"):
        import distill_task

        fn = getattr(distill_task, f"stage_{name}")
    else:
        fn = {"lm": stage_lm, "distill": stage_distill}[name]
    command = " ".join(["python", *sys.argv])
    started = dt.datetime.now().isoformat(timespec="seconds")
    try:
        res = fn(work, args.tiny, args.seed, **({"runs": args.runs} if name == "distill" else {}))
    except BaseException as e:
        record_run(work, {"stage": name, "command": command, "started": started, "ok": False,
                          "seconds": time.perf_counter() - t0, "error": f"{type(e).__name__}: {e}"[:500]})
        raise
    res["stage_seconds"] = time.perf_counter() - t0
    res["command"] = command
    write_json(path, res)
    record_run(work, {"stage": name, "command": command, "started": started, "ok": True,
                      "seconds": res["stage_seconds"]})
    return res


def record_run(work: Path, entry: dict) -> None:
    """Every stage run, good or bad, one JSON line in <work>/runs.jsonl (the results file lists them)."""
    with open(work / "runs.jsonl", "a") as f:
        f.write(json.dumps(entry) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("stage", choices=[*STAGES, "report", "all"])
    ap.add_argument("--work", type=Path, default=None)
    ap.add_argument("--tiny", action="store_true", help="small settings, seconds per stage (tests)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--force", action="append", choices=STAGES, help="rerun this stage even if cached")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--runs", default=None, help="distill: Z:lvd|random[:minutes],... (default: the stage's list); "
                    "runs already made are reused, so a longer list adds runs")
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    work = args.work or Path.home() / ".cache" / "latentlm" / ("bench-distill-tiny" if args.tiny else "bench-distill")
    work.mkdir(parents=True, exist_ok=True)
    stages = STAGES if args.stage == "all" else (() if args.stage == "report" else (args.stage,))
    for s in stages:
        run_stage(s, work, args)
    if args.stage in ("report", "all"):
        from distill_report import report

        out = args.out or (None if args.tiny else ROOT / "bench" / "results" / "distill.md")
        text = report(work)
        if out is None:
            print(text)
        else:
            out.write_text(text)
            log(f"report: {out}")
    return 0


if __name__ == "__main__":
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):  # before torch loads (every import of it is lazy)
        os.environ.setdefault(var, "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.modules.setdefault("distill", sys.modules["__main__"])  # distill_task / distill_report import it by name
    sys.exit(main())
