"""Batch jobs in the OpenAI shape: files, batches, chunked crash-safe processing.

A batch's input lines are processed in chunks of `job_chunk_size`; each chunk's output lines are committed
with one set-if-absent write keyed by the chunk index, so a worker killed mid-job (SIGKILL) loses at most
the chunk it was computing, and a chunk can never be committed twice: after a restart the job completes
with every `custom_id` exactly once. A worker holds a lease on the batch (refreshed by a heartbeat
thread); when the lease of a live batch expires, the reaper re-enqueues it.

Two stores implement the same interface: `RedisJobStore` (with rq workers: `latentlm worker`) and
`LocalJobStore` (files on local disk, jobs run in a thread of the API process)."""

from __future__ import annotations

import json
import logging
import math
import os
import re
import secrets
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson

from latentlm import ops
from latentlm.models.errors import LatentLMError
from latentlm.models.family import OPERATIONS
from latentlm.ops import dumps
from latentlm.service.errors import APIError, error_payload, from_model_error
from latentlm.service.execute import body, check_sample, parse, prepare, run_sample
from latentlm.service.registry import ModelRegistry
from latentlm.service.settings import Settings

log = logging.getLogger("latentlm.jobs")

ENDPOINTS = {f"/v1/{op}": op for op in OPERATIONS}
LIVE = ("validating", "in_progress", "finalizing", "cancelling")
TERMINAL = ("completed", "failed", "cancelled", "expired")
MAX_LINES = 100_000
QUEUE_NAME = "latentlm-batches"


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


# The ids this service hands out, exactly: `new_id` ("file_" / "batch_" + 24 hex digits) and a batch's output and
# error files ("file-<batch id>-output"). Anything else is no file or batch (404), never a store key: an id such as
# `<id>:chunks` would otherwise reach another record's Redis key, and `../x` another file on disk.
IDS = {"file": re.compile(r"file_[0-9a-f]{24}|file-batch_[0-9a-f]{24}-(?:output|error)"),
       "batch": re.compile(r"batch_[0-9a-f]{24}")}


def _safe(ident: Any, kind: str) -> bool:
    """Whether `ident` is a `kind` ("file" or "batch") id in the exact format the service generates."""
    return isinstance(ident, str) and IDS[kind].fullmatch(ident) is not None


# == stores ===========================================================================================
class RedisJobStore:
    """Files, batch records, chunk results and leases on Redis (use a `noeviction` instance)."""

    P = "latentlm:"
    _COMMIT = ("if redis.call('HSETNX', KEYS[1], ARGV[1], ARGV[2]) == 1 then "
               "redis.call('HSET', KEYS[2], ARGV[1], ARGV[3]) return 1 end return 0")
    _REFRESH = ("if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) "
                "end return 0")
    _RELEASE = "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0"

    def __init__(self, url: str, connect_timeout_s: float | None = 5.0):
        """`connect_timeout_s`: how long a request waits for an unreachable Redis before answering 503 (no read
        timeout: an rq worker's blocking reads share this connection pool)."""
        import redis

        self.redis = redis.Redis.from_url(url, socket_connect_timeout=connect_timeout_s)
        self._commit = self.redis.register_script(self._COMMIT)
        self._refresh = self.redis.register_script(self._REFRESH)
        self._release = self.redis.register_script(self._RELEASE)

    def put_file(self, meta: dict, content: bytes) -> None:
        fid = meta["id"]
        with self.redis.pipeline() as p:
            p.set(f"{self.P}file:{fid}:content", content)
            p.set(f"{self.P}file:{fid}:meta", json.dumps(meta))
            p.execute()

    def file_meta(self, fid: str) -> dict | None:
        if not _safe(fid, "file"):
            return None
        raw = self.redis.get(f"{self.P}file:{fid}:meta")
        return json.loads(raw) if raw else None

    def file_content(self, fid: str) -> bytes | None:
        return self.redis.get(f"{self.P}file:{fid}:content") if _safe(fid, "file") else None

    def put_batch(self, batch: dict) -> None:
        with self.redis.pipeline() as p:
            p.hset(f"{self.P}batch:{batch['id']}", mapping={k: json.dumps(v) for k, v in batch.items()})
            p.zadd(f"{self.P}batches", {batch["id"]: batch["created_at"]})
            p.sadd(f"{self.P}batches:active", batch["id"])
            p.execute()

    def get_batch(self, bid: str) -> dict | None:
        if not _safe(bid, "batch"):
            return None
        raw = self.redis.hgetall(f"{self.P}batch:{bid}")
        return {k.decode(): json.loads(v) for k, v in raw.items()} if raw else None

    def update_batch(self, bid: str, **fields: Any) -> None:
        with self.redis.pipeline() as p:
            p.hset(f"{self.P}batch:{bid}", mapping={k: json.dumps(v) for k, v in fields.items()})
            if fields.get("status") in TERMINAL:
                p.srem(f"{self.P}batches:active", bid)
            p.execute()

    def list_batches(self, limit: int) -> list[str]:
        return [b.decode() for b in self.redis.zrevrange(f"{self.P}batches", 0, limit - 1)]

    def active(self) -> list[str]:
        return sorted(b.decode() for b in self.redis.smembers(f"{self.P}batches:active"))

    def commit_chunk(self, bid: str, index: int, lines: list[str], completed: int, failed: int) -> bool:
        keys = [f"{self.P}batch:{bid}:chunks", f"{self.P}batch:{bid}:counts"]
        return bool(self._commit(keys=keys, args=[index, json.dumps(lines), f"{completed},{failed}"]))

    def chunk_indices(self, bid: str) -> set[int]:
        return {int(k) for k in self.redis.hkeys(f"{self.P}batch:{bid}:counts")}

    def chunks(self, bid: str) -> dict[int, list[str]]:
        raw = self.redis.hgetall(f"{self.P}batch:{bid}:chunks")
        return {int(k): json.loads(v) for k, v in raw.items()}

    def counts(self, bid: str) -> tuple[int, int]:
        c = f = 0
        for v in self.redis.hvals(f"{self.P}batch:{bid}:counts"):
            a, b = v.decode().split(",")
            c, f = c + int(a), f + int(b)
        return c, f

    def acquire_lease(self, bid: str, token: str, ttl_s: float) -> bool:
        return bool(self.redis.set(f"{self.P}batch:{bid}:lease", token, nx=True, px=int(ttl_s * 1000)))

    def refresh_lease(self, bid: str, token: str, ttl_s: float) -> bool:
        return bool(self._refresh(keys=[f"{self.P}batch:{bid}:lease"], args=[token, int(ttl_s * 1000)]))

    def release_lease(self, bid: str, token: str) -> None:
        self._release(keys=[f"{self.P}batch:{bid}:lease"], args=[token])

    def lease_held(self, bid: str) -> bool:
        return bool(self.redis.exists(f"{self.P}batch:{bid}:lease"))

    def claim_requeue(self, bid: str, ttl_s: float) -> bool:
        return bool(self.redis.set(f"{self.P}batch:{bid}:requeued", 1, nx=True, px=int(ttl_s * 1000)))


class LocalJobStore:
    """The same interface on local disk (one API process): `<dir>/files`, `<dir>/batches`, `<dir>/chunks`."""

    def __init__(self, root: Path):
        self.root = Path(root)
        for d in ("files", "batches", "chunks"):
            (self.root / d).mkdir(parents=True, exist_ok=True)
        self._lock = threading.RLock()

    def _write(self, path: Path, data: bytes) -> None:
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        tmp.write_bytes(data)
        os.replace(tmp, path)

    def put_file(self, meta: dict, content: bytes) -> None:
        self._write(self.root / "files" / f"{meta['id']}.content", content)
        self._write(self.root / "files" / f"{meta['id']}.json", json.dumps(meta).encode())

    def file_meta(self, fid: str) -> dict | None:
        p = self.root / "files" / f"{fid}.json"
        return json.loads(p.read_text()) if _safe(fid, "file") and p.is_file() else None

    def file_content(self, fid: str) -> bytes | None:
        p = self.root / "files" / f"{fid}.content"
        return p.read_bytes() if _safe(fid, "file") and p.is_file() else None

    def put_batch(self, batch: dict) -> None:
        with self._lock:
            self._write(self.root / "batches" / f"{batch['id']}.json", json.dumps(batch).encode())

    def get_batch(self, bid: str) -> dict | None:
        p = self.root / "batches" / f"{bid}.json"
        return json.loads(p.read_text()) if _safe(bid, "batch") and p.is_file() else None

    def update_batch(self, bid: str, **fields: Any) -> None:
        with self._lock:
            b = self.get_batch(bid)
            if b is not None:
                self.put_batch({**b, **fields})

    def list_batches(self, limit: int) -> list[str]:
        bs = [json.loads(p.read_text()) for p in (self.root / "batches").glob("*.json")]
        return [b["id"] for b in sorted(bs, key=lambda b: b["created_at"], reverse=True)[:limit]]

    def active(self) -> list[str]:
        out = []
        for bid in self.list_batches(1 << 30):
            b = self.get_batch(bid)
            if b and b["status"] in LIVE:
                out.append(bid)
        return sorted(out)

    def _chunk_dir(self, bid: str) -> Path:
        if not _safe(bid, "batch"):
            raise ValueError(f"not a batch id: {bid!r}")
        d = self.root / "chunks" / bid
        d.mkdir(exist_ok=True)
        return d

    def commit_chunk(self, bid: str, index: int, lines: list[str], completed: int, failed: int) -> bool:
        d = self._chunk_dir(bid)
        tmp = d / f".{index}.{threading.get_ident()}.tmp"
        tmp.write_text(json.dumps({"lines": lines, "completed": completed, "failed": failed}))
        try:
            os.link(tmp, d / f"{index}.json")  # atomic create-if-absent
            return True
        except FileExistsError:
            return False
        finally:
            tmp.unlink(missing_ok=True)

    def _records(self, bid: str) -> dict[int, dict]:
        return {int(p.stem): json.loads(p.read_text()) for p in self._chunk_dir(bid).glob("*.json")}

    def chunk_indices(self, bid: str) -> set[int]:
        return {int(p.stem) for p in self._chunk_dir(bid).glob("*.json")}

    def chunks(self, bid: str) -> dict[int, list[str]]:
        return {i: r["lines"] for i, r in self._records(bid).items()}

    def counts(self, bid: str) -> tuple[int, int]:
        rs = self._records(bid).values()
        return sum(r["completed"] for r in rs), sum(r["failed"] for r in rs)

    def acquire_lease(self, bid: str, token: str, ttl_s: float) -> bool:
        return True

    def refresh_lease(self, bid: str, token: str, ttl_s: float) -> bool:
        return True

    def release_lease(self, bid: str, token: str) -> None:
        return None


JobStore = RedisJobStore | LocalJobStore


# == creating ==========================================================================================
def file_object(meta: dict) -> dict:
    return {"id": meta["id"], "object": "file", "bytes": meta["bytes"], "created_at": meta["created_at"],
            "filename": meta["filename"], "purpose": meta["purpose"]}


def create_file(store: JobStore, content: bytes, filename: str, purpose: str) -> dict:
    meta = {"id": new_id("file"), "bytes": len(content), "created_at": int(time.time()),
            "filename": filename, "purpose": purpose}
    store.put_file(meta, content)
    return file_object(meta)


def parse_input_file(content: bytes, endpoint: str) -> tuple[list[dict], list[dict]]:
    """JSONL lines -> (requests, errors). Errors name the 1-based line and the field."""
    errors: list[dict] = []
    reqs: list[dict] = []
    seen: set[str] = set()
    try:
        text = content.decode("utf-8")
    except UnicodeDecodeError:
        return [], [{"code": "invalid_file", "message": "input file is not UTF-8 text", "line": None, "param": None}]
    lines = [ln for ln in text.splitlines() if ln.strip()]
    if not lines:
        errors.append({"code": "empty_file", "message": "input file has no request lines", "line": None,
                       "param": None})
    if len(lines) > MAX_LINES:
        errors.append({"code": "too_many_lines", "message": f"{len(lines)} lines exceed {MAX_LINES}",
                       "line": None, "param": None})
        return [], errors

    def bad(n: int, param: str, msg: str) -> None:
        errors.append({"code": "invalid_request", "message": f"line {n}: {msg}", "line": n, "param": param})

    for n, ln in enumerate(lines, 1):
        try:
            obj = orjson.loads(ln)  # a batch file can hold 100,000 lines: 3-5x faster than json.loads
        except json.JSONDecodeError as e:  # orjson's error is a subclass
            bad(n, "line", f"not valid JSON ({e.msg})")
            continue
        if not isinstance(obj, dict):
            bad(n, "line", "expected a JSON object")
            continue
        cid = obj.get("custom_id")
        if not isinstance(cid, str) or not cid:
            bad(n, "custom_id", "custom_id must be a non-empty string")
        elif cid in seen:
            bad(n, "custom_id", f"duplicate custom_id {cid!r}")
        else:
            seen.add(cid)
        if obj.get("method", "POST") != "POST":
            bad(n, "method", f"method must be POST, got {obj.get('method')!r}")
        if obj.get("url") != endpoint:
            bad(n, "url", f"url {obj.get('url')!r} does not match the batch endpoint {endpoint!r}")
        if not isinstance(obj.get("body"), dict):
            bad(n, "body", "body must be a JSON object")
        extra = sorted(set(obj) - {"custom_id", "method", "url", "body"})
        if extra:
            bad(n, extra[0], f"unknown field {extra[0]!r}")
        reqs.append(obj)
    return reqs, errors[:100]


def create_batch(store: JobStore, input_file_id: str, endpoint: str, completion_window: str = "24h",
                 metadata: dict | None = None) -> dict:
    """Validate the input file and record the batch (status in_progress, or failed with `errors`)."""
    if endpoint not in ENDPOINTS:
        raise APIError(422, f"endpoint: must be one of {', '.join(ENDPOINTS)}, got {endpoint!r}", param="endpoint",
                       code="invalid_value")
    meta = store.file_meta(input_file_id) if _safe(input_file_id, "file") else None
    content = store.file_content(input_file_id) if meta else None
    if meta is None or content is None:
        raise APIError(404, f"input_file_id: no file {input_file_id!r}", param="input_file_id", code="file_not_found")
    now = int(time.time())
    reqs, errors = parse_input_file(content, endpoint)
    batch = {"id": new_id("batch"), "object": "batch", "endpoint": endpoint, "errors": None,
             "input_file_id": input_file_id, "completion_window": completion_window, "status": "validating",
             "output_file_id": None, "error_file_id": None, "created_at": now, "in_progress_at": None,
             "expires_at": now + 86400, "finalizing_at": None, "completed_at": None, "failed_at": None,
             "expired_at": None, "cancelling_at": None, "cancelled_at": None, "total": len(reqs),
             "metadata": metadata, "cancel_requested": False}
    if errors:
        batch.update(status="failed", failed_at=now, errors={"object": "list", "data": errors})
    else:
        batch.update(status="in_progress", in_progress_at=now)
    store.put_batch(batch)
    if errors:
        store.update_batch(batch["id"], status="failed")  # leaves the active set
    return batch_object(store, batch)


def batch_object(store: JobStore, batch: dict) -> dict:
    """The public batch object with live `request_counts`."""
    completed, failed = store.counts(batch["id"])
    out = {k: v for k, v in batch.items() if k not in ("total", "cancel_requested")}
    out["request_counts"] = {"total": batch["total"], "completed": completed, "failed": failed}
    return out


def cancel_batch(store: JobStore, bid: str) -> dict:
    b = store.get_batch(bid) if _safe(bid, "batch") else None
    if b is None:
        raise APIError(404, f"no batch {bid!r}", param="batch_id", code="batch_not_found")
    if b["status"] in TERMINAL:
        if b["status"] == "cancelled":
            return batch_object(store, b)
        raise APIError(409, f"batch {bid!r} is already {b['status']}", param="batch_id", code="batch_finished",
                       type="invalid_request_error")
    store.update_batch(bid, cancel_requested=True, status="cancelling", cancelling_at=int(time.time()))
    return batch_object(store, store.get_batch(bid) or b)


# == processing ========================================================================================
def execute_lines(models: ModelRegistry, op: str, bodies: list[dict], settings: Settings
                  ) -> list[tuple[int, dict]]:
    """(status, body) per request; requests of the same model version and options share one batched call."""
    out: list[tuple[int, dict] | None] = [None] * len(bodies)
    groups: dict[tuple, list[tuple[int, Any]]] = defaultdict(list)
    for i, b in enumerate(bodies):
        try:
            req = parse(op, b)
            model = models.get(req.model)
            if op == "sample":
                check_sample(req, settings.max_sample_tokens, model=model,
                             max_request_tokens=settings.max_request_tokens)
                out[i] = (200, run_sample(model, req))
                continue
            prep = prepare(model, op, req, settings.max_request_tokens, settings.max_posterior_entries)
            groups[(id(model), op, tuple(sorted(prep.opts.items())))].append((i, prep))
        except Exception as e:
            out[i] = line_failure(i, e)
    for members in groups.values():
        first = members[0][1]
        parts = ops.run_merged(first.model, op, [p.seqs for _, p in members],
                               max_batch_tokens=settings.max_batch_tokens, **first.opts)
        for (i, p), res in zip(members, parts, strict=True):
            out[i] = line_failure(i, res) if isinstance(res, Exception) else (200, body(p, res))
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
                  progress: Callable[[int, int], None] | None = None) -> str | None:
    """Run (or resume) a batch to a terminal status; returns the status, or None if another worker holds it."""
    b = store.get_batch(bid)
    if b is None or b["status"] in TERMINAL:
        return b["status"] if b else None
    token = secrets.token_hex(8)
    if not store.acquire_lease(bid, token, settings.job_lease_s):
        return None
    beat = _Heartbeat(store, bid, token, settings.job_lease_s)
    try:
        return _process(store, models, b, settings, progress)
    except Exception as e:  # a bug or an unreadable file: the batch fails, the worker lives on
        log.exception("batch %s failed", bid)
        store.update_batch(bid, status="failed", failed_at=int(time.time()),
                           errors={"object": "list", "data": [{"code": "internal_error",
                                                               "message": f"{type(e).__name__}: {e}",
                                                               "line": None, "param": None}]})
        return "failed"
    finally:
        beat.stop.set()
        store.release_lease(bid, token)


def _process(store: JobStore, models: ModelRegistry, b: dict, settings: Settings,
             progress: Callable[[int, int], None] | None) -> str:
    bid = b["id"]
    content = store.file_content(b["input_file_id"])
    if content is None:
        raise RuntimeError(f"input file {b['input_file_id']} is gone")
    reqs, errors = parse_input_file(content, b["endpoint"])
    if errors:
        raise RuntimeError(errors[0]["message"])
    op = ENDPOINTS[b["endpoint"]]
    size = max(1, settings.job_chunk_size)
    n_chunks = math.ceil(len(reqs) / size)
    models.reload(rehash=False)  # pick up the store's current models (files re-hashed where their stat changed)
    done = store.chunk_indices(bid)
    for i in range(n_chunks):
        if i in done:
            continue
        cur = store.get_batch(bid) or b
        if cur.get("cancel_requested"):
            break
        part = reqs[i * size : (i + 1) * size]
        results = execute_lines(models, op, [r["body"] for r in part], settings)
        lines = [output_line(bid, r["custom_id"], st, resp) for r, (st, resp) in zip(part, results, strict=True)]
        ok = sum(1 for st, _ in results if st == 200)
        store.commit_chunk(bid, i, lines, ok, len(lines) - ok)
        if progress is not None:
            progress(i + 1, n_chunks)
        if settings.job_chunk_pause_s > 0:
            time.sleep(settings.job_chunk_pause_s)
    cur = store.get_batch(bid) or b
    cancelled = bool(cur.get("cancel_requested"))
    if not cancelled:
        store.update_batch(bid, status="finalizing", finalizing_at=int(time.time()))
    chunks = store.chunks(bid)
    ok_lines: list[str] = []
    bad_lines: list[str] = []
    for i in sorted(chunks):
        for ln in chunks[i]:
            (ok_lines if orjson.loads(ln)["response"]["status_code"] == 200 else bad_lines).append(ln)
    now = int(time.time())
    fields: dict[str, Any] = {}
    for kind, lines in (("output", ok_lines), ("error", bad_lines)):
        if not lines and kind == "error":
            continue
        meta = {"id": f"file-{bid}-{kind}", "bytes": 0, "created_at": now,
                "filename": f"{bid}_{kind}.jsonl", "purpose": "batch_output"}
        data = ("\n".join(lines) + ("\n" if lines else "")).encode()
        meta["bytes"] = len(data)
        store.put_file(meta, data)
        fields[f"{kind}_file_id"] = meta["id"]
    status = "cancelled" if cancelled else "completed"
    store.update_batch(bid, status=status, **fields, **{f"{status}_at": now})
    return status


# == runners ===========================================================================================
class LocalRunner:
    """Without Redis: batches run one at a time in a thread of the API process; unfinished ones resume
    at startup."""

    def __init__(self, store: LocalJobStore, models: ModelRegistry, settings: Settings):
        self.store, self.models, self.settings = store, models, settings
        self._q: list[str] = []
        self._cv = threading.Condition()
        self._stop = False
        self._t = threading.Thread(target=self._loop, name="latentlm-jobs", daemon=True)

    def start(self) -> None:
        with self._cv:
            self._q.extend(self.store.active())
        self._t.start()

    def submit(self, bid: str) -> None:
        with self._cv:
            self._q.append(bid)
            self._cv.notify()

    def stop(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._q and not self._stop:
                    self._cv.wait()
                if self._stop:
                    return
                bid = self._q.pop(0)
            if not self.models.ready:
                self.models.reload()
            process_batch(self.store, self.models, bid, self.settings)


class RQRunner:
    """With Redis: batches are rq jobs (`service.jobs.rq_process_batch`) run by `latentlm worker`."""

    def __init__(self, store: RedisJobStore, url: str):
        from rq import Queue

        self.store = store
        self.queue = Queue(QUEUE_NAME, connection=store.redis)

    def start(self) -> None:
        return None

    def submit(self, bid: str) -> None:
        enqueue(self.queue, bid)

    def stop(self) -> None:
        return None


def enqueue(queue, bid: str, note: str = "") -> None:
    """One rq job for a batch; the job id starts with the batch id (see `queued_batches`)."""
    queue.enqueue("latentlm.service.jobs.rq_process_batch", bid, job_timeout=-1, result_ttl=3600,
                  job_id=f"{bid}-{secrets.token_hex(4)}", description=f"latentlm batch {bid}{note}")


def queued_batches(queue) -> set[str]:
    """Batch ids with a job waiting in the rq queue."""
    return {jid.rsplit("-", 1)[0] for jid in queue.get_job_ids()}


# state of a `latentlm worker` process (set by service.worker before rq starts working)
WORKER_CONTEXT: dict[str, Any] = {}


def rq_process_batch(bid: str) -> str | None:
    """rq entry point: runs in the worker process with its own model registry."""
    ctx = WORKER_CONTEXT
    if not ctx:
        settings = Settings.from_env()
        ctx.update(settings=settings, store=RedisJobStore(settings.redis_url),
                   models=ModelRegistry.from_settings(settings, device="cpu"))
    status = process_batch(ctx["store"], ctx["models"], bid, ctx["settings"])
    log.info("batch %s -> %s", bid, status)
    return status
