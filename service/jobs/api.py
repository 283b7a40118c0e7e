"""The jobs API the routes call, in OpenAI's shapes: create, get and delete files; create, get, cancel and delete
batches, and the public batch object with its live `request_counts`. Input errors are `APIError`s naming the
field (404 for another key's file or batch: its existence is not revealed); blocking, so called off the event
loop."""

from __future__ import annotations

import io
import logging
import time
from collections.abc import Iterator, Mapping
from typing import Any

from latentlm.ops import spec
from latentlm.service.errors import APIError
from latentlm.service.jobs.jsonl import DEFAULT_MAX_LINE_BYTES, checked_upload, validate_input_file
from latentlm.service.jobs.store import LIVE, TERMINAL, JobStore, new_id, valid_id, visible


class _Endpoints(Mapping[str, str]):
    """route -> operation name, for every operation declared now (`ops.spec.OPERATIONS`): a batch runs any of
    them."""

    def __getitem__(self, path: str) -> str:
        for name, op in spec.OPERATIONS.items():
            if op.path == path:
                return name
        raise KeyError(path)

    def __iter__(self) -> Iterator[str]:
        return iter([op.path for op in spec.OPERATIONS.values()])

    def __len__(self) -> int:
        return len(spec.OPERATIONS)


ENDPOINTS: Mapping[str, str] = _Endpoints()
log = logging.getLogger("latentlm.jobs")
INTERNAL = ("total", "cancel_requested", "owner", "final_counts", "model_hashes")  # batch record fields never shown


def file_object(meta: dict) -> dict:
    return {"id": meta["id"], "object": "file", "bytes": meta["bytes"], "created_at": meta["created_at"],
            "expires_at": meta.get("expires_at"), "filename": meta["filename"], "purpose": meta["purpose"]}


def _expires(now: int, retention_s: int) -> int | None:
    return now + retention_s if retention_s > 0 else None


def create_file(store: JobStore, content: bytes | Any, filename: str, purpose: str, owner: str | None = None,
                retention_s: int = 0, max_line: int = DEFAULT_MAX_LINE_BYTES) -> dict:
    """Store an uploaded file: `content` is its bytes or an open binary file, streamed in chunks of `READ_CHUNK`
    (never read whole) while every line is checked against `max_line` bytes (413 `line_too_large` naming the
    line and the limit; nothing is stored then). Blocking: call it off the event loop."""
    f = io.BytesIO(content) if isinstance(content, bytes | bytearray) else content
    now = int(time.time())
    meta = {"id": new_id("file"), "bytes": 0, "created_at": now, "expires_at": _expires(now, retention_s),
            "filename": filename, "purpose": purpose, "owner": owner}
    store.put_file_stream(meta, checked_upload(f, max_line, [0]))
    return file_object(meta)


def get_file(store: JobStore, fid: str, owner: str | None, param: str = "file_id") -> dict:
    """The file's metadata, or 404 (also for another key's file: its existence is not revealed)."""
    meta = store.file_meta(fid) if valid_id(fid, "file") else None
    if not visible(meta, owner):
        raise APIError(404, f"{'input_file_id: ' if param == 'input_file_id' else ''}no file {fid!r}",
                       param=param, code="file_not_found")
    return meta


def delete_file(store: JobStore, fid: str, owner: str | None) -> dict:
    """Delete a file (OpenAI's shape); 409 while it is the input of a live batch."""
    get_file(store, fid, owner)
    for bid in store.active():
        b = store.get_batch(bid)
        if b is not None and b["status"] in LIVE and b["input_file_id"] == fid:
            raise APIError(409, f"file {fid!r} is the input of batch {bid!r}, which is {b['status']}; cancel it "
                                "first", param="file_id", code="file_in_use", type="invalid_request_error")
    store.delete_file(fid)
    return {"id": fid, "object": "file", "deleted": True}


def create_batch(store: JobStore, input_file_id: str, endpoint: str, completion_window: str = "24h",
                 metadata: dict | None = None, owner: str | None = None, retention_s: int = 0,
                 max_line: int = DEFAULT_MAX_LINE_BYTES) -> dict:
    """Validate the input file (streamed: no request is kept) and record the batch (status in_progress, or failed
    with `errors`). `expires_at`: when the batch, its chunks and its output files are deleted (None: kept).
    `model_hashes` (internal): the identity of each model the lines name, as the store's `model_identities` (the
    API's model store) gives it; a worker answers those lines only from a model of that identity
    (`processing.execute_lines`)."""
    if endpoint not in ENDPOINTS:
        raise APIError(422, f"endpoint: must be one of {', '.join(ENDPOINTS)}, got {endpoint!r}", param="endpoint",
                       code="invalid_value")
    get_file(store, input_file_id, owner, param="input_file_id")
    content = store.iter_file(input_file_id)  # streamed: never the whole file in memory
    if content is None:
        raise APIError(404, f"input_file_id: no file {input_file_id!r}", param="input_file_id", code="file_not_found")
    now = int(time.time())
    names: set[str] = set()
    total, errors = validate_input_file(content, endpoint, max_line, names)
    batch = {"id": new_id("batch"), "object": "batch", "endpoint": endpoint, "errors": None,
             "input_file_id": input_file_id, "completion_window": completion_window, "status": "validating",
             "output_file_id": None, "error_file_id": None, "created_at": now, "in_progress_at": None,
             "expires_at": _expires(now, retention_s), "finalizing_at": None, "completed_at": None,
             "failed_at": None, "expired_at": None, "cancelling_at": None, "cancelled_at": None,
             "total": total, "metadata": metadata, "cancel_requested": False, "owner": owner,
             "model_hashes": _model_hashes(store, names) if not errors else {}}
    if errors:
        batch.update(status="failed", failed_at=now, errors={"object": "list", "data": errors})
    else:
        batch.update(status="in_progress", in_progress_at=now)
    store.put_batch(batch)
    return batch_object(store, batch)


def _model_hashes(store: JobStore, names: set[str]) -> dict[str, str]:
    """{name: identity} of the models the batch's lines name, from the API's model store (`model_identities`; {}
    without one: the lines run unchecked). A store that cannot be read is logged, not fatal (nothing recorded)."""
    identify = getattr(store, "model_identities", None)
    if identify is None or not names:
        return {}
    try:
        return identify(sorted(names))
    except Exception as e:
        log.warning("batch: the identities of models %s were not recorded (%s: %s); their lines run unchecked",
                    sorted(names)[:5], type(e).__name__, e)
        return {}


def batch_object(store: JobStore, batch: dict) -> dict:
    """The public batch object with `request_counts` (live from the chunks; frozen once the batch finished)."""
    final = batch.get("final_counts")
    completed, failed = (final["completed"], final["failed"]) if final else store.counts(batch["id"])
    out = {k: v for k, v in batch.items() if k not in INTERNAL}
    out["request_counts"] = {"total": batch["total"], "completed": completed, "failed": failed}
    return out


def get_batch(store: JobStore, bid: str, owner: str | None) -> dict:
    """The batch record, or 404 (also for another key's batch)."""
    b = store.get_batch(bid) if valid_id(bid, "batch") else None
    if not visible(b, owner):
        raise APIError(404, f"no batch {bid!r}", param="batch_id", code="batch_not_found")
    return b


def cancel_batch(store: JobStore, bid: str, owner: str | None = None) -> dict:
    b = get_batch(store, bid, owner)
    if b["status"] not in TERMINAL and store.transition(
            bid, {"cancel_requested": True, "status": "cancelling", "cancelling_at": int(time.time())}):
        return batch_object(store, store.get_batch(bid) or b)
    b = get_batch(store, bid, owner)  # finished meanwhile
    if b["status"] == "cancelled":
        return batch_object(store, b)
    raise APIError(409, f"batch {bid!r} is already {b['status']}", param="batch_id", code="batch_finished",
                   type="invalid_request_error")


def delete_batch(store: JobStore, bid: str, owner: str | None) -> dict:
    """Delete a finished batch with its output and error files (the input file stays); 409 while it is live:
    cancel it first (POST /v1/batches/{id}/cancel), then delete it once it is cancelled."""
    b = get_batch(store, bid, owner)
    if b["status"] not in TERMINAL:
        raise APIError(409, f"batch {bid!r} is {b['status']}; cancel it (POST /v1/batches/{bid}/cancel) and "
                            "delete it once it is cancelled", param="batch_id", code="batch_in_progress",
                       type="invalid_request_error")
    store.delete_batch(bid)
    return {"id": bid, "object": "batch", "deleted": True}
