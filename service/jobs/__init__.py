"""Batch jobs in the OpenAI shape: files, batches, chunked crash-safe processing.

A batch's input lines are processed in chunks of `job_chunk_size`; each chunk's output lines are committed
with one set-if-absent write keyed by the chunk index, so a worker killed mid-job (SIGKILL) loses at most
the chunk it was computing, and a chunk can never be committed twice: after a restart the job completes
with every `custom_id` exactly once. A worker holds a lease on the batch (refreshed by a heartbeat
thread); when the lease of a live batch expires, the reaper re-enqueues it.

Faults: a Redis connection error or timeout while a batch runs is waited out (reconnect with backoff, then
the batch resumes from its committed chunks); any other error fails the batch visibly (status `failed`,
`errors` naming the cause, chunks deleted), never "completed" with lines missing. A batch's status only
moves forward: every transition is conditional (not already terminal; not leased by another worker), so a
worker that was frozen and resumes cannot rewrite a batch another worker finished. The output size is
checked as chunks are committed (`job_max_output_bytes`).

Retention: files and batches carry `expires_at` (`job_retention_s` after creation); they are deleted lazily
on access, by a periodic sweep, and on Redis by key TTLs. Tenancy: with API keys, each file and batch
records a hash of the key that created it (`owner`); other keys see 404.

Several workers, on any hosts sharing one Redis, can run one batch together: each claims a chunk at a time
(a claim lapses with its worker, so a dead worker's chunk is claimed again), the lease holder (the lead) waits for
the last chunks and writes the output files, streamed chunk by chunk (`processing`). Each host has its own model
store: a batch records the identity (content hash) of every model its lines name as the API's store holds it
(`model_hashes`), and a worker whose store lacks a model or holds another version of it answers those lines 503
`model_mismatch` (naming the model, the worker and both hashes), never from another model. Input files are streamed in
(upload, validation, each chunk read as a byte range) and output files out: no file is held whole in memory.

Two stores implement the same interface (`JobStore`): `RedisJobStore` (with rq workers: `latentlm worker`) and
`LocalJobStore` (files on local disk, jobs run in a thread of the API process).

Modules, each importing only those above it:
- `store`: the `JobStore` protocol, ids, statuses, visibility and expiry of records, `StorageError`, `BatchFailure`
- `jsonl`: input files as lines: chunked reads, the per-line limit, upload checks, JSONL request validation,
  chunk plans (byte ranges of `job_chunk_size` request lines) and reading one chunk's requests
- `redis_store`: `RedisJobStore` and `wait_for_redis`;  `local_store`: `LocalJobStore`
- `api`: create / get / delete files, create / get / cancel / delete batches, the public batch object
- `processing`: running one batch under a lease (`process_batch`), chunk by chunk, then its output files
- `runners`: `LocalRunner` (a thread of the API process) and `RQRunner` with the rq entry point

Every name is re-exported here: callers use `jobs.<name>` and need not know the module."""

from latentlm.service.jobs.api import (
    ENDPOINTS,
    INTERNAL,
    batch_object,
    cancel_batch,
    create_batch,
    create_file,
    delete_batch,
    delete_file,
    file_object,
    get_batch,
    get_file,
)
from latentlm.service.jobs.jsonl import (
    DEFAULT_MAX_LINE_BYTES,
    MAX_LINES,
    MAX_MODELS,
    READ_CHUNK,
    LineTooLarge,
    checked_upload,
    iter_lines,
    iter_lines_at,
    max_line_bytes,
    parse_input_file,
    plan_chunks,
    read_chunks,
    read_requests,
    validate_input_file,
)
from latentlm.service.jobs.local_store import LocalJobStore
from latentlm.service.jobs.processing import (
    ModelMismatch,
    checked_model,
    execute_lines,
    line_failure,
    output_line,
    process_batch,
)
from latentlm.service.jobs.redis_store import (
    REDIS_DOWN,
    REDIS_MAX_VALUE,
    REDIS_TIMEOUT_S,
    UPLOAD_TTL_S,
    RedisJobStore,
    wait_for_redis,
)
from latentlm.service.jobs.runners import (
    FAILURE_TTL_S,
    QUEUE_NAME,
    WORKER_CONTEXT,
    LocalRunner,
    RQRunner,
    enqueue,
    queued_batches,
    rq_process_batch,
)
from latentlm.service.jobs.store import (
    IDS,
    LIVE,
    TERMINAL,
    BatchFailure,
    JobStore,
    ModelIdentities,
    StagedFile,
    StorageError,
    is_expired,
    new_id,
    output_file_ids,
    owner_of,
    valid_id,
    visible,
    worker_identity,
)

__all__ = [
    "DEFAULT_MAX_LINE_BYTES", "ENDPOINTS", "FAILURE_TTL_S", "IDS", "INTERNAL", "LIVE", "MAX_LINES", "MAX_MODELS",
    "QUEUE_NAME", "READ_CHUNK", "REDIS_DOWN", "REDIS_MAX_VALUE", "REDIS_TIMEOUT_S", "TERMINAL", "UPLOAD_TTL_S",
    "WORKER_CONTEXT", "BatchFailure", "JobStore", "LineTooLarge", "LocalJobStore", "LocalRunner", "ModelIdentities",
    "ModelMismatch", "RQRunner", "RedisJobStore", "StagedFile", "StorageError", "batch_object", "cancel_batch",
    "checked_model", "checked_upload", "create_batch", "create_file", "delete_batch", "delete_file", "enqueue",
    "execute_lines", "file_object", "get_batch", "get_file", "is_expired", "iter_lines", "iter_lines_at",
    "line_failure", "max_line_bytes", "new_id", "output_file_ids", "output_line", "owner_of", "parse_input_file",
    "plan_chunks", "process_batch", "queued_batches", "read_chunks", "read_requests", "rq_process_batch", "valid_id",
    "validate_input_file", "visible", "wait_for_redis", "worker_identity",
]
