"""ASGI middleware in front of every route: bearer-key auth, the body-size limit (413 before the app reads
the body) and request metrics. Pure ASGI (no Request objects), so it costs microseconds per request."""

from __future__ import annotations

import hashlib
import hmac
import logging
import math
import time

from latentlm.service import errors
from latentlm.service.errors import APIError
from latentlm.service.metrics import Metrics
from latentlm.service.settings import Settings

WORK = ("POST", "PUT", "PATCH", "DELETE")  # methods refused with 503 once SIGTERM was received
BODY = "latentlm.body"  # scope key: the request body, read (and bounded) once here
DOCS = ("/metrics", "/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json")  # behind the key: protect_docs
log = logging.getLogger("latentlm.service")


class Guard:
    """ASGI middleware: payload limit (413 before the app sees the body) and request metrics."""

    def __init__(self, app, settings: Settings, metrics: Metrics, state=None):
        self.app, self.settings, self.metrics, self.state = app, settings, metrics, state
        self.keys = settings.keys  # parsed once
        self.protected = ("/v1", *DOCS) if self.keys and settings.protect_docs else ("/v1",)
        self.limiter = make_limiter(settings, metrics) if settings.rate_limit_per_key > 0 else None
        url = settings.redis_url or settings.cache_redis_url
        self.watcher = ReloadWatcher(url, state, settings) if url and state is not None else None
        if self.watcher is not None:
            state.reload_watcher = self.watcher  # the reload route bumps the generation through it

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start = time.perf_counter()
        status = [500]

        async def send_(msg):
            if msg["type"] == "http.response.start":
                status[0] = msg["status"]
            await send(msg)

        state = self.state
        if state is not None:
            state.inflight += 1
        if self.watcher is not None:
            self.watcher.poke()  # at most once a second, in the background: a reload by another API process
        try:
            path = route_path(scope)
            if state is not None and state.draining and path.startswith("/v1") and scope["method"] in WORK:
                e = state.shutting_down()  # new work after SIGTERM: 503 JSON (the load balancer moves on)
                self.metrics.error(503, "shutting_down")
                await errors.error_response(e)(scope, _empty_receive, send_)
                return
            if self.keys and path.startswith(self.protected):  # the explorer page (/) and its assets need no key
                denied = self._auth(scope)
                if denied is not None:
                    self.metrics.error(401, denied.code or "auth")
                    await errors.error_response(denied)(scope, _empty_receive, send_)
                    return
            if self.limiter is not None and path.startswith("/v1"):
                wait = await self.limiter.take(client_id(scope, bool(self.keys)))
                if wait is not None:
                    e = APIError(429, f"rate limit of {self.settings.rate_limit_per_key:g} requests/s per key "
                                 f"exceeded (LATENTLM_RATE_LIMIT_PER_KEY); retry after {wait:.2f} s",
                                 code="rate_limited", headers={"Retry-After": str(max(1, math.ceil(wait)))})
                    self.metrics.error(429, "rate_limited")
                    await errors.error_response(e)(scope, _empty_receive, send_)
                    return
            if scope["method"] in ("POST", "PUT", "PATCH") and path == "/v1/files":
                # an upload is streamed to the route (multipart spooled to disk), never buffered whole here: the
                # limit is checked on Content-Length and while the body arrives (413 then, whatever the app did)
                await self._upload(scope, receive, send_)
                return
            if scope["method"] in ("POST", "PUT", "PATCH"):
                s = self.settings
                limit = s.max_payload_bytes
                scope = _json_content_type(scope)
                body = await read_body(scope, receive, limit)
                if body is None:
                    e = APIError(413, f"request body exceeds the limit of {limit} bytes", param="body",
                                 code="payload_too_large")
                    self.metrics.error(413, "payload_too_large")
                    await errors.error_response(e)(scope, _empty_receive, send_)
                    return
                scope[BODY] = body  # the operation routes take the bytes from here
                receive = _replay(body, receive)
            await self.app(scope, receive, send_)
        finally:
            if state is not None:
                state.inflight -= 1
            route = scope.get("route")
            label = getattr(route, "path", None) or "unmatched"
            self.metrics.observe_request(label, scope["method"], status[0], time.perf_counter() - start)

    async def _upload(self, scope, receive, send) -> None:
        """Run the app on an upload whose body is counted as it is received: over `max_file_bytes` (by
        Content-Length, or once more bytes than that arrived) the app's answer is replaced by a 413."""
        limit = self.settings.max_file_bytes
        e = APIError(413, f"request body exceeds the limit of {limit} bytes", param="body", code="payload_too_large")
        for k, v in scope.get("headers", []):
            if k == b"content-length" and v.isdigit() and int(v) > limit:
                self.metrics.error(413, "payload_too_large")
                await errors.error_response(e)(scope, _empty_receive, send)
                return
        seen, over, started = [0], [False], [False]

        async def counted():
            msg = await receive()
            if msg["type"] == "http.request":
                seen[0] += len(msg.get("body", b""))
                if seen[0] > limit:
                    over[0] = True
                    raise BodyTooLarge(limit)
            return msg

        async def send_(msg):
            if over[0]:  # whatever the app answers to a cut body, the client gets the 413
                if msg["type"] == "http.response.start" and not started[0]:
                    started[0] = True
                    self.metrics.error(413, "payload_too_large")
                    await errors.error_response(e)(scope, _empty_receive, send)
                return
            started[0] = started[0] or msg["type"] == "http.response.start"
            await send(msg)

        try:
            await self.app(scope, counted, send_)
        except BodyTooLarge:
            if not started[0]:
                started[0] = True
                self.metrics.error(413, "payload_too_large")
                await errors.error_response(e)(scope, _empty_receive, send)

    def _auth(self, scope) -> APIError | None:
        return check_auth(scope, self.keys)


class BodyTooLarge(Exception):
    """Raised by the counting `receive` of an upload once its body exceeds the limit."""


def client_id(scope, keyed: bool) -> str:
    """Who a rate limit applies to: a SHA-256 of the bearer key (the key itself is never stored or logged), or
    the client address without keys."""
    if keyed:
        value = next((v for k, v in scope.get("headers", []) if k == b"authorization"), b"")
        return "k:" + hashlib.sha256(value.partition(b" ")[2].strip()).hexdigest()[:32]
    client = scope.get("client") or ("unknown", 0)
    return f"a:{client[0]}"


class LocalRateLimiter:
    """Token buckets in this process: `rate` tokens per second, at most `burst`; one token per request."""

    MAX_CLIENTS = 100_000  # buckets kept; full ones (idle clients) are dropped beyond it

    def __init__(self, rate: float, burst: int):
        self.rate, self.burst = rate, burst
        self.buckets: dict[str, tuple[float, float]] = {}  # id -> (tokens, time)

    async def take(self, ident: str) -> float | None:
        """None when the request may go; else the seconds until a token is free."""
        now = time.monotonic()
        tokens, then = self.buckets.get(ident, (self.burst, now))
        tokens = min(self.burst, tokens + (now - then) * self.rate)
        if tokens >= 1:
            self.buckets[ident] = (tokens - 1, now)
            if len(self.buckets) > self.MAX_CLIENTS:
                self._prune(now)
            return None
        self.buckets[ident] = (tokens, now)
        return (1 - tokens) / self.rate

    def _prune(self, now: float) -> None:
        full = [k for k, (t, ts) in self.buckets.items() if t + (now - ts) * self.rate >= self.burst]
        for k in full:
            del self.buckets[k]


# One token bucket per client in a Redis hash, updated atomically by one script with Redis's own clock (so API
# processes on several machines share one limit); the key expires once the bucket would be full again.
TOKEN_BUCKET = """
local rate, burst = tonumber(ARGV[1]), tonumber(ARGV[2])
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local v = redis.call('HMGET', KEYS[1], 'tokens', 'ts')
local tokens, ts = tonumber(v[1]) or burst, tonumber(v[2]) or now
tokens = math.min(burst, tokens + math.max(0, now - ts) * rate)
local wait = 0
if tokens >= 1 then tokens = tokens - 1 else wait = (1 - tokens) / rate end
redis.call('HSET', KEYS[1], 'tokens', tostring(tokens), 'ts', tostring(now))
redis.call('PEXPIRE', KEYS[1], math.ceil(burst / rate * 1000) + 1000)
return tostring(wait)
"""


class RedisRateLimiter:
    """The token bucket of `LocalRateLimiter`, shared in Redis by every API process (atomic: one Lua script).

    A slow or hung Redis must not slow every request down, nor lift the limit: each check has a short timeout and
    no retries, and the cache's circuit breaker (`cache.CircuitBreaker`, the same settings:
    LATENTLM_CACHE_BREAKER_FAILURES, LATENTLM_CACHE_BREAKER_COOLDOWN_S) skips Redis for the cool-down after that
    many failures in a row, then lets one probe through. A check that fails, and every check while the breaker is
    open, is made by an in-process bucket instead (the same rate and burst, per API process), so the limit holds
    through an outage. Counted: `latentlm_rate_limit_errors`, `latentlm_rate_limit_skipped`,
    `latentlm_rate_limit_breaker_trips`."""

    def __init__(self, url: str, rate: float, burst: int, timeout_s: float, metrics: Metrics | None = None,
                 breaker_failures: int = 3, breaker_cooldown_s: float = 30.0):
        import redis.asyncio as aioredis
        from redis.asyncio.retry import Retry
        from redis.backoff import NoBackoff

        from latentlm.service.cache import CircuitBreaker

        self.rate, self.burst, self.metrics = rate, burst, metrics
        # no retries (redis-py retries by default): a hung Redis costs one timeout per check, not several
        pool = aioredis.BlockingConnectionPool.from_url(url, max_connections=32, timeout=timeout_s,
                                                        socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                                        retry=Retry(NoBackoff(), 0))
        self.redis = aioredis.Redis(connection_pool=pool)  # waits for a free connection under concurrency
        self.script = self.redis.register_script(TOKEN_BUCKET)
        self.breaker = CircuitBreaker(breaker_failures, breaker_cooldown_s)
        self.fallback = LocalRateLimiter(rate, burst)
        self.skipped = self.trips = None
        if metrics is not None:
            counters = getattr(metrics, "_rate_limit_breaker", None)
            if counters is None:
                from prometheus_client import Counter

                counters = metrics._rate_limit_breaker = (  # type: ignore[attr-defined]
                    Counter("latentlm_rate_limit_skipped", "rate-limit checks made in-process without Redis while "
                            "the rate limiter's circuit breaker is open", registry=metrics.registry),
                    Counter("latentlm_rate_limit_breaker_trips", "times the rate limiter's circuit breaker opened",
                            registry=metrics.registry))
            self.skipped, self.trips = counters

    async def take(self, ident: str) -> float | None:
        if not self.breaker.allow():
            if self.skipped is not None:
                self.skipped.inc()
            return await self.fallback.take(ident)
        try:
            wait = float(await self.script(keys=[f"latentlm:ratelimit:{ident}"], args=[self.rate, self.burst]))
        except Exception as e:  # Redis down or hung: the in-process bucket decides
            if self.metrics is not None:
                self.metrics.rate_limit_errors.inc()
            if self.breaker.failure():
                if self.trips is not None:
                    self.trips.inc()
                log.warning("rate limit check failed (%s); circuit breaker open: limits kept in this process for "
                            "%.0f s", type(e).__name__, self.breaker.cooldown_s)
            else:
                log.warning("rate limit check failed: Redis unavailable (%s); checked in this process",
                            type(e).__name__)
            return await self.fallback.take(ident)
        if self.breaker.open_until:
            log.warning("rate limiter's Redis answers again: circuit breaker closed")
        self.breaker.fails, self.breaker.open_until = 0, 0.0
        return wait if wait > 0 else None


GENERATION_KEY = "latentlm:models:generation"


class ReloadWatcher:
    """Keeps the API processes on one Redis serving the same models: `POST /v1/models/reload` in any of them
    increments a generation counter in Redis (`bump`); every process looks at it at most once every
    `RELOAD_CHECK_S` while it takes requests (`poke`: in the background, never in a request's way) and, when it
    moved, reloads the store itself (new or changed manifests verified as a fresh load, unchanged files re-hashed
    where their stat changed). A Redis that fails is skipped behind the cache's circuit breaker (logged); the
    process then serves what it has until Redis answers again."""

    RELOAD_CHECK_S = 1.0

    def __init__(self, url: str, state, settings: Settings):
        import redis.asyncio as aioredis
        from redis.asyncio.retry import Retry
        from redis.backoff import NoBackoff

        from latentlm.service.cache import CircuitBreaker

        timeout = max(settings.cache_timeout_s, 0.5)
        self.redis = aioredis.Redis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout,
                                             retry=Retry(NoBackoff(), 0))
        self.state = state
        self.breaker = CircuitBreaker(settings.cache_breaker_failures, settings.cache_breaker_cooldown_s)
        self.seen: int | None = None  # the generation this process has loaded
        self.next_check = 0.0
        self.task = None
        self.reloads = 0  # reloads started because another process reloaded

    def poke(self) -> None:
        """Start a background check when the last one is over a second old (and none is running)."""
        import asyncio

        now = time.monotonic()
        if now < self.next_check or (self.task is not None and not self.task.done()):
            return
        self.next_check = now + self.RELOAD_CHECK_S
        self.task = asyncio.get_running_loop().create_task(self._check_logged())

    async def _check_logged(self) -> None:
        try:
            await self.check()
        except Exception as e:  # e.g. the loader shut down meanwhile: never an unretrieved task exception
            log.warning("model generation check failed: %s: %s", type(e).__name__, e)

    async def check(self) -> bool:
        """Reload when the generation in Redis is not the one this process loaded; True when it reloaded."""
        import asyncio

        registry = self.state.registry
        if not registry.ready or not self.breaker.allow():
            return False
        try:
            raw = await self.redis.get(GENERATION_KEY)
        except Exception as e:
            if self.breaker.failure():
                log.warning("model generation check failed (%s); circuit breaker open for %.0f s", type(e).__name__,
                            self.breaker.cooldown_s)
            return False
        self.breaker.fails, self.breaker.open_until = 0, 0.0
        gen = int(raw or 0)
        if gen == self.seen or (self.seen is None and gen == 0):
            self.seen = gen
            return False
        # another process reloaded (or, on the first look, may have since this process loaded the store)
        first = self.seen is None
        self.seen = gen
        self.reloads += 1
        out = await asyncio.get_running_loop().run_in_executor(self.state.loader, self._reload)
        changed = {k: v for k, v in out.items() if v}
        if changed or not first:
            log.warning("models reloaded after a reload by another API process (generation %d): %s", gen,
                        changed or "no change")
        return True

    def _reload(self) -> dict:
        out = self.state.registry.reload(rehash=False)
        out["failed"] = {name: self.state.registry.failed.get(name, "") for name in out["failed"]}
        self.state.metrics.models_loaded.set(len(self.state.registry.models))
        return out

    async def bump(self) -> int | None:
        """After a reload here: tell the other processes (the new generation, or None when Redis failed)."""
        try:
            gen = int(await self.redis.incr(GENERATION_KEY))
        except Exception as e:
            log.warning("reload not announced to other API processes: Redis unavailable (%s: %s)",
                        type(e).__name__, e)
            return None
        self.seen = gen
        return gen


def make_limiter(settings: Settings, metrics: Metrics | None = None) -> LocalRateLimiter | RedisRateLimiter:
    """Redis-backed where a cache or queue Redis is configured, else in this process."""
    rate = settings.rate_limit_per_key
    burst = settings.rate_limit_burst or max(1, math.ceil(2 * rate))
    if settings.cache_redis_url:
        return RedisRateLimiter(settings.cache_redis_url, rate, burst, max(settings.cache_timeout_s, 0.5), metrics,
                                settings.cache_breaker_failures, settings.cache_breaker_cooldown_s)
    return LocalRateLimiter(rate, burst)


def route_path(scope) -> str:
    """The path the app routes on: ASGI's `path` holds the full path, `root_path` prefix included (set by
    `uvicorn --root-path` or a proxy), so the prefix comes off before `/v1` is checked, as Starlette's router
    does; otherwise a prefixed `/v1` request would skip auth."""
    path, root = scope["path"], scope.get("root_path", "")
    if root and path.startswith(root) and path[len(root):len(root) + 1] in ("", "/"):
        return path[len(root):] or "/"
    return path


def _replay(body: bytes, receive):
    """`receive` that hands out the buffered body first, then the connection's own messages."""
    sent = False

    async def replay():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


def check_auth(scope, keys: list[str]) -> APIError | None:
    """Every /v1 route needs `Authorization: Bearer <key>` when LATENTLM_API_KEYS is set (checked before
    the body is read)."""
    value = next((v for k, v in scope.get("headers", []) if k == b"authorization"), b"")
    scheme, _, token = value.decode("latin-1").partition(" ")
    hdr = {"WWW-Authenticate": "Bearer"}
    if scheme.lower() != "bearer" or not token.strip():
        return APIError(401, "missing API key: send the header 'Authorization: Bearer <key>'",
                        code="missing_api_key", headers=hdr)
    if not any(hmac.compare_digest(token.strip().encode(), k.encode()) for k in keys):
        return APIError(401, "invalid API key", code="invalid_api_key", headers=hdr)
    return None


async def read_body(scope, receive, limit: int) -> bytes | None:
    """The whole request body, or None as soon as it is known to exceed `limit` bytes (Content-Length first,
    then while reading). A client that disconnects leaves what was received."""
    for k, v in scope.get("headers", []):
        if k == b"content-length":
            try:
                if int(v) > limit:
                    return None
            except ValueError:
                pass
    msg = await receive()
    body = msg.get("body", b"")
    if not msg.get("more_body", False) or msg["type"] == "http.disconnect":  # the usual case: one message
        return body if len(body) <= limit else None
    chunks, size = [body], len(body)
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            break
        chunk = msg.get("body", b"")
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
        if not msg.get("more_body", False):
            break
    return b"".join(chunks)


def _json_content_type(scope):
    """Bodies of JSON routes are JSON whatever the client says (e.g. `curl -d` sends a form type)."""
    if (b"content-type", b"application/json") in scope.get("headers", ()):
        return scope
    headers = [(k, v) for k, v in scope.get("headers", []) if k != b"content-type"]
    return {**scope, "headers": [*headers, (b"content-type", b"application/json")]}


async def _empty_receive():
    return {"type": "http.disconnect"}


