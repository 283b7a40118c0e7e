"""What a model family declares, once: the `Family` interface every family class implements.

A family class is the one declaration the CLI, the service, batch jobs and training read:
- `family`: the name written in a manifest;
- its artifact schema (`validate_tensors`) and how it loads (`from_tensors`);
- `operations` it answers (a subset of `OPERATIONS`), its `decode_methods` and `default_method`;
- `recipes`: how `latentlm train --family NAME` trains it (defaults of the shared training options);
- `importers`: commands that turn another tool's file into its artifact (`latentlm import-hmm`, ...).
The operations themselves (`op_score`, `op_posterior`, `op_decode`, `op_sample`, `op_embed`) return typed
results (`models.results`) holding plain Python numbers and lists (a log-probability may be -inf);
`latentlm.ops.format` turns them into JSON.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import Tensor

from latentlm.models.cost import Work
from latentlm.models.vocab import Vocabulary

OPERATIONS: tuple[str, ...] = ("score", "posterior", "decode", "sample", "embed", "constraint")
"""Every operation a family may offer, in the order the CLI and the API list them (`constraint`: a chain family
that supplies its product view, `ChainFamily.constraint_view`)."""

DECODE_METHODS: tuple[str, ...] = ("viterbi", "mbr")


@dataclass(frozen=True)
class Option:
    """A command-line option of an importer: `--flag` (dest `name`) with a default and help text; `required`:
    the command refuses to run without it."""

    name: str
    default: Any
    help: str
    required: bool = False


@dataclass(frozen=True)
class Importer:
    """`latentlm <command> FILE --name NAME`: read a file in another tool's format into this family's
    (tensors, vocabulary, config), or (tensors, vocabulary, config, extra files by name, e.g. `tokenizer.json`);
    the CLI checks and stores it. `read(path, **options)` raises `LatentLMError` naming the problem and writes
    nothing."""

    command: str
    help: str
    metavar: str
    read: Callable[..., tuple[dict[str, Tensor], Vocabulary, dict[str, Any]]
                   | tuple[dict[str, Tensor], Vocabulary, dict[str, Any], dict[str, bytes]]]
    options: tuple[Option, ...] = ()


@dataclass(frozen=True)
class Recipe:
    """`latentlm train --family NAME`: a training recipe writing this family's artifact, declared as data.
    - `defaults` fill the shared training options (`latentlm.training.settings.OPTIONS`) left unset;
    - `positive` names the options that must be positive integers; `check(settings)` adds the family's own checks;
    - `shape`: the options that fix the parameters' shapes (a checkpoint continues only a run with the same);
    - `options`: the recipe-specific options it takes (`bptt`, `split_at`, `export_only`, `weight_decay`,
      `weight_average`); set for another recipe they are refused;
    - `corpora`: the named corpora `--data` may give besides text files;
    - `needs`: the modules its training imports beyond the serving install (checked before any work);
    - `trainer`: the module whose training loop registers this recipe (`latentlm.training.recipes.trainer`),
      imported only when the recipe trains."""

    name: str
    defaults: dict[str, Any] = field(default_factory=dict)
    positive: tuple[str, ...] = ()
    check: Callable[[Any], None] | None = None
    shape: tuple[str, ...] = ()
    options: frozenset[str] = frozenset()
    corpora: tuple[str, ...] = ("ptb",)
    needs: tuple[str, ...] = ("matplotlib",)  # every trainer draws its training curve
    trainer: str = ""


class Family:
    """Interface of a model family (HMMs, PCFGs, LDS, n-gram). Families are listed in `models.registry`."""

    family: ClassVar[str]
    operations: ClassVar[frozenset[str]] = frozenset()
    decode_methods: ClassVar[frozenset[str]] = frozenset()
    default_method: ClassVar[str | None] = None  # what `decode` runs when the request names no method
    decode_notes: ClassVar[dict[str, str]] = {}  # method -> why this family cannot offer it
    recipes: ClassVar[tuple[Recipe, ...]] = ()
    importers: ClassVar[tuple[Importer, ...]] = ()

    @staticmethod
    def validate_tensors(tensors: dict[str, Tensor], config: dict[str, Any], vocab_size: int, where: str) -> None:
        raise NotImplementedError

    @classmethod
    def from_tensors(cls, tensors: dict[str, Tensor], config: dict[str, Any], *, device: str | torch.device = "cpu",
                     dtype: torch.dtype = torch.float32, storage_dtype: str | torch.dtype | None = None) -> Family:
        """The family instance from verified artifact tensors on `device`, computing in `dtype`. `storage_dtype`
        (`ops.STORAGE_DTYPES`; None: float32): a chain family's scoring precision
        (`ChainFamily.set_storage_dtype`); families with one precision ignore it."""
        raise NotImplementedError

    @classmethod
    def read_dtypes(cls, config: dict[str, Any], *, device: torch.device, dtype: torch.dtype,
                    storage_dtype: str | torch.dtype | None = None) -> dict[str, torch.dtype]:
        """Tensors that `from_tensors` keeps in a dtype other than their file's, by name, for the artifact
        reader to convert as it reads them (`models.store.read_weights`' `cast`), so that loading never holds
        both precisions of a large matrix. `config` is the manifest's, not yet checked. Default: none (a
        family converts after reading)."""
        return {}

    @property
    def num_states(self) -> int:
        raise NotImplementedError

    def describe(self) -> dict[str, Any]:
        """Family-specific fields for `GET /v1/models`."""
        return {"num_states": self.num_states}

    def cost(self, work: Work) -> int:
        """Estimated work of one request (`models.cost` units), known before any work: the service budgets
        and routes requests by it. Every family states its own algorithm's cost; there is no generic guess."""
        raise NotImplementedError(f"family {self.family!r} declares no cost model (Family.cost)")

    def posterior_entries(self, lengths: tuple[int, ...], top_k: int | None) -> int:
        """How many (state or span, probability) pairs a posterior of sequences of `lengths` returns with
        `top_k` per position (None: all), known before any work. Default: `num_states` per token."""
        width = self.num_states
        return (width if top_k is None else min(top_k, width)) * sum(lengths)

    # Operations used by `latentlm.ops` (CLI, service, jobs). Each takes validated token-id sequences and
    # returns one typed result (`models.results`) per input (or per sample); `latentlm.ops.format` alone writes
    # them as JSON. A family that lacks an operation leaves it out of `operations` and `latentlm.ops` answers
    # "unsupported".
    #   op_score(seqs, *, token_logprobs)            -> Score
    #   op_posterior(seqs, *, top_k)                 -> Marginals (chains) | SpanMarginals (PCFGs)
    #   op_decode(seqs, *, method)                   -> Path (Viterbi) | Decoded (MBR) | Parse (PCFGs)
    #   op_sample(*, n, max_tokens, seed, prefix, temperature, stop_id) -> Sample
    #   op_embed(seqs, *, causal)                    -> Embedding


def path_read(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Importers take a `Path`; accept a string too."""
    return lambda path, **kw: fn(Path(path), **kw)


def length_batches(seqs: list[list[int]], max_batch_tokens: int, split_rows: int | None = None
                   ) -> list[list[int]]:
    """Indices grouped into batches of similar length whose padded size stays <= max_batch_tokens; with
    `split_rows`, a batch of that many rows or more is also cut where the length passes twice its shortest
    (padding to the longest costs steps: used on CUDA, where batches are large)."""
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
    batches: list[list[int]] = []
    cur: list[int] = []
    shortest = 0
    for i in order:
        longest = len(seqs[i])  # sorted ascending: the newest is the longest
        doubled = split_rows is not None and len(cur) >= split_rows and longest > 2 * shortest
        if cur and ((len(cur) + 1) * longest > max_batch_tokens or doubled):
            batches.append(cur)
            cur = []
        if not cur:
            shortest = longest
        cur.append(i)
    if cur:
        batches.append(cur)
    return batches
