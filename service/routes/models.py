"""The models the service holds: list, describe, reload from the store."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Depends

from latentlm.service.state import ServiceState, get_state

router = APIRouter(prefix="/v1", tags=["models"])


@router.get("/models")
async def list_models(state: ServiceState = Depends(get_state)) -> dict:
    """Every loaded model: family, sizes, operations, decode methods (and the default), provenance."""
    return {"object": "list", "data": [m.describe() for m in state.registry.list()]}


@router.get("/models/{model_id}")
async def get_model(model_id: str, state: ServiceState = Depends(get_state)) -> dict:
    return state.registry.get(model_id).describe()


@router.post("/models/reload")
async def reload(state: ServiceState = Depends(get_state)) -> dict:
    """Pick up models added to, changed in or removed from the store, verifying every file of every model as a
    fresh load does; `failed` is {name: reason} for refused models (their previous version keeps serving).
    Requests in flight finish on the version they started with."""
    out = await asyncio.get_running_loop().run_in_executor(state.loader, state.reload_models)
    return {"object": "list", "data": [m.describe() for m in state.registry.list()], **out}
