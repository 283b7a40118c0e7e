"""The operations layer, shared by the CLI, the service, batch jobs and training's evaluation.

- `spec`: every operation declared once (`Operation`: name, request model, options, cost, run, response);
  REST routes, CLI subcommands and flags, batch-job lines and the OpenAPI document are built from `OPERATIONS`.
- `requests`: the request models (pydantic) the declarations name.
- `model`: loading a verified model (`load_model`, `LoadedModel`).
- `inputs`: inputs to token ids, stop sequences, seeds, top_k.
- `compute`: a family's operation over sequences in length-sorted batches, its typed results in input order.
- `batching`: `run` an operation in length-sorted batches; `run_merged` several requests in one run.
- `generate`: `sample`.
- `cost`: a request's estimated work, as its family states it.
- `format`: the public JSON (field names of whole and streamed responses; `dumps`).
"""

from latentlm.models.errors import InputError, LimitExceeded
from latentlm.models.family import OPERATIONS as OPERATION_NAMES
from latentlm.ops.batching import run, run_merged
from latentlm.ops.compute import (
    CPU_BATCH_TOKENS,
    CUDA_BATCH_TOKENS,
    CUDA_SPLIT_ROWS,
    batch_tokens,
    check_supported,
    default_method,
    device_batches,
)
from latentlm.ops.cost import (
    ENTRY_COST,
    OUTPUT_TOKEN_COST,
    PCFG_VITERBI_FACTOR,
    SAMPLE_STEP_COST,
    TOKEN_COST,
    operation_cost,
    posterior_entries,
)
from latentlm.ops.format import dumps, posterior_chunks
from latentlm.ops.generate import cut_at_stop, sample
from latentlm.ops.inputs import (
    MAX_SEED,
    MAX_STOP_SEQUENCES,
    MAX_STOP_TOKENS,
    check_seed,
    check_shaping,
    encode_inputs,
    encode_stops,
    parse_top_k,
)
from latentlm.ops.model import BACKENDS, DTYPES, ONNX_CACHE, STORAGE_DTYPES, LoadedModel, load_model, resolve_device

OPERATIONS = OPERATION_NAMES

__all__ = ["LoadedModel", "load_model", "encode_inputs", "run", "run_merged", "sample", "resolve_device",
           "batch_tokens", "device_batches", "parse_top_k", "check_seed", "posterior_entries", "operation_cost",
           "posterior_chunks", "dumps", "default_method", "LimitExceeded", "InputError", "OPERATIONS",
           "BACKENDS", "DTYPES", "ONNX_CACHE", "STORAGE_DTYPES", "CPU_BATCH_TOKENS", "CUDA_BATCH_TOKENS",
           "CUDA_SPLIT_ROWS", "check_supported", "ENTRY_COST", "OUTPUT_TOKEN_COST", "PCFG_VITERBI_FACTOR",
           "SAMPLE_STEP_COST", "TOKEN_COST", "cut_at_stop", "MAX_SEED", "MAX_STOP_SEQUENCES", "MAX_STOP_TOKENS",
           "check_shaping", "encode_stops"]
