"""ASGI middleware in front of every route (`Guard`): the in-flight limit (503 `overloaded` + Retry-After before
the body is read), bearer-key auth, per-key rate limits (`ratelimit`), the body-size limit (413 before the app
reads the body) and request metrics; it pokes the reload watcher (`reload`). Pure ASGI (no Request objects), so it
costs microseconds per request."""

from __future__ import annotations

import hmac
import logging
import math
import time

from latentlm.service import errors, redact
from latentlm.service.errors import APIError
from latentlm.service.metrics import Metrics
from latentlm.service.ratelimit import client_id, make_limiter
from latentlm.service.reload import ReloadWatcher
from latentlm.service.settings import Settings

WORK = ("POST", "PUT", "PATCH", "DELETE")  # methods refused with 503 once SIGTERM was received
BODY = "latentlm.body"  # scope key: the request body, read (and bounded) once here
# behind the key when API keys are set, unless LATENTLM_OPEN_DOCS=1 (`Settings.docs_protected`)
DOCS = ("/metrics", "/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json")
log = logging.getLogger("latentlm.service")


def overloaded_error(limit: int, retry_after_s: int) -> APIError:
    """503 `overloaded` + Retry-After: more requests in flight (or connections open) than the server takes."""
    return APIError(503, f"server overloaded: more than {limit} requests in flight (max_inflight, "
                         "LATENTLM_MAX_INFLIGHT); retry after the Retry-After delay", code="overloaded",
                    headers={"Retry-After": str(retry_after_s)})


class Guard:
    """ASGI middleware: in-flight limit, auth, rate limit, payload limit (413 before the app sees the body) and
    request metrics. Every log record of the process is redacted of credentials from its construction on
    (`redact.install`)."""

    def __init__(self, app, settings: Settings, metrics: Metrics, state=None):
        self.app, self.settings, self.metrics, self.state = app, settings, metrics, state
        self.keys = settings.keys  # parsed once
        redact.install(self.keys)
        self.protected = ("/v1", *DOCS) if settings.docs_protected else ("/v1",)
        self.limiter = make_limiter(settings, metrics) if settings.rate_limit_per_key > 0 else None
        url = settings.redis_url or settings.cache_redis_url
        self.watcher = ReloadWatcher(url, state, settings) if url and state is not None else None
        if self.watcher is not None:
            state.reload_watcher = self.watcher  # the reload route bumps the generation through it
        self.inflight_limit = settings.inflight_limit
        self.inflight = 0  # requests inside this middleware now (state.inflight counts the same, for the drain)
        metrics.inflight.set_function(lambda: self.inflight)
        e = overloaded_error(self.inflight_limit, settings.retry_after_s)
        body = errors.error_body(e)
        # the refusal under overload is sent as two prebuilt ASGI messages: it must cost next to nothing
        self.overloaded_start = {"type": "http.response.start", "status": 503, "headers": [
            (b"content-type", b"application/json"), (b"content-length", b"%d" % len(body)),
            (b"retry-after", str(settings.retry_after_s).encode())]}
        self.overloaded_body = {"type": "http.response.body", "body": body}

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
        self.inflight += 1
        if state is not None:
            state.inflight += 1
        if self.watcher is not None:
            self.watcher.poke()  # at most once a second, in the background: a reload by another API process
        try:
            path = route_path(scope)
            if self.inflight > self.inflight_limit and path.startswith("/v1"):
                self.metrics.error(503, "overloaded")  # before auth and the body: the cheapest answer there is
                await send_(self.overloaded_start)
                await send_(self.overloaded_body)
                return
            if state is not None and state.draining and path.startswith("/v1") and scope["method"] in WORK:
                e = state.shutting_down()  # new work after SIGTERM: 503 JSON (the load balancer moves on)
                self.metrics.error(503, "shutting_down")
                await errors.error_response(e)(scope, _empty_receive, send_)
                return
            if self.keys and path.startswith(self.protected):  # the explorer page (/) and its assets need no key
                denied = check_auth(scope, self.keys)
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
            self.inflight -= 1
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


class BodyTooLarge(Exception):
    """Raised by the counting `receive` of an upload once its body exceeds the limit."""


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


