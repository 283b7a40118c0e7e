"""What every family offers, and the shared implementation for the HMM-like families.

A `ChainFamily` subclass supplies only its view of a batch for the chain engine (`chain`, `log_chain`)
and how reduced states map back to its state ids (`state_ids`); score, posterior, Viterbi, MBR and
sampling come from here and from `models.chain`. A family that lists `constraint` in its operations also supplies
its view for the product recursions of `models.constrained` (`constraint_view`, `tempered_copy`, and
`constraint_sizes` where its chain is not its states).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch
from torch import Tensor

from latentlm.models import backend as dispatch
from latentlm.models import calibrate as calibration
from latentlm.models import chain
from latentlm.models.backend import Backend
from latentlm.models.chain import Emit, Trans
from latentlm.models.chain_view import ChainView
from latentlm.models.cost import ENTRY_COST, OUTPUT_TOKEN_COST, SAMPLE_STEP_COST, TOKEN_COST, Work, product_cost
from latentlm.models.errors import InputError
from latentlm.models.family import Family
from latentlm.models.results import Decoded, Embedding, Marginals, Path, Sample, Score
from latentlm.models.sampling import CategoricalTable, Samples, draw_rows, run_sampler, slot_to_token, truncated
from latentlm.models.sampling import tempered as tempered_weights


@dataclass
class Batch:
    """Right-padded token ids (B, T) int64 and their lengths (B,) on one device."""

    ids: Tensor
    lengths: Tensor

    @classmethod
    def from_lists(cls, seqs: list[list[int]], device: torch.device | str = "cpu") -> Batch:
        if not seqs:
            raise InputError("input: no sequences", param="input")
        for i, s in enumerate(seqs):
            if len(s) == 0:
                raise InputError(f"input[{i}]: empty sequence", param="input")
        lengths = [len(s) for s in seqs]
        T = max(lengths)
        # one numpy conversion for the padded batch (8x faster than a tensor copy per row: it matters in a busy
        # server, where every interpreter step may wait for the GIL)
        padded = [s if len(s) == T else [*s, *([0] * (T - len(s)))] for s in seqs]
        ids = torch.from_numpy(np.array(padded, dtype=np.int64))
        return cls(ids.to(device), torch.tensor(lengths, dtype=torch.long).to(device))

    @property
    def mask(self) -> Tensor:
        return chain.valid_mask(self.lengths, self.ids.shape[1])


def top_marginals(ids: Tensor, probs: Tensor, top_k: int | None) -> tuple[Tensor, Tensor]:
    """The `top_k` (None: all K) most probable states per position, sorted by probability: (states (..., k) int64,
    probs (..., k) float64), both on CPU, from state ids and marginals (..., K). O(K log k) per position."""
    K = probs.shape[-1]
    k = K if top_k is None else min(top_k, K)
    p, j = probs.topk(k, dim=-1)
    return ids.gather(-1, j).cpu(), p.double().cpu()


class ChainOps:
    """Mixin giving ChainFamily the `op_*` methods used by `latentlm.ops` (CLI and service); each returns one
    typed result (`models.results`) per input."""

    def op_score(self, seqs: list[list[int]], *, token_logprobs: bool = False) -> list[Score]:
        logp, cond = self.score(Batch.from_lists(seqs, self.device))
        logps = logp.double().cpu().tolist()  # plain floats at once: no tensor indexing per sequence
        conds = cond.double().cpu().tolist() if token_logprobs else None
        return [Score(lp, len(s), None if conds is None else conds[i][: len(s)])
                for i, (s, lp) in enumerate(zip(seqs, logps, strict=True))]

    def op_posterior(self, seqs: list[list[int]], *, top_k: int | None = None) -> list[Marginals]:
        ids, probs = self.posterior(Batch.from_lists(seqs, self.device))
        states, p = top_marginals(ids, probs, top_k)
        return [Marginals(states[i, : len(s)].tolist(), p[i, : len(s)].tolist()) for i, s in enumerate(seqs)]

    def op_decode(self, seqs: list[list[int]], *, method: str = "viterbi") -> list[Path] | list[Decoded]:
        batch = Batch.from_lists(seqs, self.device)
        if method == "viterbi":
            path, logp = self.viterbi(batch)
            path, logp = path.cpu(), logp.double().cpu()
            return [Path(path[i, : len(s)].tolist(), logp[i].item()) for i, s in enumerate(seqs)]
        states, p = self.mbr(batch)
        states, p = states.cpu(), p.double().cpu()
        return [Decoded(states[i, : len(s)].tolist(), float(p[i, : len(s)].sum()), state_probs=p[i, : len(s)].tolist())
                for i, s in enumerate(seqs)]

    def op_sample(self, *, n: int, max_tokens: int, seed: int, prefix: list[int] | None = None,
                  temperature: float = 1.0, stop_id: int | None = None,
                  stop_seqs: Sequence[Sequence[int]] = (), top_k: int | None = None,
                  top_p: float | None = None) -> list[Sample]:
        """n samples; with `top_k` or `top_p`, each token drawn from the shaped next-token distribution
        (`sample_predictive`), otherwise ancestrally (`sample`)."""
        g = torch.Generator(device=self.device).manual_seed(seed)
        if top_k is not None or top_p is not None:
            s = self.sample_predictive(n, max_tokens, g, prefix=prefix, temperature=temperature, top_k=top_k,
                                       top_p=top_p, stop_id=stop_id, stop_seqs=stop_seqs)
        else:
            s = self.sample(n, max_tokens, g, prefix=prefix, temperature=temperature, stop_id=stop_id,
                            stop_seqs=stop_seqs)
        ids, states, lengths = s.ids.cpu(), s.states.cpu(), s.lengths.cpu()
        return [Sample(ids[i, : lengths[i]].tolist(), states=states[i, : lengths[i]].tolist()) for i in range(n)]

    def op_embed(self, seqs: list[list[int]], *, causal: bool = False) -> list[Embedding]:
        """Posterior-weighted average of the `state_vectors` extra (Z, d): sum_z p(z_t | x) v_z, or with
        `causal` the filtered p(z_t | x_<=t). O(T K^2 + T K d) per sequence."""
        vecs = self.extras["state_vectors"]
        batch = Batch.from_lists(seqs, self.device)
        if causal:
            init, emit, trans = self.chain(batch)
            _, probs = chain.forward(init, emit, trans, batch.lengths, keep_alphas=True)
            ids = self.state_ids(batch)
        else:
            ids, probs = self.posterior(batch)
        vecs = vecs.to(probs.dtype)
        if probs.shape[-1] == vecs.shape[0]:  # every state present: scatter to state order, one GEMM
            e = torch.zeros_like(probs).scatter_(-1, ids, probs) @ vecs
        else:  # reduced state spaces (blocked): per position, so memory stays O(B K d)
            e = torch.stack([torch.einsum("bk,bkd->bd", probs[:, t], vecs[ids[:, t]]) for t in range(ids.shape[1])], 1)
        e = e.double().cpu()
        return [Embedding(e[i, : len(s)].tolist(), vecs.shape[1]) for i, s in enumerate(seqs)]


class ChainOperations:
    """`operations` of a chain family: the base set, plus "embed" on instances whose `extras` hold
    `state_vectors` (Z, d) (DenseHMM, neural blocked HMM). A family adds to it in its declaration, e.g.
    `operations = ChainOperations(ChainFamily.operations | {"constraint"})`."""

    def __init__(self, base: frozenset[str]):
        self.base = base

    def __get__(self, obj: Any, cls: type | None = None) -> frozenset[str]:
        if obj is not None and "state_vectors" in getattr(obj, "extras", {}):
            return self.base | {"embed"}
        return self.base


def tempered_rows(w: Tensor, temperature: float, dtype: torch.dtype) -> Tensor:
    """Each row of non-negative weights w (n, C) raised to 1 / temperature and renormalised (in float64, without
    overflow: `sampling.tempered`), in `dtype`: a tempered factor of a chain family (`ChainFamily.tempered`)."""
    t = tempered_weights(w.to(torch.float64).clamp_min(0), temperature)
    return (t / t.sum(1, keepdim=True)).to(dtype)


def check_continuable(first: Tensor, prefix: list[int] | None) -> None:
    """InputError naming `prefix` unless `first`, the distribution sampling starts from, has positive finite
    mass (a prefix of probability 0 under the model leaves none)."""
    total = float(first.double().sum())
    if prefix and not (math.isfinite(total) and total > 0):
        raise InputError("prefix: has probability 0 under this model (no state path emits it), so there is "
                         "nothing to continue", param="prefix")


class ChainFamily(ChainOps, Family):
    """Shared operations of HMM-like families over the chain engine."""

    operations = ChainOperations(frozenset({"score", "posterior", "decode", "sample"}))  # type: ignore[assignment]
    decode_methods = frozenset({"viterbi", "mbr"})
    default_method = "viterbi"
    device: torch.device
    dtype: torch.dtype
    has_fused_score: bool = False  # `score_fused` exists (`triton_chain`; rank_hmm, blocked_hmm)
    storage_dtype: torch.dtype = torch.float32  # of the matrices on the fused scoring path only (`set_storage_dtype`)
    allow_tf32: bool = False  # fused scoring path: matrix products on TF32 tensor cores (`set_storage_dtype`)
    onnx_layout: ClassVar[str | None] = None  # the ONNX scoring graph of its chain (`onnx_tensors`), None: none

    # -- what a family supplies ---------------------------------------------------------------------
    def chain(self, batch: Batch) -> tuple[Tensor, Emit, Trans]:
        """(init (B, K), emit (B, T, K) or a `chain.RowLookup`, trans) in the family's reduced state space."""
        raise NotImplementedError

    def log_chain(self, batch: Batch) -> tuple[Tensor, Emit, Trans]:
        """Log-space (log_init, log_emit (B, T, K) or a `chain.RowLookup`, log_trans) over the *model states* for
        Viterbi."""
        raise NotImplementedError

    def state_ids(self, batch: Batch) -> Tensor:
        """(B, T, K) global state id of each reduced state (dense: arange(Z))."""
        raise NotImplementedError

    @property
    def states_per_token(self) -> int:
        """K: how many states a token's posterior lists when every state is asked for (the last dimension of
        `state_ids`); every state unless the family reduces the state space per token."""
        return self.num_states

    @property
    def step_width(self) -> int:
        """States one step of the recursion spans: Z for a dense HMM, a cluster's k for a blocked one (the
        cost model's width; rank-space: the rank)."""
        return int(self.states_per_token)

    def viterbi_step_cost(self) -> int:
        """Work of one Viterbi step (max-product over the step's width)."""
        return 2 * self.step_width ** 2

    def marginal_step_cost(self) -> int:
        """Work of one forward-backward step, marginals included."""
        return 2 * self.step_width ** 2 + self.states_per_token

    def cost(self, work: Work) -> int:
        """tokens x width^2 per pass (score one, posterior/MBR two), plus what the response lists; sampling:
        max_tokens steps of n rows (filtering K (Z + V) per step when drawn from the next-token distribution);
        constraint: the product recursion over `constraint_sizes` (`cost.product_cost`)."""
        w, K = self.step_width, int(self.states_per_token)
        if work.op == "constraint":  # the product recursion of `models.constrained` over this chain's sizes
            return product_cost(*self.constraint_sizes(), work)
        if work.op == "sample":
            step = w * (self.num_states + work.vocab_size) if work.predictive else w * w
            return int(work.max_tokens * (SAMPLE_STEP_COST + work.n * (step + TOKEN_COST))
                       + work.prefix_tokens * (w * w + TOKEN_COST))
        if work.op == "score":
            per = w * w + TOKEN_COST
        elif work.op == "decode" and work.method == "viterbi":
            per = self.viterbi_step_cost() + 30_000
        else:  # posterior, MBR decode, embed: forward + backward + the marginals over the listed states
            if work.op == "embed":
                vecs = self.extras.get("state_vectors") if isinstance(getattr(self, "extras", None), dict) else None
                listed = int(vecs.shape[1]) if vecs is not None else K
            else:
                listed = 1 if work.op == "decode" else K if work.top_k is None else min(work.top_k, K)
            per = self.marginal_step_cost() + OUTPUT_TOKEN_COST + ENTRY_COST * listed
        return int(work.tokens * per)

    def posterior_entries(self, lengths: tuple[int, ...], top_k: int | None) -> int:
        width = int(self.states_per_token)
        return (width if top_k is None else min(top_k, width)) * sum(lengths)

    def sampling_tables(self, temperature: float) -> tuple[CategoricalTable, CategoricalTable, Tensor | None]:
        """(transition table over states, emission table per state, slot->token map (Z, W) or None)."""
        raise NotImplementedError

    def filtered_last(self, batch: Batch) -> Tensor:
        """p(z_T | x) at each sequence's last position (B, K) over its reduced states (`state_ids`), 0 for an
        impossible sequence. O(B T K^2)."""
        batch = self.to(batch)
        init, emit, trans = self.chain(batch)
        last = torch.zeros(len(batch.lengths), emit.shape[-1], dtype=self.dtype, device=self.device)
        chain.forward(init, emit, trans, batch.lengths, out_last=last)
        return last

    def predictive(self, prefix: list[int]) -> Tensor:
        """p(z_{T+1} | prefix) over model states (Z,)."""
        batch = Batch.from_lists([prefix], self.device)
        last = self.filtered_last(batch)[0]
        ids = self.state_ids(batch)[0, -1]
        full = torch.zeros(self.num_states, dtype=self.dtype, device=self.device)
        full[ids] = last
        return full @ self.trans

    def start_probs(self) -> Tensor:
        return self.start

    def onnx_tensors(self) -> dict[str, Tensor]:
        """The tensors `models.onnx_graph` builds this model's scoring graph from, by `onnx_layout`: "shared" (one
        step for every position) `start` (K,), `step` (K, K), `emit_by_word` (V, K); "blocked" (a k x k block per
        cluster pair) `start` (Z,), `trans_blocks` (M, k, M, k) [c_prev, i, c_next, j], `emit` (V, k),
        `word_cluster` (V,) int64. A family that declares an `onnx_layout` supplies them."""
        raise NotImplementedError(f"family {self.family!r} has no ONNX scoring graph")

    # -- constrained inference (`models.constrained`) ---------------------------------------------------
    def constraint_view(self) -> ChainView:
        """This model as the product recursions of `models.constrained` read it: S states with a start, a
        transition (S, S) and emissions (S, V) (`models.chain_view`). A family that lists `constraint` in its
        `operations` supplies it."""
        raise NotImplementedError(f"family {self.family!r} supplies no constraint view")

    def constraint_sizes(self) -> tuple[int, int, int]:
        """(S: states of the chain the product recursion runs, the width of its filter step, the states one word's
        emission touches), known before any work; here (Z, step_width, step_width): dense (Z, Z, Z), blocked
        (Z, k, k). A family whose view runs another chain (rank_hmm: its r rank variables) says so."""
        return int(self.num_states), self.step_width, self.step_width

    def tempered(self, temperature: float) -> ChainFamily:
        """The model with each factor tempered: its start, each transition row and each state's emission
        distribution raised to 1 / temperature and renormalised (`tempered_rows`), so that draws from the
        constrained distribution are exact draws of a well-defined HMM (not p(y | x)^(1/T), which does not factor
        over states). The model itself at temperature 1; InputError naming `temperature` unless it is positive and
        finite. O(size of the model's tensors)."""
        if temperature == 1.0:
            return self
        if not (temperature > 0 and math.isfinite(temperature)):
            raise InputError(f"temperature: must be a positive number, got {temperature}", param="temperature")
        return self.tempered_copy(temperature)

    def tempered_copy(self, temperature: float) -> ChainFamily:
        """`tempered` at a temperature other than 1 (checked): a new instance over tempered tensors. A family
        that lists `constraint` in its `operations` supplies it."""
        raise NotImplementedError(f"family {self.family!r} supplies no tempered copy")

    def score_fused(self, batch: Batch) -> tuple[Tensor, Tensor]:
        """`score` on the fused CUDA path (`models.triton_chain`), in `storage_dtype`; families with
        `has_fused_score` supply it."""
        raise NotImplementedError

    # -- engine choice ------------------------------------------------------------------------------
    def set_storage_dtype(self, value: torch.dtype | str | None) -> None:
        """Precision of the fused scoring path: "float32" (default, exact), "tfloat32" (float32 storage, the
        matrix products on TF32 tensor cores; opt-in) or "bfloat16" (opt-in; its error bound is
        `backend.BF16_TOKEN_ABS_BOUND` per token). Every other path stays in the model's dtype (a family may apply it
        to a CPU path too: blocked_hmm's `score`)."""
        self.allow_tf32 = isinstance(value, str) and value.lower() == "tfloat32"
        self.storage_dtype = dispatch.storage_dtype("float32" if self.allow_tf32 else value)

    @property
    def precision(self) -> str:
        """The precision `set_storage_dtype` was given, by name ("float32", "tfloat32", "bfloat16")."""
        return "tfloat32" if self.allow_tf32 else str(self.storage_dtype).removeprefix("torch.")

    def _grad(self) -> bool:
        return torch.is_grad_enabled() and any(isinstance(v, Tensor) and v.requires_grad for v in vars(self).values())

    def score_backend(self, backend: Backend | str = Backend.AUTO, width: int = 0) -> Backend:
        """The engine `score` runs on for a batch `width` positions wide (`backend.score` decides)."""
        return dispatch.score(backend, device=self.device, dtype=self.dtype, fused=self.has_fused_score,
                              grad=self._grad(), width=width)

    def backends(self) -> dict[str, str]:
        """What `describe` reports: the engine of `score` for a batch of a few short sequences on this model's
        device ("cuda_fused", "lockstep", "torch", ...; the chain engine still decides per call) and the
        storage dtype it scores in."""
        engine = self.score_backend()
        if engine is Backend.CUDA_FUSED:
            return {"score": engine.value, "storage_dtype": self.precision}
        rows = dispatch.LOCKSTEP_MIN_ROWS
        batch = Batch(torch.zeros(rows, 1, dtype=torch.long, device=self.device),
                      torch.ones(rows, dtype=torch.long, device=self.device))
        init, emit, trans = self.chain(batch)
        engine = dispatch.sum_product(Backend.AUTO, emit, trans, init, rows=rows)
        out: dict[str, Any] = {"score": engine.value, "storage_dtype": str(self.dtype).removeprefix("torch.")}
        if isinstance(trans, Tensor) and trans.device.type == "cpu":
            out.update(calibration.describe(trans.shape[-1], trans.dtype))
        return out

    def calibrate(self) -> dict[str, Any] | None:
        """Measure which batch engine and BLAS is fastest for this model's matrix on this machine
        (`models.calibrate`); the choice then holds for every model of that size and dtype in the process.
        Returns what `backends` reports, or None where nothing compiled can run (GPU, per-step matrices)."""
        batch = Batch(torch.zeros(1, 1, dtype=torch.long, device=self.device),
                      torch.ones(1, dtype=torch.long, device=self.device))
        _, _, trans = self.chain(batch)
        if not isinstance(trans, Tensor) or calibration.calibrate(trans.detach()) is None:
            return None
        return calibration.describe(trans.shape[-1], trans.dtype)

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "backend": self.backends()}

    # -- operations ---------------------------------------------------------------------------------
    def to(self, batch: Batch) -> Batch:
        return Batch(batch.ids.to(self.device), batch.lengths.to(self.device))

    def score(self, batch: Batch, *, backend: Backend | str = Backend.AUTO) -> tuple[Tensor, Tensor]:
        """log p(x) (B,) float64 (summed in float64) and per-token log p(x_t | x_<t) (B, T) (0 at padding).
        O(T K^2) per sequence. `backend` as in `models.backend.score`: "cuda_fused" (auto on CUDA for the
        families that have it) runs `score_fused`, any other the chain engine's `forward`."""
        batch = self.to(batch)
        engine = self.score_backend(backend, batch.ids.shape[1])
        if engine is Backend.CUDA_FUSED:
            logp, log_cond = self.score_fused(batch)
            return logp, log_cond.to(self.dtype)
        init, emit, trans = self.chain(batch)
        log_cond, _ = chain.forward(init, emit, trans, batch.lengths, backend=engine)
        return log_cond.double().sum(1), log_cond

    def posterior(self, batch: Batch) -> tuple[Tensor, Tensor]:
        """State marginals p(z_t | x) as (state ids (B, T, K), probs (B, T, K)); probs 0 at padding."""
        batch = self.to(batch)
        init, emit, trans = self.chain(batch)
        gamma, _ = chain.posterior(init, emit, trans, batch.lengths)
        return self.state_ids(batch), gamma

    def viterbi(self, batch: Batch) -> tuple[Tensor, Tensor]:
        """Best state path (B, T) (-1 at padding) and its joint log p(x, z) (B,)."""
        batch = self.to(batch)
        log_init, log_emit, log_trans = self.log_chain(batch)
        return chain.viterbi(log_init, log_emit, log_trans, batch.lengths)

    def mbr(self, batch: Batch) -> tuple[Tensor, Tensor]:
        """Per-position argmax of the marginals (B, T) (-1 at padding) and the chosen marginal (B, T)."""
        ids, probs = self.posterior(batch)
        p, k = probs.max(-1)
        states = ids.gather(-1, k.unsqueeze(-1)).squeeze(-1)
        states = torch.where(batch.mask.to(states.device), states, torch.full_like(states, -1))
        return states, p

    def sample(self, n: int, max_tokens: int, generator: torch.Generator, *, prefix: list[int] | None = None,
               temperature: float = 1.0, stop_id: int | None = None,
               stop_seqs: Sequence[Sequence[int]] = ()) -> Samples:
        """Draw n continuations of `prefix` (or unconditional samples) of up to `max_tokens` tokens;
        a sample ends after `stop_id` when given, or once it completes one of `stop_seqs` (`run_sampler`).
        O(n max_tokens) draws, each O(1) or O(sqrt C) (C: the row's categories, `sampling.CategoricalTable`),
        O(C) at a temperature other than 1 on a large table."""
        trans_table, emit_table, slot_token = self.sampling_tables(temperature)
        first = self._first_states(prefix)
        first_table = CategoricalTable(first[None].to(torch.float64), temperature)
        z = first_table.draw(torch.zeros(n, dtype=torch.long, device=self.device), generator)
        return run_sampler(n, max_tokens, generator, z, stop_id,
                           emit=lambda z: slot_to_token(emit_table.draw(z, generator), z, slot_token),
                           nxt=lambda z: trans_table.draw(z, generator), stop_seqs=stop_seqs)

    def _first_states(self, prefix: list[int] | None) -> Tensor:
        """p(z_1) (Z,), or p(z_{T+1} | prefix); InputError naming `prefix` when the model gives it probability 0
        (no state path emits it), where there is nothing to continue."""
        first = self.predictive(prefix) if prefix else self.start_probs()
        check_continuable(first, prefix)
        return first

    # -- sampling from the next-token distribution (top_k / top_p) --------------------------------------
    predictive_sampling: bool = False  # the family supplies the four hooks below

    def next_token_filter(self) -> NextTokenFilter | None:
        """Forward filtering over this model's next-token distributions (`NextTokenFilter`), or None where the
        family has none."""
        return NextTokenFilter(self) if self.predictive_sampling else None

    def _token_probs(self, pi: Tensor) -> Tensor:
        """p(x_t | x_<t) (n, V) from pi (n, Z) = p(z_t | x_<t)."""
        raise NotImplementedError

    def _condition(self, pi: Tensor, x: Tensor) -> tuple[Tensor, Tensor]:
        """(alpha (n, K) proportional to p(z_t | x_<=t) over the states that can emit x (n,), their global ids
        (n, K))."""
        raise NotImplementedError

    def _propagate(self, alpha: Tensor, ids: Tensor) -> Tensor:
        """pi (n, Z) = sum_i alpha[:, i] trans[ids[:, i], :] (alpha normalised)."""
        raise NotImplementedError

    def _trans_into(self, ids: Tensor, z_next: Tensor) -> Tensor:
        """trans[ids[b, i], z_next[b]] (n, K)."""
        raise NotImplementedError

    def sample_predictive(self, n: int, max_tokens: int, generator: torch.Generator, *,
                          prefix: list[int] | None = None, temperature: float = 1.0, top_k: int | None = None,
                          top_p: float | None = None, stop_id: int | None = None,
                          stop_seqs: Sequence[Sequence[int]] = ()) -> Samples:
        """n continuations drawn token by token from the model's next-token distribution p(x_t | x_<t) as LM
        samplers shape it (`sampling.truncated`: temperature, `top_k`, `top_p`), carried by forward filtering
        (pi = p(z_t | x_<t), updated by each drawn token); each sample's states are then drawn from the
        model's posterior p(z | x) by backward sampling. Per step and sample O(K (Z + V)) (K: the states one
        token can be emitted by: Z dense, k blocked)."""
        cur: dict[str, Tensor] = {"pi": self._first_states(prefix).to(self.dtype).expand(n, -1)}
        history: list[tuple[Tensor, Tensor]] = []

        def emit(_: Tensor) -> Tensor:
            x = draw_rows(truncated(self._token_probs(cur["pi"]), temperature, top_k, top_p), generator)
            alpha, ids = self._condition(cur["pi"], x)
            history.append((alpha / alpha.sum(1, keepdim=True), ids))
            return x

        def nxt(z: Tensor) -> Tensor:
            cur["pi"] = self._propagate(*history[-1])
            return z

        out = run_sampler(n, max_tokens, generator, torch.zeros(n, dtype=torch.long, device=self.device), stop_id,
                          emit=emit, nxt=nxt, stop_seqs=stop_seqs)
        z = torch.zeros(n, dtype=torch.long, device=self.device)
        for t in range(len(history) - 1, -1, -1):  # backward sampling: z_t ~ alpha_t(z) trans(z, z_{t+1})
            alpha, ids = history[t]
            w = alpha.double()
            inner = t + 1 < out.lengths
            if t + 1 < len(history):
                w = torch.where(inner[:, None], w * self._trans_into(ids, z).double(), w)
            z = ids.gather(1, draw_rows(w, generator)[:, None]).squeeze(1)
            out.states[:, t] = torch.where(t < out.lengths, z, -1)
        return out


class NextTokenFilter:
    """Forward filtering for p(x_t | x_<t), step by step: `start()` pi_1 (1, S), `after(prefix)` pi after a prefix
    (1, S), `probs(pi)` p(x_t | x_<t) (n, V) from pi (n, S), `step(pi, x)` pi_{t+1} (n, S) given the tokens x (n,).
    Here S = Z, through the family's sampling hooks: O(K (Z + V)) per row and step (K: the states one token can be
    emitted by: Z dense, k blocked). A family with another state space (rank_hmm's rank variables) subclasses it."""

    def __init__(self, family: ChainFamily):
        self.family = family

    def start(self) -> Tensor:
        return self.family.start_probs()[None].to(self.family.dtype)

    def after(self, prefix: list[int]) -> Tensor:
        """pi after `prefix` (1, S): the family's predictive distribution (one batched forward pass)."""
        if not prefix:
            return self.start()
        return self.family.predictive(prefix)[None].to(self.family.dtype)

    def probs(self, pi: Tensor) -> Tensor:
        return self.family._token_probs(pi)

    def step(self, pi: Tensor, x: Tensor) -> Tensor:
        alpha, ids = self.family._condition(pi, x)
        return self.family._propagate(alpha / alpha.sum(1, keepdim=True).clamp_min(torch.finfo(pi.dtype).tiny), ids)
