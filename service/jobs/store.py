"""What both job stores share: the `JobStore` protocol they implement, the ids the service hands out, batch
statuses, who may see a record and when it expires, and the errors a store or a batch raises.

Records are plain dicts in the OpenAI shape: a file's metadata (`id`, `bytes`, `created_at`, `expires_at`,
`filename`, `purpose`, `owner`) and a batch (`id`, `status`, `endpoint`, `input_file_id`, the `*_at` times, ...,
plus the internal fields `total`, `cancel_requested`, `owner`, `final_counts`, `model_hashes`)."""

from __future__ import annotations

import hashlib
import os
import re
import secrets
import socket
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Protocol

from latentlm.service.errors import APIError

LIVE = ("validating", "in_progress", "finalizing", "cancelling")
TERMINAL = ("completed", "failed", "cancelled", "expired")


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


# The ids this service hands out, exactly: `new_id` ("file_" / "batch_" + 24 hex digits) and a batch's output and
# error files ("file-<batch id>-output"). Anything else is no file or batch (404), never a store key: an id such as
# `<id>:chunks` would otherwise reach another record's Redis key, and `../x` another file on disk.
IDS = {"file": re.compile(r"file_[0-9a-f]{24}|file-batch_[0-9a-f]{24}-(?:output|error)"),
       "batch": re.compile(r"batch_[0-9a-f]{24}")}


def valid_id(ident: Any, kind: str) -> bool:
    """Whether `ident` is a `kind` ("file" or "batch") id in the exact format the service generates."""
    return isinstance(ident, str) and IDS[kind].fullmatch(ident) is not None


def worker_identity(name: str = "") -> str:
    """Who runs a batch, in its lease and chunk claims and in the logs: `name` (`LATENTLM_WORKER_NAME`) or
    "<host>:<pid>", so that workers on several hosts against one Redis are told apart."""
    return name or f"{socket.gethostname()}:{os.getpid()}"


def output_file_ids(bid: str) -> list[str]:
    return [f"file-{bid}-output", f"file-{bid}-error"]


def owner_of(authorization: str | None, keys: list[str]) -> str | None:
    """The owner recorded on files and batches: None without API keys (everything shared, as before keys);
    else a SHA-256 of the bearer key (the key itself is never stored)."""
    if not keys:
        return None
    token = (authorization or "").partition(" ")[2].strip()
    return hashlib.sha256(b"latentlm-api-key:" + token.encode()).hexdigest()


def visible(record: dict | None, owner: str | None) -> bool:
    """A record is seen by its owner's key; without keys (owner None) by everyone."""
    return record is not None and (owner is None or record.get("owner") == owner)


def is_expired(record: dict, now: float | None = None) -> bool:
    exp = record.get("expires_at")
    return bool(exp) and (now if now is not None else time.time()) >= exp


class StorageError(APIError):
    """The local jobs directory refused a write (disk full, read-only, no permission): 503 naming the cause."""

    def __init__(self, e: OSError):
        why = e.strerror or type(e).__name__
        super().__init__(503, f"job storage unavailable: {why} (errno {e.errno}); retry later",
                         code="storage_unavailable", headers={"Retry-After": "1"})


class BatchFailure(Exception):
    """A batch-level failure with the code its `errors` entry carries (e.g. output_too_large)."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


ModelIdentities = Callable[[Iterable[str]], dict[str, str]]


class StagedFile(Protocol):
    """A file being written piece by piece (`JobStore.stage_file`), out of sight until `JobStore.transition`
    moves it into place with its metadata; `discard` drops it."""

    size: int  # bytes written so far

    def write(self, data: bytes) -> None:
        """Append `data`."""

    def discard(self) -> None:
        """Drop what was written (nothing happens once `transition` took the file)."""


class JobStore(Protocol):
    """Files, batch records, chunk results and leases: what `RedisJobStore` (rq workers, any number of processes)
    and `LocalJobStore` (local disk, one process) both implement. Ids that are not in the service's own format
    (`valid_id`) are no record: reads answer None, deletes False."""

    max_output_bytes: int  # the largest output or error file the store can hold
    # {model name: identity} of the given names in the model store of the process that creates batches (the API:
    # `ModelRegistry.identities`); a batch records it (`api.create_batch`, field `model_hashes`) and a worker
    # answers a line only from a model of that identity. None: nothing recorded (lines run unchecked)
    model_identities: ModelIdentities | None

    # -- files: `meta` is the file's metadata record; content is bytes, streamed in chunks
    def put_file(self, meta: dict, content: bytes) -> None:
        """Store a whole file (a batch's output and error files)."""

    def put_file_stream(self, meta: dict, chunks: Iterable[bytes]) -> None:
        """Store a file from its chunks, setting `meta["bytes"]`; an error while reading leaves nothing."""

    def iter_file(self, fid: str, start: int = 0, end: int | None = None) -> Iterator[bytes] | None:
        """The file's content (bytes `start` to `end`, default all) in chunks, or None when there is no such
        file."""

    def stage_file(self, fid: str) -> StagedFile:
        """A new file `fid` to write piece by piece, placed by `transition` (a batch's output and error files)."""

    def file_meta(self, fid: str) -> dict | None:
        """The file's metadata, or None (also once expired: deleted on access)."""

    def file_content(self, fid: str) -> bytes | None:
        """The whole content, or None."""

    def delete_file(self, fid: str) -> bool:
        """Delete the file; whether it existed."""

    # -- batches
    def put_batch(self, batch: dict) -> None:
        """Write the batch record (and its index entries)."""

    def get_batch(self, bid: str) -> dict | None:
        """The batch record, or None (also once expired: deleted on access)."""

    def transition(self, bid: str, fields: dict, token: str | None = None,
                   files: list[tuple[dict, bytes | StagedFile]] = ()) -> bool:
        """If the batch exists, is not finished and no other worker holds its lease (`token` None: not checked),
        write `files` (their content as bytes, or staged) and set `fields`, in one step; False when refused."""

    def fail(self, bid: str, fields: dict, token: str | None) -> bool:
        """Mark the batch failed (as `transition`)."""

    def list_batches(self, limit: int, owner: str | None = None) -> tuple[list[dict], bool]:
        """The newest `limit` batches `owner` may see, and whether there are more."""

    def active(self) -> list[str]:
        """Ids of the batches not finished yet."""

    def forget_active(self, bid: str) -> None:
        """Drop the batch from the index of live batches."""

    def delete_batch(self, bid: str) -> bool:
        """Delete the batch record, its chunks, lease and output files; whether it existed."""

    def sweep(self, now: float | None = None) -> int:
        """Delete every file and batch whose `expires_at` has passed; how many."""

    # -- chunks: a chunk's output lines are committed once, keyed by the chunk index
    def put_plan(self, bid: str, plan: dict, expires_at: int | None = None) -> dict:
        """Record the batch's chunk plan (`jsonl.plan_chunks`) unless one is recorded; the plan recorded (the
        same for every worker, whatever its `job_chunk_size`)."""

    def get_plan(self, bid: str) -> dict | None:
        """The batch's chunk plan, or None before one is recorded."""

    def commit_chunk(self, bid: str, index: int, lines: list[str], completed: int, failed: int,
                     expires_at: int | None = None) -> int:
        """1 committed, 0 committed before (by another worker), -1 no such batch, -2 batch already finished."""

    def chunk_indices(self, bid: str) -> set[int]:
        """The indices of the committed chunks."""

    def chunk(self, bid: str, index: int) -> list[str] | None:
        """A committed chunk's output lines, or None."""

    def counts(self, bid: str) -> tuple[int, int]:
        """(completed, failed) lines over the committed chunks."""

    def output_bytes(self, bid: str) -> int:
        """Bytes of output over the committed chunks."""

    def delete_chunks(self, bid: str) -> None:
        """Delete the committed chunks."""

    # -- chunk claims: which worker computes a chunk (one process: always granted)
    def claim_chunk(self, bid: str, index: int, token: str, ttl_s: float) -> int:
        """1: `token` claims chunk `index` for `ttl_s` seconds (or holds it already); 0: another worker holds it;
        -1: it is committed."""

    def refresh_claim(self, bid: str, index: int, token: str, ttl_s: float) -> bool:
        """Extend the claim `token` holds; False when it does not hold it."""

    def release_claim(self, bid: str, index: int, token: str) -> None:
        """Give the claim up if `token` holds it."""

    # -- leases: which worker leads a batch and finalises it (one process: always granted)
    def acquire_lease(self, bid: str, token: str, ttl_s: float) -> bool:
        """Take the lease for `ttl_s` seconds, or keep it if `token` holds it already."""

    def refresh_lease(self, bid: str, token: str, ttl_s: float) -> bool:
        """Extend the lease `token` holds; False when it does not hold it."""

    def release_lease(self, bid: str, token: str) -> None:
        """Give the lease up if `token` holds it."""
