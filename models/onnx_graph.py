"""ONNX scoring graphs for the chain families that declare one (`ChainFamily.onnx_layout`: `hmm`, `blocked_hmm`,
`rank_hmm`), built with onnx.helper from the tensors the family gives (`ChainFamily.onnx_tensors`).

The graph is the scaled forward recursion of `models.chain.forward`, as one ONNX `Scan` over time:

    inputs   ids (B, T) int64, right-padded (any id in [0, V) at padding), lengths (B,) int64
    outputs  logprob (B,) float64 = log p(x) (natural log; the float32 conditionals summed in float64)
             token_logprobs (B, T) float32 = log p(x_t | x_<t), 0 at padding

    step t:  pred  = init(x_0)             t == 0, outside the Scan
                     alpha_{t-1} @ step_t  t = 1 .. T-1, the Scan body (8 nodes for hmm/rank_hmm)
             u     = pred * emit[x_t]       (gathered inside the step: no (B, T, K) emission tensor)
             c     = sum(u);  alpha_t = u / c;  token_logprob_t = log c
    padding: padded ids are replaced by an extra all-ones emission row V and their token_logprob is set
             to 0 (Where on the mask); their alpha is not held, but no real step ever follows a padded one.

`step_t` and the state space K are the family's reduced ones, so the graph has the papers' costs (by layout:
"shared" hmm and rank_hmm, "blocked" blocked_hmm):
  hmm          K = Z: init = start, step = trans (Z x Z), emit = trans-posed emissions (V, Z)    O(T Z^2)
  blocked_hmm  K = k: init = start block of cluster(x_0); step = the k x k block
               trans[cluster(x_{t-1}) states, cluster(x_t) states], gathered per sequence and step from
               a (M*M, k, k) initializer (B batched (1 x k)(k x k) products), emit (V, k)          O(T k^2)
  rank_hmm     K = r: init = rank_start, step = rank_trans (r x r), emit (V, r)                   O(T r^2)

Probability 0: when c == 0 the step gives -inf and alpha becomes 0 (not NaN), so every later real
position is -inf too and logprob is -inf: exactly what the torch engine returns.

Everything is float32 (the model's matrices are initializers); opset 17, IR version 8, so ONNX Runtime
1.13+ (e.g. Triton's onnxruntime backend) loads it. `metadata_props` carry latentlm.content_hash,
latentlm.family, latentlm.name, latentlm.opset, latentlm.vocab_size, latentlm.num_states (and, when given,
the vocabulary and preprocessing so a torch-free client can tokenise text).

Posteriors are not exported (scoring only; a backward Scan would add them).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 17
IR_VERSION = 8
GRAPH_VERSION = "1"  # bump when the inputs/outputs/metadata contract changes
LAYOUTS = ("shared", "blocked")  # what a family's `onnx_layout` may name
META_PREFIX = "latentlm."
_EXTERNAL_DATA_BYTES = 1_500_000_000  # protobuf caps a file at 2 GiB: larger weights go to a side file


def _np32(t: Any) -> np.ndarray:
    """A torch tensor or array -> contiguous float32 numpy (no torch import needed here)."""
    if hasattr(t, "detach"):
        t = t.detach().cpu().double().numpy()
    return np.ascontiguousarray(np.asarray(t, dtype=np.float32))


def _np64i(t: Any) -> np.ndarray:
    if hasattr(t, "detach"):
        t = t.detach().cpu().numpy()
    return np.ascontiguousarray(np.asarray(t, dtype=np.int64))


def family_tensors(impl: Any) -> tuple[str, dict[str, np.ndarray]]:
    """The family name and the float32/int64 arrays the scoring graph needs, from the tensors the family instance
    gives for its `onnx_layout` (`ChainFamily.onnx_tensors`): "shared" start, step, emit_by_word; "blocked" start,
    trans_blocks (M, k, M, k), emit, word_cluster, laid out here as (M, k) start blocks and (M*M, k, k) blocks."""
    family = getattr(impl, "family", None)
    layout = getattr(impl, "onnx_layout", None)
    if layout not in LAYOUTS:
        raise ValueError(f"ONNX export supports the families that declare an ONNX layout, not {family!r}")
    t = impl.onnx_tensors()
    if layout == "shared":
        return family, {"start": _np32(t["start"]), "step": _np32(t["step"]), "emit_by_word": _np32(t["emit_by_word"])}
    M, k = int(t["trans_blocks"].shape[0]), int(t["trans_blocks"].shape[1])
    trans = _np32(t["trans_blocks"])  # [c_prev, i, c_next, j]
    blocks = np.ascontiguousarray(trans.transpose(0, 2, 1, 3).reshape(M * M, k, k))  # [c_prev*M + c_next]
    return family, {"start_blocks": _np32(t["start"]).reshape(M, k), "blocks": blocks,
                    "emit_by_word": _np32(t["emit"]), "word_cluster": _np64i(t["word_cluster"]),
                    "num_clusters": np.array(M, dtype=np.int64)}


def _const(name: str, value: Any, dtype=np.int64) -> TensorProto:
    return numpy_helper.from_array(np.asarray(value, dtype=dtype), name)


def _emit_normalise(p: str, pred: str, ids: str, mask: str, alpha: str, logc: str) -> list[onnx.NodeProto]:
    """u = pred * emit[ids]; c = sum(u); alpha = u / max(c, FLT_MIN); logc = log c at real positions, else 0.
    (c == 0 gives alpha = 0 and logc = -inf; a 0 < c < FLT_MIN would leave alpha summing below 1, which
    only a conditional probability under 1.2e-38 can trigger.)"""
    h = helper.make_node
    return [h("Gather", ["emit_ext", ids], [p + "e"]),
            h("Mul", [pred, p + "e"], [p + "u"]),
            h("ReduceSum", [p + "u", "axes1"], [p + "c"], keepdims=1),          # (B, 1)
            h("Max", [p + "c", "flt_min"], [p + "c_safe"]),
            h("Div", [p + "u", p + "c_safe"], [alpha]),
            h("Log", [p + "c"], [p + "logc_raw"]),                              # -inf when c == 0
            h("Where", [mask, p + "logc_raw", "f_zero"], [logc])]                # (B, 1)


def _step_body(blocked: bool) -> onnx.GraphProto:
    """The Scan body for positions 1 .. T-1. State: alpha (B, K) float32. Scan inputs per step: ids_t (B,)
    (padding replaced by the all-ones emission row V, so a padded step needs no mask on alpha: its alpha is
    never read by a real step), mask_t (B, 1) bool and, `blocked`, blk_t (B,) = the block index
    cluster(x_{t-1}) * M + cluster(x_t). Scan output: logc (B, 1)."""
    F, I, BOOL = TensorProto.FLOAT, TensorProto.INT64, TensorProto.BOOL
    h = helper.make_node
    if blocked:
        n = [h("Gather", ["blocks", "blk_t"], ["blk"]),                      # (B, k, k)
             h("Unsqueeze", ["alpha_in", "axes1"], ["alpha3"]),               # (B, 1, k)
             h("MatMul", ["alpha3", "blk"], ["moved3"]),                      # (B, 1, k)
             h("Squeeze", ["moved3", "axes1"], ["pred"])]
    else:
        n = [h("MatMul", ["alpha_in", "step"], ["pred"])]                    # (B, K)
    n += _emit_normalise("s_", "pred", "ids_t", "mask_t", "alpha_out", "logc")
    inputs = [helper.make_tensor_value_info("alpha_in", F, ["B", "K"]),
              helper.make_tensor_value_info("ids_t", I, ["B"]),
              helper.make_tensor_value_info("mask_t", BOOL, ["B", 1])]
    if blocked:
        inputs.append(helper.make_tensor_value_info("blk_t", I, ["B"]))
    outputs = [helper.make_tensor_value_info("alpha_out", F, ["B", "K"]),
               helper.make_tensor_value_info("logc", F, ["B", 1])]
    return helper.make_graph(n, "forward_step", inputs, outputs)


def build_scoring_model(family: str, arrays: dict[str, np.ndarray], metadata: dict[str, str] | None = None,
                        opset: int = OPSET) -> onnx.ModelProto:
    """The scoring ModelProto named for `family` from `family_tensors`' arrays (their keys say the layout)."""
    blocked = "blocks" in arrays
    need = {"start_blocks", "blocks", "word_cluster", "num_clusters"} if blocked else {"start", "step"}
    if not need | {"emit_by_word"} <= set(arrays):
        raise ValueError(f"the arrays of family {family!r} lack {sorted(need | {'emit_by_word'} - set(arrays))}")
    F, I = TensorProto.FLOAT, TensorProto.INT64
    h = helper.make_node
    arrays = dict(arrays)
    emit = arrays.pop("emit_by_word")
    V, K = emit.shape
    # row V: all ones, the emission of a padded position (see _step_body)
    inits = [numpy_helper.from_array(np.concatenate([emit, np.ones((1, K), np.float32)]), "emit_ext"),
             _const("V_id", V), _const("c_0", 0), _const("c_1", 1), _const("axes0", [0]), _const("axes1", [1]),
             _const("axes2", [2]), _const("one_vec", [1]), _const("big_vec", [1 << 62]),
             _const("f_zero", 0.0, np.float32), _const("flt_min", np.finfo(np.float32).tiny, np.float32)]
    if blocked:
        wc = arrays.pop("word_cluster")
        inits.append(numpy_helper.from_array(np.concatenate([wc, np.zeros(1, np.int64)]), "word_cluster_ext"))
    inits += [numpy_helper.from_array(v, k) for k, v in arrays.items()]
    n = [
        # the (B, T) mask of real positions; padding ids -> V
        h("Shape", ["ids"], ["ids_shape"]),
        h("Gather", ["ids_shape", "c_1"], ["T"]),                             # scalar
        h("Range", ["c_0", "T", "c_1"], ["pos"]),                             # (T,)
        h("Unsqueeze", ["pos", "axes0"], ["pos_row"]),                        # (1, T)
        h("Unsqueeze", ["lengths", "axes1"], ["len_col"]),                    # (B, 1)
        h("Less", ["pos_row", "len_col"], ["mask"]),                          # (B, T) bool
        h("Where", ["mask", "ids", "V_id"], ["ids_p"]),                       # (B, T)
        h("Transpose", ["ids_p"], ["ids_tb"], perm=[1, 0]),                   # (T, B)
        h("Transpose", ["mask"], ["mask_tb"], perm=[1, 0]),
        h("Unsqueeze", ["mask_tb", "axes2"], ["mask_tb1"]),                   # (T, B, 1)
        # position 0 outside the scan
        h("Gather", ["ids_tb", "c_0"], ["ids_0"]),                            # (B,)
        h("Gather", ["mask_tb1", "c_0"], ["mask_0"]),                         # (B, 1)
        # positions 1 .. T-1 (an empty scan when T == 1)
        h("Slice", ["ids_tb", "one_vec", "big_vec", "axes0"], ["ids_rest"]),
        h("Slice", ["mask_tb1", "one_vec", "big_vec", "axes0"], ["mask_rest"]),
    ]
    scan_in = ["ids_rest", "mask_rest"]
    if blocked:
        n += [h("Gather", ["word_cluster_ext", "ids_tb"], ["cl_tb"]),         # (T, B)
              h("Gather", ["cl_tb", "c_0"], ["cl_0"]),
              h("Gather", ["start_blocks", "cl_0"], ["pred_0"]),               # (B, k)
              h("Mul", ["cl_tb", "num_clusters"], ["clM_tb"]),
              h("Slice", ["cl_tb", "one_vec", "big_vec", "axes0"], ["cl_rest"]),   # clusters of x_1 .. x_{T-1}
              h("Sub", ["T", "c_1"], ["Tm1"]),
              h("Unsqueeze", ["Tm1", "axes0"], ["Tm1_vec"]),
              h("Slice", ["clM_tb", "zero_vec", "Tm1_vec", "axes0"], ["clM_p"]),  # of x_0 .. x_{T-2}
              h("Add", ["clM_p", "cl_rest"], ["blk_rest"])]                    # (T-1, B)
        inits.append(_const("zero_vec", [0]))
        scan_in.append("blk_rest")
    else:
        n += [h("Identity", ["start"], ["pred_0"])]                            # (K,) broadcasts
    n += _emit_normalise("i_", "pred_0", "ids_0", "mask_0", "alpha_0", "logc_0")
    n += [h("Scan", ["alpha_0", *scan_in], ["alpha_T", "logc_rest"], body=_step_body(blocked),
            num_scan_inputs=len(scan_in)),                                      # logc_rest (T-1, B, 1)
          h("Unsqueeze", ["logc_0", "axes0"], ["logc_0t"]),                   # (1, B, 1)
          h("Concat", ["logc_0t", "logc_rest"], ["logc_tb1"], axis=0),
          h("Squeeze", ["logc_tb1", "axes2"], ["logc_tb"]),
          h("Transpose", ["logc_tb"], ["token_logprobs"], perm=[1, 0]),
          h("Cast", ["token_logprobs"], ["tok64"], to=TensorProto.DOUBLE),
          h("ReduceSum", ["tok64", "axes1"], ["logprob"], keepdims=0)]
    graph = helper.make_graph(
        n, f"latentlm_{family}_score",
        [helper.make_tensor_value_info("ids", I, ["B", "T"]), helper.make_tensor_value_info("lengths", I, ["B"])],
        [helper.make_tensor_value_info("logprob", TensorProto.DOUBLE, ["B"]),
         helper.make_tensor_value_info("token_logprobs", F, ["B", "T"])],
        initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)],
                              producer_name="latentlm", producer_version=GRAPH_VERSION,
                              doc_string=f"latentlm {family} scoring graph (scaled forward recursion)")
    model.ir_version = IR_VERSION
    helper.set_model_props(model, {**(metadata or {}), META_PREFIX + "opset": str(opset)})
    return model


def export_onnx(impl: Any, path: str | Path, *, name: str = "", content_hash: str = "",
                vocab: list[str] | None = None, preprocessing: dict | None = None,
                opset: int = OPSET, check: bool = True) -> Path:
    """Write the scoring graph of a loaded chain family instance with an `onnx_layout` (`hmm`, `blocked_hmm`,
    `rank_hmm`) to `path`.

    `name` and `content_hash` (the artifact's, `LoadedModel.content_hash`) go into metadata_props, as do
    the family, opset, vocabulary size and state count; `vocab` (token strings by id) and
    `preprocessing` (the manifest's dict) are stored too when given. Weights above 1.5 GB go to
    `<path>.data` beside the file (ONNX external data). Returns the path."""
    family, arrays = family_tensors(impl)
    V = arrays["emit_by_word"].shape[0]
    meta = {META_PREFIX + "family": family, META_PREFIX + "name": name, META_PREFIX + "content_hash": content_hash,
            META_PREFIX + "vocab_size": str(V), META_PREFIX + "num_states": str(int(impl.num_states)),
            META_PREFIX + "graph_version": GRAPH_VERSION, META_PREFIX + "dtype": "float32"}
    if vocab is not None:
        if len(vocab) != V:
            raise ValueError(f"vocab has {len(vocab)} tokens, the model {V}")
        meta[META_PREFIX + "vocab"] = json.dumps(list(vocab), ensure_ascii=False)
    if preprocessing is not None:
        meta[META_PREFIX + "preprocessing"] = json.dumps(preprocessing, sort_keys=True)
    model = build_scoring_model(family, arrays, meta, opset)
    if check:
        onnx.checker.check_model(model)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    big = sum(a.nbytes for a in arrays.values()) > _EXTERNAL_DATA_BYTES
    if big:
        onnx.save_model(model, str(tmp), save_as_external_data=True, all_tensors_to_one_file=True,
                        location=path.name + ".data", size_threshold=1024)
    else:
        onnx.save_model(model, str(tmp))
    tmp.replace(path)
    return path


def read_metadata(path: str | Path) -> dict[str, str]:
    """metadata_props of an exported file (without loading the weights)."""
    model = onnx.load(str(path), load_external_data=False)
    return {p.key: p.value for p in model.metadata_props}
