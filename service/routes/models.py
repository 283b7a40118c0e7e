"""The models the service holds: list, describe, reload from the store."""

from __future__ import annotations

import asyncio
import hashlib

import anyio
from fastapi import APIRouter, Depends
from fastapi.responses import Response

from latentlm import ops
from latentlm.models.errors import ArtifactError
from latentlm.models.store import manifest_files
from latentlm.ops import spec
from latentlm.service.errors import APIError
from latentlm.service.state import ServiceState, get_state

router = APIRouter(prefix="/v1", tags=["models"])


@router.get("/models", openapi_extra={"responses": {"200": {"links": {
    "GetModel": {"operationId": "get_model_v1_models__model_id__get",
                 "parameters": {"model_id": "$response.body#/data/0/id"}},
    "GetCurve": {"operationId": "curve_v1_models__model_id__curve_png_get",
                 "parameters": {"model_id": "$response.body#/data/0/id"}}}}}})
async def list_models(state: ServiceState = Depends(get_state)) -> dict:
    """Every loaded model: family, sizes, operations, decode methods (and the default), provenance."""
    return {"object": "list", "data": [spec.describe(m) for m in state.registry.list()]}


@router.get("/models/{model_id}")
async def get_model(model_id: str, state: ServiceState = Depends(get_state)) -> dict:
    if model_id == "reload" and "reload" not in state.registry.models:  # the POST-only route, not a model id
        raise APIError(405, "method GET not allowed on /v1/models/reload; use POST", code="method_not_allowed",
                       headers={"Allow": "OPTIONS, POST"})
    return spec.describe(state.registry.get(model_id))


CURVE = "curve.png"


def read_curve(model: ops.LoadedModel) -> tuple[bytes, str]:
    """The bytes of the training curve the model's verified artifact carries, and their SHA-256: 404 when the
    artifact has none, 409 when the file no longer matches the manifest the model was loaded with."""
    manifest = model.artifact.manifest
    digest = manifest.get("files", {}).get(CURVE)
    if digest is None:
        raise APIError(404, f"model {model.name!r} has no training curve (its artifact carries no {CURVE})",
                       param="model", code="not_found")
    try:
        data = manifest_files(model.artifact.path, {"files": {CURVE: digest}})[CURVE].read_bytes()
    except (ArtifactError, OSError) as e:
        why = e.message if isinstance(e, ArtifactError) else str(e)
        raise APIError(409, f"{CURVE} of model {model.name!r} cannot be read ({why}); POST /v1/models/reload to "
                       "re-verify the store", param="model", code="artifact_changed") from None
    if hashlib.sha256(data).hexdigest() != digest:
        raise APIError(409, f"{CURVE} of model {model.name!r} changed since the model was verified; "
                       "POST /v1/models/reload to load the new version", param="model", code="artifact_changed")
    return data, digest


@router.get("/models/{model_id}/curve.png", response_class=Response,
            responses={200: {"content": {"image/png": {}}, "description": "the training curve (PNG)"}})
async def curve(model_id: str, state: ServiceState = Depends(get_state)) -> Response:
    """The training curve (`curve.png`) the model's artifact carries, read from its verified model directory
    and checked against the manifest's SHA-256; 404 when the artifact has none."""
    data, digest = await anyio.to_thread.run_sync(read_curve, state.registry.get(model_id))
    return Response(data, media_type="image/png", headers={"ETag": f'"{digest}"', "Cache-Control": "no-cache"})


@router.post("/models/reload")
async def reload(state: ServiceState = Depends(get_state)) -> dict:
    """Pick up models added to, changed in or removed from the store, verifying every file of every model as a
    fresh load does; `failed` is {name: reason} for refused models (their previous version keeps serving).
    Requests in flight finish on the version they started with. With Redis, the other API processes on it reload
    too (within about a second of their next request)."""
    out = await asyncio.get_running_loop().run_in_executor(state.loader, state.reload_models)
    await state.batcher.models_changed()  # an engine process syncs with the store too
    watcher = getattr(state, "reload_watcher", None)
    if watcher is not None:  # API processes on the same Redis reload too (reload.ReloadWatcher)
        await watcher.bump()
    return {"object": "list", "data": [spec.describe(m) for m in state.registry.list()], **out}
