"""Stage `task` of bench/distill.py: a CommonGen-style keyword task with the distilled HMM (see that file)."""

from __future__ import annotations

import datetime as dt
import random
import re
import time
from pathlib import Path

from distill import cpu_name, lm_logprobs, lm_sample, load_lm, log

# ---------------------------------------------------------------- stage 3: the keyword task
STOPWORDS = frozenset("""a about above after again against all also am an and any are as at be because been before
being below between both but by can could did do does doing down during each few for from further had has have having
he her here hers him his how if in into is it its itself just me more most my no nor not now of off on once only or
other our out over own same she should so some such than that the their them then there these they this those through
to too under until up very was we were what when where which while who whom why will with would you your yours said
says say year years one two three four five new last first other many much may might must""".split())
# hmms: the first is the task's HMM (the goals), the others are compared with it
TASK_FULL = {"sets": 100, "budget": 1024, "batch": 256, "max_tokens": 32, "top_words": 1000, "alpha": 1.0,
             "hmms": ["gpt-1024-lvd", "gpt-256-lvd"]}
TASK_TINY = {"sets": 3, "budget": 8, "batch": 8, "max_tokens": 24, "top_words": 200, "alpha": 1.0,
             "hmms": ["gpt-8-lvd", "gpt-8-random"]}


def keyword_sets(n: int, seed: int, top: int) -> list[list[str]]:
    """n sets of 3 or 4 (alternating) distinct content words of one held-out PTB test sentence each (in sentence
    order): lower-case alphabetic words of 3+ letters, not in STOPWORDS, among the `top` most frequent PTB training
    words (CommonGen's concepts are common words). Drawn with `seed`."""
    from collections import Counter

    from latentlm.training.data import ptb_sentences

    freq = Counter(w for s in ptb_sentences("train") for w in s)
    common = {w for w, _ in freq.most_common(top)}
    rng = random.Random(seed)
    sents = ptb_sentences("test")
    rng.shuffle(sents)
    out: list[list[str]] = []
    for s in sents:
        k = 3 + len(out) % 2
        cands = list(dict.fromkeys(w for w in s if w.isalpha() and len(w) >= 3 and w not in STOPWORDS
                                   and w in common))
        if len(cands) >= k:
            keep = set(rng.sample(cands, k))
            out.append([w for w in cands if w in keep])
            if len(out) == n:
                break
    return out


def has_words(text: str, words: list[str]) -> bool:
    """Every word occurs in `text` as a whole word (not inside a longer run of letters, digits or '_')."""
    return all(re.search(rf"(?<!\w){re.escape(w)}(?!\w)", text) for w in words)


def constraint_for(words: list[str], max_tokens: int) -> dict:
    return {"include": [[w] for w in words], "max_tokens": max_tokens}


class Timed:
    """A logits processor wrapped to time its calls."""

    def __init__(self, proc):
        self.proc, self.seconds, self.calls = proc, 0.0, 0

    def __call__(self, input_ids, scores):
        t0 = time.perf_counter()
        out = self.proc(input_ids, scores)
        self.seconds += time.perf_counter() - t0
        self.calls += 1
        return out


def summarize(rows: list[dict], sets: int) -> dict:
    """Success over sets; LM log-likelihood per token (sum over outputs / their tokens, eos counted); ms/token."""
    outs = [r for r in rows if r.get("ok")]
    tok = sum(r["tokens"] for r in outs)
    gen_tok = sum(r.get("generated_tokens", r["tokens"]) for r in rows)
    return {"success": len({r["set"] for r in outs}) / sets, "outputs": len(outs), "tokens": tok,
            "ll_per_token": sum(r["lm_ll"] for r in outs) / tok if tok else None,
            "ms_per_token": 1000 * sum(r["seconds"] for r in rows) / gen_tok if gen_tok else None,
            "setup_s_per_set": sum(r.get("setup_seconds", 0.0) for r in rows) / sets}


def generate_one(model, eos: int, T: int, gen_kw: dict, seed: int, procs: list | None = None,
                 extra: dict | None = None) -> tuple[list[int], float]:
    """One text from `eos` (batch 1), cut after its first eos; and the seconds `generate` took."""
    import torch

    start = torch.full((1, 1), eos, dtype=torch.long)
    torch.manual_seed(seed)
    t0 = time.perf_counter()
    g = model.generate(start, attention_mask=torch.ones_like(start), logits_processor=procs,
                       **{**gen_kw, "max_new_tokens": T, **(extra or {})})
    sec = time.perf_counter() - t0
    ids = g[0, 1:].tolist()
    return (ids[: ids.index(eos) + 1] if eos in ids else ids), sec


def stage_task1(work: Path, tiny: bool, seed: int) -> dict:
    """The same sets cut to their first keyword: a constraint rejection can meet within its budget, so the
    guide's fluency is set against exact samples from the LM given the constraint."""
    return stage_task(work, tiny, seed, one_keyword=True)


def stage_steps(work: Path, tiny: bool, seed: int) -> dict:
    """The guide's step by HMM size and precision (each HMM in float64 and float32), on stage task's sets, without
    rejection: the guide's step reads the HMM's Z x V emissions once per token, so its cost against the LM's step
    is set by their sizes in bytes."""
    return stage_task(work, tiny, seed, steps=True)


def stage_task(work: Path, tiny: bool, seed: int, one_keyword: bool = False, steps: bool = False) -> dict:
    import torch
    from tokenizers import Tokenizer

    from latentlm import ops
    from latentlm.ops import constrain
    from latentlm.ops.guide import ConstraintLogitsProcessor

    cfg = dict(TASK_TINY if tiny else TASK_FULL)
    if one_keyword:
        cfg.update(one_keyword=True, budget=cfg["budget"] // 4)
    if steps:  # name@dtype: each HMM in both precisions
        cfg.update(steps=True, budget=0, hmms=[f"{n}@{d}" for n in cfg["hmms"] for d in ("float64", "float32")])
    lm_dir = work / "lm"
    model, eos = load_lm(lm_dir)
    tok = Tokenizer.from_file(str(lm_dir / "tokenizer.json"))

    def text(ids: list[int]) -> str:
        return tok.decode([i for i in ids if i != eos], skip_special_tokens=True)

    def row(i: int, ids: list[int], sec: float, words: list[str], **more) -> dict:
        t = text(ids)
        return {"set": i, "ids": ids, "text": t, "ok": has_words(t, words), "tokens": len(ids), "seconds": sec,
                "lm_ll": lm_logprobs(model, eos, [ids])[0], **more}

    hmms = {spec: ops.load_model(work / "store", spec.partition("@")[0], dtype=spec.partition("@")[2] or "float64")
            for spec in cfg["hmms"]}
    sets = keyword_sets(cfg["sets"], seed, cfg["top_words"])
    if one_keyword:
        sets = [s[:1] for s in sets]
    T = cfg["max_tokens"]
    rows: dict[str, list[dict]] = {"lm": [], "reject": [], **{f"{k}:{n}": [] for n in hmms for k in ("guide", "hmm")}}
    steps = {n: {"seconds": 0.0, "calls": 0} for n in hmms}
    gen_kw = {"do_sample": True, "top_k": 0, "top_p": 1.0, "eos_token_id": eos, "pad_token_id": eos}
    alpha = {"alpha": cfg["alpha"]} if cfg["alpha"] != 1.0 else {}
    lm_sample(model, eos, 2, T, 1, seed)  # warm-up: the first generate call pays one-time costs
    for i, words in enumerate(sets):
        c = constraint_for(words, T)
        with torch.no_grad():
            # the LM alone, one text at batch 1: the plain step the guide is compared with
            ids, sec = generate_one(model, eos, T, gen_kw, seed + i)
            rows["lm"].append({**row(i, ids, sec, words), "ok": True})
            # (a) rejection: `budget` LM samples in batches; accepted: complete (ended by eos, as the constraint's
            # event) and every keyword a whole word
            acc = []
            if cfg["budget"]:
                samples, sec = lm_sample(model, eos, cfg["budget"], T, cfg["batch"], seed * 1000 + i)
                acc = [s for s in samples if s[-1] == eos and has_words(text(s), words)]
                gen_tok = sum(map(len, samples))
                for k, s in enumerate(acc):
                    rows["reject"].append({**row(i, s, sec if k == 0 else 0.0, words),
                                           "generated_tokens": gen_tok if k == 0 else 0})
                if not acc:
                    rows["reject"].append({"set": i, "ok": False, "tokens": 0, "seconds": sec,
                                           "generated_tokens": gen_tok})
            for name, hmm in hmms.items():
                # (b) the LM + the guide
                t0 = time.perf_counter()
                proc = ConstraintLogitsProcessor(hmm, c, **alpha)
                setup = time.perf_counter() - t0
                timed = Timed(proc)
                ids, sec = generate_one(model, eos, T, gen_kw, seed + i, [timed], proc.generate_kwargs())
                steps[name]["seconds"] += timed.seconds
                steps[name]["calls"] += timed.calls
                rows[f"guide:{name}"].append(row(i, ids, sec, words, setup_seconds=setup))
                # (c) the HMM alone, exact constrained sampling
                t0 = time.perf_counter()
                dfa = constrain.compile_for(hmm, c, constrain.Limits())
                constrain.MESSAGES.get(hmm, dfa, 1.0, constrain.Limits())  # the backward messages, cached
                setup = time.perf_counter() - t0
                t0 = time.perf_counter()
                draw = constrain.sample(hmm, dfa, n=1, seed=seed + i, prefix=None)[0]
                rows[f"hmm:{name}"].append(row(i, list(draw["ids"]), time.perf_counter() - t0, words,
                                               setup_seconds=setup))
        first = f"guide:{cfg['hmms'][0]}"
        log(f"set {i} {words}: reject {len(acc)}/{cfg['budget']}, guide {rows[first][-1]['ok']} "
            f"{rows[first][-1]['text']!r}, hmm {rows['hmm:' + cfg['hmms'][0]][-1]['ok']}")
    summary = {k: summarize(v, len(sets)) for k, v in rows.items()}
    draws = cfg["budget"] * len(sets)
    summary["reject"]["accept_rate"] = sum(1 for r in rows["reject"] if r["ok"]) / draws if draws else None
    accepted = {r["set"] for r in rows["reject"] if r["ok"]}  # the sets rejection solved: (b), (c) on them alone
    for k in rows:
        if k.startswith(("guide:", "hmm:")):
            same = [r for r in rows[k] if r["ok"] and r["set"] in accepted]
            n = sum(r["tokens"] for r in same)
            summary[k]["ll_per_token_on_rejection_sets"] = sum(r["lm_ll"] for r in same) / n if n else None
    lm_step = summary["lm"]["ms_per_token"]
    a = summary["reject"]["ll_per_token"]
    goals = {}
    for name in hmms:
        g = summary[f"guide:{name}"]
        b = g["ll_per_token"]
        goals[name] = {"guide_success_100": g["success"] == 1.0,
                       "ll_gap": None if a is None or b is None else (b - a) / abs(a),
                       "ll_within_10pct": None if a is None or b is None else abs(b - a) <= 0.1 * abs(a),
                       "guided_over_plain_step": g["ms_per_token"] / lm_step,
                       "guide_step_ms": 1000 * steps[name]["seconds"] / max(1, steps[name]["calls"]),
                       "step_within_2x": g["ms_per_token"] / lm_step <= 2.0}
    return {"settings": cfg, "sets": sets, "summary": summary, "goals": goals, "rows": rows,
            "hmm_states": {n: h.impl.num_states for n, h in hmms.items()}, "cpu": cpu_name(),
            "date": dt.datetime.now().isoformat(timespec="seconds")}
