"""The FastAPI application: `create_app(settings)`.

Routes: /health, /ready, /metrics; /v1/models[/{id}], /v1/models/reload; /v1/score, /v1/posterior,
/v1/decode, /v1/sample, /v1/embed; /v1/files[/{id}[/content]], /v1/batches[/{id}[/cancel]]."""

from __future__ import annotations

import asyncio
import gc
import hmac
import json
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from typing import Any

import anyio
from fastapi import APIRouter, FastAPI, File, Form, Query, Request, UploadFile
from fastapi.responses import Response, StreamingResponse
from latentlm.models.errors import LatentLMError
from latentlm.service import errors, execute, jobs
from latentlm.service.batcher import Batcher, QueueFull
from latentlm.service.cache import CACHED_OPS, ResponseCache
from latentlm.service.errors import APIError
from latentlm.service.metrics import Metrics
from latentlm.service.registry import ModelRegistry
from latentlm.service.schemas import (
    REQUESTS,
    DecodeRequest,
    EmbedRequest,
    PosteriorRequest,
    SampleRequest,
    ScoreRequest,
)
from latentlm.service.settings import Settings
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ConfigDict, ValidationError
from starlette.routing import Route

from latentlm import ops

log = logging.getLogger("latentlm.service")
JSON = "application/json"
BIG_RESPONSE_TOKENS = 2048
FAST_PATHS = frozenset(f"/v1/{op}" for op in REQUESTS)  # serialise bigger responses off the event loop
BATCHED_PATHS = {f"/v1/{op}": op for op in REQUESTS if op != "sample"}  # served by the raw ASGI path
JSON_HEADERS = [(b"content-type", JSON.encode())]


class CreateBatch(BaseModel):
    model_config = ConfigDict(extra="forbid")
    input_file_id: str
    endpoint: str
    completion_window: str = "24h"
    metadata: dict[str, str] | None = None


class Guard:
    """ASGI middleware: payload limit (413 before the app sees the body) and request metrics."""

    def __init__(self, app, settings: Settings, metrics: Metrics):
        self.app, self.settings, self.metrics = app, settings, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start = time.perf_counter()
        status = [500]

        async def send_(msg):
            if msg["type"] == "http.response.start":
                status[0] = msg["status"]
            await send(msg)

        try:
            if self.settings.keys and scope["path"].startswith("/v1"):
                denied = self._auth(scope)
                if denied is not None:
                    self.metrics.error(401, denied.code or "auth")
                    await errors.error_response(denied)(scope, _empty_receive, send_)
                    return
            if scope["method"] in ("POST", "PUT", "PATCH"):
                s = self.settings
                limit = s.max_file_bytes if scope["path"] == "/v1/files" else s.max_payload_bytes
                if scope["path"] != "/v1/files":
                    scope = _json_content_type(scope)
                receive = await self._buffer(scope, receive, limit)
                if receive is None:
                    e = APIError(413, f"request body exceeds the limit of {limit} bytes", param="body",
                                 code="payload_too_large")
                    self.metrics.error(413, "payload_too_large")
                    await errors.error_response(e)(scope, _empty_receive, send_)
                    return
            await self.app(scope, receive, send_)
        finally:
            route = scope.get("route")
            label = getattr(route, "path", None) or (scope["path"] if scope["path"] in FAST_PATHS else "unmatched")
            self.metrics.observe_request(label, scope["method"], status[0], time.perf_counter() - start)

    def _auth(self, scope) -> APIError | None:
        return check_auth(scope, self.settings.keys)

    @staticmethod
    async def _buffer(scope, receive, limit: int):
        """Read the whole body (<= limit bytes) and replay it; None when it is too big."""
        body = await read_body(scope, receive, limit)
        if body is None:
            return None
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


class LatentLMApp(FastAPI):
    """FastAPI, except that POST /v1/{score,posterior,decode,embed} go straight to `fast_ops` (a plain ASGI
    callable): the middleware stack, routing and Request/Response objects cost more CPU per request than
    a batched 256-state forward pass. Everything else (and the OpenAPI schema) is the FastAPI app."""

    fast_ops: Any = None

    async def __call__(self, scope, receive, send) -> None:
        if self.fast_ops is not None and scope["type"] == "http" and scope["method"] == "POST" and (
                scope["path"] in BATCHED_PATHS):
            return await self.fast_ops(scope, receive, send)
        return await super().__call__(scope, receive, send)


def _json_content_type(scope):
    """Bodies of JSON routes are JSON whatever the client says (e.g. `curl -d` sends a form type)."""
    headers = [(k, v) for k, v in scope.get("headers", []) if k != b"content-type"]
    return {**scope, "headers": [*headers, (b"content-type", b"application/json")]}


async def _empty_receive():
    return {"type": "http.disconnect"}


def create_app(settings: Settings | None = None) -> FastAPI:
    """Build the app; models load in the background at startup (/ready is 503 until they have)."""
    settings = settings or Settings.from_env()
    metrics = Metrics()
    device = ops.resolve_device(settings.device)
    registry = ModelRegistry(settings.store, device=device, dtype=settings.dtype)
    batcher = Batcher(metrics, max_batch_tokens=settings.max_batch_tokens,
                      max_queue_delay_ms=settings.max_queue_delay_ms, max_queue=settings.max_queue)
    loader = ThreadPoolExecutor(1, thread_name_prefix="latentlm-load")
    state: dict[str, Any] = {"cache": None, "jobs": None, "runner": None}

    def reload_models() -> dict:
        out = registry.reload()
        metrics.models_loaded.set(len(registry.models))
        gc.collect()
        gc.freeze()  # long-lived objects (torch, models) out of the collector's way: shorter GC pauses
        return out

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await batcher.start()
        if settings.cache_redis_url:
            state["cache"] = ResponseCache(settings.cache_redis_url, settings.cache_ttl_s, metrics)
        if settings.redis_url:
            store = jobs.RedisJobStore(settings.redis_url)
            state["jobs"], state["runner"] = store, jobs.RQRunner(store, settings.redis_url)
        else:
            store = jobs.LocalJobStore(settings.state_dir / "jobs")
            state["jobs"], state["runner"] = store, jobs.LocalRunner(store, registry, settings)
        load = asyncio.get_running_loop().run_in_executor(loader, reload_models)
        load.add_done_callback(lambda f: f.exception() and log.error("model loading failed: %s", f.exception()))
        state["runner"].start()
        try:
            yield
        finally:
            state["runner"].stop()
            await batcher.stop()
            if state["cache"] is not None:
                await state["cache"].close()
            loader.shutdown(wait=False, cancel_futures=True)

    app = LatentLMApp(title="latentlm", version="0.1.0", lifespan=lifespan,
                      description="Exact inference for latent-variable language models (HMMs, VL-HMMs, rank-space "
                                  "HMMs) with dynamic batching, a Redis response cache and OpenAI-style batch jobs.")
    app.state.settings, app.state.registry, app.state.batcher, app.state.metrics = settings, registry, batcher, metrics
    errors.install(app, on_error=metrics.error)
    app.add_middleware(Guard, settings=settings, metrics=metrics)

    # -- dependencies -----------------------------------------------------------------------------
    def ensure_ready() -> None:
        if not registry.ready:
            raise APIError(503, "models are still loading; retry shortly", code="not_ready",
                           headers={"Retry-After": str(settings.retry_after_s)})

    def queue_full(e: QueueFull) -> APIError:
        return APIError(429, f"server busy: {e}", code="queue_full",
                        headers={"Retry-After": str(settings.retry_after_s)})

    def job_store():
        return state["jobs"]

    # -- health -------------------------------------------------------------------------------------
    @app.get("/health", tags=["health"])
    async def health() -> dict:
        """Liveness: answers while a batch computes."""
        return {"status": "ok"}

    @app.get("/ready", tags=["health"])
    async def ready() -> Response:
        """200 once every model in the store has been loaded (or failed to load); 503 before."""
        if not registry.ready:
            return Response(json.dumps({"status": "loading"}), status_code=503, media_type=JSON,
                            headers={"Retry-After": str(settings.retry_after_s)})
        return Response(json.dumps({"status": "ready", "models": sorted(registry.models),
                                    "failed": registry.failed}), media_type=JSON)

    @app.get("/metrics", tags=["health"])
    async def metrics_route() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    v1 = APIRouter(prefix="/v1")  # bearer keys are checked in Guard, before the body is read

    # -- models -------------------------------------------------------------------------------------
    @v1.get("/models", tags=["models"])
    async def list_models() -> dict:
        return {"object": "list", "data": [m.describe() for m in registry.list()]}

    @v1.get("/models/{model_id}", tags=["models"])
    async def get_model(model_id: str) -> dict:
        return registry.get(model_id).describe()

    @v1.post("/models/reload", tags=["models"])
    async def reload() -> dict:
        """Pick up models added to, changed in or removed from the store; requests in flight finish on
        the version they started with."""
        out = await asyncio.get_running_loop().run_in_executor(loader, reload_models)
        return {"object": "list", "data": [m.describe() for m in registry.list()], **out}

    # -- operations ---------------------------------------------------------------------------------
    async def run_op(op: str, req: BaseModel, ticket: list[bool] | None = None) -> tuple[bytes, str | None]:
        """-> (JSON body, X-Cache header value or None when there is no cache)."""
        ensure_ready()
        prep = execute.prepare(registry.get(req.model), op, req, settings.max_request_tokens)
        cache, key = state["cache"], None
        if cache is not None and op in CACHED_OPS:
            key = execute.cache_key(prep)
            hit = await cache.get(key, op)
            if hit is not None:
                return hit, "hit"
        try:
            results = await batcher.submit(prep.model, op, prep.opts, prep.seqs, ticket)
        except QueueFull as e:
            raise queue_full(e) from None
        data = execute.body(prep, results)
        big = prep.num_tokens > BIG_RESPONSE_TOKENS or op == "posterior"
        payload = await anyio.to_thread.run_sync(execute.dumps, data) if big else execute.dumps(data)
        if key is not None:
            await cache.set(key, payload)
            return payload, "miss"
        return payload, None

    async def handle(op: str, req: BaseModel, ticket: list[bool] | None = None) -> Response:
        payload, x_cache = await run_op(op, req, ticket)
        return Response(payload, media_type=JSON, headers={"X-Cache": x_cache} if x_cache else None)

    @v1.post("/score", tags=["operations"])
    async def score(req: ScoreRequest) -> Response:
        """log p(x), perplexity per input [, tokens and token_logprobs]."""
        return await handle("score", req)

    @v1.post("/posterior", tags=["operations"])
    async def posterior(req: PosteriorRequest) -> Response:
        """Per-token state marginals, most probable first (top_k per token, or every state)."""
        return await handle("posterior", req)

    @v1.post("/decode", tags=["operations"])
    async def decode(req: DecodeRequest) -> Response:
        """Viterbi path (states, logprob) or MBR (states, state_probs)."""
        return await handle("decode", req)

    @v1.post("/embed", tags=["operations"])
    async def embed(req: EmbedRequest) -> Response:
        """Per-token embeddings (families that support it)."""
        return await handle("embed", req)

    @v1.post("/sample", tags=["operations"])
    async def sample(req: SampleRequest) -> Response:
        """n samples (continuations of `prefix`); `stream: true` sends one SSE event per sample."""
        ensure_ready()
        model = registry.get(req.model)
        ops.check_supported(model, "sample")
        execute.check_sample(req, settings.max_sample_tokens)
        try:
            data = await batcher.call(model, "sample", lambda: execute.run_sample(model, req))
        except QueueFull as e:
            raise queue_full(e) from None
        if not req.stream:
            return Response(execute.dumps(data), media_type=JSON)

        async def events():
            for item in data["data"]:
                chunk = {"object": "sample.chunk", "model": model.name, **item}
                yield b"data: " + execute.dumps(chunk) + b"\n\n"
            yield b"data: " + execute.dumps({"object": "sample.usage", "model": model.name,
                                             "usage": data["usage"]}) + b"\n\n"
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    # -- files and batches --------------------------------------------------------------------------
    @v1.post("/files", tags=["batches"])
    def upload_file(file: UploadFile = File(...), purpose: str = Form("batch")) -> dict:
        """Upload a JSONL file of requests: one `{"custom_id", "method", "url", "body"}` per line."""
        if purpose != "batch":
            raise APIError(422, f"purpose: only 'batch' is supported, got {purpose!r}", param="purpose",
                           code="invalid_value")
        content = file.file.read()
        return jobs.create_file(job_store(), content, file.filename or "input.jsonl", purpose)

    @v1.get("/files/{file_id}", tags=["batches"])
    def get_file(file_id: str) -> dict:
        meta = job_store().file_meta(file_id)
        if meta is None:
            raise APIError(404, f"no file {file_id!r}", param="file_id", code="file_not_found")
        return jobs.file_object(meta)

    @v1.get("/files/{file_id}/content", tags=["batches"])
    def file_content(file_id: str) -> Response:
        content = job_store().file_content(file_id)
        if content is None:
            raise APIError(404, f"no file {file_id!r}", param="file_id", code="file_not_found")
        return Response(content, media_type="application/jsonl")

    @v1.post("/batches", tags=["batches"])
    def create_batch(req: CreateBatch) -> dict:
        """Validate the input file and queue the batch (status in_progress; failed with `errors` if invalid)."""
        b = jobs.create_batch(job_store(), req.input_file_id, req.endpoint, req.completion_window, req.metadata)
        if b["status"] == "in_progress":
            if isinstance(job_store(), jobs.RedisJobStore):
                job_store().claim_requeue(b["id"], 2 * settings.job_lease_s)
            state["runner"].submit(b["id"])
        return b

    @v1.get("/batches", tags=["batches"])
    def list_batches(limit: int = Query(20, ge=1, le=100)) -> dict:
        store = job_store()
        data = [jobs.batch_object(store, b) for bid in store.list_batches(limit) if (b := store.get_batch(bid))]
        return {"object": "list", "data": data, "has_more": False}

    @v1.get("/batches/{batch_id}", tags=["batches"])
    def get_batch(batch_id: str) -> dict:
        b = job_store().get_batch(batch_id) if jobs._safe(batch_id) else None
        if b is None:
            raise APIError(404, f"no batch {batch_id!r}", param="batch_id", code="batch_not_found")
        return jobs.batch_object(job_store(), b)

    @v1.post("/batches/{batch_id}/cancel", tags=["batches"])
    def cancel_batch(batch_id: str) -> dict:
        return jobs.cancel_batch(job_store(), batch_id)

    app.include_router(v1)

    # Fast paths. The operation routes above define the OpenAPI schema; requests are served elsewhere:
    # score/posterior/decode/embed by `serve_op`, a plain ASGI callable that LatentLMApp calls before the
    # middleware stack (it does Guard's work itself: auth, payload limit, request metrics; and the error
    # handlers' work: the same error bodies and error counts); sample by a plain Starlette route (matched
    # first). Both validate with pydantic-core straight from the JSON bytes.
    api_keys = settings.keys  # parsed once

    async def serve_op(scope, receive, send) -> None:
        start = time.perf_counter()
        op = BATCHED_PATHS[scope["path"]]
        ticket, status = None, 500
        try:
            try:
                if api_keys and (denied := check_auth(scope, api_keys)) is not None:
                    raise denied
                raw = await read_body(scope, receive, settings.max_payload_bytes)
                if raw is None:
                    raise APIError(413, f"request body exceeds the limit of {settings.max_payload_bytes} bytes",
                                   param="body", code="payload_too_large")
                ticket = batcher.announce()  # lets the batcher know company is coming (Batcher._company_coming)
                payload, x_cache = await run_op(op, parse_json(op, raw), ticket)
                status, headers = 200, JSON_HEADERS if x_cache is None else [(b"x-cache", x_cache.encode()),
                                                                              *JSON_HEADERS]
            except Exception as exc:
                e = as_api_error(exc, scope)
                metrics.error(e.status, e.code or e.type)
                status, payload = e.status, errors.error_body(e)
                headers = [*((k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in e.headers.items()),
                           *JSON_HEADERS]
            await send({"type": "http.response.start", "status": status,
                        "headers": [(b"content-length", b"%d" % len(payload)), *headers]})
            await send({"type": "http.response.body", "body": payload})
        finally:
            batcher.retract(ticket)
            metrics.observe_request(scope["path"], "POST", status, time.perf_counter() - start)

    app.fast_ops = serve_op

    async def fast_sample(request: Request) -> Response:
        return await sample(parse_json("sample", await request.body()))

    app.router.routes.insert(0, Route("/v1/sample", fast_sample, methods=["POST"]))
    return app


def as_api_error(e: Exception, scope) -> APIError:
    """What the app's exception handlers answer for `e` (a 500 is logged with its traceback)."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, LatentLMError):
        return errors.from_model_error(e)
    log.error("internal error on %s %s", scope["method"], scope["path"], exc_info=e)
    return APIError(500, f"internal error: {type(e).__name__}", code="internal_error")


def parse_json(op: str, raw: bytes) -> BaseModel:
    """Body bytes -> the operation's request model; the same errors as FastAPI's validation path."""
    if not raw.strip():
        raise APIError(422, "body: empty request body; expected a JSON object", param="body", code="missing_field")
    try:
        return REQUESTS[op].model_validate_json(raw)
    except ValidationError as e:
        errs = list(e.errors())
        if errs and not errs[0].get("loc") and errs[0].get("type") != "json_invalid":
            raise APIError(422, "body: expected a JSON object", param="body", code="invalid_value") from None
        raise errors.describe_validation(errs) from None
