"""The settings of a `latentlm train` run as one typed, frozen object (`TrainSettings`): the fields after
`resume` are the command's flags (`--name-with-dashes`) and the config files' keys (`OPTIONS`), declared once
here. `training.settings.resolve_settings` builds and validates them; every trainer takes them."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any


def _option(typ: type, default: Any, help_text: str) -> Any:
    """A setting that is also a `latentlm train` flag (`--name-with-dashes`) and a config key: its type (what
    a config value is coerced to), its default (None: filled per recipe, `Recipe.defaults`) and help."""
    return field(default=default, metadata={"type": typ, "help": help_text})


@dataclass(frozen=True)
class TrainSettings:
    """The settings of one `latentlm train` run, resolved once (command line > `--config` > the recipe's
    defaults > the defaults here) and validated by `resolve_settings`; every trainer takes them. The fields
    after `resume` are the command's flags and the config file's keys (`OPTIONS`)."""

    family: str
    data: tuple[str, ...]
    name: str
    store: Path
    resume: bool = False
    states: int | None = _option(int, None, "number of hidden states (hmm, densehmm, blocked_hmm, rank_hmm)")
    clusters: int | None = _option(int, None, "Brown clusters M (blocked_hmm); states must be divisible by it")
    rank: int | None = _option(int, None, "rank r (rank_hmm)")
    hidden: int | None = _option(int, None, "hidden size of the neural parameterization / vector dim (densehmm)")
    epochs: int | None = _option(int, None, "passes over the training data (EM iterations for hmm)")
    batch: int | None = _option(int, None,
                      "sentences per batch (blocked_hmm with --bptt: running-text streams, so --batch x --bptt "
                      "tokens per step)")
    bptt: int = _option(int, 0, "blocked_hmm: tokens per BPTT chunk over the running text (0 = sentence batches)")
    bptt_rotate: bool = _option(bool, False,
                      "blocked_hmm with --bptt: every epoch the running text starts at a random token "
                      "(drawn from the seed and the epoch), so the streams and chunks differ from epoch "
                      "to epoch (off: the same batches every epoch, as the paper's BPTT iterator)")
    reset_eos: bool = _option(bool, False,
                      "blocked_hmm with --bptt: every <eos> ends a sentence and the next one starts from "
                      "the start distribution (the authors' --reset_eos 1): the state is carried across "
                      "chunk boundaries, never across sentences, so training scores sentences as "
                      "sentence-level evaluation does and the export keeps the trained start (off: the "
                      "state runs on through <eos>; the export's start is the state after <eos>)")
    device: str = _option(str, "cpu", "cpu, cuda or auto")
    gemm: str = _option(str, "auto",
                      "blocked_hmm, rank_hmm on CPU: the library of the training step's float32 GEMMs: 'auto' "
                      "(time torch's BLAS and oneDNN on the model's shapes at the start and take the faster; a "
                      "resumed run keeps its checkpoint's), 'torch' or 'onednn'")
    seed: int = _option(int, 0, "random seed (everything is deterministic given it)")
    lr: float | None = _option(float, None, "learning rate (AdamW)")
    max_steps: int = _option(int, 0, "stop after this many optimisation steps / EM iterations (0 = no limit)")
    init_noise: float = _option(float, 3.0,
                      "hmm EM: scale of the random log-normal perturbation of the initial parameters")
    smoothing: float = _option(float, 1e-4, "hmm EM: pseudo-count added to every expected count (MAP-EM; 0 = plain EM)")
    dropout: float | None = _option(float, None,
                      "rank_hmm: dropout on the start vector and the U/V embeddings (default 0.1)")
    weight_decay: float | None = _option(float, None,
                      "blocked_hmm, rank_hmm: AdamW's decoupled weight decay on every parameter "
                      "(default 0 blocked_hmm, as Chiu & Rush; 0.01 rank_hmm, as Yang et al.)")
    weight_average: float = _option(float, 0.0,
                      "blocked_hmm, rank_hmm: evaluate and export an exponential moving average of "
                      "the parameters with this decay per step (e.g. 0.99: about the last 100 steps; "
                      "0 = off: the parameters themselves)")
    state_dropout: float = _option(float, 0.5,
                      "blocked_hmm: fraction of each cluster's states dropped per batch (lambda)")
    patience: int = _option(int, 2,
                      "early stopping: stop after this many evaluations in a row without improvement "
                      "(0 = never stop early)")
    lr_patience: int = _option(int, 0,
                      "blocked_hmm, rank_hmm: decay the LR after every N evaluations in a row without "
                      "improvement (0 = at each one)")
    lr_decay: float | None = _option(float, None,
                      "blocked_hmm, rank_hmm: divide the LR by this on a plateau (default 4 blocked_hmm, "
                      "2 rank_hmm)")
    lr_anneal: float = _option(float, 0.0,
                      "blocked_hmm, rank_hmm: over the last this fraction of the budget (whichever of "
                      "--epochs, --max-steps, --time-limit runs out first) the LR falls linearly to 0 "
                      "(0 = off: only the plateau decay)")
    eval_every: int = _option(int, 0, "evaluate on validation every N steps (0 = --evals-per-epoch times per epoch)")
    evals_per_epoch: int = _option(int, 1, "blocked_hmm, rank_hmm: evaluations per epoch when --eval-every is 0")
    time_limit: float = _option(float, 0.0,
                      "blocked_hmm, rank_hmm: stop after this many minutes of training (wall clock from the "
                      "first step, evaluations included, corpus reading and Brown clustering not; 0 = no limit) "
                      "and export the best evaluation")
    export_only: bool = _option(bool, False,
                      "blocked_hmm, rank_hmm, with --resume: export the checkpoint's best parameters "
                      "again without training (e.g. a checkpoint brought back from a GPU run)")
    split_at: str = _option(str, "",
                      "blocked_hmm: epochs (1 to --epochs - 1, comma-separated; epochs count from 0) at "
                      "whose start every state splits in two, or shares of the training budget (10%,30%: "
                      "at the first epoch start after that share of --epochs / --max-steps / --time-limit), "
                      "a warm start that keeps the model's distribution (--states is the final count; "
                      "training starts with states / 2^(number of splits))")
    state_embedding: str = _option(str, "factored",
                      "blocked_hmm: 'factored' ([cluster; state] embeddings composed by an MLP, "
                      "App. A.2), 'independent' (one learned vector per state and role, "
                      "App. A.3) or 'tied' (one learned vector per state shared by every "
                      "role, as the authors' paper-scale PTB command)")
    checkpoint_every: int | None = _option(int, None,
                      "also checkpoint every N optimisation steps (blocked_hmm, rank_hmm; default "
                      "200) or E-step batches (hmm, densehmm; default 0); 0 = only at evaluations / "
                      "iteration ends; --resume continues from the exact batch")
    train_sentences: int = _option(int, 0, "use only the first N training sentences (0 = all)")
    valid_sentences: int = _option(int, 0, "use only the first N validation sentences (0 = all)")
    min_count: int = _option(int, 1, "text files: keep words seen at least this often")
    max_vocab: int = _option(int, 10000, "text files: vocabulary size including <unk> and <eos>")
    lowercase: bool = _option(bool, False, "text files: lower-case the text (recorded in the manifest)")
    fit: str = _option(str, "em",
                      "densehmm: 'em' (EM with a gradient M-step), 'em-tied' (the same EM on the earlier tied "
                      "variant: emissions from the outgoing vectors plus a word bias) or 'cooc' (co-occurrence fit)")
    nt: int | None = _option(int, None, "pcfg: nonterminals")
    pt: int | None = _option(int, None, "pcfg: preterminals")
    dim: int | None = _option(int, None, "lds: latent dimension")
    lags: int | None = _option(int, None, "lds: lag covariances")
    progress: bool = _option(bool, True, "show a progress bar")


OPTIONS: dict[str, tuple[type, Any, str]] = {
    f.name: (f.metadata["type"], f.default, f.metadata["help"]) for f in fields(TrainSettings) if f.metadata}
"""The flags of `latentlm train` and the keys of its config files: name -> (type, default, help)."""
