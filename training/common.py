"""Habits shared by every trainer: seeds, length-bucketed batches, progress bar, checkpoints
(safetensors + JSON, no pickle), early stopping, the training-curve PNG and the export call."""

from __future__ import annotations

import io
import json
import math
import os
import random
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor

from latentlm.models.base import Batch
from latentlm.training.recipes import recipes, recipes_with

if TYPE_CHECKING:
    from latentlm.training.options import TrainSettings

STATE_EMBEDDINGS = ("factored", "independent", "tied")  # blocked_hmm's state parameterisations (neural.VLHMM)


@dataclass
class Interrupt:
    """Whether Ctrl-C (SIGINT) asked a training loop to stop (`graceful_interrupt`)."""

    requested: bool = False


@contextmanager
def graceful_interrupt() -> Iterator[Interrupt]:
    """Within the block, a first Ctrl-C sets `requested` (the loop finishes its step, evaluates, checkpoints and
    exports its best evaluation) and a second raises KeyboardInterrupt as usual. Outside the main thread (where
    signal handlers cannot be set) it never fires."""
    flag = Interrupt()
    if threading.current_thread() is not threading.main_thread():
        yield flag
        return

    def handler(signum: int, frame: Any) -> None:
        if flag.requested:
            raise KeyboardInterrupt
        flag.requested = True
        print("\ninterrupted: finishing this step, then evaluating and exporting the best evaluation so far "
              "(Ctrl-C again to abort without exporting)", file=sys.stderr, flush=True)

    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield flag
    finally:
        signal.signal(signal.SIGINT, previous)


def seed_all(seed: int) -> torch.Generator:
    """Seed python, torch (CPU and CUDA); returns a torch Generator seeded with `seed`."""
    random.seed(seed)
    torch.manual_seed(seed)
    return torch.Generator().manual_seed(seed)


def resolve_device(spec: str) -> torch.device:
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(spec)


def bucket_batches(seqs: list[list[int]], batch: int, generator: torch.Generator | None = None,
                   device: torch.device | str = "cpu") -> list[Batch]:
    """Length-bucketed batches of `batch` sentences (sorted by length, so padding is small), in a random
    order when `generator` is given. O(N log N)."""
    order = sorted(range(len(seqs)), key=lambda i: (len(seqs[i]), i))
    groups = [order[i : i + batch] for i in range(0, len(order), batch)]
    if generator is not None:
        perm = torch.randperm(len(groups), generator=generator).tolist()
        groups = [groups[i] for i in perm]
    return [Batch.from_lists([seqs[i] for i in g], device) for g in groups]


def num_tokens(seqs: list[list[int]]) -> int:
    return sum(len(s) for s in seqs)


def evaluate(score: Callable[[Batch], Tensor], batches: list[Batch]) -> float:
    """Corpus perplexity exp(-sum log p / tokens) given `score(batch) -> log p per sequence (B,)`."""
    total, n = 0.0, 0
    with torch.no_grad():
        for b in batches:
            total += float(score(b).double().sum())
            n += int(b.lengths.sum())
    return math.exp(-total / n)


# -- the process ----------------------------------------------------------------------------------------
def clip_grad_norm(parameters: Iterable[torch.nn.Parameter], max_norm: float) -> Tensor:
    """`torch.nn.utils.clip_grad_norm_` with the same bits; returns the total L2 norm as a 0-dim tensor (on the
    gradients' device: reading it is the caller's one host sync). Torch multiplies all gradients by
    min(1, max_norm / (norm + 1e-6)) unconditionally; x * 1.0 == x, so on a CPU that pass is skipped when the
    factor is 1 (about 0.5 ms of a 40 ms step for 4 million parameters), while on a GPU it runs, as in torch,
    since deciding would wait on the device."""
    params = [p for p in parameters if p.grad is not None]
    if not params:
        return torch.zeros(())
    total = torch.nn.utils.get_total_norm([p.grad for p in params])
    if total.device.type != "cpu" or bool(max_norm / (total + 1e-6) < 1.0):  # the comparison torch's clamp makes
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total


def reuse_freed_memory() -> bool:
    """Make glibc's malloc serve every allocation from its heap and keep freed memory there (mallopt
    M_MMAP_MAX = 0, M_TRIM_THRESHOLD = -1: never trim). A training step allocates and frees the same large
    tensors every time; above glibc's 32 MiB mmap ceiling (4,096^2 float32 = 64 MiB: the transition logits of
    an 8,192-state VL-HMM under state dropout) each one is a fresh mapping whose pages fault in one by one,
    ~100k page faults and ~0.3 s of kernel time per step there. Trimming is off, not only raised to the
    largest threshold mallopt takes (2 GiB): at 32,768 states the step frees more than 2 GiB at the heap's top
    (each transition-sized tensor is 1 GiB), and giving it back made every step fault it in again (5.2 against
    2.9 s per step). The process keeps its peak heap until it exits. Allocations the heap cannot hold still
    fall back to mmap. Returns False where there is no glibc (then nothing changes)."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    if not sys.platform.startswith("linux") or name is None:
        return False
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError):
        return False
    M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4
    return bool(mallopt(M_MMAP_MAX, 0)) and bool(mallopt(M_TRIM_THRESHOLD, -1))  # -1: never trim (mallopt(3))


# -- growing models (--split-at) ---------------------------------------------------------------------
@dataclass(frozen=True)
class Splits:
    """When a growing VL-HMM doubles its states (`--split-at`): at the start of the epochs `at`, or, `by_budget`,
    at the first epoch start after the fraction `at[i]` of the training budget is spent (`budget_used`: epochs,
    steps or wall time against their limits), so that a time-limited schedule keeps its shape on a machine of
    any speed."""

    at: tuple[float, ...] = ()
    by_budget: bool = False

    def __len__(self) -> int:
        return len(self.at)

    def due(self, done: int, epoch: int, used: float) -> bool:
        """Whether split number `done` (0-based; `done` splits made so far) is due at the start of `epoch` with
        the fraction `used` of the budget spent."""
        if done >= len(self.at):
            return False
        return used >= self.at[done] if self.by_budget else epoch >= self.at[done]

    def describe(self, done: int) -> str:
        """The splits still to come, for a progress label ('' when none)."""
        ahead = self.at[done:]
        if not ahead:
            return ""
        if self.by_budget:
            return f" (x2 at {', '.join(f'{100 * a:g}%' for a in ahead)} of the budget)"
        return f" (x2 at epoch {', '.join(str(int(a)) for a in ahead)})"


def split_plan(ns: TrainSettings) -> Splits:
    """`--split-at`, checked: epochs ("20,60": distinct, in [1, epochs)) or shares of the training budget ("10%,30%":
    distinct, in (0%, 100%)); blocked_hmm only; the starting model (states / 2^splits) still has whole clusters
    that keep a state under dropout."""
    from latentlm.models.errors import InputError

    if not ns.split_at:
        return Splits()
    items = [x.strip() for x in str(ns.split_at).strip("[] ").split(",") if x.strip()]
    by_budget = any(x.endswith("%") for x in items)
    try:
        if by_budget and not all(x.endswith("%") for x in items):
            raise ValueError
        at = [float(x[:-1]) / 100 for x in items] if by_budget else [int(x) for x in items]
    except ValueError:
        raise InputError(f"--split-at: expected comma-separated epochs (20,60) or shares of the budget (10%,30%), "
                         f"got {ns.split_at!r}", param="split_at") from None
    if "split_at" not in recipes()[ns.family].options:
        raise InputError(f"--split-at: only {' and '.join(recipes_with('split_at'))} splits its states, not "
                         f"{ns.family}", param="split_at")
    if by_budget:
        if len(set(at)) != len(at) or any(not 0 < a < 1 for a in at):
            raise InputError(f"--split-at: expected distinct shares of the budget between 0% and 100%, got "
                             f"{ns.split_at!r}", param="split_at")
    elif len(set(at)) != len(at) or any(not 1 <= e < ns.epochs for e in at):
        raise InputError(f"--split-at: expected distinct epochs in [1, {ns.epochs}) (--epochs {ns.epochs}), got "
                         f"{ns.split_at!r}", param="split_at")
    start, clusters = ns.states >> len(at), ns.clusters or 1
    k = start // clusters
    if start << len(at) != ns.states or k < 1 or start % clusters or k - round(k * ns.state_dropout) < 1:
        raise InputError(f"--split-at: {len(at)} split(s) need --states {ns.states} to be {2 ** len(at)} x a "
                         f"multiple of --clusters {clusters} whose states per cluster keep one under "
                         f"--state-dropout {ns.state_dropout}", param="split_at")
    return Splits(tuple(sorted(at)), by_budget)


# -- checkpoints --------------------------------------------------------------------------------------
def checkpoint_dir(store: Path | str, name: str) -> Path:
    """Where `name`'s training checkpoint lives: `<store>/.train/<name>/` (hidden from the model list)."""
    return Path(store) / ".train" / name


_DESCRIBE = {"states": "{} states", "clusters": "{} clusters", "rank": "rank {}", "hidden": "hidden size {}",
             "nt": "{} nonterminals", "pt": "{} preterminals", "dim": "latent dimension {}", "lags": "{} lags",
             "split_at": "--split-at {!r}"}


def shape_keys(family: str) -> tuple[str, ...]:
    """The settings that fix recipe `family`'s parameter shapes (`Recipe.shape`): a checkpoint only continues
    the run that wrote it."""
    recipe = recipes().get(family)
    return recipe.shape if recipe is not None else ()


def shape_settings(ns: TrainSettings) -> dict[str, Any]:
    """`family` and the shape settings of `ns` (what `save_checkpoint` records and `check_resume` compares)."""
    return {"family": ns.family, **{k: getattr(ns, k) for k in shape_keys(ns.family)}}


def _inferred_settings(path: Path) -> dict[str, Any]:
    """Shape settings of a checkpoint written before they were recorded (EM families: from `best_trans`)."""
    from safetensors import safe_open

    try:
        with safe_open(str(path / "tensors.safetensors"), "pt") as f:
            keys = set(f.keys())
            if "best_trans" not in keys:
                return {}
            family = "densehmm" if any(k.startswith("model.") for k in keys) else "hmm"
            return {"family": family, "states": int(f.get_slice("best_trans").get_shape()[0])}
    except OSError:
        return {}


def check_resume(ns: TrainSettings) -> None:
    """For `--resume`: refuse (InputError naming the flag) when the checkpoint of `ns.name` was written with
    another family or other shape settings than `ns` asks for, before any data is read. Without this the
    parameters would silently take the checkpoint's shapes while the settings (and the progress label,
    the manifest) say otherwise."""
    from latentlm.models.errors import InputError

    if not ns.resume:
        return
    path = checkpoint_dir(ns.store, ns.name)
    if not (path / "state.json").is_file():
        raise InputError(f"--resume: no checkpoint for {ns.name!r} in {path}", param="resume")
    state = json.loads((path / "state.json").read_text("utf-8"))
    saved = state.get("settings") or _inferred_settings(path)
    want = shape_settings(ns)
    fam = saved.get("family")
    if fam is not None and fam != want["family"]:
        raise InputError(f"--family: the checkpoint of {ns.name!r} is a {fam} run, not {want['family']}; "
                         f"drop --resume or use --family {fam}", param="family")
    for key in shape_keys(ns.family):
        have = saved.get(key)
        if have is not None and have != want[key]:
            flag = "--" + key.replace("_", "-")
            shown = repr(have) if isinstance(have, str) else have  # --split-at '' (no splits)
            raise InputError(f"{flag}: the checkpoint of {ns.name!r} has {_DESCRIBE[key].format(have)}, not "
                             f"{want[key]}; drop --resume or use {flag} {shown}", param=key)


def save_checkpoint(path: Path, tensors: dict[str, Tensor], state: dict[str, Any], ns: TrainSettings | None = None
                    ) -> None:
    """Write tensors.safetensors + state.json atomically (state.json last, so it marks completeness).
    With the run's settings `ns`, state.json records its shape settings for `check_resume`."""
    if ns is not None:
        state = {**state, "settings": shape_settings(ns)}
    path.mkdir(parents=True, exist_ok=True)
    tmp = path / "tensors.safetensors.tmp"
    save_file({k: v.detach().cpu().clone().contiguous() for k, v in tensors.items()}, str(tmp))
    os.replace(tmp, path / "tensors.safetensors")
    tmp = path / "state.json.tmp"
    tmp.write_text(json.dumps(state, indent=1), encoding="utf-8")
    os.replace(tmp, path / "state.json")


def load_checkpoint(path: Path) -> tuple[dict[str, Tensor], dict[str, Any]]:
    return load_file(str(path / "tensors.safetensors")), json.loads((path / "state.json").read_text("utf-8"))


def rng_tensors(gen: torch.Generator) -> dict[str, Tensor]:
    """The random state a resume must restore, as uint8 tensors: `gen` ("rng"), torch's global CPU
    generator ("torch_rng", used by nn.Dropout and torch.rand without a generator) and, when CUDA is in
    use, the current device's generator ("cuda_rng")."""
    out = {"rng": gen.get_state(), "torch_rng": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda_rng"] = torch.cuda.get_rng_state()
    return out


def restore_rng(gen: torch.Generator, tensors: dict[str, Tensor]) -> None:
    """Inverse of `rng_tensors` (entries missing from older checkpoints are left alone)."""
    gen.set_state(tensors["rng"])
    if "torch_rng" in tensors:
        torch.set_rng_state(tensors["torch_rng"])
    if "cuda_rng" in tensors and torch.cuda.is_available():
        torch.cuda.set_rng_state(tensors["cuda_rng"])


def optimizer_tensors(opt: torch.optim.Optimizer) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """Flatten an optimizer's state into safetensors-able tensors + JSON scalars (no pickle)."""
    sd = opt.state_dict()
    tensors, scalars = {}, {}
    for pid, st in sd["state"].items():
        for k, v in st.items():
            if isinstance(v, Tensor):
                tensors[f"opt.{pid}.{k}"] = v
            else:
                scalars[f"{pid}.{k}"] = v
    return tensors, {"scalars": scalars, "param_groups": sd["param_groups"]}


def restore_optimizer(opt: torch.optim.Optimizer, tensors: dict[str, Tensor], meta: dict[str, Any]) -> None:
    state: dict[int, dict[str, Any]] = {}
    for key, v in tensors.items():
        if key.startswith("opt."):
            _, pid, k = key.split(".", 2)
            state.setdefault(int(pid), {})[k] = v
    for key, v in meta["scalars"].items():
        pid, k = key.split(".", 1)
        state.setdefault(int(pid), {})[k] = v
    opt.load_state_dict({"state": state, "param_groups": meta["param_groups"]})


# -- progress, history, early stopping ----------------------------------------------------------------
@dataclass
class History:
    """Training curve: one row per evaluation (step, epoch, tokens, seconds, train loss, valid ppl)."""

    rows: list[dict[str, float]] = field(default_factory=list)
    best: float = math.inf
    bad_evals: int = 0

    def add(self, **row: float) -> bool:
        """Record a row; returns True when validation perplexity improved."""
        self.rows.append(row)
        ppl = row.get("valid_ppl", math.inf)
        if ppl < self.best - 1e-9:
            self.best, self.bad_evals = ppl, 0
            return True
        self.bad_evals += 1
        return False

    def to_json(self) -> dict[str, Any]:
        return {"rows": self.rows, "best": self.best, "bad_evals": self.bad_evals}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> History:
        return cls(list(d["rows"]), float(d["best"]), int(d["bad_evals"]))


class Progress:
    """tqdm bar over training tokens showing tokens/s, loss and the last validation perplexity."""

    def __init__(self, total_tokens: int, desc: str, enabled: bool = True, initial: int = 0):
        from tqdm.auto import tqdm

        self.bar = tqdm(total=total_tokens, initial=initial, desc=desc, unit="tok", unit_scale=True,
                        disable=not enabled, dynamic_ncols=True, mininterval=0.5)
        self.t0 = time.perf_counter()
        self.done = 0
        self.post: dict[str, str] = {}

    def update(self, tokens: int, loss: float | None = None, valid_ppl: float | None = None) -> None:
        self.done += tokens
        dt = max(time.perf_counter() - self.t0, 1e-9)
        self.post["tok/s"] = f"{self.done / dt:,.0f}"
        if loss is not None:
            self.post["loss"] = f"{loss:.3f}"
        if valid_ppl is not None:
            self.post["val_ppl"] = f"{valid_ppl:.1f}"
        self.bar.set_postfix(self.post, refresh=False)
        self.bar.update(tokens)

    def relabel(self, desc: str) -> None:
        """Change the bar's label (a model that grows mid-run says its new size)."""
        self.bar.set_description(desc, refresh=False)

    def close(self) -> None:
        self.bar.close()


def curve_png(history: History, title: str) -> bytes:
    """Training curve (validation perplexity and training loss per evaluation) as PNG bytes (Agg)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = history.rows
    x = [r.get("tokens", i) for i, r in enumerate(rows)]
    fig, ax = plt.subplots(figsize=(6, 4), dpi=100)
    ax.plot(x, [r.get("valid_ppl", math.nan) for r in rows], "o-", label="valid perplexity")
    train = [r.get("train_ppl", math.nan) for r in rows]
    if any(not math.isnan(v) for v in train):
        ax.plot(x, train, "s--", label="train perplexity")
    later = [r.get("valid_ppl", math.nan) for r in rows[1:]] + [v for v in train[1:] if not math.isnan(v)]
    later = [v for v in later if math.isfinite(v)]
    if later and rows and rows[0].get("valid_ppl", 0) > 3 * max(later):  # a random start would squash the plot
        ax.set_ylim(min(later) * 0.9, max(later) * 1.2)
        ax.annotate(f"start: {rows[0]['valid_ppl']:.3g}", xy=(0.02, 0.95), xycoords="axes fraction", va="top")
    ax.set_xlabel("training tokens")
    ax.set_ylabel("perplexity")
    ax.set_yscale("log")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend()
    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return buf.getvalue()


def series_png(ys: list[float], *, xs: list[float] | None = None, xlabel: str, ylabel: str, title: str) -> bytes:
    """One curve (e.g. an EM objective per iteration) as PNG bytes (Agg backend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.2), dpi=100)
    ax.plot(list(range(len(ys))) if xs is None else xs, ys, marker="o")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return buf.getvalue()


def provenance(ns: TrainSettings, history: History, seconds: float, extra: dict[str, Any] | None = None,
               more_settings: dict[str, Any] | None = None) -> dict[str, Any]:
    """What the manifest records about training: settings (with a trainer's own fixed ones, `more_settings`),
    data, time, final validation perplexity."""
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in {**asdict(ns), **(more_settings or {})}.items()}
    return {"source": "latentlm train", "settings": settings, "train_seconds": round(seconds, 1),
            "best_valid_ppl": history.best, "curve": history.rows[-50:], **(extra or {})}


def epochs_iter(start_epoch: int, epochs: int) -> Iterator[int]:
    return iter(range(start_epoch, epochs))
