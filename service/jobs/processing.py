"""Running one batch, crash-safe: its input lines in chunks of `job_chunk_size`, each chunk's output lines
committed once (keyed by the chunk index), under a lease on the batch refreshed by a heartbeat thread; then
the output and error files written and the terminal status set in one conditional step. A Redis outage is
waited out and the batch resumes from its committed chunks; any other error fails the batch visibly.

Lines of the same model version and options share one batched run (`execute_lines`, `spec.run_calls`) where
the operation merges; the others (sampling) run line by line. With an engine process (`service.engine`) the lines
run there, on its device, merged by its batcher."""

from __future__ import annotations

import functools
import logging
import math
import secrets
import threading
import time
from collections.abc import Callable
from typing import Any

import orjson

from latentlm.models.errors import LatentLMError
from latentlm.ops import dumps
from latentlm.ops.spec import Call
from latentlm.ops.spec import run_calls as run_calls_here
from latentlm.service.errors import APIError, error_payload, from_model_error
from latentlm.service.execute import body, limits, parse, prepare
from latentlm.service.jobs.api import ENDPOINTS
from latentlm.service.jobs.jsonl import max_line_bytes, parse_input_file
from latentlm.service.jobs.redis_store import REDIS_DOWN, wait_for_redis
from latentlm.service.jobs.store import TERMINAL, BatchFailure, JobStore, StorageError, output_file_ids
from latentlm.service.registry import ModelRegistry
from latentlm.service.settings import Settings

log = logging.getLogger("latentlm.jobs")


RunCalls = Callable[[list[Call]], list[Any]]  # prepared calls -> each one's results (or its exception)


def execute_lines(models: ModelRegistry, op: str, bodies: list[dict], settings: Settings,
                  run_calls: RunCalls | None = None) -> list[tuple[int, dict]]:
    """(status, body) per request; requests of the same model version and options share one batched call.
    `run_calls`: where the prepared calls run (an engine process, `engine.EngineClient.run_calls`); default here
    (`spec.run_calls`)."""
    out: list[tuple[int, dict] | None] = [None] * len(bodies)
    calls: list[tuple[int, Call]] = []
    for i, b in enumerate(bodies):
        try:
            req = parse(op, b)
            model = models.get(req.model)
            calls.append((i, prepare(model, op, req, settings.max_request_tokens, settings.max_posterior_entries,
                                     max_cost=settings.max_request_cost, max_sample_tokens=settings.max_sample_tokens,
                                     limits=limits(settings))))
        except Exception as e:
            out[i] = line_failure(i, e)
    here = functools.partial(run_calls_here, max_batch_tokens=settings.max_batch_tokens)
    results = (run_calls or here)([c for _, c in calls])
    for (i, c), res in zip(calls, results, strict=True):
        out[i] = line_failure(i, res) if isinstance(res, Exception) else (200, body(c, res))
    return [o for o in out if o is not None]


def line_failure(line: int, e: Exception) -> tuple[int, dict]:
    """(status, error body) for one batch line: the API's error for a request error, and a 500 for anything
    else, so one line's failure never fails the whole batch."""
    if isinstance(e, APIError):
        return e.status, error_payload(e)
    if isinstance(e, LatentLMError):
        ae = from_model_error(e)
        return ae.status, error_payload(ae)
    log.error("batch line %d failed", line, exc_info=e)
    ae = APIError(500, f"internal error: {type(e).__name__}", code="internal_error")
    return ae.status, error_payload(ae)


def output_line(bid: str, custom_id: str, status: int, resp: dict) -> str:
    err = None if status == 200 else {"code": resp["error"].get("code"), "message": resp["error"]["message"]}
    rid = f"batch_req_{bid.removeprefix('batch_')}_{custom_id}"
    return dumps({"id": rid, "custom_id": custom_id, "response": {"status_code": status, "body": resp},
                  "error": err}).decode()


class _Heartbeat:
    """Refreshes a batch lease every ttl/3 seconds until stopped (dies with the process)."""

    def __init__(self, store: JobStore, bid: str, token: str, ttl_s: float):
        self.stop = threading.Event()
        self.t = threading.Thread(target=self._run, args=(store, bid, token, ttl_s), daemon=True)
        self.t.start()

    def _run(self, store, bid, token, ttl_s) -> None:
        while not self.stop.wait(ttl_s / 3):
            try:
                store.refresh_lease(bid, token, ttl_s)
            except Exception as e:  # Redis blip: the next beat retries
                log.warning("lease refresh failed for %s: %s", bid, e)


def process_batch(store: JobStore, models: ModelRegistry, bid: str, settings: Settings,
                  progress: Callable[[int, int], None] | None = None,
                  stop: threading.Event | None = None, run_calls: RunCalls | None = None) -> str | None:
    """Run (or resume) a batch to a terminal status; returns the status, or None if another worker holds it
    (or it is gone). A Redis outage is waited out (reconnecting with backoff up to `redis_retry_max_s`), then the
    batch resumes from its committed chunks; `stop` set gives up the wait (the reaper re-enqueues the batch).
    `run_calls`: where the lines' calls run (`execute_lines`)."""
    token = secrets.token_hex(8)
    while True:
        try:
            return _run_leased(store, models, bid, settings, progress, token, run_calls)
        except REDIS_DOWN as e:
            log.warning("batch %s: Redis unavailable (%s: %s); resuming when it answers", bid, type(e).__name__, e)
            if not wait_for_redis(store.redis, settings.redis_retry_max_s, stop):  # type: ignore[attr-defined]
                return None


def _run_leased(store: JobStore, models: ModelRegistry, bid: str, settings: Settings,
                progress: Callable[[int, int], None] | None, token: str, run_calls: RunCalls | None) -> str | None:
    b = store.get_batch(bid)
    if b is None or b["status"] in TERMINAL:
        return b["status"] if b else None
    if not store.acquire_lease(bid, token, settings.job_lease_s):
        return None
    beat = _Heartbeat(store, bid, token, settings.job_lease_s)
    try:
        return _process(store, models, b, settings, progress, token, run_calls)
    except REDIS_DOWN:
        raise
    except Exception as e:  # a bug, a full disk, an unreadable file: the batch fails, the worker lives on
        return _fail(store, bid, token, e)
    finally:
        beat.stop.set()
        try:
            store.release_lease(bid, token)
        except REDIS_DOWN:
            pass  # it expires by itself


def _fail(store: JobStore, bid: str, token: str, e: Exception) -> str | None:
    """Mark the batch failed with an error naming the cause; its chunks are deleted (space back), the counts
    reached are kept in `request_counts`."""
    code = e.code if isinstance(e, (BatchFailure, APIError)) and e.code else "internal_error"
    msg = e.message if isinstance(e, APIError) else f"{type(e).__name__}: {e}" if code == "internal_error" else str(e)
    if isinstance(e, (BatchFailure, StorageError)):
        log.error("batch %s failed: %s", bid, msg)
    else:
        log.exception("batch %s failed", bid)
    cur = store.get_batch(bid)
    if cur is None or cur["status"] in TERMINAL:
        return cur["status"] if cur else None
    try:
        completed, failed = store.counts(bid)
    except (OSError, ValueError):
        completed = failed = 0
    try:
        store.delete_chunks(bid)
        for fid in output_file_ids(bid):  # half-written output of a failed finalisation
            store.delete_file(fid)
    except (OSError, StorageError) as de:
        log.warning("batch %s: chunks not deleted: %s", bid, de)
    fields = {"status": "failed", "failed_at": int(time.time()),
              "final_counts": {"completed": completed, "failed": failed},
              "errors": {"object": "list", "data": [{"code": code, "message": msg, "line": None, "param": None}]}}
    if store.fail(bid, fields, token):
        return "failed"
    cur = store.get_batch(bid)
    return cur["status"] if cur else None


def _hold(store: JobStore, bid: str, token: str, ttl_s: float) -> bool:
    """Whether this worker still holds the batch's lease (taken again if it lapsed and nobody took it)."""
    return store.refresh_lease(bid, token, ttl_s) or store.acquire_lease(bid, token, ttl_s)


def _process(store: JobStore, models: ModelRegistry, b: dict, settings: Settings,
             progress: Callable[[int, int], None] | None, token: str, run_calls: RunCalls | None) -> str | None:
    bid = b["id"]
    content = store.iter_file(b["input_file_id"])
    if content is None:
        raise BatchFailure("input_file_missing", f"input file {b['input_file_id']} is gone")
    reqs, errors = parse_input_file(content, b["endpoint"], max_line_bytes(settings))
    if errors:
        raise BatchFailure("invalid_file", errors[0]["message"])
    op = ENDPOINTS[b["endpoint"]]
    size = max(1, settings.job_chunk_size)
    n_chunks = math.ceil(len(reqs) / size)
    limit = min(settings.job_max_output_bytes, store.max_output_bytes)
    models.reload(rehash=False)  # pick up the store's current models (files re-hashed where their stat changed)
    done = store.chunk_indices(bid)
    out_bytes = store.output_bytes(bid)
    for i in range(n_chunks):
        if i in done:
            continue
        cur = store.get_batch(bid)
        if cur is None or cur["status"] in TERMINAL:  # a worker frozen past its lease, resumed
            log.warning("batch %s: %s; stopping", bid,
                        "deleted meanwhile" if cur is None else f"{cur['status']}: finished by another worker")
            return cur["status"] if cur else None
        if cur.get("cancel_requested"):
            break
        if not _hold(store, bid, token, settings.job_lease_s):
            log.warning("batch %s: another worker holds its lease now; leaving it to that worker", bid)
            return None
        part = reqs[i * size : (i + 1) * size]
        results = execute_lines(models, op, [r["body"] for r in part], settings, run_calls)
        lines = [output_line(bid, r["custom_id"], st, resp) for r, (st, resp) in zip(part, results, strict=True)]
        ok = sum(1 for st, _ in results if st == 200)
        r = store.commit_chunk(bid, i, lines, ok, len(lines) - ok, b.get("expires_at"))
        if r < 0:
            log.warning("batch %s: %s; stopping", bid, "deleted meanwhile" if r == -1 else "finished by another worker")
            cur = store.get_batch(bid)
            return cur["status"] if cur else None
        out_bytes = out_bytes + sum(len(ln.encode()) + 1 for ln in lines) if r == 1 else store.output_bytes(bid)
        if out_bytes > limit:
            c, f = store.counts(bid)
            raise BatchFailure("output_too_large", f"the output reached {out_bytes} bytes after {c + f} of "
                                                   f"{len(reqs)} lines, above the limit of {limit} bytes "
                                                   "(LATENTLM_JOB_MAX_OUTPUT_BYTES); its chunks were deleted")
        if progress is not None:
            progress(i + 1, n_chunks)
        if settings.job_chunk_pause_s > 0:
            time.sleep(settings.job_chunk_pause_s)
    return _finalize(store, b, reqs, n_chunks, limit, token)


def _finalize(store: JobStore, b: dict, reqs: list[dict], n_chunks: int, limit: int, token: str) -> str | None:
    """Write the output and error files and set the terminal status in one conditional step; a completed batch
    has exactly one output line per request (checked), or it fails."""
    bid = b["id"]
    cur = store.get_batch(bid)
    if cur is None or cur["status"] in TERMINAL:
        return cur["status"] if cur else None
    cancelled = bool(cur.get("cancel_requested"))
    if not cancelled and not store.transition(bid, {"status": "finalizing", "finalizing_at": int(time.time())},
                                              token):
        cur = store.get_batch(bid)
        return cur["status"] if cur else None
    indices = sorted(store.chunk_indices(bid))
    missing = sorted(set(range(n_chunks)) - set(indices))
    if missing and not cancelled:
        raise BatchFailure("lines_missing", f"chunks {missing[:10]} of {n_chunks} have no committed output")
    ok_lines: list[str] = []
    bad_lines: list[str] = []
    for i in indices:
        lines = store.chunk(bid, i)
        if lines is None:
            raise BatchFailure("lines_missing", f"chunk {i} vanished while the output was written")
        for ln in lines:
            (ok_lines if orjson.loads(ln)["response"]["status_code"] == 200 else bad_lines).append(ln)
    if not cancelled and len(ok_lines) + len(bad_lines) != len(reqs):
        raise BatchFailure("lines_missing", f"{len(ok_lines) + len(bad_lines)} output lines for {len(reqs)} requests")
    now = int(time.time())
    fields: dict[str, Any] = {}
    files: list[tuple[dict, bytes]] = []
    for kind, lines in (("output", ok_lines), ("error", bad_lines)):
        if not lines and kind == "error":
            continue
        data = ("\n".join(lines) + ("\n" if lines else "")).encode()
        if len(data) > limit:
            raise BatchFailure("output_too_large", f"the {kind} file has {len(data)} bytes, above the limit of "
                                                   f"{limit} bytes (LATENTLM_JOB_MAX_OUTPUT_BYTES)")
        meta = {"id": f"file-{bid}-{kind}", "bytes": len(data), "created_at": now, "expires_at": b.get("expires_at"),
                "filename": f"{bid}_{kind}.jsonl", "purpose": "batch_output", "owner": b.get("owner")}
        files.append((meta, data))
        fields[f"{kind}_file_id"] = meta["id"]
    status = "cancelled" if cancelled else "completed"
    fields.update(status=status, final_counts={"completed": len(ok_lines), "failed": len(bad_lines)},
                  **{f"{status}_at": now})
    if not store.transition(bid, fields, token, files):
        log.warning("batch %s was finished by another worker; its output left as it is", bid)
        cur = store.get_batch(bid)
        return cur["status"] if cur else None
    try:
        store.delete_chunks(bid)  # the output files hold them now
    except (OSError, *REDIS_DOWN) as e:
        log.warning("batch %s: chunks not deleted after completion: %s", bid, e)
    return status
