"""The operations layer, shared by the CLI, the service, batch jobs and training's evaluation: load a
model, turn inputs into token ids, run an operation in length-sorted batches (several requests' inputs
merged into one run), and write the JSON each input gets back.

Field names are the public contract (see README): score -> logprob, num_tokens, perplexity
[, tokens, token_logprobs]; decode -> states, logprob (Viterbi) / state_probs (MBR); posterior ->
marginals [{states, probs}] sorted by probability; sample -> tokens, ids, states; embed -> embeddings, dim.

JSON is written in one place, `dumps`: strict JSON (RFC 8259), UTF-8; a non-finite float (the log-probability
or perplexity of a sequence the model gives probability 0) is written as `null`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import torch

from latentlm.models import backend as dispatch
from latentlm.models.errors import InputError, LimitExceeded, UnsupportedOperation
from latentlm.models.family import OPERATIONS, Family, length_batches
from latentlm.models.registry import get_family, load_artifact
from latentlm.models.store import Artifact, model_path
from latentlm.models.vocab import Vocabulary


@dataclass
class LoadedModel:
    """A verified artifact plus its family instance on a device."""

    name: str
    artifact: Artifact
    impl: Family
    device: torch.device
    runners: dict[str, Any] = field(default_factory=dict)  # operation -> what runs it instead of `impl`
    backend_notes: dict[str, str] = field(default_factory=dict)  # operation -> why it stayed on torch

    def runner(self, op: str) -> Any:
        """What answers `op`: the ONNX Runtime scorer where one was attached (`use_onnx`), else the family."""
        return self.runners.get(op, self.impl)

    def numerics(self) -> str:
        """What this model's answers depend on besides its content, e.g. "float32-bfloat16-onnx": its dtype, the
        storage precision of its scoring (`set_storage_dtype`: float32, tfloat32, bfloat16) and whether ONNX
        Runtime scores it. Part of the response cache's key: servers set up differently never share answers."""
        dtype = str(getattr(self.impl, "dtype", "")).removeprefix("torch.")
        return "-".join(p for p in (dtype, getattr(self.impl, "precision", ""), "onnx" if self.runners else "") if p)

    def use_onnx(self, cache_dir: Path) -> None:
        """Score through onnxruntime: export the scoring graph once per content hash into `cache_dir` (reused
        while the model is unchanged) and attach an `OnnxScorer` for `score`. Families the graph does not
        cover, and every other operation, stay on torch (said in `describe()`)."""
        from latentlm import onnx_backend
        from latentlm.models import onnx_graph

        if self.family not in onnx_graph.FAMILIES:
            self.backend_notes["score"] = f"no ONNX graph for family {self.family}"
            return
        path = Path(cache_dir) / f"{self.name}-{self.content_hash[:16]}.onnx"
        if not path.is_file():
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp.onnx")
            onnx_backend.export_model(self, tmp)
            tmp.rename(path)
        self.runners["score"] = onnx_backend.OnnxScorer(path, expected_hash=self.content_hash)

    @property
    def vocab(self) -> Vocabulary:
        return self.artifact.vocab

    @property
    def family(self) -> str:
        return self.artifact.family

    @property
    def content_hash(self) -> str:
        return self.artifact.content_hash

    def describe(self) -> dict[str, Any]:
        """The `GET /v1/models` entry."""
        m = self.artifact.manifest
        family = self.impl.describe()
        # which engine answers: the family's own report (e.g. score on "lockstep" or "cuda_fused"), with the
        # operations an ONNX Runtime scorer took over marked "onnx"
        backend = {**family.pop("backend", {}), **{op: "onnx" for op in self.runners}}
        return {
            "id": self.name, "object": "model", "family": self.family, "vocab_size": len(self.vocab),
            **family,
            "operations": sorted(self.impl.operations),
            "decode_methods": sorted(self.impl.decode_methods),
            "default_method": self.impl.default_method,
            "backend": backend,
            **({"backend_notes": self.backend_notes} if self.backend_notes else {}),
            "preprocessing": m.get("preprocessing", {}),
            "content_hash": self.content_hash,
            "created": m.get("provenance", {}).get("created"),
            "provenance": m.get("provenance", {}),
        }


def resolve_device(spec: str | None) -> torch.device:
    """'auto' -> cuda when available else cpu; 'cuda' without a GPU is an error."""
    spec = (spec or "auto").lower()
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if spec.startswith("cuda") and not torch.cuda.is_available():
        raise InputError("device: 'cuda' requested but no CUDA device is available", param="device")
    if spec not in ("cpu",) and not spec.startswith("cuda"):
        raise InputError(f"device: expected auto, cpu or cuda, got {spec!r}", param="device")
    return torch.device(spec)


DTYPES = {"float32": torch.float32, "float64": torch.float64}


BACKENDS = ("torch", "onnx")
# scoring precisions of chain families (`ChainFamily.set_storage_dtype`): float32 (exact), tfloat32 (CUDA: float32
# storage, TF32 tensor-core products), bfloat16 (half the bytes of each matrix read; CUDA, and blocked_hmm on CPU,
# where the bfloat16 matrix replaces the float32 one for every operation)
STORAGE_DTYPES = dispatch.PRECISIONS
ONNX_CACHE = ".onnx"  # inside the store: exported graphs, named by model and content hash


def load_model(store: Path | str, name: str, device: str | torch.device = "cpu",
               dtype: str = "float32", backend: str = "torch",
               storage_dtype: str | torch.dtype | None = None) -> LoadedModel:
    """Verify and load `<store>/<name>` onto `device`; with `backend="onnx"`, scoring runs through
    onnxruntime (the graph exported to `<store>/.onnx/` on first use). `storage_dtype` (`STORAGE_DTYPES`; None:
    float32): the precision of a chain family's scoring (`ChainFamily.set_storage_dtype`; other families have one
    precision, the model's dtype)."""
    if backend not in BACKENDS:
        raise InputError(f"backend: expected one of {', '.join(BACKENDS)}, got {backend!r}", param="backend")
    if dtype not in DTYPES:
        raise InputError(f"dtype: expected one of {sorted(DTYPES)}, got {dtype!r}", param="dtype")
    if isinstance(storage_dtype, str) and storage_dtype not in STORAGE_DTYPES:
        raise InputError(f"storage_dtype: expected one of {', '.join(STORAGE_DTYPES)}, got {storage_dtype!r}",
                         param="storage_dtype")
    dev = torch.device(device) if not isinstance(device, torch.device) else device
    # read once, straight onto the device, each tensor in the dtype the family keeps it in
    art = load_artifact(model_path(store, name), device=dev, dtype=DTYPES[dtype], storage_dtype=storage_dtype)
    fam = get_family(art.family)
    impl = fam.from_tensors(art.tensors, art.config, device=dev, dtype=DTYPES[dtype], storage_dtype=storage_dtype)
    art.tensors.clear()  # the family holds them now (converted, for a dtype other than the file's): one copy
    model = LoadedModel(name=name, artifact=art, impl=impl, device=dev)
    if backend == "onnx":
        model.use_onnx(Path(store) / ONNX_CACHE)
    return model


def encode_inputs(vocab: Vocabulary, inputs: list[Any], *, as_ids: bool | None = None,
                  where: str = "input") -> list[list[int]]:
    """Strings (tokenised per the manifest, `<eos>` appended if trained with it) or lists of token ids
    (taken as is, each id checked against [0, V)) -> token-id lists. Errors name the item and position."""
    seqs = []
    for i, item in enumerate(inputs):
        loc = f"{where}[{i}]"
        if isinstance(item, str) and not as_ids:
            seqs.append(vocab.encode(item, where=loc))
        elif isinstance(item, str):
            try:
                ids = [int(tok) for tok in item.split()]
            except ValueError:
                bad = next(t for t in item.split() if not t.lstrip("-").isdigit())
                raise InputError(f"{loc}: {bad!r} is not an integer token id", param=where) from None
            seqs.append(vocab.check_ids(ids, where=loc))
        elif isinstance(item, list):
            seqs.append(vocab.check_ids(item, where=loc))
        else:
            raise InputError(f"{loc}: expected a string or a list of token ids", param=where)
    return seqs


def default_method(model: LoadedModel) -> str | None:
    """The decode method a request without `method` gets: the family's declared default."""
    return model.impl.default_method


def check_supported(model: LoadedModel, op: str, method: str | None = None) -> None:
    """UnsupportedOperation (400) naming what the model offers when `op` / decode `method` is not among it."""
    impl = model.impl
    if op not in impl.operations:
        raise UnsupportedOperation(
            f"model {model.name!r} (family {model.family}) does not support {op!r}; it supports "
            f"{', '.join(sorted(impl.operations)) or 'nothing'}", param="model")
    if op == "decode" and method is not None and method not in impl.decode_methods:
        if method in impl.decode_notes:
            raise UnsupportedOperation(impl.decode_notes[method], param="method")
        raise UnsupportedOperation(
            f"family {model.family} has no decode method {method!r}; use one of "
            f"{', '.join(sorted(impl.decode_methods))}", param="method")


CPU_BATCH_TOKENS = 16384  # padded tokens of one batched call on CPU (the compiled engines' sweet spot)
CUDA_BATCH_TOKENS = 1 << 18  # on CUDA: a call costs a few launches or one graph replay whatever its size, so
#                              large batches (up to `triton_chain`'s rows per graph call at 64 tokens) pay
CUDA_SPLIT_ROWS = 256  # on CUDA a length-sorted batch this large is cut where its longest would pass twice its
#                        shortest (padding to the longest costs steps), smaller ones are kept whole


def batch_tokens(device: torch.device | str, requested: int | None = None) -> int:
    """The padded-token cap of one batched call: `requested` when positive, else by device (CPU_BATCH_TOKENS,
    CUDA_BATCH_TOKENS on a GPU)."""
    if requested is not None and requested > 0:
        return int(requested)
    return CUDA_BATCH_TOKENS if torch.device(device).type == "cuda" else CPU_BATCH_TOKENS


def device_batches(seqs: list[list[int]], max_batch_tokens: int, device: torch.device | str) -> list[list[int]]:
    """Indices in length-sorted batches of at most `max_batch_tokens` padded tokens; on CUDA a batch of
    CUDA_SPLIT_ROWS+ rows is also cut where the length doubles (`length_batches`)."""
    cuda = torch.device(device).type == "cuda"
    return length_batches(seqs, max_batch_tokens, CUDA_SPLIT_ROWS if cuda else None)


def run(model: LoadedModel, op: str, seqs: list[list[int]], *, max_batch_tokens: int | None = None,
        **opts: Any) -> list[dict]:
    """Run `op` over token-id sequences in length-sorted batches; returns one dict per input in input
    order, each with `index` and the operation's fields (and `tokens` where they help). `max_batch_tokens`:
    padded tokens per batched call (None or 0: `batch_tokens` for the model's device)."""
    if op == "decode" and opts.get("method") is None:
        opts["method"] = default_method(model)
    check_supported(model, op, opts.get("method"))
    fn = getattr(model.runner(op), f"op_{op}")
    results: list[dict | None] = [None] * len(seqs)
    cap = batch_tokens(model.device, max_batch_tokens)
    for idx in device_batches(seqs, cap, model.device):
        for i, res in zip(idx, fn([seqs[i] for i in idx], **opts), strict=True):
            results[i] = res
    out = []
    for i, res in enumerate(results):
        assert res is not None
        if op == "score" and "token_logprobs" in res:
            res = {**res, "tokens": model.vocab.decode(seqs[i])}
        out.append({"index": i, **res})
    return out


MAX_STOP_SEQUENCES = 4  # as OpenAI-style servers allow
MAX_STOP_TOKENS = 64  # tokens per stop sequence


def sample(model: LoadedModel, *, n: int = 1, max_tokens: int = 32, seed: int = 0,
           prefix: str | list[int] | None = None, temperature: float = 1.0, stop_at_eos: bool = True,
           stop: str | Sequence[str | list[int]] | None = None, top_k: int | None = None,
           top_p: float | None = None) -> list[dict]:
    """n samples (continuations of `prefix` when given, which is tokenised without `<eos>`). `stop`: up to
    `MAX_STOP_SEQUENCES` stop sequences (text, tokenised without `<eos>`, or token-id lists; one string alone
    is one sequence): a sample of a chain family ends before the first place its drawn tokens spell one (the
    sequence itself left out, as OpenAI-style servers do). Cutting a drawn sample there gives exactly the
    distribution of stopping there: what follows a position never changes what precedes it. Chain families
    report each sample's `finish_reason`: "stop" (a stop sequence), "eos" (ended by `<eos>`) or "length"
    (`max_tokens` drawn). `top_k` / `top_p`: each token is drawn from the model's next-token distribution
    p(x_t | x_<t), `temperature` applied to it, cut to its `top_k` most probable tokens and to the fewest whose
    mass reaches `top_p`, as LM servers do (forward filtering; the states then from p(z | x); families with
    `predictive_sampling`: hmm, tagging_hmm, blocked_hmm). Without them a sample is drawn ancestrally, state
    then token, `temperature` applied to each table."""
    from latentlm.models.tree import PCFGOps

    check_supported(model, "sample")
    if n < 1 or max_tokens < 1:
        raise InputError("n and max_tokens must be >= 1", param="n" if n < 1 else "max_tokens")
    if not (temperature > 0 and math.isfinite(temperature)):
        raise InputError(f"temperature must be a positive finite number, got {temperature!r}", param="temperature")
    check_seed(seed)
    prefix_ids = None
    if prefix is not None and prefix != "" and prefix != []:
        if isinstance(prefix, str):
            prefix_ids = model.vocab.encode(prefix, add_eos=False, where="prefix")
        else:
            prefix_ids = model.vocab.check_ids(list(prefix), where="prefix")
    shaping = check_shaping(model, top_k, top_p)
    stops = encode_stops(model.vocab, stop)
    trees = isinstance(model.impl, PCFGOps)
    if stops and trees:
        raise UnsupportedOperation("stop: a PCFG samples whole sentences with their trees; stop sequences apply to "
                                   "the chain families", param="stop")
    stop_id = model.vocab.eos_id if stop_at_eos else None
    res = model.impl.op_sample(n=n, max_tokens=max_tokens, seed=seed, prefix=prefix_ids, temperature=temperature,
                               stop_id=stop_id, **({"stop_seqs": stops} if stops else {}), **shaping)
    if not trees:
        res = [cut_at_stop(r, stops, stop_id, max_tokens) for r in res]
    return [{"index": i, "tokens": model.vocab.decode(r["ids"]), **r} for i, r in enumerate(res)]


def check_shaping(model: LoadedModel, top_k: Any, top_p: Any) -> dict[str, Any]:
    """`sample`'s top_k / top_p as keyword arguments of `op_sample` (none when both are None); InputError naming
    the field for a top_k that is not a positive integer or a top_p outside (0, 1], UnsupportedOperation for a
    family that samples only ancestrally."""
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise InputError(f"top_k: expected a positive integer, got {top_k!r}", param="top_k")
    if top_p is not None and (isinstance(top_p, bool) or not isinstance(top_p, (int, float))
                              or not 0 < top_p <= 1):
        raise InputError(f"top_p: expected a number in (0, 1], got {top_p!r}", param="top_p")
    given = {k: v for k, v in (("top_k", top_k), ("top_p", top_p)) if v is not None}
    if given and not getattr(model.impl, "predictive_sampling", False):
        name = next(iter(given))
        raise UnsupportedOperation(f"{name}: family {model.family!r} samples ancestrally only (state, then token); "
                                   "sampling from the next-token distribution (top_k, top_p) is offered by hmm, "
                                   "tagging_hmm and blocked_hmm", param=name)
    return given


def encode_stops(vocab: Vocabulary, stop: Any) -> list[list[int]]:
    """Token-id lists of `sample`'s stop sequences; InputError naming `stop` (or `stop[i]`) for anything but a
    string, or a list of up to `MAX_STOP_SEQUENCES` non-empty strings or token-id lists of at most
    `MAX_STOP_TOKENS` tokens."""
    if stop is None:
        return []
    items = [stop] if isinstance(stop, str) else stop
    if not isinstance(items, list) or len(items) > MAX_STOP_SEQUENCES:
        raise InputError(f"stop: expected a string or a list of at most {MAX_STOP_SEQUENCES} strings or token-id "
                         f"lists, got {stop!r}"[:300], param="stop")
    out = []
    for i, item in enumerate(items):
        where = f"stop[{i}]" if not isinstance(stop, str) else "stop"
        if isinstance(item, str):
            words = vocab.tokenize(item)
            unknown = next((w for w in words if w not in vocab.index), None)
            if unknown is not None:  # it would match <unk>: a sample never spells the word itself
                raise InputError(f"{where}: {unknown!r} is not in the model's vocabulary, so no sample spells it "
                                 f"(write {vocab.tokens[vocab.unk_id]!r} to stop at an unknown word)"
                                 if vocab.unk_id is not None else f"{where}: {unknown!r} is not in the model's "
                                 "vocabulary, so no sample spells it", param="stop")
            ids = [vocab.index[w] for w in words]
        elif isinstance(item, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in item):
            ids = list(item)
            if ids and not all(0 <= t < len(vocab) for t in ids):
                raise InputError(f"{where}: token ids must lie in [0, {len(vocab)}), got {item!r}"[:300], param="stop")
        else:
            raise InputError(f"{where}: expected a string or a list of token ids, got {item!r}"[:300], param="stop")
        if not 1 <= len(ids) <= MAX_STOP_TOKENS:
            raise InputError(f"{where}: a stop sequence needs 1 to {MAX_STOP_TOKENS} tokens, got {len(ids)}",
                             param="stop")
        out.append(ids)
    return out


def cut_at_stop(sample: dict, stops: list[list[int]], stop_id: int | None, max_tokens: int) -> dict:
    """A chain family's drawn sample {"ids", "states"} cut before the first stop sequence its ids spell (the
    first to be complete; of those complete at the same token, the longest), with its `finish_reason` ("stop",
    "eos" or "length"). O(len(ids) x total stop length)."""
    ids = sample["ids"]
    for end in range(1, len(ids) + 1):  # the first place a stop sequence is complete; there, the longest one
        hit = max((len(s) for s in stops if len(s) <= end and ids[end - len(s): end] == s), default=0)
        if hit:
            keep = end - hit
            return {**sample, "ids": ids[:keep], "states": sample["states"][:keep], "finish_reason": "stop"}
    eos = stop_id is not None and bool(ids) and ids[-1] == stop_id
    return {**sample, "finish_reason": "eos" if eos else "length"}


MAX_SEED = 1 << 63  # seeds are 0 <= seed < 2^63 (torch's generator takes 64 bits; JSON clients often only 63)


def check_seed(seed: Any) -> int:
    """InputError naming `seed` unless it is an integer in [0, 2^63) (torch raises ValueError beyond 64 bits)."""
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise InputError(f"seed: expected an integer, got {seed!r}", param="seed")
    if not 0 <= seed < MAX_SEED:
        raise InputError(f"seed: must be in [0, 2^63), got {seed}", param="seed")
    return seed


def posterior_entries(model: LoadedModel, seqs: Sequence[Sequence[int]], top_k: int | None) -> int:
    """How many (state or span, probability) pairs a posterior of `seqs` returns, known before any work: per
    token min(top_k, states listed) for chain families, per sentence of n tokens min(top_k, n(n-1)/2) spans
    for PCFGs. The service bounds it (`max_posterior_entries`): with every state, the response of a long
    input is gigabytes."""
    from latentlm.models.tree import PCFGOps

    if isinstance(model.impl, PCFGOps):
        spans = (len(s) * (len(s) - 1) // 2 for s in seqs)
        return sum(n if top_k is None else min(top_k, n) for n in spans)
    width = model.impl.states_per_token
    return (width if top_k is None else min(top_k, width)) * sum(len(s) for s in seqs)


# -- cost estimates ----------------------------------------------------------------------------------
# A request's work is estimated before it runs, in multiply-add-like units ("cost"): the service refuses a
# request above its budget (`max_request_cost`) and sends requests above `heavy_request_cost` to the heavy lane.
# The model is the algorithm's own: chains tokens x width^2 (width: the states one step of the recursion spans:
# Z for a dense HMM, the k states of a cluster for a blocked HMM, the rank r for a rank-space HMM; Viterbi over
# a rank-space HMM's m states builds an m x m matrix per token: m^2 r), PCFGs n^3/6 split points x the rule work
# of a split per sentence (dense: nt x S^2; rank: r, plus n^2 x r x S for the terminals), sampling n x
# max_tokens steps (plus the prefix) with a fixed per-step overhead, and a floor per token for the work around
# the recursion (tokenising, writing the response).
TOKEN_COST = 5_000  # per input token (encoding, copying), whatever the model
OUTPUT_TOKEN_COST = 200_000  # per token whose result is a list (posterior, MBR, embed): building the objects
ENTRY_COST = 20_000  # per (state, probability) entry or embedding value returned
SAMPLE_STEP_COST = 3_000_000  # per sampling step (one Python-level step of the sampler, vectorised over n)
PCFG_VITERBI_FACTOR = 10  # max-product charts are not GEMMs: measured ~10x the inside pass per rule product


def chain_width(impl: Any) -> int:
    """States one step of a chain recursion spans (see above)."""
    from latentlm.models.rank_hmm import RankHMM

    if isinstance(impl, RankHMM):
        return int(impl.rank)
    return int(getattr(impl, "states_per_token", None) or impl.num_states)


def operation_cost(model: LoadedModel, op: str, seqs: Sequence[Sequence[int]] = (), *,
                   method: str | None = None, top_k: int | None = None, n: int = 1, max_tokens: int = 0,
                   prefix_tokens: int = 0, predictive: bool = False) -> int:
    """Estimated work of `op` over `seqs` (or, for `sample`, of n x max_tokens steps after a prefix of
    `prefix_tokens`; `predictive`: drawn from the next-token distribution, top_k / top_p), in the units above
    (~0.05-0.1 ns each on one AVX2 core); known before any work."""
    from latentlm.models.dense_pcfg import DensePCFG
    from latentlm.models.lds import LDS
    from latentlm.models.ngram import NGramLM
    from latentlm.models.rank_hmm import RankHMM
    from latentlm.models.tree import PCFGOps

    impl = model.impl
    lengths = [len(s) for s in seqs]
    ntok = sum(lengths)
    if op == "decode" and method is None:
        method = default_method(model)
    if isinstance(impl, PCFGOps):
        S = impl.nt + impl.pt
        if op == "sample":
            return int(n * max_tokens * (S * S + TOKEN_COST) + 8 * SAMPLE_STEP_COST)
        if op == "decode" and method == "viterbi":
            split = PCFG_VITERBI_FACTOR * impl.nt * S * S
        else:
            split = impl.nt * S * S if isinstance(impl, DensePCFG) else impl.chart_width
        out = ENTRY_COST // 2 if op in ("posterior", "decode") else 0  # spans listed per sentence
        work = sum(L * (L * L - 1) // 6 * split + L * L * (impl.chart_width * S + out) for L in lengths)
        return int(work + TOKEN_COST * ntok)
    if op == "sample":
        w = chain_width(impl)
        step = w * (impl.num_states + len(model.vocab)) if predictive else w * w  # filtering: K (Z + V)
        return int(max_tokens * (SAMPLE_STEP_COST + n * (step + TOKEN_COST)) + prefix_tokens * (w * w + TOKEN_COST))
    if op == "embed" and isinstance(impl, LDS):
        d = impl.num_states
        lags = int((getattr(impl, "config", None) or {}).get("lags") or 1)
        return int(ntok * (d * d * lags + OUTPUT_TOKEN_COST + ENTRY_COST * d))
    if isinstance(impl, NGramLM):
        return int(ntok * (64 * getattr(impl, "order", 3) + TOKEN_COST))
    w = chain_width(impl)
    K = int(getattr(impl, "states_per_token", None) or impl.num_states)  # states listed per token
    rank_m = impl.num_states if isinstance(impl, RankHMM) else None
    if op == "score":
        per = w * w + TOKEN_COST
    elif op == "decode" and method == "viterbi":
        per = (rank_m * rank_m * (w + 1) if rank_m else 2 * w * w) + 30_000
    else:  # posterior, MBR decode, embed: forward + backward + the marginals over the listed states
        if op == "embed":
            vecs = (getattr(impl, "extras", None) or {}).get("state_vectors")
            listed = int(vecs.shape[1]) if vecs is not None else K
        else:
            listed = 1 if op == "decode" else K if top_k is None else min(top_k, K)
        per = 2 * w * w + (2 * w * rank_m if rank_m else 0) + K + OUTPUT_TOKEN_COST + ENTRY_COST * listed
    return int(ntok * per)


def posterior_chunks(model: LoadedModel, seqs: list[list[int]], top_k: int | None, positions: int = 1024,
                     offset: int = 0):
    """Posterior results of `seqs` in pieces, for streaming: yields dicts `{"index", "offset", "marginals"}` of
    at most `positions` tokens each (chain families; the marginals of a long sequence are formatted piece by
    piece from the tensor, never all as Python objects at once) or `{"index", "spans"}` per sentence (PCFGs).
    Concatenating a sequence's pieces gives exactly `run(model, "posterior", ...)`'s answer. `offset` is added
    to the indices."""
    from latentlm.models.base import Batch, ChainOps

    check_supported(model, "posterior")
    impl = model.runner("posterior")
    if not isinstance(impl, ChainOps):
        for r in run(model, "posterior", seqs, top_k=top_k):
            r["index"] += offset
            yield r
        return
    with torch.no_grad():
        ids, probs = impl.posterior(Batch.from_lists(seqs, impl.device))
    K = probs.shape[-1]
    k = K if top_k is None else min(top_k, K)
    for i, s in enumerate(seqs):
        for t0 in range(0, len(s), positions):
            t1 = min(len(s), t0 + positions)
            p, j = probs[i, t0:t1].topk(k, dim=-1)  # as op_posterior: sorted by probability
            states = ids[i, t0:t1].gather(-1, j)
            p, states = p.double().cpu().tolist(), states.cpu().tolist()
            yield {"index": offset + i, "offset": t0,
                   "marginals": [{"states": st, "probs": pr} for st, pr in zip(states, p, strict=True)]}
        if not s:
            yield {"index": offset + i, "offset": 0, "marginals": []}


def parse_top_k(value: Any) -> int | None:
    """'all' / None -> None (every state); positive int -> int."""
    if value is None or value == "all":
        return None
    try:
        k = int(value)
    except (TypeError, ValueError):
        raise InputError(f"top_k: expected a positive integer or 'all', got {value!r}", param="top_k") from None
    if k < 1:
        raise InputError(f"top_k: must be >= 1, got {k}", param="top_k")
    return k


def run_merged(model: LoadedModel, op: str, groups: Sequence[list[list[int]]], *,
               max_batch_tokens: int | None = None, **opts: Any) -> list[list[dict] | Exception]:
    """Several requests' inputs (`groups`, each a list of token-id sequences) in one `run`; each group gets
    its own results renumbered from 0. When the merged run raises, each group runs alone, so one bad request
    never fails its neighbours: a group's entry is then its own results or its exception."""
    seqs = [s for g in groups for s in g]
    try:
        results = run(model, op, seqs, max_batch_tokens=max_batch_tokens, **opts)
    except Exception as e:
        if len(groups) == 1:
            return [e]
        return [run_merged(model, op, [g], max_batch_tokens=max_batch_tokens, **opts)[0] for g in groups]
    out: list[list[dict] | Exception] = []
    pos = 0
    for g in groups:
        part = results[pos : pos + len(g)]
        pos += len(g)
        for j, r in enumerate(part):  # fresh dicts from run: renumber within the request in place
            r["index"] = j
        out.append(part)
    return out


def _finite(x: Any) -> Any:
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_finite(v) for v in x]
    return x


def dumps(obj: Any) -> bytes:
    """Strict JSON (UTF-8 bytes, compact); NaN and +-inf become null. orjson (it writes non-finite floats as
    null itself, and is ~20x faster than the json module on a score response); the json module for what
    orjson does not take (e.g. integers beyond 64 bits)."""
    try:
        return orjson.dumps(obj)
    except TypeError:
        return json.dumps(_finite(obj), ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()


__all__ = ["LoadedModel", "load_model", "encode_inputs", "run", "run_merged", "sample", "resolve_device",
           "batch_tokens", "device_batches",
           "parse_top_k", "check_seed", "posterior_entries", "operation_cost", "posterior_chunks", "dumps",
           "default_method", "LimitExceeded", "OPERATIONS"]
