"""Neural HMM language models trained by gradient descent through the scaled forward of `models.chain`.

* `blocked_hmm` — VL-HMM (Chiu & Rush 2020, App. A.2): Z = M k states over M Brown clusters; factored
  state embeddings [E_m(cluster); E_z(state)] composed by residual MLPs with LayerNorm into H_out, H_in,
  H_emit; trans = softmax(H_out H_in^T), emission p(w | z) = softmax over z's cluster's words of
  H_emit E_x^T. State dropout: per batch, each cluster keeps exactly k - round(lambda k) states drawn
  without replacement (one mask shared by the batch), which also shrinks the DP to k' x k' blocks.
  Optional BPTT: the corpus as B running streams cut into chunks, carrying the filtered posterior.
* `rank_hmm` — rank-space HMM (Yang et al. 2022, §4.3, App. B): U, V softmaxes of dot products of state and
  rank embeddings, W softmax over words of h2(rank embeddings) . word embeddings; dropout 0.1 on the start
  vector and the U/V embeddings; forward in rank space, O(T r^2).

Both use AdamW, length-bucketed shuffled batches, LR decay on a validation plateau, early stopping,
checkpoints (safetensors + JSON) and `--resume`; export caches the matrices in the family's schema.

The package, by seam: `networks` (the parameterisations), `emission` (a VL-HMM's per-cluster emission
log-softmax, three autograd paths), `losses` (the objectives and their autograd Functions), `growth` (state
splitting, --split-at), `schedule` (AdamW, the clipped step, the LR schedule, weight averaging), `bptt` (running
text) and `loop` (setup, step, check, checkpoint, export). The names below are re-exported here.
"""

from latentlm.training.neural.bptt import bptt_batches, carry_from_checkpoint, fix_start_for_streams
from latentlm.training.neural.emission import (
    CLUSTER_EMIT_MAX_K,
    ClusterGemmLogSoftmax,
    ClusterLogSoftmax,
    cluster_log_softmax,
    cluster_log_softmax_padded,
    cluster_log_softmax_reference,
)
from latentlm.training.neural.growth import checkpoint_states, split_model, split_state_dict, split_states, splits_done
from latentlm.training.neural.loop import (
    Position,
    TrainingDiverged,
    build,
    exported_tensors,
    family_scorer,
    gemm_for_run,
    train,
)
from latentlm.training.neural.losses import BlockedNLL, blocked_loss, rank_loss, sentence_pieces
from latentlm.training.neural.networks import (
    EXPORT_ROWS,
    VLHMM,
    RankNeural,
    ResBlock,
    YangRes,
    rows_of,
    sample_state_dropout,
)
from latentlm.training.neural.schedule import (
    MAX_GRAD_NORM,
    anneal_factor,
    backward_clipped,
    budget_used,
    fill_missing_grads,
    make_optimizer,
    parameters_swapped,
    set_lr,
    update_average,
)

__all__ = [
    "CLUSTER_EMIT_MAX_K", "EXPORT_ROWS", "MAX_GRAD_NORM", "VLHMM", "BlockedNLL", "ClusterGemmLogSoftmax",
    "ClusterLogSoftmax", "Position", "RankNeural", "ResBlock", "TrainingDiverged", "YangRes", "anneal_factor",
    "backward_clipped", "blocked_loss", "bptt_batches", "budget_used", "build", "carry_from_checkpoint",
    "checkpoint_states", "cluster_log_softmax", "cluster_log_softmax_padded", "cluster_log_softmax_reference",
    "exported_tensors", "family_scorer", "fill_missing_grads", "fix_start_for_streams", "gemm_for_run",
    "make_optimizer", "parameters_swapped", "rank_loss", "rows_of", "sample_state_dropout", "sentence_pieces",
    "set_lr", "split_model", "split_state_dict", "split_states", "splits_done", "train", "update_average",
]
