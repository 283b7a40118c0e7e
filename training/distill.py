"""`latentlm distill`: an HMM distilled from the user's language model (GeLaTo / Ctrl-G's recipe).

1. The LM (`--lm DIR`, a local `save_pretrained` directory) is checked and the run's memory estimated before any
   work (`distill_sampling.inspect_lm`, `memory_estimate`).
2. Samples: `--samples` training and `--valid-samples` held-out sequences of at most `--max-length` tokens, in
   resumable shards under the work directory (`<store>/.distill/<name>/` or `--work-dir`; `distill_sampling`).
3. Initialisation: LVD (k-means of the LM's hidden states, `distill_init`) or random.
4. EM over the LM's token ids (`distill_em`), validation perplexity after each step, a checkpoint after each step
   (a rerun with the same settings continues it; more `--em-steps` extend it); `--time-limit` (minutes from the
   start of the command: sampling is never cut, EM is) and Ctrl-C stop EM cleanly, a step in progress finishing on
   the samples it has read, as Ctrl-G's steps each read a chunk of the samples.
5. Export: a dense `hmm` carrying the LM's `tokenizer.json` (`notes/tokenizer_contract`), `curve.png`,
   `curve.json`, and provenance naming the LM (directory, config and tokenizer hashes) and the recipe. The model
   exported is the EM step with the best validation perplexity (`best.safetensors` in the work directory), as
   `latentlm train` exports its best evaluation.

Under `torchrun` (`training.distributed`) every rank draws its own shards of samples (shard i on rank i mod W, each
seeded by its index: the samples do not depend on W), each E-step reads its rank's shards and the counts are
summed; rank 0 initialises (LVD), evaluates and writes. The work directory must be one every rank sees (a shared
filesystem across machines).

`--family blocked_hmm` replaces steps 3-5 by the neural trainer over Brown clusters of the token ids
(`distill_blocked`); its memory estimate is its own.
"""

from __future__ import annotations

import gc
import json
import math
import os
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from latentlm.models.errors import InputError, LimitExceeded
from latentlm.models.registry import save_artifact
from latentlm.models.store import check_name
from latentlm.models.tokenizer import TOKENIZER_FILE
from latentlm.training import common, distributed
from latentlm.training import distill_blocked as blocked
from latentlm.training import distill_sampling as sampling
from latentlm.training.distill_em import (
    EM_BYTES_PER_ENTRY,
    ESTEP_BYTES_PER_CELL,
    Counts,
    Params,
    accumulate,
    m_step,
    perplexity,
    random_params,
    sample_batches,
    unigram_counts,
    unigram_perplexity,
)
from latentlm.training.distill_init import lvd_params

GIB = 1 << 30
FAMILIES = ("hmm", "blocked_hmm")
INITS = ("lvd", "random")
ESTEP_BUDGET = {"cpu": 256 << 20, "cuda": 2 << 30}  # the E-step workspace `--batch-size 0` aims at
HMM_DEFAULTS = {"em_steps": 10, "pseudocount": 0.1, "init": "lvd", "lvd_samples": 10000, "kmeans_iters": 25,
                "batch_size": 0}  # --family hmm's own settings (None: its default here; refused for blocked_hmm)
BLOCKED_ONLY = ("clusters", "epochs", "lr")  # --family blocked_hmm's own settings (the trainer's defaults)


@dataclass
class DistillSettings:
    """Everything `latentlm distill` takes (the CLI's flags, by name). A family's own settings left None take the
    family's defaults (`HMM_DEFAULTS`, filled in for --family hmm; the trainer's for blocked_hmm); given to the
    other family they are refused."""

    lm: Path
    name: str
    store: Path
    states: int
    samples: int
    max_length: int
    seed: int = 0
    family: str = "hmm"
    prompts: Path | None = None
    time_limit: float | None = None  # minutes
    device: str = "auto"
    valid_samples: int | None = None  # default: min(20000, max(100, samples // 10))
    em_steps: int | None = None  # hmm: 10
    pseudocount: float | None = None  # hmm: 0.1
    init: str | None = None  # hmm: "lvd"
    lvd_samples: int | None = None  # hmm: 10000
    kmeans_iters: int | None = None  # hmm: 25
    batch_size: int | None = None  # hmm: E-step rows per batch; 0 (the default): what ESTEP_BUDGET allows
    clusters: int | None = None  # blocked_hmm: Brown clusters (default `distill_blocked.default_clusters`)
    epochs: int | None = None  # blocked_hmm: passes over the samples (the trainer's default, 10)
    lr: float | None = None  # blocked_hmm: AdamW's learning rate (the trainer's default, 0.01)
    sample_batch: int = 64
    shard_size: int = 10000
    work_dir: Path | None = None
    max_memory: float | None = None  # GiB; default: what the device has available
    progress: bool = True

    def __post_init__(self) -> None:
        if self.family == "hmm":
            for key, value in HMM_DEFAULTS.items():
                if getattr(self, key) is None:
                    setattr(self, key, value)

    @property
    def valid_count(self) -> int:
        return self.valid_samples if self.valid_samples is not None else min(20000, max(100, self.samples // 10))

    def check(self) -> None:
        """Refuse bad settings before any work, naming the flag."""
        check_name(self.name)
        if self.family not in FAMILIES:
            raise InputError(f"--family: one of {', '.join(FAMILIES)}, got {self.family!r}", param="family")
        hmm = self.family == "hmm"
        for key in BLOCKED_ONLY if hmm else HMM_DEFAULTS:
            if getattr(self, key) is not None:
                raise InputError(f"--{key.replace('_', '-')}: only for --family {'blocked_hmm' if hmm else 'hmm'} ("
                                 + ("a dense hmm is trained by EM: --em-steps, --pseudocount, --init" if hmm else
                                    "a blocked_hmm is trained by the gradient trainer: --clusters, --epochs, --lr")
                                 + ")", param=key)
        if hmm and self.init not in INITS:
            raise InputError(f"--init: one of {', '.join(INITS)}, got {self.init!r}", param="init")
        for key in ("states", "samples", "max_length", "sample_batch", "shard_size", *(("lvd_samples",) * hmm)):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise InputError(f"--{key.replace('_', '-')}: must be a positive integer, got {v!r}", param=key)
        for key in (*(("em_steps", "batch_size", "kmeans_iters") * hmm), "valid_count"):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                name = "valid_samples" if key == "valid_count" else key
                raise InputError(f"--{name.replace('_', '-')}: must be a non-negative integer, got {v!r}", param=name)
        if self.valid_count < 1:
            raise InputError("--valid-samples: at least 1 (validation perplexity is measured on them)",
                             param="valid_samples")
        if hmm and not (self.pseudocount >= 0 and math.isfinite(self.pseudocount)):
            raise InputError(f"--pseudocount: must be >= 0, got {self.pseudocount}", param="pseudocount")
        if not hmm:
            blocked.check(self)
        if self.time_limit is not None and not self.time_limit > 0:
            raise InputError(f"--time-limit: minutes, > 0, got {self.time_limit}", param="time_limit")
        if self.max_memory is not None and not self.max_memory > 0:
            raise InputError(f"--max-memory: GiB, > 0, got {self.max_memory}", param="max_memory")


# -- memory -----------------------------------------------------------------------------------------------
def available_memory(device: torch.device) -> int:
    """Bytes free for this run on `device`: CUDA's free memory; on CPU psutil's `available` where installed,
    else /proc/meminfo's MemAvailable, else free pages (os.sysconf)."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except ImportError:
        pass
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def estep_batch(s: DistillSettings, device: torch.device) -> int:
    """E-step rows per batch: `--batch-size`, or as many as keep the (B, L, Z) workspace in ESTEP_BUDGET."""
    if s.batch_size:
        return s.batch_size
    per_row = ESTEP_BYTES_PER_CELL * s.max_length * s.states
    return max(1, min(1024, ESTEP_BUDGET.get(device.type, ESTEP_BUDGET["cpu"]) // per_row))


def memory_estimate(s: DistillSettings, info: sampling.LMInfo, batch: int) -> dict[str, int]:
    """Bytes the run holds at its peak, by part: EM's parameters and expected counts (EM_BYTES_PER_ENTRY per entry
    of Z x (Z + V)), the E-step's workspace (B x L x Z cells), and, while the LM is loaded (sampling, LVD), its
    weights plus the LVD hidden states (tokens x d float32)."""
    Z, V = s.states, info.vocab_size
    em = EM_BYTES_PER_ENTRY * Z * (Z + V + 1)
    estep = ESTEP_BYTES_PER_CELL * batch * s.max_length * Z
    lm = sum(size for size, _ in info.weight_files.values())
    lvd = 4 * min(s.lvd_samples, s.samples) * s.max_length * info.hidden_size if s.init == "lvd" else 0
    lvd_phase = lm + lvd + (12 * Z * (Z + V) if s.init == "lvd" else 0)  # counts and parameters of the LVD M-step
    return {"em": em, "estep": estep, "lm": lm, "lvd": lvd, "total": max(em + estep, lvd_phase)}


def check_memory(s: DistillSettings, info: sampling.LMInfo, device: torch.device, batch: int) -> dict[str, Any]:
    """Refuse (LimitExceeded naming --states) a run whose estimate exceeds the memory available (or --max-memory).
    `batch`: E-step rows (hmm) or the clusters (blocked_hmm, `distill_blocked.check_memory`)."""
    avail = int(s.max_memory * GIB) if s.max_memory is not None else available_memory(device)
    if s.family == "blocked_hmm":
        return blocked.check_memory(s, info, device, batch, avail)
    est = memory_estimate(s, info, batch)
    if est["total"] > avail:
        raise LimitExceeded(
            f"--states {s.states}: distilling needs about {est['total'] / GIB:.2f} GiB on {device.type} "
            f"(EM over {s.states} states x {info.vocab_size} tokens: {est['em'] / GIB:.2f} GiB of parameters and "
            f"expected counts, {est['estep'] / GIB:.2f} GiB of E-step workspace for {batch} rows; the LM and LVD's "
            f"hidden states {(est['lm'] + est['lvd']) / GIB:.2f} GiB) but {avail / GIB:.2f} GiB is "
            f"{'allowed (--max-memory)' if s.max_memory is not None else 'available'}; lower --states "
            "(or --batch-size, --lvd-samples)", param="states")
    return {"estimate_bytes": est["total"], "available_bytes": avail}


# -- the run ---------------------------------------------------------------------------------------------
def _log(msg: str) -> None:
    if distributed.launched_rank() == 0:  # under torchrun rank 0 alone reports
        print(f"distill: {msg}", file=sys.stderr, flush=True)


def _key(what: dict[str, Any]) -> str:
    import hashlib

    return hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()[:16]


class Run:
    """One `latentlm distill` run: its settings, the LM, the work directory and what it measured."""

    def __init__(self, s: DistillSettings):
        self.t0 = time.perf_counter()
        s.check()
        self.s = s
        self.info = sampling.inspect_lm(s.lm)
        self.prompts, self.prompts_sha = sampling.read_prompts(s.prompts, self.info) if s.prompts else (None, None)
        self.world = distributed.world(s.device)
        if self.world.size > 1 and s.family != "hmm":
            raise InputError(f"--family {s.family}: under torchrun distill trains the dense hmm by EM; run "
                             f"{s.family} in one process", param="family")
        self.device = self.world.device
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise InputError("--device cuda: no CUDA device here", param="device")
        self.clusters = blocked.clusters_for(s, self.info) if s.family == "blocked_hmm" else 0
        self.batch = estep_batch(s, self.device) if s.family == "hmm" else 0
        self.memory = check_memory(s, self.info, self.device, self.batch or self.clusters)
        self.work = Path(s.work_dir) if s.work_dir else Path(s.store) / ".distill" / s.name
        self.sample_key = sampling.sample_key(self.info, max_length=s.max_length, seed=s.seed,
                                              shard_size=s.shard_size, batch=s.sample_batch,
                                              prompts_sha=self.prompts_sha)
        self.sample_dir = self.work / "samples" / self.sample_key
        self.model = None
        self.record: dict[str, Any] = {}

    def lm(self):
        if self.model is None:
            _log(f"loading {self.info.model_type} from {self.info.path} on {self.device}")
            self.model = sampling.load_model(self.info, self.device)
        return self.model

    def free_lm(self) -> None:
        self.model = None
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def split(self, name: str) -> tuple[Path, int]:
        return self.sample_dir / name, (self.s.samples if name == "train" else self.s.valid_count)

    def arrays(self, name: str):
        d, n = self.split(name)
        return sampling.read_split(d, n, self.s.shard_size, self.s.max_length)

    # 2. samples
    def sample(self) -> None:
        """Draw the missing shards of both splits (this rank's: shard i on rank i mod W), then wait for every
        rank's. The record sums the ranks' shards and tokens; tokens/s is their sum over the slowest rank's time."""
        s, world = self.s, self.world
        from tqdm.auto import tqdm

        mine = sum(r for name in ("train", "valid")
                   for r in world.mine(sampling.shard_rows(self.split(name)[1], s.shard_size)))
        bar = tqdm(total=mine, desc="sampling" + (f" (rank 0 of {world.size})" if world.size > 1 else ""),
                   unit="seq", disable=not (s.progress and world.main), dynamic_ncols=True, mininterval=0.5)
        stats = {}
        for name in ("train", "valid"):
            d, n = self.split(name)
            rows = sampling.shard_rows(n, s.shard_size)
            if all(sampling.complete(sampling.shard_path(d, i), r, s.max_length)
                   for i, r in world.mine(enumerate(rows))):
                stats[name] = sampling.SamplingStats(reused=len(list(world.mine(rows))))
                bar.update(sum(world.mine(rows)))
                continue
            stats[name] = sampling.sample_split(self.lm(), self.info, d, name, count=n, shard_size=s.shard_size,
                                                max_length=s.max_length, seed=s.seed, batch=s.sample_batch,
                                                prompts=self.prompts, device=self.device, bar=bar, world=world)
        bar.close()
        reused, drawn, tokens = world.sum_floats([sum(st.reused for st in stats.values()),
                                                  sum(st.drawn for st in stats.values()),
                                                  sum(st.tokens for st in stats.values())])
        seconds = sum(st.seconds for st in stats.values())
        seconds = world.max_floats([seconds])[0]  # the ranks draw at once: the slowest one's time
        world.barrier()  # every shard is on disk before any rank reads
        tokens = int(tokens)
        self.record["sampling"] = {
            "dir": str(self.sample_dir), "shards_reused": int(reused), "shards_drawn": int(drawn),
            "tokens_drawn": tokens, "seconds": round(seconds, 3),
            "tokens_per_s": round(tokens / seconds, 1) if seconds else None,
            "device": self.device.type, "batch": s.sample_batch, "ranks": world.size}
        r = self.record["sampling"]
        _log(f"samples in {self.sample_dir}: {r['shards_reused']} shard(s) reused, {r['shards_drawn']} drawn"
             + (f" ({tokens} tokens in {seconds:.1f} s: {r['tokens_per_s']:,.0f} tokens/s)" if seconds else ""))

    # 3. initialisation
    def valid_perplexity(self, p: Params, batches) -> float:
        """Rank 0's validation perplexity, known to every rank."""
        return self.world.broadcast_floats([perplexity(p, batches)[0] if self.world.main else 0.0])[0]

    def initial(self, gen: torch.Generator, counts: np.ndarray) -> Params:
        """Random (from the training samples' unigram `counts` (V,)) or LVD; LVD runs on rank 0 and its
        parameters are broadcast."""
        s, V = self.s, self.info.vocab_size
        if s.init == "random":
            uni = torch.from_numpy(counts + 1)
            return random_params(s.states, uni / uni.sum(), gen).to(self.device)
        if not self.world.main:
            Z = s.states
            p = Params(torch.empty(Z, device=self.device), torch.empty(Z, Z, device=self.device),
                       torch.empty(V, Z, device=self.device))
            self.world.broadcast_(p.start, p.trans, p.emit_by_word)
            return p
        t = time.perf_counter()
        n = min(s.lvd_samples, s.samples)
        rows, got = [], 0
        for a in self.arrays("train"):
            rows.append(np.asarray(a[: n - got]))
            got += len(rows[-1])
            if got >= n:
                break
        samples = np.concatenate(rows)
        vectors = sampling.hidden_states(self.lm(), self.info, samples, prompts=self.prompts, first_row=0,
                                         batch=s.sample_batch, device=self.device)
        self.free_lm()
        kgen = torch.Generator(device=self.device).manual_seed(s.seed)
        p, info = lvd_params(samples, vectors, s.states, V, pseudocount=s.pseudocount, iters=s.kmeans_iters,
                             generator=kgen)
        info["seconds"] = round(time.perf_counter() - t, 3)
        p = p.to(self.device)
        self.world.broadcast_(p.start, p.trans, p.emit_by_word)
        self.record["lvd"] = info
        _log(f"LVD: k-means of {len(vectors)} hidden states (d={vectors.shape[1]}) into {s.states} clusters "
             f"({info['clusters_used']} used, {info['kmeans_iterations']} iterations) in {info['seconds']:.1f} s")
        return p

    # 4. EM
    def em_key(self) -> str:
        s = self.s
        return _key({"samples": self.sample_key, "n": s.samples, "valid": s.valid_count, "states": s.states,
                     "init": s.init, "lvd": [s.lvd_samples, s.kmeans_iters] if s.init == "lvd" else None,
                     "pseudocount": s.pseudocount, "seed": s.seed})

    def checkpoint(self, p: Params, state: dict[str, Any], best: bool = False) -> None:
        """Parameters and history after an EM step: `params-<step>.safetensors` (and, at a new best validation
        perplexity, the same file as `best.safetensors`), then `state.json` naming both (each written whole, then
        renamed into place), then the older parameters removed: a run killed anywhere leaves a state and the
        parameters it names."""
        d = self.work / "em"
        d.mkdir(parents=True, exist_ok=True)
        name = f"params-{state['done']:05d}.safetensors"
        tmp = d / f".{name}.{os.getpid()}.tmp"
        save_file({k: v.detach().cpu().contiguous() for k, v in p.tensors().items()}, str(tmp))
        os.replace(tmp, d / name)
        if best:
            tmp = d / f".best.{os.getpid()}.tmp"
            try:
                os.link(d / name, tmp)  # the same bytes, no second write
            except OSError:
                shutil.copyfile(d / name, tmp)
            os.replace(tmp, d / "best.safetensors")
        tmp = d / f".state.{os.getpid()}.tmp"
        tmp.write_text(json.dumps({**state, "params": name}), encoding="utf-8")
        os.replace(tmp, d / "state.json")
        for old in d.glob("params-*.safetensors"):
            if old.name != name:
                old.unlink()

    def resume(self) -> tuple[Params, dict[str, Any]] | None:
        d = self.work / "em"
        try:
            state = json.loads((d / "state.json").read_text(encoding="utf-8"))
            if state.get("key") != self.em_key():
                return None
            t = load_file(str(d / state["params"]), device=str(self.device))
        except (OSError, ValueError, KeyError):
            return None
        return Params(t["start"], t["trans"], t["emit_by_word"]), state

    def em(self, p: Params, history: common.History, done: int, deadline: float | None) -> tuple[Params, int]:
        """EM steps `done + 1 ..` up to --em-steps, a history row and a checkpoint after each."""
        s = self.s
        Z, V = s.states, self.info.vocab_size
        world = self.world
        valid = list(sample_batches(self.arrays("valid"), self.batch, self.device)) if world.main else []
        bar = common.Progress(self.train_tokens * max(s.em_steps - done, 0), f"EM Z={Z}", s.progress and world.main)
        with common.graceful_interrupt() as interrupt:
            while done < s.em_steps and not world.any(interrupt.requested or _past(deadline)):
                t = time.perf_counter()
                c = Counts.zeros(Z, V, self.device)
                with torch.no_grad():
                    for b in sample_batches(world.mine(self.arrays("train")), self.batch, self.device):
                        accumulate(p, b, c)
                        bar.update(int(b.lengths.sum()) * world.size, loss=-c.loglik / c.tokens)
                        if interrupt.requested or _past(deadline):
                            break
                world.sum_(c.start, c.trans, c.emit)  # a rank cut short by the clock sums what it read
                c.loglik, tokens, sequences = world.sum_floats([c.loglik, c.tokens, c.sequences])
                c.tokens, c.sequences = int(tokens), int(sequences)
                cut = c.sequences < s.samples
                objective = (c.loglik + p.log_prior(s.pseudocount)) / c.tokens
                train_ppl, tokens = math.exp(-c.loglik / c.tokens), c.tokens
                p = m_step(c, s.pseudocount, old=p)
                del c
                vppl = self.valid_perplexity(p, valid)
                done += 1
                step_s = time.perf_counter() - t
                prev = history.rows[-1]
                row = {"iteration": done, "tokens": prev["tokens"] + tokens, "seconds": prev["seconds"] + step_s,
                       "step_seconds": step_s, "train_ppl": train_ppl, "objective_per_token": objective,
                       "valid_ppl": vppl, **({"cut_short": 1.0} if cut else {})}
                improved = history.add(**row)
                bar.update(0, valid_ppl=vppl)
                if world.main:
                    self.checkpoint(p, {"key": self.em_key(), "done": done, "history": history.to_json(),
                                        "lvd": self.record.get("lvd"), "world_size": world.size,
                                        "best_step": done if improved else self.best_step()}, best=improved)
                _log(f"EM step {done}/{s.em_steps}: train ppl {train_ppl:.3f} (before the step), valid ppl "
                     f"{vppl:.3f}, {step_s:.2f} s" + (" (cut short: time limit or interrupt)" if cut else ""))
        bar.close()
        return p, done

    # 5. export
    def provenance(self) -> dict[str, Any]:
        """What every family's manifest records: the LM, the settings, the samples (count, length, seed, prompts,
        how they were drawn), the device, the memory estimate, the unigram baseline."""
        s = self.s
        return {
            "source": "latentlm distill", "lm": self.info.provenance(),
            "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(s).items()},
            "samples": s.samples, "valid_samples": s.valid_count, "max_length": s.max_length, "seed": s.seed,
            "prompts": None if self.prompts is None else {"file": str(s.prompts), "sha256": self.prompts_sha,
                                                          "count": len(self.prompts)},
            "world_size": self.world.size, "device": self.device.type, "train_tokens": self.train_tokens,
            "memory": self.memory,
            **self.record}

    def best_step(self) -> int:
        """The EM step `best.safetensors` holds (0: none, the initial parameters were best)."""
        try:
            return int(json.loads((self.work / "em" / "state.json").read_text(encoding="utf-8")).get("best_step", 0))
        except (OSError, ValueError):
            return 0

    def best(self, p: Params, done: int) -> tuple[Params, int]:
        """The parameters to export: the best validation step's (`best.safetensors`), else `p` (step `done`)."""
        step = self.best_step()
        if step in (0, done):
            return p, done
        t = load_file(str(self.work / "em" / "best.safetensors"), device=str(self.device))
        return Params(t["start"], t["trans"], t["emit_by_word"]), step

    def export(self, p: Params, history: common.History, done: int) -> Path:
        s, info = self.s, self.info
        p, step = self.best(p, done)
        curve = {"rows": history.rows, "unigram_valid_ppl": self.record["unigram_valid_ppl"]}
        title = f"hmm {s.states} states distilled from {info.path.name} ({s.init} init, EM)"
        extra = {TOKENIZER_FILE: info.tokenizer_json, "curve.png": common.curve_png(history, title),
                 "curve.json": json.dumps(curve, indent=1).encode()}
        steps = [r["step_seconds"] for r in history.rows if "step_seconds" in r]
        prov = {
            **self.provenance(), "init": s.init, "em_steps": done, "pseudocount": s.pseudocount,
            "batch_rows": self.batch, "em_step_seconds": (sum(steps) / len(steps)) if steps else None,
            "train_seconds": round(time.perf_counter() - self.t0, 1), "best_valid_ppl": history.best,
            "final_valid_ppl": history.rows[-1]["valid_ppl"], "exported_step": step,
            "exported_valid_ppl": next(r["valid_ppl"] for r in history.rows if r["iteration"] == step),
            "curve": history.rows[-50:]}
        return save_artifact(s.store, s.name, "hmm", p.export_tensors(), info.vocab, config={"num_states": s.states},
                             provenance=prov, extra_files=extra)

    def run(self) -> Path:
        s = self.s
        deadline = None if s.time_limit is None else time.time() + s.time_limit * 60 - (time.perf_counter() - self.t0)
        self.sample()
        V, world = self.info.vocab_size, self.world
        counts = torch.from_numpy(unigram_counts(world.mine(self.arrays("train")), V)).to(self.device)
        world.sum_(counts)  # whole numbers: exact in float64 whatever the order
        counts = counts.cpu().numpy()
        self.train_tokens = int(counts.sum())
        self.record["unigram_valid_ppl"] = (unigram_perplexity(counts, self.arrays("valid")) if world.main
                                            else math.nan)
        if s.family == "blocked_hmm":
            return blocked.train(self, int((counts > 0).sum()), deadline, _log)
        resumed = self.resume()
        if resumed is not None:
            p, state = resumed
            history, done = common.History.from_json(state["history"]), int(state["done"])
            if state.get("lvd"):
                self.record["lvd"] = state["lvd"]
            _log(f"EM: continuing from the checkpoint after step {done} in {self.work / 'em'}")
        else:
            torch.manual_seed(s.seed)
            p = self.initial(torch.Generator().manual_seed(s.seed), counts)
            vppl = self.valid_perplexity(p, sample_batches(self.arrays("valid"), self.batch, self.device)
                                         if world.main else [])
            history, done = common.History(), 0
            history.add(iteration=0, tokens=0, seconds=0.0, valid_ppl=vppl)
            _log(f"initial ({s.init}) valid ppl {vppl:.3f} (unigram {self.record['unigram_valid_ppl']:.3f})")
        self.free_lm()
        p, done = self.em(p, history, done, deadline)
        if not world.main:
            return Path(s.store) / s.name
        path = self.export(p, history, done)
        step = self.best_step() or done
        _log(f"wrote {s.name} to {path}: {s.states} states over {V} tokens, valid ppl "
             f"{history.rows[step]['valid_ppl']:.3f} (unigram {self.record['unigram_valid_ppl']:.3f}), {done} EM steps"
             + (f"; exported step {step}, the best on validation" if step != done else ""))
        return path


def _past(deadline: float | None) -> bool:
    return deadline is not None and time.time() >= deadline


def distill(s: DistillSettings) -> Path:
    """Run `latentlm distill` with settings `s` (on every rank torchrun started); returns the artifact directory."""
    path = Run(s).run()
    distributed.close()
    return path
