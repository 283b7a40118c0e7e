"""`latentlm train --family pcfg`: unsupervised maximum likelihood for the rank-space PCFG (Yang et al. 2022,
§4.2 with the App. A neural parameterization), by gradient descent through the rank-space inside pass of
`models.tree` (the same code that serves the exported model).

Parameterization (App. A; h = --hidden): symbol embeddings w_l = [w_n; w_t] (NT + PT, h), rank embeddings
u_H (r, h) shared by U, V and W, word embeddings u_E (V, h), residual MLPs h(x) = g1(g2(W x)) with
g(y) = ReLU(V ReLU(U y)) + y:
    s = softmax_S(u_S . h1(w_l))  (the start rule over all symbols: preterminals give one-word sentences)
    E = softmax_V(u_E h2(w_t))    U = softmax_r(u_H f1(w_n))
    V = softmax_S(u_H f2(w_l))    W = softmax_S(u_H f3(w_l))
Adam (beta 0.75, 0.999), lr 2e-3 (App. D), gradient-norm clip 3, length-bucketed batches (one length per
batch, so charts need no padding), training sentences of at most `--max-length` 40 words (TN-PCFG's
setting; validation uses every sentence). Sentences carry no `<eos>`: a PCFG's p(x) already includes
where the sentence stops. Export: factors plus the cached rank-space products (H, I, J, K, L).
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from latentlm.models.errors import InputError
from latentlm.models.pcfg import RankPCFG, pcfg_tensors
from latentlm.models.registry import save_artifact
from latentlm.models.tree import inside
from latentlm.models.vocab import Preprocessing, Vocabulary
from latentlm.training import common, distributed
from latentlm.training.neural import YangRes
from latentlm.training.recipes import trainer

if TYPE_CHECKING:
    from latentlm.training.options import TrainSettings

TRAIN_MAX_LENGTH = 40  # words of the longest training sentence (TN-PCFG's setting); validation uses every one


class NeuralPCFG(nn.Module):
    """App. A parameterization -> factors (start (S,), parent (NT, r), left (r, S), right (r, S), emit (PT, V)).
    O(S r h + PT V h) per call."""

    def __init__(self, nt: int, pt: int, r: int, V: int, h: int):
        super().__init__()
        self.nt, self.pt = nt, pt
        self.sym = nn.Parameter(torch.empty(nt + pt, h))
        self.rank = nn.Parameter(torch.empty(r, h))
        self.h_start, self.h_emit = YangRes(h), YangRes(h)
        self.f_parent, self.f_left, self.f_right = YangRes(h), YangRes(h), YangRes(h)
        self.u_start = nn.Linear(h, 1)
        self.u_emit = nn.Linear(h, V)
        for p in self.parameters():
            if p.dim() > 1:
                nn.init.xavier_normal_(p)

    def forward(self) -> dict[str, Tensor]:
        nts, pts = self.sym[: self.nt], self.sym[self.nt :]
        return {"start": self.u_start(self.h_start(self.sym)).squeeze(-1).softmax(0),
                "parent": (self.f_parent(nts) @ self.rank.T).softmax(1),
                "left": (self.rank @ self.f_left(self.sym).T).softmax(1),
                "right": (self.rank @ self.f_right(self.sym).T).softmax(1),
                "emit": self.u_emit(self.h_emit(pts)).softmax(1)}


def grammar(net: NeuralPCFG, dtype: torch.dtype = torch.float32) -> RankPCFG:
    """The current parameters as a (differentiable) rank-space PCFG."""
    f = {k: v.to(dtype) for k, v in net().items()}
    t, cfg = pcfg_tensors(**f)
    return RankPCFG(t, cfg)


def length_batches(seqs: list[list[int]], batch: int, generator: torch.Generator | None) -> list[list[int]]:
    """Indices of equal-length sentences in chunks of <= `batch`, in random order when `generator` is given."""
    by_n: dict[int, list[int]] = {}
    for i, s in enumerate(seqs):
        by_n.setdefault(len(s), []).append(i)
    out = [idx[j : j + batch] for n in sorted(by_n) for idx in [by_n[n]] for j in range(0, len(idx), batch)]
    if generator is not None:
        out = [out[i] for i in torch.randperm(len(out), generator=generator).tolist()]
    return out


def corpus_logprob(model: RankPCFG, seqs: list[list[int]], batch: int = 256) -> float:
    """Sum of log p(x) over sentences (no grad), batched by length."""
    total = 0.0
    with torch.no_grad():
        for idx in length_batches(seqs, batch, None):
            ids = torch.as_tensor([seqs[i] for i in idx], dtype=torch.long, device=model.device)
            total += float(inside(model, ids).double().sum())
    return total


def load_data(ns: TrainSettings) -> tuple[Vocabulary, list[list[int]], list[list[int]]]:
    """PTB (Mikolov split, lower-cased, no punctuation, 10k words incl. <unk>) or text files, without <eos>."""
    from latentlm.training.data import build_vocab, encode_corpus, ptb_sentences, read_text_files

    pre = Preprocessing(lowercase=ns.lowercase, unk="<unk>", eos=None, add_eos=False)
    if list(ns.data) == ["ptb"]:
        train_s, valid_s = ptb_sentences("train"), ptb_sentences("valid")
        vocab = build_vocab(train_s, preprocessing=pre)
    else:
        sents = read_text_files(ns.data, lowercase=pre.lowercase)
        train_s = [s for i, s in enumerate(sents) if i % 20 != 19]
        valid_s = [s for i, s in enumerate(sents) if i % 20 == 19] or train_s[-1:]
        vocab = build_vocab(train_s, min_count=ns.min_count, max_size=ns.max_vocab, preprocessing=pre)
    train, valid = encode_corpus(train_s, vocab), encode_corpus(valid_s, vocab)
    return vocab, train[: ns.train_sentences or None], valid[: ns.valid_sentences or None]


@trainer("pcfg", data_parallel=True)
def train(ns: TrainSettings) -> Path:
    """Train, checkpoint every epoch, export `ns.name` into `ns.store`; returns the artifact directory. The sizes
    and the optimiser's settings come validated, with the recipe's defaults (`RankPCFG.recipes`); a resumed run
    must have its checkpoint's sizes (`common.check_resume`). Under torchrun each rank takes its rows of every
    batch, the gradients are summed, rank 0 evaluates and writes."""
    common.check_resume(ns)
    world = distributed.world(ns.device)
    gen = common.seed_all(ns.seed)
    device = world.device
    vocab, train_ids, valid_ids = load_data(ns)
    train_ids = [s for s in train_ids if 1 <= len(s) <= TRAIN_MAX_LENGTH]
    if not train_ids:
        raise InputError(f"data: no training sentences of 1..{TRAIN_MAX_LENGTH} words", param="data")
    net = NeuralPCFG(ns.nt, ns.pt, ns.rank, len(vocab), ns.hidden).to(device)
    opt = torch.optim.Adam(net.parameters(), lr=ns.lr, betas=(0.75, 0.999))
    history, epoch0, step = common.History(), 0, 0
    ckdir = common.checkpoint_dir(ns.store, ns.name)
    if ns.resume:
        tensors, state = common.load_checkpoint(ckdir)
        net.load_state_dict({k[4:]: v for k, v in tensors.items() if k.startswith("net.")})
        common.restore_optimizer(opt, tensors, state["optimizer"])
        history, epoch0, step = common.History.from_json(state["history"]), state["epoch"], state["step"]
    N = common.num_tokens(train_ids)
    bar = common.Progress(N * max(ns.epochs - epoch0, 0), f"pcfg NT={ns.nt} PT={ns.pt} r={ns.rank}",
                          ns.progress and world.main)
    t0, seen = time.perf_counter(), 0
    for epoch in range(epoch0, ns.epochs):
        lp, tok, step, stop = run_epoch(net, opt, train_ids, ns.batch, gen, device, bar, step, ns.max_steps, world)
        seen += tok
        valid_ppl = world.broadcast_floats([evaluate(net, valid_ids) if world.main else 0.0])[0]
        history.add(step=step, epoch=epoch + 1, tokens=seen, seconds=time.perf_counter() - t0,
                    train_ppl=math.exp(-lp / max(tok, 1)), valid_ppl=valid_ppl)
        bar.update(0, valid_ppl=valid_ppl)
        if world.main:
            save(ckdir, net, opt, history, epoch + 1, step, ns)
        if stop:
            break
    bar.close()
    if not world.main:
        return Path(ns.store) / ns.name
    return export(ns, net, vocab, history, time.perf_counter() - t0, world.size)


def run_epoch(net: NeuralPCFG, opt: torch.optim.Optimizer, seqs: list[list[int]], batch: int,
              gen: torch.Generator, device: torch.device, bar: common.Progress | None, step: int,
              max_steps: int = 0, world: distributed.World | None = None) -> tuple[float, int, int, bool]:
    """One pass of Adam steps on -mean log p(x) over length batches -> (sum log p, tokens, step, stopped). On W
    ranks (`world`) each takes its rows of a batch (one row at weight 0 when it has none) and back-propagates
    their share of the batch mean; the gradients are summed before clipping."""
    world = world or distributed.World()
    net.train()
    run_lp, run_tok = 0.0, 0
    for idx in length_batches(seqs, batch, gen):
        mine, weight = idx[world.share(len(idx))], 1.0
        if not mine:
            mine, weight = idx[:1], 0.0
        ids = torch.as_tensor([seqs[i] for i in mine], dtype=torch.long, device=device)
        logz = inside(grammar(net), ids)
        loss = -logz.sum() * (weight / len(idx))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        world.sum_gradients(net.parameters())
        common.clip_grad_norm(net.parameters(), 3.0)
        opt.step()
        step += 1
        lp, ntok = world.sum_floats([float(logz.detach().double().sum()) * weight, ids.numel() * weight])
        run_lp += lp
        run_tok += int(ntok)
        if bar is not None:
            bar.update(int(ntok), loss=-lp / ntok)
        if max_steps and step >= max_steps:
            return run_lp, run_tok, step, True
    return run_lp, run_tok, step, False


def evaluate(net: NeuralPCFG, seqs: list[list[int]]) -> float:
    """Word-level perplexity exp(-sum log p(x) / words) on `seqs` (no <eos>; every length)."""
    net.eval()
    with torch.no_grad():
        model = grammar(net)
        lp = corpus_logprob(model, seqs)
    return math.exp(-lp / max(1, sum(len(s) for s in seqs)))


def save(ckdir: Path, net: NeuralPCFG, opt: torch.optim.Optimizer, history: common.History, epoch: int,
         step: int, ns: TrainSettings | None = None) -> None:
    """Checkpoint the parameters, Adam's state and the history after `epoch` epochs (`step` steps), with the run's
    shape settings (`ns`) for `common.check_resume`."""
    otensors, ometa = common.optimizer_tensors(opt)
    tensors = {f"net.{k}": v for k, v in net.state_dict().items()} | otensors
    common.save_checkpoint(ckdir, tensors, {"epoch": epoch, "step": step, "history": history.to_json(),
                                            "optimizer": ometa}, ns)


def export(ns: TrainSettings, net: NeuralPCFG, vocab: Vocabulary, history: common.History,
           seconds: float, world_size: int = 1) -> Path:
    """Materialise the factors and the cached rank-space products into a `pcfg` artifact (+ curve.png)."""
    with torch.no_grad():
        f = {k: v.double().cpu() for k, v in net().items()}
    tensors, config = pcfg_tensors(**f)
    tensors = {k: v.float() for k, v in tensors.items()}
    title = f"rank-space PCFG NT={ns.nt} PT={ns.pt} r={ns.rank}"
    prov = common.provenance(ns, history, seconds, {"word_level_ppl_note": "perplexity per word, no <eos>",
                                                    "world_size": world_size},
                             {"max_length": TRAIN_MAX_LENGTH})
    return save_artifact(ns.store, ns.name, "pcfg", tensors, vocab, config=config, provenance=prov,
                         extra_files={"curve.png": common.curve_png(history, title)})


# -- evaluation: grammar recovery from sampled sentences ----------------------------------------------
def tree_spans(tree: tuple, start: int = 0) -> tuple[set[tuple[int, int]], int]:
    """Nested (sym, left, right) / (sym, word) tuples -> (constituents of width >= 2, number of words)."""
    if len(tree) == 2:
        return set(), 1
    left, nl = tree_spans(tree[1], start)
    right, nr = tree_spans(tree[2], start + nl)
    return left | right | {(start, start + nl + nr)}, nl + nr


def branching(n: int, right: bool) -> set[tuple[int, int]]:
    """Spans of the fully right- (or left-) branching tree over n words."""
    return {(i, n) for i in range(n - 1)} if right else {(0, j) for j in range(2, n + 1)}


def span_f1(pred: list[set], gold: list[set], lengths: list[int]) -> tuple[float, float]:
    """(sentence-level mean F1, corpus F1) of unlabelled spans, ignoring the trivial whole-sentence span and
    sentences shorter than 3 words (no non-trivial spans)."""
    sent, tp, np_, ng = [], 0, 0, 0
    for p, g, n in zip(pred, gold, lengths, strict=True):
        if n < 3:
            continue
        p, g = p - {(0, n)}, g - {(0, n)}
        hit = len(p & g)
        tp, np_, ng = tp + hit, np_ + len(p), ng + len(g)
        prec, rec = hit / max(len(p), 1), hit / max(len(g), 1)
        sent.append(0.0 if hit == 0 else 2 * prec * rec / (prec + rec))
    prec, rec = tp / max(np_, 1), tp / max(ng, 1)
    return sum(sent) / max(len(sent), 1), (0.0 if tp == 0 else 2 * prec * rec / (prec + rec))


def recovery(*, seed: int = 0, true_nt: int = 6, true_pt: int = 12, V: int = 200, n_train: int = 4000,
             n_test: int = 400, max_len: int = 30, nt: int = 12, pt: int = 24, rank: int = 32, hidden: int = 64,
             batch: int = 32, lr: float = 2e-3, minutes: float = 8.0, concentration: float = 0.3,
             leaf_bias: float = -0.5) -> str:
    """Sample a corpus with trees from a random dense grammar, train a rank-space PCFG on the sentences
    only, and compare MBR parses (span F1) and held-out perplexity with the true grammar's. Markdown."""
    from latentlm.models.dense_pcfg import DensePCFG, random_dense_pcfg
    from latentlm.models.tree import sample_trees

    torch.set_num_threads(1)
    t, cfg = random_dense_pcfg(true_nt, true_pt, V, seed=seed, concentration=concentration, leaf_bias=leaf_bias)
    t["start"][true_nt:] = 0  # sentences start from a nonterminal (no one-word sentences)
    t["start"] /= t["start"].sum()
    truth = DensePCFG.from_tensors(t, cfg, dtype=torch.float64)
    gen = torch.Generator().manual_seed(seed)
    root, expand, emit = truth.sampling_tables(1.0)
    sample = sample_trees(n_train + n_test, num_nt=true_nt, root=root, expand=lambda a: expand(a, gen),
                          emit=lambda x: emit(x, gen), max_tokens=max_len, generator=gen, device=torch.device("cpu"))
    seqs, gold = sample.ids, [tree_spans(tr)[0] for tr in sample.trees]
    train_ids, test_ids, gold_test = seqs[:n_train], seqs[n_train:], gold[n_train:]
    lengths = [len(s) for s in test_ids]
    words = sum(lengths)

    def ppl(model) -> float:
        return math.exp(-float(model.log_prob(test_ids).sum()) / words)

    common.seed_all(seed)
    net = NeuralPCFG(nt, pt, rank, V, hidden)
    opt = torch.optim.Adam(net.parameters(), lr=lr, betas=(0.75, 0.999))
    curve, t0, step, epoch = [], time.perf_counter(), 0, 0
    while time.perf_counter() - t0 < minutes * 60:
        _, _, step, _ = run_epoch(net, opt, train_ids, batch, gen, torch.device("cpu"), None, step)
        epoch += 1
        with torch.no_grad():
            learned = RankPCFG.from_tensors(pcfg_tensors(**{k: v.double() for k, v in net().items()})[0],
                                            {"nt": nt, "pt": pt, "rank": rank}, dtype=torch.float64)
        curve.append((epoch, step, ppl(learned)))
    learned_mbr = [set(d.spans) for d in learned.op_decode(test_ids, method="mbr")]
    true_mbr = [set(d.spans) for d in truth.op_decode(test_ids, method="mbr")]
    true_vit = [set(d.spans) for d in truth.op_decode(test_ids, method="viterbi")]
    rows = [("true grammar, MBR", span_f1(true_mbr, gold_test, lengths), ppl(truth)),
            ("true grammar, Viterbi", span_f1(true_vit, gold_test, lengths), None),
            (f"learned rank-space `pcfg` (NT={nt}, PT={pt}, r={rank}), MBR", span_f1(learned_mbr, gold_test, lengths),
             curve[-1][2]),
            ("right-branching", span_f1([branching(n, True) for n in lengths], gold_test, lengths), None),
            ("left-branching", span_f1([branching(n, False) for n in lengths], gold_test, lengths), None)]
    out = [f"True grammar: random `dense_pcfg`, NT={true_nt}, PT={true_pt}, V={V}, Dirichlet-like rows "
           f"(concentration {concentration}), binary rules with preterminal children weighted by e^{leaf_bias} (longer "
           f"sentences), start rule over nonterminals only, seed {seed}. "
           f"Corpus: {n_train} training + {n_test} test sentences "
           f"sampled with their trees (length <= {max_len}, mean test length {words / n_test:.1f}). "
           f"Learner: App. A parameterization, h={hidden}, Adam lr {lr}, batch {batch}, {epoch} epochs "
           f"({step} steps, {(time.perf_counter() - t0) / 60:.1f} min, 1 thread).",
           "",
           "| parser / model | sentence F1 | corpus F1 | test perplexity (per word) |",
           "|---|---|---|---|"]
    for name, f1, p in rows:
        f = "– | –" if f1 is None else f"{100 * f1[0]:.1f} | {100 * f1[1]:.1f}"
        out.append(f"| {name} | {f} | {'–' if p is None else f'{p:.2f}'} |")
    every = max(1, len(curve) // 10)
    out += ["", "Learning curve (epoch, steps, test perplexity): "
            + ", ".join(f"({e}, {s}, {p:.2f})" for e, s, p in curve[::every] + curve[-1:])]
    return "\n".join(out)


def ptb_report(store: Path, name: str, n_examples: int = 4, max_words: int = 15) -> str:
    """PTB valid/test perplexity of a stored `pcfg` (per word, and per word+<eos> to set beside HMMs that
    predict <eos>) and MBR parses of a few short test sentences, as markdown."""
    from latentlm import ops
    from latentlm.models.tree import relabel_leaves
    from latentlm.training.data import encode_corpus, ptb_sentences

    torch.set_num_threads(1)
    model = ops.load_model(store, name)
    out = ["| split | sentences | words | log p | perplexity per word | per word+`<eos>` |",
           "|---|---|---|---|---|---|"]
    for split in ("valid", "test"):
        seqs = encode_corpus(ptb_sentences(split), model.vocab)
        lp = float(model.impl.log_prob(seqs).sum())
        w = sum(len(x) for x in seqs)
        out.append(f"| {split} | {len(seqs)} | {w} | {lp:.0f} | {math.exp(-lp / w):.1f} | "
                   f"{math.exp(-lp / (w + len(seqs))):.1f} |")
    sents = [s for s in ptb_sentences("test") if 6 <= len(s) <= max_words and "<unk>" not in s][:n_examples]
    seqs = encode_corpus(sents, model.vocab)
    out += ["", "MBR parses (root S, other constituents X) of the first short PTB test sentences without `<unk>`:", ""]
    for s, r in zip(sents, ops.run(model, "decode", seqs, method="mbr"), strict=True):
        out.append(f"    {relabel_leaves(r['tree'], s)}")
    return "\n".join(out)


if __name__ == "__main__":
    import sys

    ap = argparse.ArgumentParser(description="evaluations of the rank-space PCFG")
    sub = ap.add_subparsers(dest="what", required=True)
    p = sub.add_parser("recovery", help="grammar recovery from sentences sampled from a known grammar")
    p.add_argument("--minutes", type=float, default=8.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vocab", type=int, default=200)
    p.add_argument("--concentration", type=float, default=0.3, help="smaller: spikier rule/emission rows")
    p.add_argument("--leaf-bias", type=float, default=-0.5, help="log-weight of preterminal children")
    p = sub.add_parser("ptb", help="PTB perplexity and example parses of a trained model")
    p.add_argument("--store", type=Path, required=True)
    p.add_argument("--name", required=True)
    a = ap.parse_args()
    if a.what == "recovery":
        sys.stdout.write(recovery(seed=a.seed, minutes=a.minutes, V=a.vocab, concentration=a.concentration,
                                  leaf_bias=a.leaf_bias) + "\n")
    else:
        sys.stdout.write(ptb_report(a.store, a.name) + "\n")
