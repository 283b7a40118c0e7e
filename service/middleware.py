"""ASGI middleware in front of every route: bearer-key auth, the body-size limit (413 before the app reads
the body) and request metrics. Pure ASGI (no Request objects), so it costs microseconds per request."""

from __future__ import annotations

import hmac
import time

from latentlm.service import errors
from latentlm.service.errors import APIError
from latentlm.service.metrics import Metrics
from latentlm.service.settings import Settings

WORK = ("POST", "PUT", "PATCH", "DELETE")  # methods refused with 503 once SIGTERM was received
BODY = "latentlm.body"  # scope key: the request body, read (and bounded) once here


class Guard:
    """ASGI middleware: payload limit (413 before the app sees the body) and request metrics."""

    def __init__(self, app, settings: Settings, metrics: Metrics, state=None):
        self.app, self.settings, self.metrics, self.state = app, settings, metrics, state
        self.keys = settings.keys  # parsed once

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
        try:
            path = route_path(scope)
            if state is not None and state.draining and path.startswith("/v1") and scope["method"] in WORK:
                e = state.shutting_down()  # new work after SIGTERM: 503 JSON (the load balancer moves on)
                self.metrics.error(503, "shutting_down")
                await errors.error_response(e)(scope, _empty_receive, send_)
                return
            if self.keys and path.startswith("/v1"):  # the explorer page (/) and its assets need no key
                denied = self._auth(scope)
                if denied is not None:
                    self.metrics.error(401, denied.code or "auth")
                    await errors.error_response(denied)(scope, _empty_receive, send_)
                    return
            if scope["method"] in ("POST", "PUT", "PATCH"):
                s = self.settings
                limit = s.max_file_bytes if path == "/v1/files" else s.max_payload_bytes
                if path != "/v1/files":
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

    def _auth(self, scope) -> APIError | None:
        return check_auth(scope, self.keys)


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


