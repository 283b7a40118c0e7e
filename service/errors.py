"""HTTP errors in the `{"error": {"message", "type", "param", "code"}}` shape, and the mapping from the
model layer's exceptions to status codes. Installed on the app so that no bad input ever yields a 500."""

from __future__ import annotations

import logging
import re
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import OutOfMemoryError as RedisOutOfMemoryError
from redis.exceptions import ReadOnlyError as RedisReadOnlyError
from redis.exceptions import TimeoutError as RedisTimeoutError
from starlette.exceptions import HTTPException as StarletteHTTPException

from latentlm.models.errors import (
    ArtifactError,
    InputError,
    LatentLMError,
    LimitExceeded,
    ModelNotFound,
    UnsupportedOperation,
)
from latentlm.ops import dumps

log = logging.getLogger("latentlm.service")
# pydantic puts the union member it tried into `loc` (top_k.int, prefix.list[int]); not a field name
_UNION_TAG = re.compile(r"^(int|str|float|bool|none|list|dict|(literal|list|dict|function-\w+|constrained-\w+)\[.*)$")

TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
         405: "invalid_request_error", 413: "limit_exceeded", 422: "invalid_request_error",
         429: "rate_limit_error", 500: "internal_error", 503: "service_unavailable"}


class APIError(Exception):
    """An error answered as JSON with `status`; `headers` e.g. Retry-After."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or TYPES.get(status, "invalid_request_error")
        self.headers = headers or {}


class ShuttingDown(Exception):
    """The service received SIGTERM: work it can no longer finish is answered 503 (`shutting_down`)."""


def shutting_down(retry_after_s: int = 1) -> APIError:
    """503 + Retry-After + Connection: close in the error shape: the client retries on another instance."""
    return APIError(503, "the server is shutting down; retry on another instance", code="shutting_down",
                    headers={"Retry-After": str(retry_after_s), "Connection": "close"})


def from_model_error(e: LatentLMError) -> APIError:
    """InputError -> 422, ModelNotFound -> 404, LimitExceeded -> 413, UnsupportedOperation -> 400; the error's own
    `code` where it names one."""
    code = getattr(e, "code", None)
    if isinstance(e, ModelNotFound):
        return APIError(404, e.message, param=e.param or "model", code=code or "model_not_found")
    if isinstance(e, LimitExceeded):
        return APIError(413, e.message, param=e.param, code=code or "limit_exceeded")
    if isinstance(e, UnsupportedOperation):
        return APIError(400, e.message, param=e.param, code=code or "unsupported_operation")
    if isinstance(e, InputError):
        return APIError(422, e.message, param=e.param, code=code or "invalid_value")
    if isinstance(e, ArtifactError):  # e.g. an invalid model name in a request
        if e.param == "name":
            return APIError(404, e.message, param="model", code="model_not_found")
        return APIError(500, f"model artifact error: {e.message}", param=e.param, code="artifact_error")
    return APIError(422, e.message, param=e.param, code="invalid_value")


def backend_unavailable(e: Exception, retry_after_s: int = 1) -> APIError:
    """A Redis connection or timeout error (the batch-job store or queue is down): 503 with Retry-After."""
    return APIError(503, f"batch backend unavailable: cannot reach Redis ({type(e).__name__}); retry later",
                    code="backend_unavailable", headers={"Retry-After": str(retry_after_s)})


def error_payload(e: APIError) -> dict[str, Any]:
    return {"error": {"message": e.message, "type": e.type, "param": e.param, "code": e.code}}


def error_body(e: APIError) -> bytes:
    return dumps(error_payload(e))


def error_response(e: APIError) -> Response:
    return Response(error_body(e), status_code=e.status, media_type="application/json", headers=e.headers)


def describe_validation(errors: list[dict]) -> APIError:
    """First pydantic error -> 422 naming the field (400 for a body that is not JSON at all)."""
    if not errors:
        return APIError(422, "invalid request", code="invalid_value")
    err = errors[0]
    loc = [str(p) for p in err.get("loc", ()) if p != "body" and not _UNION_TAG.match(str(p))]
    if err.get("type") == "json_invalid":
        detail = err.get("ctx", {}).get("error", "")
        return APIError(400, f"request body is not valid JSON{': ' + detail if detail else ''}", code="invalid_json")
    param = ".".join(loc) if loc else "body"
    msg = err.get("msg", "invalid value")
    if err.get("type") == "missing" and not loc:
        return APIError(422, "body: empty request body; expected a JSON object", param="body", code="missing_field")
    if err.get("type") == "missing":
        return APIError(422, f"{param}: field required", param=param, code="missing_field")
    if err.get("type") == "extra_forbidden":
        return APIError(422, f"{param}: unknown field", param=param, code="unknown_field")
    if err.get("type") == "model_attributes_type" or (not loc and "dict" in msg.lower()):
        return APIError(422, "body: expected a JSON object", param="body", code="invalid_value")
    msg = msg.removeprefix("Value error, ")
    return APIError(422, f"{param}: {msg}", param=param, code="invalid_value")


def allowed_methods(app: Any, scope: dict) -> list[str]:
    """Every method some route accepts on this path (OPTIONS included; HEAD where Starlette adds it to GET). A
    route with a literal path shadows parameter routes that also match (`/v1/models/reload` is not a model id)."""
    from starlette.routing import Match

    path = scope.get("path", "")
    matched = [r for r in _flat(app.router.routes) if r.matches({**scope, "method": "GET"})[0] != Match.NONE
               or r.matches({**scope, "method": "POST"})[0] != Match.NONE]
    literal = [r for r in matched if getattr(r, "path", None) == path]
    methods = {m for r in (literal or matched) for m in (getattr(r, "methods", None) or {"GET", "HEAD"})}
    return sorted(methods | {"OPTIONS"}) if methods else []


def _flat(routes: list) -> list:
    """Routes with the routers included without a prefix (FastAPI's `_IncludedRouter`) opened up."""
    out = []
    for r in routes:
        inner = getattr(r, "original_router", None)
        out.extend(_flat(inner.routes) if inner is not None else [r])
    return out


def install(app: FastAPI, on_error=None, retry_after_s: int = 1) -> None:
    """Exception handlers producing the error shape for every error; `on_error(status, type)` counts them.
    Redis connection and timeout errors (an outage of the batch-job store), and a Redis that refuses writes
    (maxmemory on a noeviction instance, a read-only replica), answer 503 with Retry-After."""

    def respond(e: APIError) -> Response:
        if on_error is not None:
            on_error(e.status, e.code or e.type)
        return error_response(e)

    @app.exception_handler(APIError)
    async def _api(request: Request, e: APIError):
        return respond(e)

    @app.exception_handler(LatentLMError)
    async def _model(request: Request, e: LatentLMError):
        return respond(from_model_error(e))

    @app.exception_handler(ShuttingDown)
    async def _stopping(request: Request, e: ShuttingDown):
        return respond(shutting_down(retry_after_s))

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, e: RequestValidationError):
        return respond(describe_validation(list(e.errors())))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, e: StarletteHTTPException):
        headers = dict(e.headers or {})
        if e.status_code == 405:
            allow = allowed_methods(request.app, request.scope)
            if request.method == "OPTIONS" and allow:  # no route handles OPTIONS itself: answer it here
                return Response(status_code=204, headers={"Allow": ", ".join(allow)})
            headers["Allow"] = ", ".join(allow)
        msg = {404: f"no route {request.url.path}", 405: f"method {request.method} not allowed on {request.url.path}"}
        return respond(APIError(e.status_code, msg.get(e.status_code, str(e.detail)),
                                code={404: "unknown_route", 405: "method_not_allowed"}.get(e.status_code),
                                headers=headers))

    async def _backend(request: Request, e: Exception):
        log.warning("Redis unavailable on %s %s: %s", request.method, request.url.path, e)
        return respond(backend_unavailable(e, retry_after_s))

    app.add_exception_handler(RedisConnectionError, _backend)
    app.add_exception_handler(RedisTimeoutError, _backend)

    async def _backend_full(request: Request, e: Exception):
        log.warning("Redis refused a write on %s %s: %s", request.method, request.url.path, e)
        why = "out of memory (maxmemory reached)" if isinstance(e, RedisOutOfMemoryError) else "read-only"
        return respond(APIError(503, f"batch backend unavailable: Redis is {why}; retry later",
                                code="backend_unavailable", headers={"Retry-After": str(retry_after_s)}))

    app.add_exception_handler(RedisOutOfMemoryError, _backend_full)
    app.add_exception_handler(RedisReadOnlyError, _backend_full)

    @app.exception_handler(Exception)
    async def _internal(request: Request, e: Exception):
        log.exception("internal error on %s %s", request.method, request.url.path)
        return respond(APIError(500, f"internal error: {type(e).__name__}", code="internal_error"))
