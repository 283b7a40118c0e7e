"""OpenAI-shaped batch jobs: upload a JSONL file of requests, create a batch, follow it, fetch its output."""

from __future__ import annotations

from fastapi import APIRouter, Depends, File, Form, Query, UploadFile
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict

from latentlm.service import jobs
from latentlm.service.errors import APIError
from latentlm.service.state import ServiceState, get_state

router = APIRouter(prefix="/v1", tags=["batches"])


class CreateBatch(BaseModel):
    model_config = ConfigDict(extra="forbid")
    input_file_id: str
    endpoint: str
    completion_window: str = "24h"
    metadata: dict[str, str] | None = None


@router.post("/files")
def upload_file(file: UploadFile = File(...), purpose: str = Form("batch"),
                state: ServiceState = Depends(get_state)) -> dict:
    """Upload a JSONL file of requests: one `{"custom_id", "method", "url", "body"}` per line."""
    if purpose != "batch":
        raise APIError(422, f"purpose: only 'batch' is supported, got {purpose!r}", param="purpose",
                       code="invalid_value")
    return jobs.create_file(state.jobs, file.file.read(), file.filename or "input.jsonl", purpose)


@router.get("/files/{file_id}")
def get_file(file_id: str, state: ServiceState = Depends(get_state)) -> dict:
    meta = state.jobs.file_meta(file_id) if jobs._safe(file_id, "file") else None
    if meta is None:
        raise APIError(404, f"no file {file_id!r}", param="file_id", code="file_not_found")
    return jobs.file_object(meta)


@router.get("/files/{file_id}/content")
def file_content(file_id: str, state: ServiceState = Depends(get_state)) -> Response:
    content = state.jobs.file_content(file_id) if jobs._safe(file_id, "file") else None
    if content is None:
        raise APIError(404, f"no file {file_id!r}", param="file_id", code="file_not_found")
    return Response(content, media_type="application/jsonl")


@router.post("/batches")
def create_batch(req: CreateBatch, state: ServiceState = Depends(get_state)) -> dict:
    """Validate the input file and queue the batch (status in_progress; failed with `errors` if invalid)."""
    b = jobs.create_batch(state.jobs, req.input_file_id, req.endpoint, req.completion_window, req.metadata)
    if b["status"] == "in_progress":
        if isinstance(state.jobs, jobs.RedisJobStore):
            state.jobs.claim_requeue(b["id"], 2 * state.settings.job_lease_s)
        state.runner.submit(b["id"])
    return b


@router.get("/batches")
def list_batches(limit: int = Query(20, ge=1, le=100), state: ServiceState = Depends(get_state)) -> dict:
    store = state.jobs
    data = [jobs.batch_object(store, b) for bid in store.list_batches(limit) if (b := store.get_batch(bid))]
    return {"object": "list", "data": data, "has_more": False}


@router.get("/batches/{batch_id}")
def get_batch(batch_id: str, state: ServiceState = Depends(get_state)) -> dict:
    b = state.jobs.get_batch(batch_id) if jobs._safe(batch_id, "batch") else None
    if b is None:
        raise APIError(404, f"no batch {batch_id!r}", param="batch_id", code="batch_not_found")
    return jobs.batch_object(state.jobs, b)


@router.post("/batches/{batch_id}/cancel")
def cancel_batch(batch_id: str, state: ServiceState = Depends(get_state)) -> dict:
    return jobs.cancel_batch(state.jobs, batch_id)
