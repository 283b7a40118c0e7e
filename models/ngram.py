"""`ngram`: a backoff n-gram language model imported from an ARPA file (e.g. KenLM's `lmplz`), scored exactly.

Words have ids 0..W-1: the vocabulary's V tokens, then `<s>` (id V, context only, never predicted) and, when
the ARPA file's own `<unk>` is not the vocabulary's unknown word (KenLM reserves the literal `<unk>`, so
PTB's `<unk>` is renamed before training), that `<unk>` as id V+1 (in the unigram distribution, never
produced by tokenisation). ARPA `</s>` is the vocabulary's `<eos>`.

Tensors (natural-log probabilities and backoffs; ARPA stores log10):
  unigram_logprob (W,), unigram_backoff (W,) [order > 1]    indexed by word id (a unigram's id is its word)
  keys_n (M_n,) int64, strictly increasing, n = 2..N        key = id of the (n-1)-gram prefix * W + last word
  logprob_n (M_n,), backoff_n (M_n,) [n < N]                an n-gram's id is its row in keys_n
Lookup is a binary search (`torch.searchsorted`) per order, so scoring is vectorised over a whole batch:
O(B T N log M) time. After `<eos>` the context restarts at `<s>`, so a sequence of several sentences
scores as the product of its sentences.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from latentlm.models.base import Batch, ChainOps
from latentlm.models.checks import NORMALISATION_TOL, check_shape
from latentlm.models.cost import TOKEN_COST, Work
from latentlm.models.errors import ArtifactError, InputError, UnsupportedOperation
from latentlm.models.family import Family, Importer, Option
from latentlm.models.results import Result
from latentlm.models.vocab import Preprocessing, Vocabulary

LN10 = math.log(10.0)
ARPA_BOS, ARPA_EOS, ARPA_UNK = "<s>", "</s>", "<unk>"


# -- lookups over the sorted key tables ---------------------------------------------------------------
def lookup(keys: Tensor, ctx: Tensor, word: Tensor, num_words: int) -> Tensor:
    """Row of (ctx, word) in the sorted `keys` (M,), or -1 where absent or ctx < 0; any shape. O(log M)."""
    q = ctx.clamp_min(0) * num_words + word
    if keys.numel() == 0:
        return torch.full_like(q, -1)
    pos = torch.searchsorted(keys, q).clamp_max(keys.numel() - 1)
    hit = (keys[pos] == q) & (ctx >= 0)
    return torch.where(hit, pos, torch.full_like(pos, -1))


def context_ids(keys: list[Tensor], hist: Tensor, bos_id: int, num_words: int) -> list[Tensor]:
    """Ids of the j-grams ending at each position of `hist` (B, L), j = 1..len(keys)+1, as a list of (B, L)
    (-1 where absent, where the j-gram would start before position 0, or where `<s>` is not its first word).
    `keys[j-2]` is the order-j table. O(B L N log M)."""
    out = [hist]
    for k in keys:
        prev = torch.full_like(hist, -1)
        prev[:, 1:] = out[-1][:, :-1]
        prev = torch.where(hist == bos_id, torch.full_like(prev, -1), prev)  # `<s>` only opens an n-gram
        out.append(lookup(k, prev, hist, num_words))
    return out


def cond_logprob(uni_lp: Tensor, keys: list[Tensor], lps: list[Tensor],
                 backoffs: list[Tensor], ctx: list[Tensor], word: Tensor, num_words: int) -> Tensor:
    """log p(word | context) by the backoff recursion. `ctx[j-1]` (same shape as `word`) is the id of the
    context's length-j suffix at order j (-1 if absent), j = 1..N-1; `keys/lps[n-2]` and `backoffs[j-1]` are
    the order-n / order-j tables (backoffs[0]: unigrams). Longest matching n-gram plus the backoffs of the
    longer contexts. O(N log M) per entry."""
    lp = uni_lp[word]
    found = torch.zeros_like(word, dtype=torch.bool)
    backoff = torch.zeros_like(lp)
    for n in range(len(ctx) + 1, 1, -1):  # orders N..2, highest first
        c = ctx[n - 2]
        row = lookup(keys[n - 2], c, word, num_words)
        hit = (row >= 0) & ~found
        lp = torch.where(hit, lps[n - 2][row.clamp_min(0)], lp)
        # a context that is present but has no explicit continuation with `word` backs off
        miss = ~found & ~hit & (c >= 0)
        backoff = backoff + torch.where(miss, backoffs[n - 2][c.clamp_min(0)], torch.zeros_like(lp))
        found |= hit
    return lp + backoff


# -- the family ----------------------------------------------------------------------------------------
class NGramLM(Family):
    """Backoff n-gram LM (ARPA semantics): score only, exact, vectorised over the batch."""

    family = "ngram"
    operations = frozenset({"score"})
    decode_methods = frozenset()
    importers = (Importer(
        "import-arpa", "import a backoff n-gram model from an ARPA file (e.g. KenLM's lmplz); score only",
        "FILE.arpa", lambda path, unk_token=None: read_arpa(path, unk_token or ARPA_UNK, progress=True),
        (Option("unk_token", None, "the ARPA word that is the vocabulary's <unk> (default <unk>; e.g. _unk_ when "
                                   "<unk> was renamed before lmplz)"),)),)

    def __init__(self, tensors: dict[str, Tensor], config: dict[str, Any], dtype: torch.dtype):
        self.config = config
        self.order = int(config["order"])
        self.num_words = int(config["num_words"])
        self.bos_id = int(config["bos_id"])
        self.uni_lp = tensors["unigram_logprob"].to(dtype)
        self.keys = [tensors[f"keys_{n}"] for n in range(2, self.order + 1)]
        self.lps = [tensors[f"logprob_{n}"].to(dtype) for n in range(2, self.order + 1)]
        self.backoffs = [tensors["unigram_backoff"].to(dtype)] if self.order > 1 else []  # backoffs, orders 1..N-1
        self.backoffs += [tensors[f"backoff_{n}"].to(dtype) for n in range(2, self.order)]
        self.device, self.dtype = self.uni_lp.device, dtype

    @staticmethod
    def validate_tensors(tensors: dict[str, Tensor], config: dict[str, Any], vocab_size: int, where: str) -> None:
        validate(tensors, config, vocab_size, where)

    @classmethod
    def from_tensors(cls, tensors: dict[str, Tensor], config: dict[str, Any], *, device: str | torch.device = "cpu",
                     dtype: torch.dtype = torch.float32, storage_dtype: str | torch.dtype | None = None) -> NGramLM:
        return cls({k: v.to(device) for k, v in tensors.items()}, config, dtype)

    @property
    def num_states(self) -> int:
        return 0  # no latent states

    def cost(self, work: Work) -> int:
        """Per token one binary search per order: 64 x order."""
        return int(work.tokens * (64 * self.order + TOKEN_COST))

    def describe(self) -> dict[str, Any]:
        return {"order": self.order, "ngram_counts": self.config.get("ngram_counts")}

    def score(self, batch: Batch) -> tuple[Tensor, Tensor]:
        """log p(x) (B,) float64 and per-token log p(x_t | x_<t) (B, T) (0 at padding); `<s>` opens each
        sequence and follows every `<eos>`. O(B T N log M)."""
        ids, lengths = batch.ids.to(self.device), batch.lengths.to(self.device)
        eos = self.config.get("eos_id")
        hist = torch.full_like(ids, self.bos_id)  # hist[:, t] = the word before x_t (`<s>` after `<eos>`)
        prev = ids[:, :-1]
        hist[:, 1:] = prev if eos is None else torch.where(prev == eos, torch.full_like(prev, self.bos_id), prev)
        ctx = context_ids(self.keys[: max(self.order - 2, 0)], hist, self.bos_id, self.num_words)
        ctx = ctx[: self.order - 1]
        cond = cond_logprob(self.uni_lp, self.keys, self.lps, self.backoffs, ctx, ids, self.num_words)
        mask = torch.arange(ids.shape[1], device=self.device)[None] < lengths[:, None]
        cond = torch.where(mask, cond, torch.zeros_like(cond))
        return cond.double().sum(1), cond

    op_score = ChainOps.op_score  # the HMM families' `Score` results, from `score` above

    def _unsupported(self, op: str) -> UnsupportedOperation:
        return UnsupportedOperation(f"family ngram supports only 'score', not {op!r} (an n-gram model has no "
                                    "latent states)", param="model")

    def op_posterior(self, seqs: list[list[int]], *, top_k: int | None = None) -> list[Result]:
        raise self._unsupported("posterior")

    def op_decode(self, seqs: list[list[int]], *, method: str = "viterbi") -> list[Result]:
        raise self._unsupported("decode")

    def op_sample(self, **_: Any) -> list[Result]:
        raise self._unsupported("sample")

    def op_embed(self, seqs: list[list[int]], *, causal: bool = False) -> list[Result]:
        raise self._unsupported("embed")


# -- validation ----------------------------------------------------------------------------------------
def _bad(where: str, key: str, msg: str) -> ArtifactError:
    return ArtifactError(f"{where}: {msg}", param=key)


def validate(tensors: dict[str, Tensor], config: dict[str, Any], vocab_size: int, where: str,
             tol: float = NORMALISATION_TOL) -> None:
    """Config and shapes, finite floats, strictly sorted keys whose contexts exist, log-probs <= 0, and
    every context's distribution over the W-1 predictable words summing to 1 within `tol`. O(M N log M)."""
    for k in ("order", "num_words", "bos_id"):
        if not isinstance(config.get(k), int) or isinstance(config.get(k), bool):
            raise _bad(where, k, f"config {k!r} must be an integer, got {config.get(k)!r}")
    N, W, bos = config["order"], config["num_words"], config["bos_id"]
    if N < 1:
        raise _bad(where, "order", f"config order must be >= 1, got {N}")
    if bos != vocab_size or W not in (vocab_size + 1, vocab_size + 2):
        raise _bad(where, "num_words", f"config num_words={W}, bos_id={bos} do not fit vocab_size {vocab_size} "
                   "(expected bos_id = V and num_words = V+1 or V+2)")
    eos = config.get("eos_id")
    if eos is not None and not (isinstance(eos, int) and 0 <= eos < vocab_size):
        raise _bad(where, "eos_id", f"config eos_id {eos!r} is not a vocabulary id")
    expected = {"unigram_logprob"} | ({"unigram_backoff"} if N > 1 else set())
    for n in range(2, N + 1):
        expected |= {f"keys_{n}", f"logprob_{n}"} | ({f"backoff_{n}"} if n < N else set())
    if set(tensors) != expected:
        extra, missing = sorted(set(tensors) - expected), sorted(expected - set(tensors))
        raise _bad(where, (missing or extra)[0],
                   f"tensors do not match an order-{N} model (missing {missing}, unexpected {extra})")
    check_shape(tensors, "unigram_logprob", (W,), where)
    if N > 1:
        check_shape(tensors, "unigram_backoff", (W,), where)
    prev_count = W
    for n in range(2, N + 1):
        keys = tensors[f"keys_{n}"]
        if keys.dtype != torch.int64 or keys.dim() != 1:
            raise _bad(where, f"keys_{n}", f"tensor 'keys_{n}' must be 1-d int64, got {keys.dtype} {list(keys.shape)}")
        M = keys.shape[0]
        check_shape(tensors, f"logprob_{n}", (M,), where)
        if n < N:
            check_shape(tensors, f"backoff_{n}", (M,), where)
        if M and bool((keys[1:] <= keys[:-1]).any()):
            i = int((keys[1:] <= keys[:-1]).nonzero()[0, 0])
            raise _bad(where, f"keys_{n}", f"tensor 'keys_{n}' is not strictly increasing at row {i + 1}")
        if M and (int(keys[0]) < 0 or int(keys[-1]) >= prev_count * W):
            raise _bad(where, f"keys_{n}", f"tensor 'keys_{n}' refers to a context outside the {prev_count} "
                       f"{n - 1}-grams")
        prev_count = M
    for k, t in tensors.items():
        if k.startswith("keys_"):
            continue
        if not t.is_floating_point() or not bool(torch.isfinite(t).all()):
            raise _bad(where, k, f"tensor {k!r} must be finite floating point")
        if "logprob" in k and bool((t > 0).any()):
            i = int((t > 0).nonzero()[0, 0])
            raise _bad(where, k, f"tensor {k!r} has a log-probability > 0 ({float(t[i]):.6g} at row {i})")
    check_normalised(tensors, N, W, bos, eos, where, tol)


def ngram_words(tensors: dict[str, Tensor], N: int, W: int) -> list[Tensor]:
    """Word matrices (M_n, n) of every order, reconstructed from the keys. O(sum_n M_n n)."""
    words = [torch.arange(W, dtype=torch.long)[:, None]]
    for n in range(2, N + 1):
        keys = tensors[f"keys_{n}"]
        words.append(torch.cat([words[-1][keys // W], (keys % W)[:, None]], 1))
    return words


def check_normalised(tensors: dict[str, Tensor], N: int, W: int, bos: int, eos: int | None, where: str,
                     tol: float) -> None:
    """sum_w p(w | c) = 1 for the empty context and every context c listed in the model:
    sum_{explicit w} p(c, w) + b(c) (1 - sum_{explicit w} p(w | c minus its first word)). O(M N^2 log M)."""
    t = {k: v.double() for k, v in tensors.items()}
    uni = t["unigram_logprob"].exp()
    total = float(uni.sum() - uni[bos])
    if abs(total - 1) > tol:
        raise _bad(where, "unigram_logprob", f"the unigram distribution sums to {total:.6g}, not 1 "
                   f"(tolerance {tol}; `<s>` excluded)")
    if N == 1:
        return
    words = ngram_words(tensors, N, W)
    keys = [tensors[f"keys_{n}"] for n in range(2, N + 1)]
    lps = [t[f"logprob_{n}"] for n in range(2, N + 1)]
    bo_tabs = [t["unigram_backoff"]] + [t[f"backoff_{n}"] for n in range(2, N)]
    for n in range(2, N + 1):
        w = words[n - 1]  # (M, n): context w[:, :-1], predicted word w[:, -1]
        if bool((w[:, 1:] == bos).any()):
            raise _bad(where, f"keys_{n}", f"an order-{n} n-gram has `<s>` after its first word")
        ctx = keys[n - 2] // W  # id of the context at order n-1
        # ids of the shorter suffixes of the context (lengths 1..n-2) at their orders
        suffix = w[:, 1:-1]
        sfx_ids = context_ids(keys[: max(n - 3, 0)], suffix, bos, W) if suffix.shape[1] else []
        lower_ctx = [s[:, -1] for s in sfx_ids[: n - 2]]
        if any(bool((c < 0).any()) for c in lower_ctx):
            raise _bad(where, f"keys_{n}", f"an order-{n} n-gram's context suffix is not listed at a lower order")
        lower = cond_logprob(t["unigram_logprob"], keys, lps, bo_tabs, lower_ctx,
                             w[:, -1], W).exp()
        n_ctx = words[n - 2].shape[0]
        explicit = torch.zeros(n_ctx, dtype=torch.float64, device=ctx.device).index_add_(0, ctx, lps[n - 2].exp())
        lower_sum = torch.zeros(n_ctx, dtype=torch.float64, device=ctx.device).index_add_(0, ctx, lower)
        has = torch.zeros(n_ctx, dtype=torch.bool, device=ctx.device)
        has[ctx] = True
        bo = bo_tabs[n - 2].exp()
        sums = torch.where(has, explicit + bo * (1 - lower_sum), bo)
        # a context ending in `</s>` is never used (the context restarts at `<s>`)
        used = words[n - 2][:, -1] != eos if eos is not None else torch.ones_like(has)
        bad = used & ((sums - 1).abs() > tol)
        if bool(bad.any()):
            i = int(bad.nonzero()[0, 0])
            raise _bad(where, f"logprob_{n}", f"the distribution after order-{n - 1} context #{i} (word ids "
                       f"{words[n - 2][i].tolist()}) sums to {float(sums[i]):.6g}, not 1 (tolerance {tol})")


# -- ARPA import ---------------------------------------------------------------------------------------
@dataclass
class ArpaModel:
    """A parsed ARPA file: per order n, word-id rows (M_n, n), log10 probs (M_n,), log10 backoffs (M_n,)."""

    words: list[str]
    grams: list[Tensor]
    logprob10: list[Tensor]
    backoff10: list[Tensor]


class ArpaError(InputError):
    """A malformed ARPA file (the message names the line)."""


def parse_arpa(lines: Iterable[str], name: str = "ARPA") -> ArpaModel:
    """Read an ARPA backoff model: `\\data\\` counts, `\\n-grams:` sections (log10 prob, words, optional log10
    backoff), `\\end\\`. Every n-gram's words must be unigrams; duplicates and count mismatches are errors."""
    it = iter(enumerate(lines, start=1))
    counts: list[int] = []
    lineno = 0

    def err(at: int, msg: str) -> ArpaError:
        return ArpaError(f"{name}: line {at}: {msg}", param="FILE")

    for lineno, line in it:
        if line.strip() == "\\data\\":
            break
        if line.strip():
            raise err(lineno, f"expected '\\data\\' before any content, got {line.strip()[:40]!r}")
    else:
        raise ArpaError(f"{name}: no '\\data\\' header (not an ARPA file?)", param="FILE")
    section = None
    for lineno, line in it:
        s = line.strip()
        if not s:
            continue
        if s.startswith("ngram "):
            k, _, v = s[6:].partition("=")
            if not (k.strip().isdigit() and v.strip().isdigit()) or int(k) != len(counts) + 1:
                raise err(lineno, f"bad count line {s!r} (expected 'ngram {len(counts) + 1}=COUNT')")
            counts.append(int(v))
            continue
        section = s
        break
    if not counts:
        raise err(lineno, "no 'ngram N=COUNT' lines after '\\data\\'")
    N = len(counts)
    index: dict[str, int] = {}
    words: list[str] = []
    grams: list[Tensor] = []
    lp10: list[Tensor] = []
    bo10: list[Tensor] = []
    for n in range(1, N + 1):
        if section != f"\\{n}-grams:":
            raise err(lineno, f"expected '\\{n}-grams:', got {section!r}" if section else f"missing '\\{n}-grams:'")
        rows: list[list[int]] = []
        lps: list[float] = []
        bo_list: list[float] = []
        section = None
        for lineno, line in it:
            parts = line.split()
            if not parts:
                continue
            if parts[0].startswith("\\"):
                section = line.strip()
                break
            if len(parts) not in (n + 1, n + 2) or (n == N and len(parts) == n + 2):
                raise err(lineno, f"expected {n + 1}{'' if n == N else f' or {n + 2}'} fields in a {n}-gram line, "
                          f"got {len(parts)}")
            try:
                lp = float(parts[0])
                bo = float(parts[n + 1]) if len(parts) == n + 2 else 0.0
            except ValueError:
                raise err(lineno, f"not a number in {line.strip()[:60]!r}") from None
            if not (math.isfinite(lp) and math.isfinite(bo)):
                raise err(lineno, f"log-probability or backoff is not finite in {line.strip()[:60]!r}")
            if lp > 0:
                raise err(lineno, f"log10 probability {lp} > 0")
            toks = parts[1 : n + 1]
            if n == 1:
                if toks[0] in index:
                    raise err(lineno, f"duplicate unigram {toks[0]!r}")
                index[toks[0]] = len(words)
                words.append(toks[0])
                rows.append([index[toks[0]]])
            else:
                try:
                    rows.append([index[w] for w in toks])
                except KeyError as e:
                    raise err(lineno, f"word {e.args[0]!r} is not a unigram") from None
            lps.append(lp)
            bo_list.append(bo)
        if len(rows) != counts[n - 1]:
            raise err(lineno, f"the header says {counts[n - 1]} {n}-grams, the section has {len(rows)}")
        grams.append(torch.tensor(rows, dtype=torch.long).reshape(len(rows), n))
        lp10.append(torch.tensor(lps, dtype=torch.float64))
        bo10.append(torch.tensor(bo_list, dtype=torch.float64))
    if section != "\\end\\":
        raise err(lineno, f"expected '\\end\\' after the {N}-grams, got {section!r}" if section
                  else "missing '\\end\\'")
    return ArpaModel(words, grams, lp10, bo10)


def arpa_to_artifact(arpa: ArpaModel, unk_token: str = ARPA_UNK, name: str = "ARPA",
                     dtype: torch.dtype = torch.float64
                     ) -> tuple[dict[str, Tensor], Vocabulary, dict[str, Any]]:
    """(tensors, vocabulary, config) of the `ngram` artifact: ARPA `</s>` -> `<eos>`, `unk_token` -> `<unk>`,
    `<s>` -> id V; tables sorted by (context id, word). Preprocessing as for PTB (whitespace, `<eos>` added).
    O(M N log M)."""
    pre = Preprocessing()  # lowercase off, unk <unk>, eos <eos>, add_eos: identical to training.data's PTB
    for tok in (ARPA_BOS, ARPA_EOS, unk_token):
        if tok not in arpa.words:
            raise ArpaError(f"{name}: the unigrams have no {tok!r}"
                            + (" (see --unk-token)" if tok == unk_token else ""), param="FILE")
    if unk_token in (ARPA_BOS, ARPA_EOS):
        raise ArpaError(f"--unk-token cannot be {unk_token!r}", param="unk_token")
    rename = {ARPA_EOS: pre.eos, unk_token: pre.unk}
    extra = [ARPA_BOS] + ([ARPA_UNK] if unk_token != ARPA_UNK and ARPA_UNK in arpa.words else [])
    tokens = [rename.get(w, w) for w in arpa.words if w not in extra]
    clash = next((w for w in arpa.words if w in (pre.eos, pre.unk) and w not in rename and w not in extra), None)
    if clash is not None:
        raise ArpaError(f"{name}: the ARPA vocabulary has a literal {clash!r}, which this import uses for "
                        f"{'</s>' if clash == pre.eos else unk_token!r}", param="FILE")
    vocab = Vocabulary(tokens, pre)
    V = len(tokens)
    W = V + len(extra)
    new_id = torch.empty(len(arpa.words), dtype=torch.long)
    kept = [i for i, w in enumerate(arpa.words) if w not in extra]
    new_id[kept] = torch.arange(V)
    for j, w in enumerate(extra):
        new_id[arpa.words.index(w)] = V + j
    N = len(arpa.grams)
    tensors: dict[str, Tensor] = {}
    uni_lp = torch.zeros(W, dtype=torch.float64)
    uni_lp[new_id[arpa.grams[0][:, 0]]] = arpa.logprob10[0] * LN10
    tensors["unigram_logprob"] = uni_lp.to(dtype)
    if N > 1:
        uni_bo = torch.zeros(W, dtype=torch.float64)
        uni_bo[new_id[arpa.grams[0][:, 0]]] = arpa.backoff10[0] * LN10
        tensors["unigram_backoff"] = uni_bo.to(dtype)
    for n in range(2, N + 1):
        g = new_id[arpa.grams[n - 1]]
        prefix = g[:, :-1]
        ids = [prefix[:, 0]]
        for j in range(2, n):  # id of the (n-1)-word prefix, one order at a time
            ids.append(lookup(tensors[f"keys_{j}"], ids[-1], prefix[:, j - 1], W))
        ctx = ids[-1]
        if bool((ctx < 0).any()):
            r = int((ctx < 0).nonzero()[0, 0])
            raise ArpaError(f"{name}: the {n}-gram {' '.join(arpa.words[i] for i in arpa.grams[n - 1][r].tolist())!r} "
                            f"has no {n - 1}-gram for its first {n - 1} words", param="FILE")
        keys = ctx * W + g[:, -1]
        keys, order = keys.sort()
        if keys.numel() > 1 and bool((keys[1:] == keys[:-1]).any()):
            r = int(order[1:][keys[1:] == keys[:-1]][0])
            raise ArpaError(f"{name}: duplicate {n}-gram "
                            f"{' '.join(arpa.words[i] for i in arpa.grams[n - 1][r].tolist())!r}", param="FILE")
        tensors[f"keys_{n}"] = keys
        tensors[f"logprob_{n}"] = (arpa.logprob10[n - 1][order] * LN10).to(dtype)
        if n < N:
            tensors[f"backoff_{n}"] = (arpa.backoff10[n - 1][order] * LN10).to(dtype)
        elif bool((arpa.backoff10[n - 1] != 0).any()):
            raise ArpaError(f"{name}: {n}-grams of the highest order cannot have backoffs", param="FILE")
    config = {"order": N, "num_words": W, "bos_id": V, "eos_id": vocab.eos_id,
              "arpa_unk_id": V + 1 if len(extra) > 1 else None, "unk_token": unk_token, "log_base": "e",
              "ngram_counts": [int(g.shape[0]) for g in arpa.grams]}
    return tensors, vocab, config


def read_arpa(path: Path, unk_token: str = ARPA_UNK, dtype: torch.dtype = torch.float64, progress: bool = False
              ) -> tuple[dict[str, Tensor], Vocabulary, dict[str, Any]]:
    """Parse an ARPA file (plain text) into the `ngram` artifact's (tensors, vocabulary, config); with
    `progress`, a progress bar on stderr when it is a terminal."""
    from tqdm.auto import tqdm

    if not path.is_file():
        raise ArpaError(f"{path}: no such file", param="FILE")

    def counted(f: Iterable[str], bar: tqdm) -> Iterable[str]:
        done = 0
        for i, line in enumerate(f):
            done += len(line)
            if i & 0xFFFF == 0xFFFF:
                bar.update(done - bar.n)
            yield line
        bar.update(done - bar.n)

    try:
        with open(path, encoding="utf-8") as f, tqdm(total=path.stat().st_size, unit="B", unit_scale=True,
                                                      desc=f"reading {path.name}", leave=False,
                                                      disable=None if progress else True) as bar:
            arpa = parse_arpa(counted(f, bar), name=str(path))
    except UnicodeDecodeError as e:
        raise ArpaError(f"{path}: not UTF-8 text ({e})", param="FILE") from None
    return arpa_to_artifact(arpa, unk_token, name=str(path), dtype=dtype)
