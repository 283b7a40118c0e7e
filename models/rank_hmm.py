"""`rank_hmm` — the rank-space HMM of Yang, Liu & Tu (2022), §4.3 and App. B.

The merged factor p(z_t, x_t | z_{t-1}) is a CPD of rank r:
    p(z_t, x_t | z_{t-1}) = sum_q U[q, z_{t-1}] V[q, z_t] W[q, x_t]
with U[:, z] = p(q | z) (over ranks), V[q, :] = p(z | q) (over states), W[q, :] = p(x | q) (over words),
and z_0 ~ s. Marginalising the states leaves an HMM over the r rank variables:
    rank_start = s U^T (r,),   rank_trans = V U^T (r, r),   emission p(x | q) = W[q, x],
so scoring runs in rank space in O(T r^2) without ever forming the m x m transition matrix.

Artifact tensors: `start` s (m,), `state_in` = U^T (m, r) rows sum to 1, `state_out` = V (r, m) rows sum
to 1, `emit` = W^T (V, r) columns sum to 1, `rank_start` (r,), `rank_trans` (r, r) rows sum to 1 (checked
against the factors on load). Config: `num_states` m, `rank` r.

Costs per sequence: score O(T r^2); state posteriors p(z_t | x) over the m states O(T r (r + m)) time and
O(T m) memory (one extra (r x m) GEMM per side per step); Viterbi over states builds the per-token m x m
matrix U^T diag(W[:, x_t]) V: O(T m^2 r) time and O(m^2) memory, refused beyond `VITERBI_MAX_ELEMENTS`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from latentlm.models import chain, triton_chain
from latentlm.models.base import Batch, ChainFamily, ChainOperations, NextTokenFilter, check_continuable, tempered_rows
from latentlm.models.chain import Emit, RowLookup, Trans
from latentlm.models.chain_view import DenseView
from latentlm.models.checks import CHECK_CHUNK, check_distribution, check_shape
from latentlm.models.errors import ArtifactError, LimitExceeded
from latentlm.models.family import Recipe
from latentlm.models.sampling import CategoricalTable, Samples, run_sampler, tables_at

VITERBI_MAX_ELEMENTS = 1 << 26  # m * m entries of the per-token state-space matrix (256 MiB in float32)


class RankHMM(ChainFamily):
    family = "rank_hmm"
    operations = ChainOperations(ChainFamily.operations | {"constraint"})  # type: ignore[assignment]
    onnx_layout = "shared"  # in rank space
    recipes = (Recipe("rank_hmm", {"states": 1024, "rank": 256, "hidden": 256, "epochs": 10, "batch": 64, "lr": 1e-2,
                                   "dropout": 0.1, "checkpoint_every": 200},
                      positive=("states", "epochs", "batch", "rank", "hidden"), shape=("states", "rank", "hidden"),
                      options=frozenset({"export_only", "weight_decay", "weight_average"}),
                      trainer="latentlm.training.neural"),)
    viterbi_max_elements = VITERBI_MAX_ELEMENTS
    has_fused_score = True  # on CUDA `score` runs `triton_chain.rank_forward_cuda` (see `models.backend.score`)

    def __init__(self, t: dict[str, Tensor]):
        self.start, self.state_in, self.state_out = t["start"], t["state_in"], t["state_out"]
        self.emit, self.rank_start, self.rank_trans = t["emit"], t["rank_start"], t["rank_trans"]
        self.extras = {k: v for k, v in t.items() if k not in _CORE}
        self.device, self.dtype = self.rank_trans.device, self.rank_trans.dtype

    @staticmethod
    def validate_tensors(tensors: dict[str, Tensor], config: dict[str, Any], vocab_size: int, where: str) -> None:
        for key in ("num_states", "rank"):
            if not isinstance(config.get(key), int) or config[key] <= 0:
                raise ArtifactError(f"{where}: config needs a positive integer {key!r}", param=key)
        m, r = config["num_states"], config["rank"]
        check_distribution(check_shape(tensors, "start", (m,), where), "start", 0, where)
        check_distribution(check_shape(tensors, "state_in", (m, r), where), "state_in", 1, where)
        check_distribution(check_shape(tensors, "state_out", (r, m), where), "state_out", 1, where)
        check_distribution(check_shape(tensors, "emit", (vocab_size, r), where), "emit", 0, where)
        check_distribution(check_shape(tensors, "rank_start", (r,), where), "rank_start", 0, where)
        check_distribution(check_shape(tensors, "rank_trans", (r, r), where), "rank_trans", 1, where)
        # the cached rank-space matrices must be the products of the stored factors (checked on a
        # deterministic subset of rows so the check stays O(r m) even at paper scale)
        rows = torch.linspace(0, r - 1, steps=min(r, 16)).long().unique()
        si = tensors["state_in"]
        err_t = (_product64(tensors["state_out"][rows], si) - tensors["rank_trans"][rows].double()).abs().max().item()
        err_s = (_product64(tensors["start"][None], si)[0] - tensors["rank_start"].double()).abs().max().item()
        if err_t > 1e-4 or err_s > 1e-4:
            bad = "rank_trans" if err_t > 1e-4 else "rank_start"
            raise ArtifactError(f"{where}: tensor {bad!r} does not match the product of the stored factors "
                                f"(max error {max(err_t, err_s):.3g})", param=bad)

    @classmethod
    def from_tensors(cls, tensors, config, *, device="cpu", dtype=torch.float32, storage_dtype=None) -> RankHMM:
        """`storage_dtype` ("float32" default, "bfloat16"): precision of the fused CUDA scoring path only."""
        model = cls({k: v.to(device=device, dtype=dtype) for k, v in tensors.items()})
        model.set_storage_dtype(storage_dtype)
        return model

    @property
    def num_states(self) -> int:
        return self.start.shape[0]

    @property
    def rank(self) -> int:
        return self.rank_trans.shape[0]

    def describe(self) -> dict[str, Any]:
        return {"num_states": self.num_states, "rank": self.rank, "backend": self.backends()}

    @property
    def step_width(self) -> int:
        """The rank r: every step of the recursion is an r x r product."""
        return int(self.rank)

    def viterbi_step_cost(self) -> int:
        """Viterbi over the m states builds an m x m matrix per token from the rank-r factors: m^2 (r + 1)."""
        m = self.num_states
        return m * m * (self.rank + 1)

    def marginal_step_cost(self) -> int:
        """Forward-backward in rank space plus the marginals over the m states: 2 r^2 + 2 r m + m."""
        r, m = self.rank, self.num_states
        return 2 * r * r + 2 * r * m + m

    def score_fused(self, batch: Batch) -> tuple[Tensor, Tensor]:
        return triton_chain.score_rank(self, batch, storage_dtype=self.storage_dtype, allow_tf32=self.allow_tf32)

    def chain(self, batch: Batch) -> tuple[Tensor, Emit, Trans]:
        """Rank-space chain: init (B, r), emit (B, T, r), shared (r, r) step."""
        return self.rank_start.expand(batch.ids.shape[0], -1), RowLookup(self.emit, batch.ids), self.rank_trans

    def state_ids(self, batch: Batch) -> Tensor:
        B, T = batch.ids.shape
        return torch.arange(self.num_states, device=self.device).expand(B, T, -1)

    def posterior(self, batch: Batch) -> tuple[Tensor, Tensor]:
        """p(z_t | x) over the m states: (alpha_t V)[z] * (U^T (w_{t+1} * beta_{t+1}))[z], normalised.
        O(T r (r + m)) time, O(B T m) output."""
        batch = self.to(batch)
        init, emit, trans = self.chain(batch)
        log_cond, alphas = chain.forward(init, emit, trans, batch.lengths, keep_alphas=True)
        betas = chain.backward(emit, trans, batch.lengths, log_cond)
        B, T, _ = emit.shape
        ahead = torch.ones(B, T, self.rank, dtype=self.dtype, device=self.device)
        if T > 1:
            ahead[:, :-1] = self.emit[batch.ids[:, 1:]] * betas[:, 1:]
        last = chain.valid_mask(batch.lengths, T) & ~chain.valid_mask(batch.lengths - 1, T)
        ahead = torch.where(last.unsqueeze(-1), torch.ones((), dtype=self.dtype, device=self.device), ahead)
        probs = (alphas @ self.state_out) * (ahead @ self.state_in.T)
        probs = probs / probs.sum(-1, keepdim=True).clamp_min(torch.finfo(self.dtype).tiny)
        probs = torch.where(batch.mask.unsqueeze(-1), probs, torch.zeros((), dtype=self.dtype, device=self.device))
        return self.state_ids(batch), probs

    def log_chain(self, batch: Batch) -> tuple[Tensor, Tensor, Trans]:
        """State-space chain for Viterbi with per-token m x m matrices U^T diag(W[:, x_t]) V."""
        m = self.num_states
        if m * m > self.viterbi_max_elements:
            raise LimitExceeded(
                f"Viterbi for rank_hmm needs the {m} x {m} state-space matrix per token ({m * m:,} entries), "
                f"above the limit of {self.viterbi_max_elements:,}; use method 'mbr' instead", param="method")
        B, T = batch.ids.shape
        w = self.emit[batch.ids]  # (B, T, r)
        tiny = torch.finfo(self.dtype).tiny
        log_init = ((self.rank_start * w[:, 0]) @ self.state_out).clamp_min(tiny).log()  # (B, m)
        log_emit = torch.zeros(B, T, m, dtype=self.dtype, device=self.device)

        def log_trans(t: int) -> Tensor:  # (B, m, m)
            return ((self.state_in.unsqueeze(0) * w[:, t].unsqueeze(1)) @ self.state_out).clamp_min(tiny).log()

        return log_init, log_emit, log_trans

    def viterbi(self, batch: Batch) -> tuple[Tensor, Tensor]:
        """Exact best state path; batch rows are processed in chunks so memory is O(m^2) per row."""
        batch = self.to(batch)
        m = self.num_states
        chunk = max(1, self.viterbi_max_elements // (m * m))
        paths, logps = [], []
        for i in range(0, batch.ids.shape[0], chunk):
            sub = Batch(batch.ids[i : i + chunk], batch.lengths[i : i + chunk])
            log_init, log_emit, log_trans = self.log_chain(sub)
            p, lp = chain.viterbi(log_init, log_emit, log_trans, sub.lengths)
            paths.append(p)
            logps.append(lp)
        return torch.cat(paths), torch.cat(logps)

    # -- sampling: q_t -> (x_t ~ W[q_t], z_t ~ V[q_t]) -> q_{t+1} ~ U[:, z_t] ----------------------------
    def next_token_filter(self) -> RankFilter:
        return RankFilter(self)

    def _tables(self, temperature: float):
        return (CategoricalTable(self.emit.T, temperature), CategoricalTable(self.state_out, temperature),
                CategoricalTable(self.state_in, temperature))

    def sample(self, n: int, max_tokens: int, generator: torch.Generator, *, prefix: list[int] | None = None,
               temperature: float = 1.0, stop_id: int | None = None,
               stop_seqs: Sequence[Sequence[int]] = ()) -> Samples:
        word_t, state_t, rank_t = tables_at(self, temperature, self._tables)
        if prefix:
            batch = Batch.from_lists([prefix], self.device)
            init, emit, trans = self.chain(batch)
            _, alphas = chain.forward(init, emit, trans, batch.lengths, keep_alphas=True)
            first = alphas[0, -1] @ self.rank_trans  # p(q_{T+1} | prefix)
            check_continuable(first, prefix)
        else:
            first = self.rank_start
        q = CategoricalTable(first[None], temperature).draw(torch.zeros(n, dtype=torch.long, device=self.device),
                                                            generator)
        cur: dict[str, Tensor] = {}

        def emit_fn(q: Tensor) -> Tensor:
            cur["z"] = state_t.draw(q, generator)
            return word_t.draw(q, generator)

        return run_sampler(n, max_tokens, generator, q, stop_id, emit=emit_fn,
                            nxt=lambda q: rank_t.draw(cur["z"], generator), state_of=lambda q: cur["z"],
                            stop_seqs=stop_seqs)

    def onnx_tensors(self) -> dict[str, Tensor]:
        return {"start": self.rank_start, "step": self.rank_trans, "emit_by_word": self.emit}

    # -- constrained inference: the HMM of the r rank variables ---------------------------------------------
    def constraint_view(self) -> RankView:
        return RankView(self)

    def constraint_sizes(self) -> tuple[int, int, int]:
        """The product recursion runs the r-state chain of the rank variables: (r, r, r)."""
        return self.rank, self.rank, self.rank

    def tempered_copy(self, temperature: float) -> RankHMM:
        """The rank-space start, step and emissions tempered (they define the HMM its chain runs); the state-space
        factors kept."""
        def rows(w: Tensor) -> Tensor:
            return tempered_rows(w, temperature, self.dtype)

        return RankHMM({"start": self.start, "state_in": self.state_in, "state_out": self.state_out,
                        "rank_start": rows(self.rank_start[None])[0], "rank_trans": rows(self.rank_trans),
                        "emit": rows(self.emit.T).T.contiguous()})


_CORE = ("start", "state_in", "state_out", "emit", "rank_start", "rank_trans")


class RankView(DenseView):
    """rank_hmm as the r-state HMM of its rank variables: rank_start, rank_trans (r, r), emissions emit.T (r, V);
    the prefix filtered by the chain engine in rank space, words drawn from the rank variables' word tables."""

    model: RankHMM

    def __init__(self, model: RankHMM):
        super().__init__(model, model.rank_start, model.rank_trans, model.emit.T, model.emit)

    def predictive(self, prefix: list[int]) -> Tensor:
        return self.model.filtered_last(Batch.from_lists([prefix], self.device))[0] @ self.trans

    def draw_words(self, z: Tensor, generator: torch.Generator) -> Tensor:
        return tables_at(self.model, 1.0, self.model._tables)[0].draw(z, generator)


def _product64(a: Tensor, b: Tensor) -> Tensor:
    """a (n, m) @ b (m, r) in float64, over slices of m: the float64 copies are a slice's, not the matrices'
    (a rank-4,096 artifact's factors are 256 MiB each in float32). O(n m r)."""
    out = torch.zeros(a.shape[0], b.shape[1], dtype=torch.float64, device=b.device)
    step = max(1, CHECK_CHUNK // max(1, b.shape[1]))
    for lo in range(0, b.shape[0], step):
        out += a[:, lo: lo + step].double() @ b[lo: lo + step].double()
    return out


class RankFilter(NextTokenFilter):
    """`NextTokenFilter` over the rank variables q (S = r): p(x | q) = emit[x, q], q_{t+1} ~ rank_trans[q_t];
    O(r (r + V)) per row and step."""

    family: RankHMM

    def start(self) -> Tensor:
        return self.family.rank_start[None].to(self.family.dtype)

    def after(self, prefix: list[int]) -> Tensor:
        pi = self.start()
        for x in prefix:
            pi = self.step(pi, torch.tensor([x], device=pi.device))
        return pi

    def probs(self, pi: Tensor) -> Tensor:
        return pi @ self.family.emit.T

    def step(self, pi: Tensor, x: Tensor) -> Tensor:
        alpha = pi * self.family.emit[x]
        return (alpha / alpha.sum(1, keepdim=True).clamp_min(torch.finfo(pi.dtype).tiny)) @ self.family.rank_trans
