"""ONNX scoring graphs for the HMM families (`hmm`, `blocked_hmm`, `rank_hmm`), built with onnx.helper.

The graph is the scaled forward recursion of `models.chain.forward`, as one ONNX `Scan` over time:

    inputs   ids (B, T) int64, right-padded (any id in [0, V) at padding), lengths (B,) int64
    outputs  logprob (B,) float64 = log p(x) (natural log; the float32 conditionals summed in float64)
             token_logprobs (B, T) float32 = log p(x_t | x_<t), 0 at padding

    step t:  pred  = init(x_0)             if t == 0
                     alpha_{t-1} @ step_t  otherwise
             u     = pred * emit[x_t]       (gathered inside the step: no (B, T, K) emission tensor)
             c     = sum(u);  alpha_t = u / c;  token_logprob_t = log c
             padded steps (t >= length) keep alpha and give 0.

`step_t` and the state space K are the family's reduced ones, so the graph has the papers' costs:
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

Posteriors are not exported (scoring only).
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
FAMILIES = ("hmm", "blocked_hmm", "rank_hmm")
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
    """The family name and the float32/int64 arrays the scoring graph needs, from the family instance's
    public attributes (DenseHMM: start, trans, emit; BlockedHMM: start, trans, emit, word_cluster, M, k;
    RankHMM: rank_start, rank_trans, emit)."""
    family = getattr(impl, "family", None)
    if family == "hmm":
        return family, {"start": _np32(impl.start), "step": _np32(impl.trans),
                        "emit_by_word": np.ascontiguousarray(_np32(impl.emit).T)}
    if family == "blocked_hmm":
        M, k = int(impl.M), int(impl.k)
        trans = _np32(impl.trans).reshape(M, k, M, k)  # [c_prev, i, c_next, j]
        blocks = np.ascontiguousarray(trans.transpose(0, 2, 1, 3).reshape(M * M, k, k))  # [c_prev*M + c_next]
        return family, {"start_blocks": _np32(impl.start).reshape(M, k), "blocks": blocks,
                        "emit_by_word": _np32(impl.emit), "word_cluster": _np64i(impl.word_cluster),
                        "num_clusters": np.array(M, dtype=np.int64)}
    if family == "rank_hmm":
        return family, {"start": _np32(impl.rank_start), "step": _np32(impl.rank_trans),
                        "emit_by_word": _np32(impl.emit)}
    raise ValueError(f"ONNX export supports the families {', '.join(FAMILIES)}, not {family!r}")


def _const(name: str, value: Any, dtype=np.int64) -> TensorProto:
    return numpy_helper.from_array(np.asarray(value, dtype=dtype), name)


def _step_body(family: str) -> onnx.GraphProto:
    """The Scan body. States: alpha (B, K) float32. Scan inputs per step: ids_t (B,), prev_t (B,)
    (x_{t-1}; only read by blocked_hmm), mask_t (B, 1) bool, first scalar bool. Scan output: logc (B,)."""
    F, I, BOOL = TensorProto.FLOAT, TensorProto.INT64, TensorProto.BOOL
    n: list[onnx.NodeProto] = []
    inits = [_const("b_axes1", [1]), _const("b_zero", 0.0, np.float32), _const("b_one", 1.0, np.float32)]
    if family == "blocked_hmm":
        # clusters of x_{t-1} and x_t, then the (B, k, k) blocks and a batched (B,1,k) x (B,k,k) product
        n += [helper.make_node("Gather", ["word_cluster", "ids_t"], ["cl_t"]),
              helper.make_node("Gather", ["word_cluster", "prev_t"], ["cl_p"]),
              helper.make_node("Mul", ["cl_p", "num_clusters"], ["cl_pM"]),
              helper.make_node("Add", ["cl_pM", "cl_t"], ["blk_idx"]),
              helper.make_node("Gather", ["blocks", "blk_idx"], ["blk"]),            # (B, k, k)
              helper.make_node("Unsqueeze", ["alpha_in", "b_axes1"], ["alpha3"]),    # (B, 1, k)
              helper.make_node("MatMul", ["alpha3", "blk"], ["moved3"]),             # (B, 1, k)
              helper.make_node("Squeeze", ["moved3", "b_axes1"], ["moved"]),
              helper.make_node("Gather", ["start_blocks", "cl_t"], ["init_t"])]      # (B, k)
    else:
        n += [helper.make_node("MatMul", ["alpha_in", "step"], ["moved"]),           # (B, K)
              helper.make_node("Identity", ["start"], ["init_t"])]                   # (K,) broadcasts
    n += [helper.make_node("Where", ["first", "init_t", "moved"], ["pred"]),
          helper.make_node("Gather", ["emit_by_word", "ids_t"], ["e_t"]),            # (B, K)
          helper.make_node("Mul", ["pred", "e_t"], ["u"]),
          helper.make_node("ReduceSum", ["u", "b_axes1"], ["c"], keepdims=1),        # (B, 1)
          helper.make_node("Greater", ["c", "b_zero"], ["c_pos"]),
          helper.make_node("Where", ["c_pos", "c", "b_one"], ["c_safe"]),            # u / 1 = 0 when c == 0
          helper.make_node("Div", ["u", "c_safe"], ["alpha_new"]),
          helper.make_node("Log", ["c"], ["logc_raw"]),                              # -inf when c == 0
          helper.make_node("Where", ["mask_t", "alpha_new", "alpha_in"], ["alpha_out"]),
          helper.make_node("Where", ["mask_t", "logc_raw", "b_zero"], ["logc2"]),
          helper.make_node("Squeeze", ["logc2", "b_axes1"], ["logc"])]
    inputs = [helper.make_tensor_value_info("alpha_in", F, ["B", "K"]),
              helper.make_tensor_value_info("ids_t", I, ["B"]),
              helper.make_tensor_value_info("prev_t", I, ["B"]),
              helper.make_tensor_value_info("mask_t", BOOL, ["B", 1]),
              helper.make_tensor_value_info("first", BOOL, [])]
    outputs = [helper.make_tensor_value_info("alpha_out", F, ["B", "K"]),
               helper.make_tensor_value_info("logc", F, ["B"])]
    return helper.make_graph(n, "forward_step", inputs, outputs, initializer=inits)


def build_scoring_model(family: str, arrays: dict[str, np.ndarray], metadata: dict[str, str] | None = None,
                        opset: int = OPSET) -> onnx.ModelProto:
    """The scoring ModelProto for `family` from `family_tensors`' arrays."""
    if family not in FAMILIES:
        raise ValueError(f"ONNX export supports the families {', '.join(FAMILIES)}, not {family!r}")
    F, I = TensorProto.FLOAT, TensorProto.INT64
    inits = [numpy_helper.from_array(v, k) for k, v in arrays.items()]
    inits += [_const("c_0", 0), _const("c_1", 1), _const("axes0", [0]), _const("axes1", [1]),
              _const("axes2", [2]), _const("one_vec", [1]), _const("pad_id", [[0]])]
    n = [
        # T, B and the (B, T) mask of real positions
        helper.make_node("Shape", ["ids"], ["ids_shape"]),
        helper.make_node("Gather", ["ids_shape", "c_1"], ["T"]),                # scalar
        helper.make_node("Gather", ["ids_shape", "c_0"], ["B"]),
        helper.make_node("Range", ["c_0", "T", "c_1"], ["pos"]),                # (T,)
        helper.make_node("Unsqueeze", ["pos", "axes0"], ["pos_row"]),           # (1, T)
        helper.make_node("Unsqueeze", ["lengths", "axes1"], ["len_col"]),       # (B, 1)
        helper.make_node("Less", ["pos_row", "len_col"], ["mask"]),             # (B, T) bool
        helper.make_node("Transpose", ["mask"], ["mask_tb"], perm=[1, 0]),
        helper.make_node("Unsqueeze", ["mask_tb", "axes2"], ["mask_tb1"]),     # (T, B, 1)
        helper.make_node("Equal", ["pos", "c_0"], ["first"]),                   # (T,) bool
        # ids as (T, B) and x_{t-1} as (T, B) (row 0: a dummy id, never used since first[0] is true)
        helper.make_node("Transpose", ["ids"], ["ids_tb"], perm=[1, 0]),
        helper.make_node("Unsqueeze", ["B", "axes0"], ["B_vec"]),
        helper.make_node("Concat", ["one_vec", "B_vec"], ["pad_shape"], axis=0),
        helper.make_node("Expand", ["pad_id", "pad_shape"], ["pad_row"]),      # (1, B)
        helper.make_node("Concat", ["pad_row", "ids_tb"], ["prev_ext"], axis=0),
        helper.make_node("Unsqueeze", ["T", "axes0"], ["T_vec"]),
        helper.make_node("Slice", ["prev_ext", "zero_vec", "T_vec", "axes0"], ["prev_tb"]),  # rows 0 .. T-1
    ]
    inits.append(_const("zero_vec", [0]))
    # initial alpha (B, K): any finite value (first[0] selects the init); zeros of the right shape
    K = arrays["start_blocks"].shape[1] if family == "blocked_hmm" else arrays["start"].shape[0]
    inits.append(_const("zeros_1K", np.zeros((1, K)), np.float32))
    n += [helper.make_node("Concat", ["B_vec", "one_vec"], ["bk_shape"], axis=0),
          helper.make_node("Expand", ["zeros_1K", "bk_shape"], ["alpha0"]),
          helper.make_node("Scan", ["alpha0", "ids_tb", "prev_tb", "mask_tb1", "first"], ["alpha_T", "logc_tb"],
                           body=_step_body(family), num_scan_inputs=4),
          helper.make_node("Transpose", ["logc_tb"], ["token_logprobs"], perm=[1, 0]),
          helper.make_node("Cast", ["token_logprobs"], ["tok64"], to=TensorProto.DOUBLE),
          helper.make_node("ReduceSum", ["tok64", "axes1"], ["logprob"], keepdims=0)]
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
    """Write the scoring graph of a loaded `hmm`, `blocked_hmm` or `rank_hmm` family instance to `path`.

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
