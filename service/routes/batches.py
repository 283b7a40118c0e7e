"""OpenAI-shaped batch jobs: upload a JSONL file of requests, create a batch, follow it, fetch its output,
delete files and finished batches. With API keys, files and batches belong to the key that created them
(other keys get 404); they expire `LATENTLM_JOB_RETENTION_S` after creation (`expires_at`)."""

from __future__ import annotations

from typing import Literal

from fastapi import APIRouter, Depends, File, Form, Query, Request, UploadFile
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from latentlm.ops import spec
from latentlm.service import jobs
from latentlm.service.errors import APIError
from latentlm.service.state import ServiceState, get_state

router = APIRouter(prefix="/v1", tags=["batches"])


def _links(param: str, ops: dict[str, str]) -> dict:
    """OpenAPI links from a created object's `id` to the operations that take it (clients and schemathesis's
    stateful tests follow them)."""
    return {"responses": {"200": {"links": {
        name: {"operationId": op, "parameters": {param: "$response.body#/id"}} for name, op in ops.items()}}}}


FILE_LINKS = _links("file_id", {"GetFile": "get_file_v1_files__file_id__get",
                                "GetFileContent": "file_content_v1_files__file_id__content_get",
                                "DeleteFile": "delete_file_v1_files__file_id__delete"})
FILE_LINKS["responses"]["200"]["links"]["CreateBatch"] = {
    "operationId": "create_batch_v1_batches_post",
    "requestBody": {"input_file_id": "$response.body#/id", "endpoint": "/v1/score"}}
BATCH_LINKS = _links("batch_id", {"GetBatch": "get_batch_v1_batches__batch_id__get",
                                  "CancelBatch": "cancel_batch_v1_batches__batch_id__cancel_post",
                                  "DeleteBatch": "delete_batch_v1_batches__batch_id__delete"})


def _endpoints(schema: dict) -> None:
    """The schema's enum: the route of every operation declared when the document is built."""
    schema["enum"] = [op.path for op in spec.OPERATIONS.values()]


class CreateBatch(BaseModel):
    model_config = ConfigDict(extra="forbid")
    input_file_id: str
    endpoint: str = Field(description="the operation every line runs, as its route (e.g. /v1/score); checked by "
                                      "`jobs.create_batch` against the operations declared",
                          json_schema_extra=_endpoints)
    completion_window: str = "24h"
    metadata: dict[str, str] | None = None


def owner(request: Request, state: ServiceState = Depends(get_state)) -> str | None:
    """Dependency: a hash of the caller's API key (None without keys: everything shared)."""
    return jobs.owner_of(request.headers.get("authorization"), state.settings.keys)


@router.post("/files", openapi_extra=FILE_LINKS)
def upload_file(file: UploadFile = File(...), purpose: Literal["batch"] = Form("batch"),
                state: ServiceState = Depends(get_state), who: str | None = Depends(owner)) -> dict:
    """Upload a JSONL file of requests: one `{"custom_id", "method", "url", "body"}` per line."""
    if purpose != "batch":
        raise APIError(422, f"purpose: only 'batch' is supported, got {purpose!r}", param="purpose",
                       code="invalid_value")
    # streamed from the spooled upload in chunks (never read whole), each line checked against
    # LATENTLM_JOB_MAX_LINE_BYTES (413 `line_too_large` naming the line); a sync route: off the event loop
    return jobs.create_file(state.jobs, file.file, file.filename or "input.jsonl", purpose, who,
                            state.settings.job_retention_s, jobs.max_line_bytes(state.settings))


@router.get("/files/{file_id}")
def get_file(file_id: str, state: ServiceState = Depends(get_state), who: str | None = Depends(owner)) -> dict:
    return jobs.file_object(jobs.get_file(state.jobs, file_id, who))


@router.get("/files/{file_id}/content", response_class=Response,
            responses={200: {"content": {"application/jsonl": {"schema": {"type": "string"}}},
                             "description": "the file's bytes (JSON Lines), streamed"}})
def file_content(file_id: str, state: ServiceState = Depends(get_state),
                 who: str | None = Depends(owner)) -> Response:
    meta = jobs.get_file(state.jobs, file_id, who)
    chunks = state.jobs.iter_file(file_id)  # streamed in chunks: an output file can be hundreds of MB
    if chunks is None:
        raise APIError(404, f"no file {file_id!r}", param="file_id", code="file_not_found")
    return StreamingResponse(chunks, media_type="application/jsonl", headers={"Content-Length": str(meta["bytes"])})


@router.delete("/files/{file_id}")
def delete_file(file_id: str, state: ServiceState = Depends(get_state), who: str | None = Depends(owner)) -> dict:
    """`{"id", "object": "file", "deleted": true}`; 409 while the file is the input of a live batch."""
    return jobs.delete_file(state.jobs, file_id, who)


@router.post("/batches", openapi_extra=BATCH_LINKS)
def create_batch(req: CreateBatch, state: ServiceState = Depends(get_state),
                 who: str | None = Depends(owner)) -> dict:
    """Validate the input file and queue the batch (status in_progress; failed with `errors` if invalid)."""
    b = jobs.create_batch(state.jobs, req.input_file_id, req.endpoint, req.completion_window, req.metadata, who,
                          state.settings.job_retention_s, jobs.max_line_bytes(state.settings))
    if b["status"] == "in_progress":
        if isinstance(state.jobs, jobs.RedisJobStore):
            state.jobs.claim_requeue(b["id"], 2 * state.settings.job_lease_s)
        state.runner.submit(b["id"])
    return b


@router.get("/batches")
def list_batches(limit: int = Query(20, ge=1, le=100), state: ServiceState = Depends(get_state),
                 who: str | None = Depends(owner)) -> dict:
    """The caller's newest batches first."""
    records, more = state.jobs.list_batches(limit, who)
    return {"object": "list", "data": [jobs.batch_object(state.jobs, b) for b in records], "has_more": more}


@router.get("/batches/{batch_id}")
def get_batch(batch_id: str, state: ServiceState = Depends(get_state), who: str | None = Depends(owner)) -> dict:
    return jobs.batch_object(state.jobs, jobs.get_batch(state.jobs, batch_id, who))


@router.post("/batches/{batch_id}/cancel")
def cancel_batch(batch_id: str, state: ServiceState = Depends(get_state),
                 who: str | None = Depends(owner)) -> dict:
    return jobs.cancel_batch(state.jobs, batch_id, who)


@router.delete("/batches/{batch_id}")
def delete_batch(batch_id: str, state: ServiceState = Depends(get_state),
                 who: str | None = Depends(owner)) -> dict:
    """Delete a finished batch and its output and error files (the input file stays): `{"id", "object":
    "batch", "deleted": true}`. A live batch answers 409 (`batch_in_progress`): cancel it first."""
    return jobs.delete_batch(state.jobs, batch_id, who)
