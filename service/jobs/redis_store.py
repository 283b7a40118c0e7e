"""The Redis job store (`RedisJobStore`, used with rq workers: `latentlm worker`, on any number of hosts): files,
batch records, chunk plans, chunk results, chunk claims and leases as Redis keys, with the atomic steps (chunk
commit, claim and lease take / refresh / release, status transitions) as Lua scripts or WATCH transactions; and
`wait_for_redis`, the reconnect loop with backoff that a batch and the worker run while Redis is down. Nothing here
names a local path: a worker on another host sees the same files and batches as the API."""

from __future__ import annotations

import json
import logging
import secrets
import threading
import time
from collections.abc import Iterable, Iterator
from typing import Any

import redis
import redis.exceptions
from redis.backoff import NoBackoff
from redis.retry import Retry

from latentlm.service.errors import APIError
from latentlm.service.jobs.jsonl import READ_CHUNK
from latentlm.service.jobs.store import (
    TERMINAL,
    ModelIdentities,
    StagedFile,
    is_expired,
    output_file_ids,
    valid_id,
    visible,
)

log = logging.getLogger("latentlm.jobs")

REDIS_DOWN: tuple[type[Exception], ...] = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError)
REDIS_TIMEOUT_S = 5.0         # connect and read timeout of a job-store command (a hung Redis answers 503)
REDIS_MAX_VALUE = 512 << 20   # Redis refuses a string above 512 MiB: an output file must stay below
UPLOAD_TTL_S = 3600           # Redis: a half-uploaded file's temporary key expires after this


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


class RedisJobStore:
    """Files, batch records, chunk results and leases on Redis (use a `noeviction` instance with persistence,
    e.g. `--appendonly yes`, so that jobs survive a Redis restart). Every key of a file or batch expires at its
    `expires_at` (EXPIREAT); a sorted set `expiry` lets the sweep delete what the TTLs leave in the indexes."""

    P = "latentlm:"
    _TERMINAL_JSON = " or ".join(f"st == '{json.dumps(t)}'" for t in TERMINAL)
    # KEYS chunks, counts, batch; ARGV index, lines, "completed,failed,bytes", expire-at (0: none).
    # 1 committed, 0 already committed, -1 no such batch, -2 batch already finished
    # KEYS[4] bytes: the output bytes over the committed chunks (summed from `counts` once if it is missing: a
    # batch committed by an older version), ARGV[5] this chunk's bytes
    _COMMIT = ("local st = redis.call('HGET', KEYS[3], 'status') if not st then return -1 end "
               f"if {_TERMINAL_JSON} then return -2 end "
               "if redis.call('HSETNX', KEYS[1], ARGV[1], ARGV[2]) == 0 then return 0 end "
               "if redis.call('EXISTS', KEYS[4]) == 0 then local t = 0 "
               "for _, v in ipairs(redis.call('HVALS', KEYS[2])) do "
               "local b = string.match(v, '^%d+,%d+,(%d+)$') if b then t = t + tonumber(b) end end "
               "redis.call('SET', KEYS[4], t) end "
               "redis.call('INCRBY', KEYS[4], ARGV[5]) "
               "redis.call('HSET', KEYS[2], ARGV[1], ARGV[3]) "
               "if tonumber(ARGV[4]) > 0 then redis.call('EXPIREAT', KEYS[1], ARGV[4]) "
               "redis.call('EXPIREAT', KEYS[2], ARGV[4]) redis.call('EXPIREAT', KEYS[4], ARGV[4]) end return 1")
    _ACQUIRE = ("local v = redis.call('GET', KEYS[1]) if v and v ~= ARGV[1] then return 0 end "
                "redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2]) return 1")
    _REFRESH = ("if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) "
                "end return 0")
    _RELEASE = "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0"
    # KEYS claim, counts; ARGV index, token, ttl ms. 1 claimed (or held already), 0 held by another, -1 committed
    _CLAIM = ("if redis.call('HEXISTS', KEYS[2], ARGV[1]) == 1 then return -1 end "
              "local v = redis.call('GET', KEYS[1]) if v and v ~= ARGV[2] then return 0 end "
              "redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3]) return 1")
    # KEYS plan, batch; ARGV plan, expire-at (0: none). The plan recorded; nil when the batch is gone or finished
    _PUT_PLAN = ("local st = redis.call('HGET', KEYS[2], 'status') "
                 f"if (not st) or {_TERMINAL_JSON} then return nil end "
                 "if tonumber(ARGV[2]) > 0 then redis.call('SET', KEYS[1], ARGV[1], 'NX', 'EXAT', ARGV[2]) "
                 "else redis.call('SET', KEYS[1], ARGV[1], 'NX') end return redis.call('GET', KEYS[1])")
    max_output_bytes = REDIS_MAX_VALUE - (1 << 20)
    max_file_bytes = REDIS_MAX_VALUE  # an upload above it answers 413 `file_too_large`

    def __init__(self, url: str, connect_timeout_s: float | None = REDIS_TIMEOUT_S,
                 timeout_s: float | None = REDIS_TIMEOUT_S, model_identities: ModelIdentities | None = None):
        """`connect_timeout_s` / `timeout_s`: how long a command waits for an unreachable / hung Redis before it
        fails (503 on the routes). rq's blocking reads use their own connection (see `service.worker`).
        `model_identities`: the API's models, recorded with each batch it creates (`JobStore.model_identities`)."""
        self.model_identities = model_identities
        # one immediate retry on a connection error (a pooled connection that died with a restarted Redis) and
        # none on a timeout, not redis-py's default of 10 with backoff: an unreachable Redis answers 503 at once,
        # a hung one after one timeout
        self.redis = redis.Redis.from_url(url, socket_connect_timeout=connect_timeout_s, socket_timeout=timeout_s,
                                          retry=Retry(NoBackoff(), 1, (redis.exceptions.ConnectionError,)))
        self._commit = self.redis.register_script(self._COMMIT)
        self._acquire = self.redis.register_script(self._ACQUIRE)
        self._refresh = self.redis.register_script(self._REFRESH)
        self._release = self.redis.register_script(self._RELEASE)
        self._claim = self.redis.register_script(self._CLAIM)
        self._put_plan = self.redis.register_script(self._PUT_PLAN)

    def _k(self, *parts: str) -> str:
        return self.P + ":".join(parts)

    # -- files
    def _set_file(self, p: Any, meta: dict, content: bytes | StagedFile) -> None:
        fid, exp = meta["id"], meta.get("expires_at")
        key = self._k("file", fid, "content")
        if isinstance(content, _Staged):
            p.rename(content.key, key)
            if exp:
                p.expireat(key, exp)
            else:
                p.persist(key)
        else:
            p.set(key, content, exat=exp or None)
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
                if size + len(chunk) > self.max_file_bytes:
                    raise APIError(413, f"file: more than {self.max_file_bytes} bytes, the most one file holds on "
                                        "the Redis job store; split it into several batches", param="file",
                                   code="file_too_large")
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

    def iter_file(self, fid: str, start: int = 0, end: int | None = None) -> Iterator[bytes] | None:
        """The file's content (bytes `start` to `end`, default all) in chunks of `READ_CHUNK` (GETRANGE), or None
        when there is no such file."""
        if self.file_meta(fid) is None:
            return None
        key = self._k("file", fid, "content")
        size = self.redis.strlen(key)
        if not size and not self.redis.exists(key):
            return None
        stop = size if end is None else min(size, end)

        def gen() -> Iterator[bytes]:
            for off in range(max(0, start), stop, READ_CHUNK):
                part = self.redis.getrange(key, off, min(stop, off + READ_CHUNK) - 1)
                if not part:
                    return
                yield part

        return gen()

    def stage_file(self, fid: str) -> StagedFile:
        """A file written by APPENDs to a temporary key (expiring after `UPLOAD_TTL_S` unless `transition`
        renames it into place)."""
        return _Staged(self.redis, self._k("file", fid, "stage", secrets.token_hex(6)))

    def file_meta(self, fid: str) -> dict | None:
        if not valid_id(fid, "file"):
            return None
        raw = self.redis.get(self._k("file", fid, "meta"))
        meta = json.loads(raw) if raw else None
        if meta is not None and is_expired(meta):
            self.delete_file(fid)
            return None
        return meta

    def file_content(self, fid: str) -> bytes | None:
        if self.file_meta(fid) is None:
            return None
        return self.redis.get(self._k("file", fid, "content"))

    def delete_file(self, fid: str) -> bool:
        if not valid_id(fid, "file"):
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
        if not valid_id(bid, "batch"):
            return None
        raw = self.redis.hgetall(self._k("batch", bid))
        b = {k.decode(): json.loads(v) for k, v in raw.items()} if raw else None
        if b is not None and ("id" not in b or "status" not in b):  # a partial hash (a write raced a delete)
            return None
        if b is not None and is_expired(b):
            self.delete_batch(bid)
            return None
        return b

    def transition(self, bid: str, fields: dict, token: str | None = None,
                   files: list[tuple[dict, bytes | StagedFile]] = ()) -> bool:
        """Atomically: if the batch exists, is not finished and no other worker holds its lease (`token` None:
        the lease is not checked), write `files` (bytes, or staged: renamed into place) and set `fields`. False
        when refused."""
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
                    for _, data in files:
                        if isinstance(data, _Staged) and not p.exists(data.key):
                            raise RuntimeError(f"batch {bid}: a staged output file expired before it was placed")
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
        if not valid_id(bid, "batch"):
            return False
        key = self._k("batch", bid)
        owner = self.redis.hget(key, "owner")
        with self.redis.pipeline() as p:
            p.delete(key, self._k("batch", bid, "chunks"), self._k("batch", bid, "counts"),
                     self._k("batch", bid, "lease"), self._k("batch", bid, "requeued"), self._k("batch", bid, "plan"),
                     self._k("batch", bid, "bytes"))
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
    def put_plan(self, bid: str, plan: dict, expires_at: int | None = None) -> dict:
        """SET NX of the chunk plan (it expires with the batch), unless the batch is gone or finished (a helper
        come late would leave a plan behind); the plan recorded."""
        raw = self._put_plan(keys=[self._k("batch", bid, "plan"), self._k("batch", bid)],
                             args=[json.dumps(plan), int(expires_at or 0)])
        return json.loads(raw) if raw is not None else plan

    def get_plan(self, bid: str) -> dict | None:
        raw = self.redis.get(self._k("batch", bid, "plan"))
        return json.loads(raw) if raw is not None else None

    def commit_chunk(self, bid: str, index: int, lines: list[str], completed: int, failed: int,
                     expires_at: int | None = None) -> int:
        """1 committed, 0 committed before (by another worker), -1 no such batch, -2 batch already finished."""
        nbytes = sum(len(ln.encode()) + 1 for ln in lines)
        keys = [self._k("batch", bid, "chunks"), self._k("batch", bid, "counts"), self._k("batch", bid),
                self._k("batch", bid, "bytes")]
        return int(self._commit(keys=keys, args=[index, json.dumps(lines), f"{completed},{failed},{nbytes}",
                                                 int(expires_at or 0), nbytes]))

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
        """O(1): the running total `commit_chunk` keeps (summed over the chunks when there is none)."""
        v = self.redis.get(self._k("batch", bid, "bytes"))
        return int(v) if v is not None else sum(r[2] for r in self._count_rows(bid) if len(r) > 2)

    def delete_chunks(self, bid: str) -> None:
        self.redis.delete(self._k("batch", bid, "chunks"), self._k("batch", bid, "counts"),
                          self._k("batch", bid, "bytes"), self._k("batch", bid, "plan"))

    # -- chunk claims (they expire after their ttl: a dead worker's chunk is claimed again)
    def claim_chunk(self, bid: str, index: int, token: str, ttl_s: float) -> int:
        """1 claimed (or held already), 0 held by another worker, -1 committed."""
        return int(self._claim(keys=[self._k("batch", bid, "claim", str(index)), self._k("batch", bid, "counts")],
                               args=[index, token, int(ttl_s * 1000)]))

    def refresh_claim(self, bid: str, index: int, token: str, ttl_s: float) -> bool:
        return bool(self._refresh(keys=[self._k("batch", bid, "claim", str(index))], args=[token, int(ttl_s * 1000)]))

    def release_claim(self, bid: str, index: int, token: str) -> None:
        self._release(keys=[self._k("batch", bid, "claim", str(index))], args=[token])

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

    def lease_holder(self, bid: str) -> str | None:
        """The token of the worker leading the batch (`<worker identity>/<random>`), or None."""
        v = self.redis.get(self._k("batch", bid, "lease"))
        return v.decode() if v is not None else None


class _Staged:
    """A file being written to a temporary Redis key by APPEND (`RedisJobStore.stage_file`)."""

    def __init__(self, client: Any, key: str):
        self.redis, self.key, self.size = client, key, 0
        self.redis.set(key, b"", ex=UPLOAD_TTL_S)

    def write(self, data: bytes) -> None:
        if data:
            self.redis.append(self.key, data)
            self.size += len(data)

    def discard(self) -> None:
        try:
            self.redis.delete(self.key)
        except REDIS_DOWN:  # it expires by itself
            pass
