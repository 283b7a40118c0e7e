"""Liveness, readiness and Prometheus metrics."""

from __future__ import annotations

import json

from fastapi import APIRouter, Depends
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST

from latentlm.service.state import ServiceState, get_state

router = APIRouter(tags=["health"])
JSON = "application/json"


@router.get("/health")
async def health() -> dict:
    """Liveness: answers while a batch computes."""
    return {"status": "ok"}


@router.get("/ready", responses={503: {"description": "models still loading, the engine process not reachable, or "
                                                    "shutting down (SIGTERM)"}})
async def ready(state: ServiceState = Depends(get_state)) -> Response:
    """200 once every model in the store has been loaded (or failed to load) and, with an engine process, the engine
    is connected; 503 before (`loading`, `engine_unavailable`), and from the moment the process receives SIGTERM
    (`shutting_down`)."""
    if state.draining:
        return Response(json.dumps({"status": "shutting_down"}), status_code=503, media_type=JSON,
                        headers={"Retry-After": str(state.settings.retry_after_s)})
    if not state.registry.ready:
        return Response(json.dumps({"status": "loading"}), status_code=503, media_type=JSON,
                        headers={"Retry-After": str(state.settings.retry_after_s)})
    if not state.batcher.ready:
        return Response(json.dumps({"status": "engine_unavailable"}), status_code=503, media_type=JSON,
                        headers={"Retry-After": str(state.settings.retry_after_s)})
    return Response(json.dumps({"status": "ready", "models": sorted(state.registry.models),
                                "failed": state.registry.failed}), media_type=JSON)


@router.get("/metrics", response_class=Response,
            responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}},
                             "description": "Prometheus text exposition format"}})
async def metrics(state: ServiceState = Depends(get_state)) -> Response:
    """Prometheus text format: request duration, queue wait and depth, batch sizes, tokens, errors, cache."""
    return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)
