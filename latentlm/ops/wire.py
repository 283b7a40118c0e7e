"""A prepared call between processes (an API worker and the engine process, `service.engine`), in one form for every
operation: the operation's name, the model version, its options and what `prepare` built (encoded inputs, a
constraint's automaton, a completion's prompts), its size, cost and limits. The receiving process runs it as it is
(`from_wire`): nothing is validated, encoded or compiled twice.

The bytes: msgpack, with extension types for what msgpack's own types lose: tuples (a compiled constraint is keyed
by its hashable `Constraint`: cached automata and backward messages find it again), numpy arrays (dtype and shape
kept) and the dataclasses of `TYPES` (automata, constraints, typed results), rebuilt by name from that list only.
Numbers of numpy or torch (`tolist`) go as plain numbers or lists. Answers cross the same way (`pack`)."""

from __future__ import annotations

import dataclasses
from typing import Any

import msgpack
import numpy as np

from latentlm.models.constraint import Constraint, WordDFA
from latentlm.models.results import RESULTS
from latentlm.models.text_constraint import TextConstraint, TextDFA
from latentlm.ops import spec
from latentlm.ops.call import Call
from latentlm.ops.constrain import Limits
from latentlm.ops.model import LoadedModel

MAX_MESSAGE_BYTES = 1 << 30  # one message at most (a posterior answer of max_posterior_entries is ~50 MB)
TUPLE, ARRAY, DATACLASS = 1, 2, 3  # msgpack extension type codes
TYPES: dict[str, type] = {cls.__name__: cls for cls in (Constraint, WordDFA, TextConstraint, TextDFA, *RESULTS)}
"""The dataclasses that cross as themselves: name -> class (a name not here is refused)."""
LIMITS = tuple(f.name for f in dataclasses.fields(Limits) if f.name != "cancelled")


def _default(obj: Any) -> Any:
    if isinstance(obj, tuple):
        return msgpack.ExtType(TUPLE, pack(list(obj)))
    if isinstance(obj, np.ndarray):
        return msgpack.ExtType(ARRAY, pack([obj.dtype.str, list(obj.shape), np.ascontiguousarray(obj).tobytes()]))
    cls = type(obj)
    if dataclasses.is_dataclass(obj) and TYPES.get(cls.__name__) is cls:
        return msgpack.ExtType(DATACLASS, pack([cls.__name__, {f.name: getattr(obj, f.name)
                                                                for f in dataclasses.fields(obj)}]))
    if hasattr(obj, "tolist"):  # numpy and torch numbers and tensors
        return obj.tolist()
    for plain in (bool, int, float, str, bytes, list, dict):  # subclasses (strict types send them here)
        if isinstance(obj, plain):
            return plain(obj)
    raise TypeError(f"cannot send a {cls.__name__} between processes (ops.wire.TYPES lists the dataclasses that can)")


def _ext(code: int, data: bytes) -> Any:
    if code == TUPLE:
        return tuple(unpack(data))
    if code == ARRAY:
        dtype, shape, raw = unpack(data)
        return np.frombuffer(raw, dtype=np.dtype(dtype)).reshape(shape).copy()
    if code == DATACLASS:
        name, fields = unpack(data)
        if name not in TYPES:
            raise ValueError(f"no dataclass {name!r} crosses between processes")
        return TYPES[name](**fields)
    return msgpack.ExtType(code, data)


def pack(obj: Any) -> bytes:
    """`obj` as msgpack bytes (tuples, numpy arrays and `TYPES` as extension types)."""
    return msgpack.packb(obj, default=_default, use_bin_type=True, strict_types=True)


def unpack(data: bytes) -> Any:
    return msgpack.unpackb(data, raw=False, strict_map_key=False, ext_hook=_ext)


def unpacker() -> msgpack.Unpacker:
    """A streaming reader of `pack`ed messages written back to back."""
    return msgpack.Unpacker(raw=False, strict_map_key=False, max_buffer_size=MAX_MESSAGE_BYTES, ext_hook=_ext)


def to_wire(call: Call) -> dict[str, Any]:
    """A prepared call as the other process gets it: `{"op", "model", "hash", "opts", "seqs", "cost", "tokens":
    [input, output], "prepared", "limits"}` (`pack` it)."""
    return {"op": call.op.name, "model": call.model.name, "hash": call.model.content_hash, "opts": call.opts,
            "seqs": call.seqs, "cost": call.cost, "tokens": [call.input_tokens, call.output_tokens],
            "prepared": call.prepared, "limits": [getattr(call.limits, name) for name in LIMITS]}


def from_wire(msg: dict[str, Any], model: LoadedModel) -> Call:
    """The call `to_wire` sent, on `model` (the version named by `msg["hash"]`), ready for its operation's `run`;
    InputError naming `op` for an operation this process does not declare."""
    inputs, outputs = msg["tokens"]
    return Call(model, spec.get(msg["op"]), msg["opts"], msg["seqs"], None, msg["cost"], input_tokens=inputs,
                output_tokens=outputs, prepared=msg["prepared"], limits=Limits(**dict(zip(LIMITS, msg["limits"],
                                                                                          strict=True))))
