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

Two stores implement the same interface: `RedisJobStore` (with rq workers: `latentlm worker`) and
`LocalJobStore` (files on local disk, jobs run in a thread of the API process)."""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
import secrets
import shutil
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import orjson
import redis
import redis.exceptions
from redis.backoff import NoBackoff
from redis.retry import Retry

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
REDIS_DOWN: tuple[type[Exception], ...] = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError)
REDIS_TIMEOUT_S = 5.0         # connect and read timeout of a job-store command (a hung Redis answers 503)
REDIS_MAX_VALUE = 512 << 20   # Redis refuses a string above 512 MiB: an output file must stay below
FAILURE_TTL_S = 7 * 86400     # how long rq keeps a failed job's record
INTERNAL = ("total", "cancel_requested", "owner", "final_counts")  # batch record fields never shown
READ_CHUNK = 1 << 20          # files are read, written and scanned in pieces of this size, never whole
DEFAULT_MAX_LINE_BYTES = 2_000_000  # `Settings.job_max_line_bytes` (LATENTLM_JOB_MAX_LINE_BYTES)
UPLOAD_TTL_S = 3600           # Redis: a half-uploaded file's temporary key expires after this


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


def _expired(record: dict, now: float | None = None) -> bool:
    exp = record.get("expires_at")
    return bool(exp) and (now if now is not None else time.time()) >= exp


class StorageError(APIError):
    """The local jobs directory refused a write (disk full, read-only, no permission): 503 naming the cause."""

    def __init__(self, e: OSError):
        why = e.strerror or type(e).__name__
        super().__init__(503, f"job storage unavailable: {why} (errno {e.errno}); retry later",
                         code="storage_unavailable", headers={"Retry-After": "1"})


class LineTooLarge(Exception):
    """A line of a batch input file is longer than the per-line limit (`job_max_line_bytes`)."""

    def __init__(self, line: int, size: int, limit: int):
        super().__init__(f"line {line} has {size} bytes or more, above the limit of {limit} bytes per line "
                         "(LATENTLM_JOB_MAX_LINE_BYTES)")
        self.line, self.size, self.limit = line, size, limit


def max_line_bytes(settings: Settings | None) -> int:
    """The per-line limit of batch input files (`job_max_line_bytes`; 0 or unset: the default)."""
    v = getattr(settings, "job_max_line_bytes", 0) if settings is not None else 0
    return int(v) if v and int(v) > 0 else DEFAULT_MAX_LINE_BYTES


def read_chunks(f: Any, size: int | None = None) -> Iterator[bytes]:
    """The bytes of the open binary file `f` in pieces of `size` (default `READ_CHUNK`; closed at the end)."""
    size = size or READ_CHUNK
    try:
        while chunk := f.read(size):
            yield chunk
    finally:
        f.close()


def iter_lines(chunks: Iterable[bytes], limit: int) -> Iterator[tuple[int, bytes]]:
    """(1-based line number, line without its end of line) of a byte stream split on `\n` (a trailing `\r` is
    dropped); raises `LineTooLarge` as soon as a line exceeds `limit` bytes, before the rest of it is read. At most
    `limit` + one chunk is held at a time."""
    buf = bytearray()
    n = 1
    for chunk in chunks:
        start = 0
        while True:
            i = chunk.find(b"\n", start)
            if i < 0:
                buf += memoryview(chunk)[start:]
                if len(buf) > limit + 1:  # + 1: a `\r` before the `\n` still to come
                    raise LineTooLarge(n, len(buf), limit)
                break
            if buf:
                buf += memoryview(chunk)[start:i]
                line = bytes(buf)
                buf.clear()
            else:
                line = chunk[start:i]
            if line.endswith(b"\r"):
                line = line[:-1]
            if len(line) > limit:
                raise LineTooLarge(n, len(line), limit)
            yield n, line
            n += 1
            start = i + 1
    if buf:
        line = bytes(buf[:-1] if buf.endswith(b"\r") else buf)
        if len(line) > limit:
            raise LineTooLarge(n, len(line), limit)
        yield n, line


def checked_upload(f: Any, limit: int, counter: list[int]) -> Iterator[bytes]:
    """The chunks of the uploaded file `f`, passed on as they are read while every line's length is checked
    (413 `line_too_large` naming the line and the limit as soon as one is over it); `counter[0]` counts bytes."""

    def too_large(line: int, length: int) -> APIError:
        return APIError(413, f"file: line {line} has {length} bytes or more, above the limit of {limit} bytes per "
                             "line (LATENTLM_JOB_MAX_LINE_BYTES)", param="file", code="line_too_large")

    line, length, last_cr = 1, 0, False
    for chunk in read_chunks(f):
        counter[0] += len(chunk)
        start = 0
        while True:
            i = chunk.find(b"\n", start)
            end = len(chunk) if i < 0 else i
            if end > start:
                length += end - start
                last_cr = chunk[end - 1] == 13  # a `\r` before the `\n` is not part of the line
            if i < 0:
                if length > limit + 1:
                    raise too_large(line, length)
                break
            if length - last_cr > limit:
                raise too_large(line, length - last_cr)
            line, length, last_cr, start = line + 1, 0, False, i + 1
        yield chunk
    if length - last_cr > limit:
        raise too_large(line, length - last_cr)


class BatchFailure(Exception):
    """A batch-level failure with the code its `errors` entry carries (e.g. output_too_large)."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


def wait_for_redis(client: Any, max_wait_s: float, stop: threading.Event | None = None) -> bool:
    """Block until `client` answers PING (exponential backoff from 0.25 s to `max_wait_s`, each retry logged);
    False when `stop` is set first."""
    delay, attempt = 0.25, 0
    while stop is None or not stop.is_set():
        try:
            client.ping()
            if attempt:
                log.warning("Redis answers again (after %d failed attempts)", attempt)
            return True
        except REDIS_DOWN as e:
            attempt += 1
            log.warning("Redis unavailable (%s: %s); retry %d in %.2f s", type(e).__name__, e, attempt, delay)
        if stop is not None:
            stop.wait(delay)
        else:
            time.sleep(delay)
        delay = min(delay * 2, max(0.25, max_wait_s))
    return False


# == stores ===========================================================================================
class RedisJobStore:
    """Files, batch records, chunk results and leases on Redis (use a `noeviction` instance with persistence,
    e.g. `--appendonly yes`, so that jobs survive a Redis restart). Every key of a file or batch expires at its
    `expires_at` (EXPIREAT); a sorted set `expiry` lets the sweep delete what the TTLs leave in the indexes."""

    P = "latentlm:"
    _TERMINAL_JSON = " or ".join(f"st == '{json.dumps(t)}'" for t in TERMINAL)
    # KEYS chunks, counts, batch; ARGV index, lines, "completed,failed,bytes", expire-at (0: none).
    # 1 committed, 0 already committed, -1 no such batch, -2 batch already finished
    _COMMIT = ("local st = redis.call('HGET', KEYS[3], 'status') if not st then return -1 end "
               f"if {_TERMINAL_JSON} then return -2 end "
               "if redis.call('HSETNX', KEYS[1], ARGV[1], ARGV[2]) == 0 then return 0 end "
               "redis.call('HSET', KEYS[2], ARGV[1], ARGV[3]) "
               "if tonumber(ARGV[4]) > 0 then redis.call('EXPIREAT', KEYS[1], ARGV[4]) "
               "redis.call('EXPIREAT', KEYS[2], ARGV[4]) end return 1")
    _ACQUIRE = ("local v = redis.call('GET', KEYS[1]) if v and v ~= ARGV[1] then return 0 end "
                "redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2]) return 1")
    _REFRESH = ("if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) "
                "end return 0")
    _RELEASE = "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0"
    max_output_bytes = REDIS_MAX_VALUE - (1 << 20)

    def __init__(self, url: str, connect_timeout_s: float | None = REDIS_TIMEOUT_S,
                 timeout_s: float | None = REDIS_TIMEOUT_S):
        """`connect_timeout_s` / `timeout_s`: how long a command waits for an unreachable / hung Redis before it
        fails (503 on the routes). rq's blocking reads use their own connection (see `service.worker`)."""
        # one immediate retry on a connection error (a pooled connection that died with a restarted Redis) and
        # none on a timeout, not redis-py's default of 10 with backoff: an unreachable Redis answers 503 at once,
        # a hung one after one timeout
        self.redis = redis.Redis.from_url(url, socket_connect_timeout=connect_timeout_s, socket_timeout=timeout_s,
                                          retry=Retry(NoBackoff(), 1, (redis.exceptions.ConnectionError,)))
        self._commit = self.redis.register_script(self._COMMIT)
        self._acquire = self.redis.register_script(self._ACQUIRE)
        self._refresh = self.redis.register_script(self._REFRESH)
        self._release = self.redis.register_script(self._RELEASE)

    def _k(self, *parts: str) -> str:
        return self.P + ":".join(parts)

    # -- files
    def _set_file(self, p: Any, meta: dict, content: bytes) -> None:
        fid, exp = meta["id"], meta.get("expires_at")
        p.set(self._k("file", fid, "content"), content, exat=exp or None)
        p.set(self._k("file", fid, "meta"), json.dumps(meta), exat=exp or None)
        if exp:
            p.zadd(self._k("expiry"), {f"file:{fid}": exp})

    def put_file(self, meta: dict, content: bytes) -> None:
        with self.redis.pipeline() as p:
            self._set_file(p, meta, content)
            p.execute()

    def put_file_stream(self, meta: dict, chunks: Iterable[bytes]) -> None:
        """Store a file from its chunks (APPENDed to a temporary key, renamed in place with the metadata once
        complete); `meta["bytes"]` is set from what was stored. An error while reading leaves nothing."""
        fid, exp = meta["id"], meta.get("expires_at")
        tmp, key = self._k("file", fid, "upload"), self._k("file", fid, "content")
        size = 0
        try:
            self.redis.set(tmp, b"", ex=UPLOAD_TTL_S)
            for chunk in chunks:
                self.redis.append(tmp, chunk)
                size += len(chunk)
            meta["bytes"] = size
            with self.redis.pipeline() as p:
                p.rename(tmp, key)
                if exp:
                    p.expireat(key, exp)
                else:
                    p.persist(key)
                p.set(self._k("file", fid, "meta"), json.dumps(meta), exat=exp or None)
                if exp:
                    p.zadd(self._k("expiry"), {f"file:{fid}": exp})
                p.execute()
        except BaseException:
            try:
                self.redis.delete(tmp)
            except Exception:  # Redis down: the key expires by itself
                pass
            raise

    def iter_file(self, fid: str) -> Iterator[bytes] | None:
        """The file's content in chunks of `READ_CHUNK` (GETRANGE), or None when there is no such file."""
        if self.file_meta(fid) is None:
            return None
        key = self._k("file", fid, "content")
        size = self.redis.strlen(key)
        if not size and not self.redis.exists(key):
            return None

        def gen() -> Iterator[bytes]:
            for off in range(0, size, READ_CHUNK):
                part = self.redis.getrange(key, off, min(size, off + READ_CHUNK) - 1)
                if not part:
                    return
                yield part

        return gen()

    def file_meta(self, fid: str) -> dict | None:
        if not _safe(fid, "file"):
            return None
        raw = self.redis.get(self._k("file", fid, "meta"))
        meta = json.loads(raw) if raw else None
        if meta is not None and _expired(meta):
            self.delete_file(fid)
            return None
        return meta

    def file_content(self, fid: str) -> bytes | None:
        if self.file_meta(fid) is None:
            return None
        return self.redis.get(self._k("file", fid, "content"))

    def delete_file(self, fid: str) -> bool:
        if not _safe(fid, "file"):
            return False
        with self.redis.pipeline() as p:
            p.delete(self._k("file", fid, "meta"), self._k("file", fid, "content"))
            p.zrem(self._k("expiry"), f"file:{fid}")
            return bool(p.execute()[0])

    # -- batches
    def put_batch(self, batch: dict) -> None:
        bid, exp = batch["id"], batch.get("expires_at")
        key = self._k("batch", bid)
        with self.redis.pipeline() as p:
            p.hset(key, mapping={k: json.dumps(v) for k, v in batch.items()})
            p.zadd(self._k("batches"), {bid: batch["created_at"]})
            if batch.get("owner"):
                p.zadd(self._k("batches", "o", batch["owner"]), {bid: batch["created_at"]})
            if batch["status"] in TERMINAL:
                p.srem(self._k("batches", "active"), bid)
            else:
                p.sadd(self._k("batches", "active"), bid)
            if exp:
                p.expireat(key, exp)
                p.zadd(self._k("expiry"), {f"batch:{bid}": exp})
            p.execute()

    def get_batch(self, bid: str) -> dict | None:
        if not _safe(bid, "batch"):
            return None
        raw = self.redis.hgetall(self._k("batch", bid))
        b = {k.decode(): json.loads(v) for k, v in raw.items()} if raw else None
        if b is not None and ("id" not in b or "status" not in b):  # a partial hash (a write raced a delete)
            return None
        if b is not None and _expired(b):
            self.delete_batch(bid)
            return None
        return b

    def transition(self, bid: str, fields: dict, token: str | None = None,
                   files: list[tuple[dict, bytes]] = ()) -> bool:
        """Atomically: if the batch exists, is not finished and no other worker holds its lease (`token` None:
        the lease is not checked), write `files` and set `fields`. False when refused."""
        key, lease = self._k("batch", bid), self._k("batch", bid, "lease")
        for _ in range(50):
            with self.redis.pipeline() as p:
                try:
                    p.watch(key, lease)
                    st = p.hget(key, "status")
                    if st is None or json.loads(st) in TERMINAL:
                        return False
                    holder = p.get(lease) if token is not None else None
                    if holder is not None and holder.decode() != token:
                        return False
                    p.multi()
                    for meta, data in files:
                        self._set_file(p, meta, data)
                    p.hset(key, mapping={k: json.dumps(v) for k, v in fields.items()})
                    if fields.get("status") in TERMINAL:
                        p.srem(self._k("batches", "active"), bid)
                    p.execute()
                    return True
                except redis.exceptions.WatchError:  # our heartbeat refreshed the lease meanwhile: again
                    continue
        raise RuntimeError(f"batch {bid}: status update kept conflicting")

    def fail(self, bid: str, fields: dict, token: str | None) -> bool:
        """Mark a batch failed (as `transition`)."""
        return self.transition(bid, fields, token)

    def list_batches(self, limit: int, owner: str | None = None) -> tuple[list[dict], bool]:
        """The newest `limit` batches `owner` may see, and whether there are more; ids whose record expired are
        dropped from the index on the way."""
        zkey = self._k("batches", "o", owner) if owner else self._k("batches")
        out: list[dict] = []
        start = 0
        while len(out) <= limit:
            ids = [b.decode() for b in self.redis.zrevrange(zkey, start, start + 2 * limit)]
            if not ids:
                break
            start += len(ids)
            for bid in ids:
                b = self.get_batch(bid)
                if b is None:
                    self.redis.zrem(zkey, bid)
                    start -= 1
                elif visible(b, owner):
                    out.append(b)
        return out[:limit], len(out) > limit

    def active(self) -> list[str]:
        return sorted(b.decode() for b in self.redis.smembers(self._k("batches", "active")))

    def forget_active(self, bid: str) -> None:
        self.redis.srem(self._k("batches", "active"), bid)

    def delete_batch(self, bid: str) -> bool:
        """The batch record, its chunks, lease and output files, and its index entries."""
        if not _safe(bid, "batch"):
            return False
        key = self._k("batch", bid)
        owner = self.redis.hget(key, "owner")
        with self.redis.pipeline() as p:
            p.delete(key, self._k("batch", bid, "chunks"), self._k("batch", bid, "counts"),
                     self._k("batch", bid, "lease"), self._k("batch", bid, "requeued"))
            for fid in output_file_ids(bid):
                p.delete(self._k("file", fid, "meta"), self._k("file", fid, "content"))
                p.zrem(self._k("expiry"), f"file:{fid}")
            p.zrem(self._k("batches"), bid)
            if owner and json.loads(owner):
                p.zrem(self._k("batches", "o", json.loads(owner)), bid)
            p.srem(self._k("batches", "active"), bid)
            p.zrem(self._k("expiry"), f"batch:{bid}")
            return bool(p.execute()[0])

    def sweep(self, now: float | None = None) -> int:
        """Delete every file and batch whose `expires_at` has passed; returns how many."""
        now = time.time() if now is None else now
        n = 0
        for m in self.redis.zrangebyscore(self._k("expiry"), "-inf", now):
            kind, _, ident = m.decode().partition(":")
            deleted = self.delete_batch(ident) if kind == "batch" else self.delete_file(ident)
            self.redis.zrem(self._k("expiry"), m)
            n += bool(deleted)
        return n

    # -- chunks
    def commit_chunk(self, bid: str, index: int, lines: list[str], completed: int, failed: int,
                     expires_at: int | None = None) -> int:
        """1 committed, 0 committed before (by another worker), -1 no such batch, -2 batch already finished."""
        nbytes = sum(len(ln.encode()) + 1 for ln in lines)
        keys = [self._k("batch", bid, "chunks"), self._k("batch", bid, "counts"), self._k("batch", bid)]
        return int(self._commit(keys=keys, args=[index, json.dumps(lines), f"{completed},{failed},{nbytes}",
                                                 int(expires_at or 0)]))

    def chunk_indices(self, bid: str) -> set[int]:
        return {int(k) for k in self.redis.hkeys(self._k("batch", bid, "counts"))}

    def chunk(self, bid: str, index: int) -> list[str] | None:
        raw = self.redis.hget(self._k("batch", bid, "chunks"), index)
        return json.loads(raw) if raw is not None else None

    def _count_rows(self, bid: str) -> list[list[int]]:
        return [[int(x) for x in v.decode().split(",")] for v in self.redis.hvals(self._k("batch", bid, "counts"))]

    def counts(self, bid: str) -> tuple[int, int]:
        rows = self._count_rows(bid)
        return sum(r[0] for r in rows), sum(r[1] for r in rows)

    def output_bytes(self, bid: str) -> int:
        return sum(r[2] for r in self._count_rows(bid) if len(r) > 2)

    def delete_chunks(self, bid: str) -> None:
        self.redis.delete(self._k("batch", bid, "chunks"), self._k("batch", bid, "counts"))

    # -- leases
    def acquire_lease(self, bid: str, token: str, ttl_s: float) -> bool:
        """Take the lease, or keep it if `token` holds it already."""
        return bool(self._acquire(keys=[self._k("batch", bid, "lease")], args=[token, int(ttl_s * 1000)]))

    def refresh_lease(self, bid: str, token: str, ttl_s: float) -> bool:
        return bool(self._refresh(keys=[self._k("batch", bid, "lease")], args=[token, int(ttl_s * 1000)]))

    def release_lease(self, bid: str, token: str) -> None:
        self._release(keys=[self._k("batch", bid, "lease")], args=[token])

    def lease_held(self, bid: str) -> bool:
        return bool(self.redis.exists(self._k("batch", bid, "lease")))

    def claim_requeue(self, bid: str, ttl_s: float) -> bool:
        return bool(self.redis.set(self._k("batch", bid, "requeued"), 1, nx=True, px=int(ttl_s * 1000)))


def _unlink(path: Path) -> None:
    try:
        path.unlink(missing_ok=True)
    except OSError:
        pass


class LocalJobStore:
    """The same interface on local disk (one API process): `<dir>/files`, `<dir>/batches`, `<dir>/chunks`.

    A write the disk refuses (full, read-only) raises `StorageError` and leaves no `.tmp` file behind. A batch
    that fails because of it is marked failed in memory when even that cannot be written (`_pending`, shown by
    the routes, written to disk as soon as the disk takes it)."""

    max_output_bytes = 1 << 62

    def __init__(self, root: Path):
        self.root = Path(root)
        for d in ("files", "batches", "chunks"):
            (self.root / d).mkdir(parents=True, exist_ok=True)
        self._lock = threading.RLock()
        self._pending: dict[str, dict] = {}
        self.clean_tmp(max_age_s=0)  # one process owns the directory: every .tmp left is from a crash

    def _write(self, path: Path, data: bytes) -> None:
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except OSError as e:
            _unlink(tmp)
            raise StorageError(e) from e

    def clean_tmp(self, max_age_s: float = 600) -> int:
        """Remove `.tmp` files older than `max_age_s` (a crash between write and rename leaves them)."""
        n, cutoff = 0, time.time() - max_age_s
        for pattern in ("files/.*.tmp", "batches/.*.tmp", "chunks/*/.*.tmp"):
            for p in self.root.glob(pattern):
                try:
                    if p.stat().st_mtime <= cutoff:
                        p.unlink()
                        n += 1
                except OSError:
                    pass
        return n

    # -- files
    def put_file(self, meta: dict, content: bytes) -> None:
        body = self.root / "files" / f"{meta['id']}.content"
        self._write(body, content)
        try:
            self._write(self.root / "files" / f"{meta['id']}.json", json.dumps(meta).encode())
        except StorageError:
            _unlink(body)
            raise

    def file_meta(self, fid: str) -> dict | None:
        if not _safe(fid, "file"):
            return None
        p = self.root / "files" / f"{fid}.json"
        try:
            meta = json.loads(p.read_text())
        except FileNotFoundError:
            return None
        if _expired(meta):
            self._drop_expired("file", fid, self.delete_file)
            return None
        return meta

    def file_content(self, fid: str) -> bytes | None:
        if self.file_meta(fid) is None:
            return None
        try:
            return (self.root / "files" / f"{fid}.content").read_bytes()
        except FileNotFoundError:
            return None

    def put_file_stream(self, meta: dict, chunks: Iterable[bytes]) -> None:
        """Write a file from its chunks (to a `.tmp` file, renamed once complete, then the metadata);
        `meta["bytes"]` is set from what was written. An error while reading leaves nothing behind."""
        body = self.root / "files" / f"{meta['id']}.content"
        tmp = body.with_name(f".{body.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        size = 0
        try:
            with open(tmp, "wb") as f:
                for chunk in chunks:
                    f.write(chunk)
                    size += len(chunk)
            os.replace(tmp, body)
        except OSError as e:
            _unlink(tmp)
            raise StorageError(e) from e
        except BaseException:
            _unlink(tmp)
            raise
        meta["bytes"] = size
        try:
            self._write(self.root / "files" / f"{meta['id']}.json", json.dumps(meta).encode())
        except StorageError:
            _unlink(body)
            raise

    def iter_file(self, fid: str) -> Iterator[bytes] | None:
        """The file's content in chunks of `READ_CHUNK`, or None when there is no such file."""
        if self.file_meta(fid) is None:
            return None
        try:
            return read_chunks(open(self.root / "files" / f"{fid}.content", "rb"))
        except FileNotFoundError:
            return None

    def delete_file(self, fid: str) -> bool:
        if not _safe(fid, "file"):
            return False
        meta = self.root / "files" / f"{fid}.json"
        existed = meta.is_file()
        for p in (meta, self.root / "files" / f"{fid}.content"):
            try:
                p.unlink(missing_ok=True)
            except OSError as e:
                raise StorageError(e) from e
        return existed

    # -- batches
    def put_batch(self, batch: dict) -> None:
        with self._lock:
            self._write(self.root / "batches" / f"{batch['id']}.json", json.dumps(batch).encode())
            self._pending.pop(batch["id"], None)

    def _read_batch(self, bid: str) -> dict | None:
        if bid in self._pending:
            return dict(self._pending[bid])
        try:
            return json.loads((self.root / "batches" / f"{bid}.json").read_text())
        except FileNotFoundError:
            return None

    def get_batch(self, bid: str) -> dict | None:
        if not _safe(bid, "batch"):
            return None
        with self._lock:
            b = self._read_batch(bid)
        if b is not None and _expired(b):
            self._drop_expired("batch", bid, self.delete_batch)
            return None
        return b

    @staticmethod
    def _drop_expired(kind: str, ident: str, delete) -> None:
        """Delete an expired file or batch on access; a store that refuses (read-only disk) only logs."""
        try:
            delete(ident)
        except StorageError as e:
            log.warning("expired %s %s not deleted: %s", kind, ident, e.message)

    def transition(self, bid: str, fields: dict, token: str | None = None,
                   files: list[tuple[dict, bytes]] = ()) -> bool:
        """If the batch exists and is not finished: write `files`, set `fields` (one process: no lease)."""
        with self._lock:
            b = self.get_batch(bid)
            if b is None or b["status"] in TERMINAL:
                return False
            for meta, data in files:
                self.put_file(meta, data)
            self.put_batch({**b, **fields})
            return True

    def fail(self, bid: str, fields: dict, token: str | None) -> bool:
        """As `transition`, but a disk that refuses the write keeps the failed record in memory (shown by the
        routes, written by `flush`) rather than leave the batch in_progress."""
        with self._lock:
            try:
                return self.transition(bid, fields, token)
            except StorageError as e:
                b = self.get_batch(bid)
                if b is None or b["status"] in TERMINAL:
                    return False
                self._pending[bid] = {**b, **fields}
                log.error("batch %s: failed status kept in memory until the disk takes it (%s)", bid, e.message)
                return True

    def flush(self) -> int:
        """Write the batch records `fail` kept in memory; returns how many are still pending."""
        with self._lock:
            for rec in list(self._pending.values()):
                try:
                    self.put_batch(rec)
                    self.delete_chunks(rec["id"])  # what the failure could not delete then
                except (StorageError, OSError):
                    break
            return len(self._pending)

    def _all_batches(self) -> list[dict]:
        with self._lock:
            out = dict(self._pending)
            for p in (self.root / "batches").glob("batch_*.json"):
                if p.stem not in out:
                    try:
                        out[p.stem] = json.loads(p.read_text())
                    except (OSError, ValueError):
                        continue
        return list(out.values())

    def list_batches(self, limit: int, owner: str | None = None) -> tuple[list[dict], bool]:
        now = time.time()
        bs = [b for b in self._all_batches() if visible(b, owner) and not _expired(b, now)]
        bs.sort(key=lambda b: b["created_at"], reverse=True)
        return bs[:limit], len(bs) > limit

    def active(self) -> list[str]:
        return sorted(b["id"] for b in self._all_batches() if b["status"] in LIVE and not _expired(b))

    def forget_active(self, bid: str) -> None:
        return None

    def delete_batch(self, bid: str) -> bool:
        if not _safe(bid, "batch"):
            return False
        with self._lock:
            p = self.root / "batches" / f"{bid}.json"
            existed = p.is_file() or bid in self._pending
            try:
                for fid in output_file_ids(bid):
                    self.delete_file(fid)
                self.delete_chunks(bid)
                p.unlink(missing_ok=True)
            except OSError as e:
                raise StorageError(e) from e
            self._pending.pop(bid, None)
            return existed

    def sweep(self, now: float | None = None) -> int:
        """Delete expired files and batches, chunk directories of batches that are gone, and stale `.tmp`
        files; returns how many files and batches were deleted."""
        now = time.time() if now is None else now
        n = 0
        for b in self._all_batches():
            if _expired(b, now):
                n += self.delete_batch(b["id"])
        for p in (self.root / "files").glob("file*.json"):
            try:
                meta = json.loads(p.read_text())
            except (OSError, ValueError):
                continue
            if _expired(meta, now):
                n += self.delete_file(meta["id"])
        for d in (self.root / "chunks").glob("batch_*"):
            if _safe(d.name, "batch") and d.name not in self._pending and \
                    not (self.root / "batches" / f"{d.name}.json").exists():
                shutil.rmtree(d, ignore_errors=True)
        self.clean_tmp()
        return n

    # -- chunks
    def _chunk_dir(self, bid: str, create: bool = False) -> Path:
        if not _safe(bid, "batch"):
            raise ValueError(f"not a batch id: {bid!r}")
        d = self.root / "chunks" / bid
        if create:
            try:
                d.mkdir(exist_ok=True)
            except OSError as e:
                raise StorageError(e) from e
        return d

    def commit_chunk(self, bid: str, index: int, lines: list[str], completed: int, failed: int,
                     expires_at: int | None = None) -> int:
        """1 committed, 0 committed before, -1 no such batch, -2 batch already finished."""
        b = self.get_batch(bid)
        if b is None:
            return -1
        if b["status"] in TERMINAL:
            return -2
        d = self._chunk_dir(bid, create=True)
        tmp = d / f".{index}.{threading.get_ident()}.tmp"
        rec = {"lines": lines, "completed": completed, "failed": failed,
               "bytes": sum(len(ln.encode()) + 1 for ln in lines)}
        try:
            tmp.write_text(json.dumps(rec))
            os.link(tmp, d / f"{index}.json")  # atomic create-if-absent
            return 1
        except FileExistsError:
            return 0
        except OSError as e:
            raise StorageError(e) from e
        finally:
            _unlink(tmp)

    def _records(self, bid: str) -> dict[int, dict]:
        out = {}
        for p in self._chunk_dir(bid).glob("*.json"):
            try:
                out[int(p.stem)] = json.loads(p.read_text())
            except FileNotFoundError:
                continue
        return out

    def chunk_indices(self, bid: str) -> set[int]:
        return {int(p.stem) for p in self._chunk_dir(bid).glob("*.json")}

    def chunk(self, bid: str, index: int) -> list[str] | None:
        try:
            return json.loads((self._chunk_dir(bid) / f"{index}.json").read_text())["lines"]
        except FileNotFoundError:
            return None

    def counts(self, bid: str) -> tuple[int, int]:
        rs = self._records(bid).values()
        return sum(r["completed"] for r in rs), sum(r["failed"] for r in rs)

    def output_bytes(self, bid: str) -> int:
        return sum(r.get("bytes", 0) for r in self._records(bid).values())

    def delete_chunks(self, bid: str) -> None:
        d = self._chunk_dir(bid)
        if d.exists():
            shutil.rmtree(d)

    # -- leases (one process: nothing to arbitrate)
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
            "expires_at": meta.get("expires_at"), "filename": meta["filename"], "purpose": meta["purpose"]}


def _expires(now: int, retention_s: int) -> int | None:
    return now + retention_s if retention_s > 0 else None


def create_file(store: JobStore, content: bytes | Any, filename: str, purpose: str, owner: str | None = None,
                retention_s: int = 0, max_line: int = DEFAULT_MAX_LINE_BYTES) -> dict:
    """Store an uploaded file: `content` is its bytes or an open binary file, streamed in chunks of `READ_CHUNK`
    (never read whole) while every line is checked against `max_line` bytes (413 `line_too_large` naming the
    line and the limit; nothing is stored then). Blocking: call it off the event loop."""
    import io

    f = io.BytesIO(content) if isinstance(content, bytes | bytearray) else content
    now = int(time.time())
    meta = {"id": new_id("file"), "bytes": 0, "created_at": now, "expires_at": _expires(now, retention_s),
            "filename": filename, "purpose": purpose, "owner": owner}
    store.put_file_stream(meta, checked_upload(f, max_line, [0]))
    return file_object(meta)


def get_file(store: JobStore, fid: str, owner: str | None, param: str = "file_id") -> dict:
    """The file's metadata, or 404 (also for another key's file: its existence is not revealed)."""
    meta = store.file_meta(fid) if _safe(fid, "file") else None
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


def parse_input_file(content: bytes | Iterable[bytes] | None, endpoint: str,
                     max_line: int = DEFAULT_MAX_LINE_BYTES) -> tuple[list[dict], list[dict]]:
    """JSONL lines -> (requests, errors). Errors name the 1-based line (blank lines counted, skipped) and the
    field. `content` is the file's bytes or its chunks (streamed: a line over `max_line` bytes is an error,
    `line_too_large`, found before more than the limit is held)."""
    errors: list[dict] = []
    reqs: list[dict] = []
    seen: set[str] = set()
    chunks = [content] if isinstance(content, bytes | bytearray) else (content or [])
    n_lines = 0
    lines: list[tuple[int, bytes]] = []
    try:
        for n, ln in iter_lines(chunks, max_line):
            if not ln.strip():
                continue
            n_lines += 1
            if n_lines > MAX_LINES:
                errors.append({"code": "too_many_lines", "message": f"more than {MAX_LINES} lines",
                               "line": n, "param": None})
                return [], errors
            try:
                ln.decode("utf-8")
            except UnicodeDecodeError:
                return [], [{"code": "invalid_file", "message": f"input file is not UTF-8 text (line {n})",
                             "line": n, "param": None}]
            lines.append((n, ln))
            if len(lines) >= 1024:
                _parse_lines(lines, endpoint, reqs, errors, seen)
                lines.clear()
    except LineTooLarge as e:
        return [], [{"code": "line_too_large", "message": str(e), "line": e.line, "param": None}]
    _parse_lines(lines, endpoint, reqs, errors, seen)
    if not n_lines:
        errors.append({"code": "empty_file", "message": "input file has no request lines", "line": None,
                       "param": None})
    return reqs, errors[:100]


def _parse_lines(lines: list[tuple[int, bytes]], endpoint: str, reqs: list[dict], errors: list[dict],
                 seen: set[str]) -> None:
    """Check (number, line) pairs as request lines: valid ones appended to `reqs`, problems to `errors`."""

    def bad(n: int, param: str, msg: str) -> None:
        errors.append({"code": "invalid_request", "message": f"line {n}: {msg}", "line": n, "param": param})

    for n, ln in lines:
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


def create_batch(store: JobStore, input_file_id: str, endpoint: str, completion_window: str = "24h",
                 metadata: dict | None = None, owner: str | None = None, retention_s: int = 0,
                 max_line: int = DEFAULT_MAX_LINE_BYTES) -> dict:
    """Validate the input file and record the batch (status in_progress, or failed with `errors`).
    `expires_at`: when the batch, its chunks and its output files are deleted (None: kept)."""
    if endpoint not in ENDPOINTS:
        raise APIError(422, f"endpoint: must be one of {', '.join(ENDPOINTS)}, got {endpoint!r}", param="endpoint",
                       code="invalid_value")
    get_file(store, input_file_id, owner, param="input_file_id")
    content = store.iter_file(input_file_id)  # streamed: never the whole file in memory
    if content is None:
        raise APIError(404, f"input_file_id: no file {input_file_id!r}", param="input_file_id", code="file_not_found")
    now = int(time.time())
    reqs, errors = parse_input_file(content, endpoint, max_line)
    batch = {"id": new_id("batch"), "object": "batch", "endpoint": endpoint, "errors": None,
             "input_file_id": input_file_id, "completion_window": completion_window, "status": "validating",
             "output_file_id": None, "error_file_id": None, "created_at": now, "in_progress_at": None,
             "expires_at": _expires(now, retention_s), "finalizing_at": None, "completed_at": None,
             "failed_at": None, "expired_at": None, "cancelling_at": None, "cancelled_at": None,
             "total": len(reqs), "metadata": metadata, "cancel_requested": False, "owner": owner}
    if errors:
        batch.update(status="failed", failed_at=now, errors={"object": "list", "data": errors})
    else:
        batch.update(status="in_progress", in_progress_at=now)
    store.put_batch(batch)
    return batch_object(store, batch)


def batch_object(store: JobStore, batch: dict) -> dict:
    """The public batch object with `request_counts` (live from the chunks; frozen once the batch finished)."""
    final = batch.get("final_counts")
    completed, failed = (final["completed"], final["failed"]) if final else store.counts(batch["id"])
    out = {k: v for k, v in batch.items() if k not in INTERNAL}
    out["request_counts"] = {"total": batch["total"], "completed": completed, "failed": failed}
    return out


def get_batch(store: JobStore, bid: str, owner: str | None) -> dict:
    """The batch record, or 404 (also for another key's batch)."""
    b = store.get_batch(bid) if _safe(bid, "batch") else None
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
                             max_request_tokens=settings.max_request_tokens, max_cost=settings.max_request_cost)
                out[i] = (200, run_sample(model, req))
                continue
            prep = prepare(model, op, req, settings.max_request_tokens, settings.max_posterior_entries,
                           max_cost=settings.max_request_cost)
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
                  progress: Callable[[int, int], None] | None = None,
                  stop: threading.Event | None = None) -> str | None:
    """Run (or resume) a batch to a terminal status; returns the status, or None if another worker holds it
    (or it is gone). A Redis outage is waited out (reconnecting with backoff up to `redis_retry_max_s`), then the
    batch resumes from its committed chunks; `stop` set gives up the wait (the reaper re-enqueues the batch)."""
    token = secrets.token_hex(8)
    while True:
        try:
            return _run_leased(store, models, bid, settings, progress, token)
        except REDIS_DOWN as e:
            log.warning("batch %s: Redis unavailable (%s: %s); resuming when it answers", bid, type(e).__name__, e)
            if not wait_for_redis(store.redis, settings.redis_retry_max_s, stop):  # type: ignore[union-attr]
                return None


def _run_leased(store: JobStore, models: ModelRegistry, bid: str, settings: Settings,
                progress: Callable[[int, int], None] | None, token: str) -> str | None:
    b = store.get_batch(bid)
    if b is None or b["status"] in TERMINAL:
        return b["status"] if b else None
    if not store.acquire_lease(bid, token, settings.job_lease_s):
        return None
    beat = _Heartbeat(store, bid, token, settings.job_lease_s)
    try:
        return _process(store, models, b, settings, progress, token)
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
             progress: Callable[[int, int], None] | None, token: str) -> str | None:
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
        results = execute_lines(models, op, [r["body"] for r in part], settings)
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


# == runners ===========================================================================================
class LocalRunner:
    """Without Redis: batches run one at a time in a thread of the API process; unfinished ones resume
    at startup. The thread survives any error (a full or read-only disk fails the batch, not the thread) and
    deletes expired jobs every `job_sweep_interval_s`."""

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
        next_sweep = time.monotonic()
        while True:
            with self._cv:
                while not self._q and not self._stop and time.monotonic() < next_sweep:
                    self._cv.wait(max(0.01, next_sweep - time.monotonic()))
                if self._stop:
                    return
                bid = self._q.pop(0) if self._q else None
            try:
                if time.monotonic() >= next_sweep:
                    next_sweep = time.monotonic() + max(1.0, self.settings.job_sweep_interval_s)
                    if n := self.store.sweep():
                        log.info("deleted %d expired files and batches", n)
                self.store.flush()
                if bid is not None:
                    if not self.models.ready:
                        self.models.reload()
                    process_batch(self.store, self.models, bid, self.settings)
            except Exception:  # never let the runner thread die: later batches must still run
                log.exception("job runner: error (batch %s); going on", bid)


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
                  failure_ttl=FAILURE_TTL_S, job_id=f"{bid}-{secrets.token_hex(4)}",
                  description=f"latentlm batch {bid}{note}")


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
    status = process_batch(ctx["store"], ctx["models"], bid, ctx["settings"], stop=ctx.get("stop"))
    log.info("batch %s -> %s", bid, status)
    return status
