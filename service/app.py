"""The FastAPI application: `create_app(settings)`.

One request path: every route (health, models, the five operations, files and batches) is a FastAPI route
behind the same middleware (`middleware.Guard`: auth, body limit, metrics) and the same exception handlers
(`errors.install`: one error shape). Routers live in `latentlm.service.routes`; what they share is the app's
`ServiceState` (`state.get_state`).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import signal
import threading
from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from latentlm.ops import spec
from latentlm.service import errors, jobs
from latentlm.service.batcher import Batcher
from latentlm.service.cache import ResponseCache
from latentlm.service.engine import EngineClient
from latentlm.service.metrics import Metrics, multiprocess_dir, publish_live_metrics
from latentlm.service.middleware import Guard
from latentlm.service.preparing import Preparer
from latentlm.service.registry import ModelRegistry
from latentlm.service.routes import batches, completions, explorer, health, models, operations
from latentlm.service.schemas import ERROR_SCHEMA
from latentlm.service.settings import Settings
from latentlm.service.state import ServiceState

log = logging.getLogger("latentlm.service")


def create_app(settings: Settings | None = None) -> FastAPI:
    """Build the app; models load in the background at startup (/ready is 503 until they have)."""
    settings = settings or Settings.from_env()
    metrics = Metrics()
    state = ServiceState(
        settings=settings, metrics=metrics,
        registry=ModelRegistry.from_settings(settings),
        batcher=EngineClient(settings.engine_socket, metrics, max_queue=settings.max_queue,
                             retry_after_s=settings.retry_after_s) if settings.engine_socket else
        Batcher(metrics, max_batch_tokens=settings.max_batch_tokens, max_queue_delay_ms=settings.max_queue_delay_ms,
                max_queue=settings.max_queue, max_heavy=settings.max_heavy_requests),
        preparer=Preparer(settings.constraint_compile_workers, settings.max_heavy_requests))

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await state.batcher.start()
        if settings.cache_redis_url and settings.cache_ttl_s > 0:
            state.cache = ResponseCache(settings.cache_redis_url, settings.cache_ttl_s, metrics, settings)
        if settings.redis_url:
            # a batch records its models' identities as this API's store holds them (workers on other hosts check)
            state.jobs = jobs.RedisJobStore(settings.redis_url, model_identities=state.registry.identities)
            state.runner = jobs.RQRunner(state.jobs, settings.redis_url)
        else:
            state.jobs = jobs.LocalJobStore(settings.state_dir / "jobs", model_identities=state.registry.identities)
            # with an engine process, batch-job lines run there too (on its device, merged by its batcher)
            run_calls = functools.partial(state.batcher.run_calls, heavy_cost=settings.heavy_request_cost,
                                          slice_cost=settings.heavy_slice_cost) \
                if isinstance(state.batcher, EngineClient) else None
            state.runner = jobs.LocalRunner(state.jobs, state.registry, settings, run_calls)
        load = asyncio.get_running_loop().run_in_executor(state.loader, state.reload_models)
        load.add_done_callback(lambda f: f.exception() and log.error("model loading failed: %s", f.exception()))
        state.runner.start()
        restore = install_sigterm(state)
        refresher = asyncio.create_task(publish_live_metrics(metrics)) if multiprocess_dir() else None
        try:
            yield
        finally:
            if refresher is not None:
                refresher.cancel()
            restore()
            state.runner.stop()
            state.preparer.stop()
            await state.batcher.stop()
            if state.cache is not None:
                await state.cache.close()
            state.loader.shutdown(wait=False, cancel_futures=True)

    # The operation routes are the app's own first routes (matched first, with no included-router layer to
    # walk); the other routers are included. OpenTelemetry is opt-in (LATENTLM_OTEL=1): FastAPI's native
    # telemetry checks its providers on every request otherwise.
    otel = {} if settings.otel else {"tracing": False, "metrics": False, "logs": False}
    app = FastAPI(title="latentlm", version="0.1.0", lifespan=lifespan, routes=list(operations.build_router().routes),
                  telemetry=otel,
                  description="Exact inference for latent-variable language models (HMMs, VL-HMMs, rank-space "
                              "HMMs, PCFGs, LDS) with dynamic batching, a Redis response cache and OpenAI-style "
                              "batch jobs.")
    app.state.service = state
    app.state.settings, app.state.registry, app.state.batcher, app.state.metrics = (
        settings, state.registry, state.batcher, metrics)
    errors.install(app, on_error=metrics.error, retry_after_s=settings.retry_after_s)
    app.add_middleware(Guard, settings=settings, metrics=metrics, state=state)
    for router in (health.router, models.router, completions.router, batches.router, explorer.router):
        app.include_router(router)
    app.openapi = lambda: openapi_document(app, settings)  # type: ignore[method-assign]
    return app


def operation_paths() -> set[str]:
    return {op.path for op in spec.OPERATIONS.values()}
WHY = {400: "the body is not JSON, or the model does not support the operation",
       401: "missing or invalid API key", 404: "no such model, file, batch or route",
       405: "method not allowed (see the Allow header)", 409: "conflict with the resource's state",
       413: "a size limit or budget exceeded (the limit is named)",
       422: "invalid value (`param` names the field)", 429: "queue full or rate limit: retry after Retry-After",
       503: "overloaded, not ready, shutting down, or the batch backend is unavailable: retry after Retry-After"}


def error_codes(method: str, path: str, op: dict, settings: Settings) -> list[int]:
    """The error statuses one operation of the document can answer (each in the `Error` shape)."""
    codes = set()
    if path.startswith("/v1"):
        if settings.keys:
            codes.add(401)
        if settings.rate_limit_per_key > 0:
            codes.add(429)
        codes.add(503)  # overloaded (LATENTLM_MAX_INFLIGHT); new work while shutting down
        if method == "post":
            codes |= {400, 413}
        if "{" in path:
            codes.add(404)
        if op.get("requestBody") or op.get("parameters"):
            codes.add(422)
        if path.startswith(("/v1/files", "/v1/batches")):
            codes.add(503)  # batch backend unavailable
        if method == "delete" or path.endswith(("curve.png", "/cancel")):
            codes.add(409)
        if method == "post" and path == "/v1/batches":
            codes.add(404)  # input_file_id names no file
    if path in operation_paths():
        codes |= {400, 404, 413, 422, 429, 503}
    if path == "/v1/models/{model_id}":
        codes.add(405)  # GET /v1/models/reload
    if path in ("/metrics", "/docs", "/redoc", "/openapi.json") and settings.docs_protected:
        codes.add(401)
    return sorted(codes)


def openapi_document(app: FastAPI, settings: Settings) -> dict:
    """FastAPI's document with the truth added: every error status each operation can answer with the `Error`
    body (FastAPI's own 422 schema replaced), and the HTTP bearer scheme on /v1 when API keys are set."""
    if app.openapi_schema:
        return app.openapi_schema
    doc = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
    comps = doc.setdefault("components", {})
    schemas = comps.setdefault("schemas", {})
    schemas["Error"] = ERROR_SCHEMA
    for name in ("HTTPValidationError", "ValidationError"):
        schemas.pop(name, None)
    ref = {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}
    if settings.keys:
        comps["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer",
                                               "description": "one of LATENTLM_API_KEYS"}}
    for path, item in doc.get("paths", {}).items():
        for method, op in item.items():
            responses = op.setdefault("responses", {})
            for code in error_codes(method, path, op, settings):
                responses[str(code)] = {"description": WHY[code], "content": ref}
            if settings.keys and (path.startswith("/v1") or settings.docs_protected and path == "/metrics"):
                op["security"] = [{"bearer": []}]
    _integer_bounds(doc)
    app.openapi_schema = doc
    return doc


def _integer_bounds(node) -> None:
    """FastAPI's OpenAPI models hold `minimum`/`maximum` as floats: 2^63 comes out as 9.223372036854776e+18, which
    a client (or schemathesis) reads as a bound above 2^63. Integer schemas get their bounds back as integers."""
    if isinstance(node, dict):
        if node.get("type") == "integer":
            for k in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
                if isinstance(node.get(k), float) and node[k].is_integer():
                    node[k] = int(node[k])
        for v in node.values():
            _integer_bounds(v)
    elif isinstance(node, list):
        for v in node:
            _integer_bounds(v)


def install_sigterm(state: ServiceState):
    """Put a SIGTERM handler in front of the server's (uvicorn's, which closes the listening socket at once and
    cuts requests off after its own timeout): /ready and new work answer 503 at once while the socket stays open,
    in-flight requests get `shutdown_grace_s` to finish (`ServiceState.drain`), then the server's handler runs. A
    second SIGTERM goes to the server's handler at once. Only under a server that handles SIGTERM in the main
    thread (not in TestClient). Returns the function that puts the server's handler back."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    previous = signal.getsignal(signal.SIGTERM)
    if not callable(previous):
        return lambda: None
    loop = asyncio.get_running_loop()
    tasks: list[asyncio.Task] = []  # holds the drain task (the loop keeps only a weak reference)
    started = [False]

    def chain(sig: int, frame) -> None:
        previous(sig, frame)

    async def drain_then_exit(sig: int) -> None:
        try:
            out = await state.drain()
            log.warning("drained after %.2f s (%d left, %d answered 503)", out["waited_s"], out["left"],
                        out["answered_503"])
        finally:
            chain(sig, None)

    def handler(sig: int, frame) -> None:
        if started[0]:  # a second SIGTERM: stop now
            chain(sig, frame)
            return
        started[0] = True
        state.draining = True  # /ready and new work answer 503 from now on
        loop.call_soon_threadsafe(lambda: tasks.append(loop.create_task(drain_then_exit(sig))))

    signal.signal(signal.SIGTERM, handler)

    def restore() -> None:
        if signal.getsignal(signal.SIGTERM) is handler:
            signal.signal(signal.SIGTERM, previous)

    return restore
