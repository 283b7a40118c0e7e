"""Running one batch, crash-safe, on one worker or on several at once (any hosts, one Redis): the first run records
the batch's chunk plan (`jsonl.plan_chunks`: chunks of `job_chunk_size` request lines, as byte ranges of the input
file), then every worker on the batch claims chunks one at a time (a claim expires `job_lease_s` after its last
refresh, so a dead worker's chunk is claimed again), reads only that chunk's lines, and commits its output lines
once (keyed by the chunk index). The worker holding the batch's lease leads it: it waits for the chunks others
compute, then streams the output and error files from the chunks and sets the terminal status in one conditional
step. A heartbeat thread refreshes the lease and the claim. A Redis outage is waited out and the batch resumes
from its committed chunks; any other error fails the batch visibly.

With rq (`runners.rq_process_batch`), the lead enqueues helper jobs for the same batch (`fan_out`), one per other
live worker (`job_workers_per_batch`): idle workers, on this host or another, pick them up and claim chunks.

Lines of the same model version and options share one batched run (`execute_lines`, `spec.run_calls`) where
the operation merges; the others (sampling) run line by line. With an engine process (`service.engine`) the lines
run there, on its device, merged by its batcher.

Each line runs only on the model version the batch was created with (`model_hashes`, recorded from the API's store
by `api.create_batch`): a worker whose store lacks the model or holds another version answers the line 503
`model_mismatch` naming the model, itself and both hashes (`checked_model`), and logs it once per model and batch."""

from __future__ import annotations

import functools
import logging
import secrets
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import orjson

from latentlm.models.errors import LatentLMError, ModelNotFound
from latentlm.ops import LoadedModel, dumps
from latentlm.ops.spec import Call
from latentlm.ops.spec import run_calls as run_calls_here
from latentlm.service.errors import APIError, error_payload, from_model_error
from latentlm.service.execute import body, limits, parse, prepare
from latentlm.service.jobs.api import ENDPOINTS
from latentlm.service.jobs.jsonl import LineTooLarge, max_line_bytes, plan_chunks, read_requests
from latentlm.service.jobs.redis_store import REDIS_DOWN, wait_for_redis
from latentlm.service.jobs.store import (
    TERMINAL,
    BatchFailure,
    JobStore,
    StagedFile,
    StorageError,
    output_file_ids,
    worker_identity,
)
from latentlm.service.registry import ModelRegistry
from latentlm.service.settings import Settings

log = logging.getLogger("latentlm.jobs")


RunCalls = Callable[[list[Call]], list[Any]]  # prepared calls -> each one's results (or its exception)
FanOut = Callable[[int], None]  # called by a batch's lead with how many more workers could share it


def execute_lines(models: ModelRegistry, op: str, bodies: list[dict], settings: Settings,
                  run_calls: RunCalls | None = None, *, expected: Mapping[str, str] | None = None,
                  worker: str = "") -> list[tuple[int, dict]]:
    """(status, body) per request; requests of the same model version and options share one batched call.
    `run_calls`: where the prepared calls run (an engine process, `engine.EngineClient.run_calls`); default here
    (`spec.run_calls`). `expected`: {model name: content hash} the batch recorded (`api.create_batch`): a line
    naming one of them whose model here has another hash, or is missing, is not run and answers 503
    `model_mismatch` (`ModelMismatch`, naming the model, `worker` and both hashes)."""
    out: list[tuple[int, dict] | None] = [None] * len(bodies)
    calls: list[tuple[int, Call]] = []
    for i, b in enumerate(bodies):
        try:
            req = parse(op, b)
            model = checked_model(models, req.model, expected, worker)
            calls.append((i, prepare(model, op, req, settings.max_request_tokens, settings.max_posterior_entries,
                                     max_cost=settings.max_request_cost, max_sample_tokens=settings.max_sample_tokens,
                                     limits=limits(settings))))
        except Exception as e:
            out[i] = line_failure(i, e)
    here = functools.partial(run_calls_here, max_batch_tokens=settings.max_batch_tokens)
    results = (run_calls or here)([c for _, c in calls])
    for (i, c), res in zip(calls, results, strict=True):
        out[i] = line_failure(i, res) if isinstance(res, Exception) else (200, body(c, res))
    return [o for o in out if o is not None]


class ModelMismatch(APIError):
    """A batch line names a model that this worker's store lacks or holds in another version than the one the
    batch was created with: 503 `model_mismatch`, param `model`; the line's error body adds `model`, `worker`,
    `expected_content_hash` (the batch's) and `content_hash` (this worker's; null: no such model here)."""

    def __init__(self, model: str, worker: str, expected: str, found: str | None):
        here = f"holds content_hash {found}" if found else "has no such model"
        super().__init__(503, f"model {model!r}: worker {worker} {here}, not the version this batch was created with "
                              f"(content_hash {expected}); the line was not run. Every worker's model store must "
                              "hold the same artifacts as the API's (GET /v1/models shows each one's content_hash)",
                         param="model", code="model_mismatch")
        self.details = {"model": model, "worker": worker, "expected_content_hash": expected, "content_hash": found}


def checked_model(models: ModelRegistry, name: str, expected: Mapping[str, str] | None, worker: str) -> LoadedModel:
    """`models.get(name)`, refused (`ModelMismatch`) when the batch recorded another identity for `name` than the
    model here has, or this worker lacks a model the batch recorded."""
    want = expected.get(name) if expected else None
    if want is None:
        return models.get(name)
    worker = worker or worker_identity()
    try:
        model = models.get(name)
    except ModelNotFound:
        raise ModelMismatch(name, worker, want, None) from None
    if model.content_hash != want:
        raise ModelMismatch(name, worker, want, model.content_hash)
    return model


def line_failure(line: int, e: Exception) -> tuple[int, dict]:
    """(status, error body) for one batch line: the API's error for a request error, and a 500 for anything
    else, so one line's failure never fails the whole batch."""
    if isinstance(e, ModelMismatch):
        payload = error_payload(e)
        payload["error"].update(e.details)
        return e.status, payload
    if isinstance(e, APIError):
        return e.status, error_payload(e)
    if isinstance(e, LatentLMError):
        ae = from_model_error(e)
        return ae.status, error_payload(ae)
    log.error("batch line %d failed", line, exc_info=e)
    ae = APIError(500, f"internal error: {type(e).__name__}", code="internal_error")
    return ae.status, error_payload(ae)


def output_line(bid: str, custom_id: str, status: int, resp: dict) -> str:
    err = None if status == 200 else {"code": resp["error"].get("code"), "message": resp["error"]["message"]}
    rid = f"batch_req_{bid.removeprefix('batch_')}_{custom_id}"
    return dumps({"id": rid, "custom_id": custom_id, "response": {"status_code": status, "body": resp},
                  "error": err}).decode()


class _Hold:
    """A worker's hold on one batch: the batch lease while it leads the batch (the lead alone finalises it), and
    the claim on the chunk it computes; a daemon thread refreshes both every ttl/3 seconds (it dies with the
    process: a dead worker's lease and claim lapse after `ttl_s`). `computed`: chunks committed here, of
    `n_chunks`."""

    def __init__(self, store: JobStore, bid: str, token: str, ttl_s: float):
        self.store, self.bid, self.token, self.ttl_s = store, bid, token, ttl_s
        self.lead = store.acquire_lease(bid, token, ttl_s)
        self.chunk: int | None = None
        self.computed = self.n_chunks = 0
        self.stop = threading.Event()
        self.t = threading.Thread(target=self._run, daemon=True)
        self.t.start()

    def _run(self) -> None:
        while not self.stop.wait(self.ttl_s / 3):
            try:
                if self.lead:
                    self.store.refresh_lease(self.bid, self.token, self.ttl_s)
                chunk = self.chunk
                if chunk is not None:
                    self.store.refresh_claim(self.bid, chunk, self.token, self.ttl_s)
            except Exception as e:  # Redis blip: the next beat retries
                log.warning("lease refresh failed for %s: %s", self.bid, e)

    def take_lead(self) -> bool:
        """Whether this worker leads the batch now: its lease refreshed, or taken if it lapsed and nobody took it."""
        was = self.lead
        self.lead = _hold(self.store, self.bid, self.token, self.ttl_s)
        if was and not self.lead:
            log.warning("batch %s: another worker leads it now; %s goes on as a helper", self.bid, self.token)
        return self.lead

    def claim(self, index: int) -> int:
        """1: chunk `index` is this worker's to compute; 0: another worker's; -1: committed."""
        r = self.store.claim_chunk(self.bid, index, self.token, self.ttl_s)
        if r == 1:
            self.chunk = index
        return r

    def release(self, index: int) -> None:
        self.chunk = None
        self.store.release_claim(self.bid, index, self.token)

    def close(self) -> None:
        self.stop.set()
        try:
            if self.chunk is not None:
                self.release(self.chunk)
            if self.lead:
                self.store.release_lease(self.bid, self.token)
        except REDIS_DOWN:
            pass  # they expire by themselves


def process_batch(store: JobStore, models: ModelRegistry, bid: str, settings: Settings,
                  progress: Callable[[int, int], None] | None = None,
                  stop: threading.Event | None = None, run_calls: RunCalls | None = None,
                  fan_out: FanOut | None = None) -> str | None:
    """Run (or resume, or help) a batch to a terminal status; returns the status, or None when this worker left
    the batch to another (its lead) or it is gone. A Redis outage is waited out (reconnecting with backoff up to
    `redis_retry_max_s`), then the batch resumes from its committed chunks; `stop` set gives up the wait (the
    reaper re-enqueues the batch). `run_calls`: where the lines' calls run (`execute_lines`). `fan_out`: how the
    lead asks other workers to help (rq: helper jobs); None: this worker alone."""
    token = f"{worker_identity(getattr(settings, 'worker_name', ''))}/{secrets.token_hex(6)}"
    while True:
        try:
            return _run_leased(store, models, bid, settings, progress, token, run_calls, fan_out)
        except REDIS_DOWN as e:
            log.warning("batch %s: Redis unavailable (%s: %s); resuming when it answers", bid, type(e).__name__, e)
            if not wait_for_redis(store.redis, settings.redis_retry_max_s, stop):  # type: ignore[attr-defined]
                return None


def _run_leased(store: JobStore, models: ModelRegistry, bid: str, settings: Settings,
                progress: Callable[[int, int], None] | None, token: str, run_calls: RunCalls | None,
                fan_out: FanOut | None) -> str | None:
    b = store.get_batch(bid)
    if b is None or b["status"] in TERMINAL:
        return b["status"] if b else None
    hold = _Hold(store, bid, token, settings.job_lease_s)
    try:
        return _process(store, models, b, settings, progress, hold, run_calls, fan_out)
    except REDIS_DOWN:
        raise
    except Exception as e:  # a bug, a full disk, an unreadable file: the batch fails, the worker lives on
        return _fail(store, bid, token if hold.lead else None, e)
    finally:
        hold.close()
        log.info("batch %s: %d of %d chunks computed by %s (%s)", bid, hold.computed, hold.n_chunks, token,
                 "lead" if hold.lead else "helper")


def _fail(store: JobStore, bid: str, token: str | None, e: Exception) -> str | None:
    """Mark the batch failed with an error naming the cause; its chunks are deleted (space back), the counts
    reached are kept in `request_counts`. `token`: the lead's (None: a helper's failure, refused only once the
    batch is finished)."""
    code = e.code if isinstance(e, (BatchFailure, APIError)) and e.code else "internal_error"
    msg = e.message if isinstance(e, APIError) else f"{type(e).__name__}: {e}" if code == "internal_error" else str(e)
    if isinstance(e, (BatchFailure, StorageError)):
        log.error("batch %s failed: %s", bid, msg)
    else:
        log.exception("batch %s failed", bid)
    cur = store.get_batch(bid)
    if cur is None or cur["status"] in TERMINAL:
        return cur["status"] if cur else None
    try:
        completed, failed = store.counts(bid)
    except (OSError, ValueError):
        completed = failed = 0
    try:
        store.delete_chunks(bid)
        for fid in output_file_ids(bid):  # half-written output of a failed finalisation
            store.delete_file(fid)
    except (OSError, StorageError) as de:
        log.warning("batch %s: chunks not deleted: %s", bid, de)
    fields = {"status": "failed", "failed_at": int(time.time()),
              "final_counts": {"completed": completed, "failed": failed},
              "errors": {"object": "list", "data": [{"code": code, "message": msg, "line": None, "param": None}]}}
    if store.fail(bid, fields, token):
        return "failed"
    cur = store.get_batch(bid)
    return cur["status"] if cur else None


def _hold(store: JobStore, bid: str, token: str, ttl_s: float) -> bool:
    """Whether this worker still holds the batch's lease (taken again if it lapsed and nobody took it)."""
    return store.refresh_lease(bid, token, ttl_s) or store.acquire_lease(bid, token, ttl_s)


def _plan(store: JobStore, b: dict, settings: Settings) -> dict:
    """The batch's chunk plan: the one recorded, else made from the input file (streamed) and recorded (the first
    record wins, so every worker uses the same chunks whatever its `job_chunk_size`)."""
    plan = store.get_plan(b["id"])
    if plan is None:
        content = store.iter_file(b["input_file_id"])
        if content is None:
            raise BatchFailure("input_file_missing", f"input file {b['input_file_id']} is gone")
        try:
            made = plan_chunks(content, settings.job_chunk_size, max_line_bytes(settings))
        except LineTooLarge as e:
            raise BatchFailure("invalid_file", str(e)) from None
        plan = store.put_plan(b["id"], made, b.get("expires_at"))
    if plan["lines"] != b["total"]:
        raise BatchFailure("invalid_file", f"the input file has {plan['lines']} request lines, the batch "
                                           f"{b['total']}")
    return plan


def _chunk_requests(store: JobStore, b: dict, plan: dict, i: int, settings: Settings) -> list[dict]:
    """The requests of chunk `i`: only its byte range of the input file is read."""
    content = store.iter_file(b["input_file_id"], plan["bounds"][i], plan["bounds"][i + 1])
    if content is None:
        raise BatchFailure("input_file_missing", f"input file {b['input_file_id']} is gone")
    reqs, errors = read_requests(content, b["endpoint"], plan["first_line"][i], max_line_bytes(settings))
    if errors:
        raise BatchFailure("invalid_file", errors[0]["message"])
    size = plan["chunk_size"]
    want = min(size, plan["lines"] - i * size)
    if len(reqs) != want:
        raise BatchFailure("invalid_file", f"chunk {i} of the input file has {len(reqs)} request lines, its plan "
                                           f"{want}")
    return reqs


def _process(store: JobStore, models: ModelRegistry, b: dict, settings: Settings,
             progress: Callable[[int, int], None] | None, hold: _Hold, run_calls: RunCalls | None,
             fan_out: FanOut | None) -> str | None:
    """Claim and compute chunks until none is left to claim; then the lead waits for the chunks other workers
    hold (claiming again any whose claim lapsed) and finalises, a helper leaves."""
    bid = b["id"]
    plan = _plan(store, b, settings)
    n_chunks = hold.n_chunks = len(plan["bounds"]) - 1
    limit = min(settings.job_max_output_bytes, store.max_output_bytes)
    op = ENDPOINTS[b["endpoint"]]
    models.reload(rehash=False)  # pick up the store's current models (files re-hashed where their stat changed)
    expected = b.get("model_hashes") or {}  # each line runs only on the model version the batch was created with
    worker = worker_identity(getattr(settings, "worker_name", ""))
    _log_mismatches(models, bid, expected, worker)
    if hold.lead and fan_out is not None and n_chunks > 1:
        try:
            fan_out(n_chunks - 1)
        except Exception as e:  # the batch still runs, on this worker
            log.warning("batch %s: no helpers asked for (%s: %s)", bid, type(e).__name__, e)
    poll_s = min(0.1, settings.job_lease_s / 10)  # the lead, waiting for the last chunks: a few commands each
    while True:
        cur = store.get_batch(bid)
        if cur is None or cur["status"] in TERMINAL:  # a worker frozen past its lease, resumed
            log.warning("batch %s: %s; stopping", bid,
                        "deleted meanwhile" if cur is None else f"{cur['status']}: finished by another worker")
            return cur["status"] if cur else None
        cancelled = bool(cur.get("cancel_requested"))
        done = store.chunk_indices(bid)
        held = 0  # chunks other workers compute now
        for i in range(n_chunks):
            if cancelled or i in done:
                continue
            r = hold.claim(i)
            if r != 1:
                held += r == 0
                continue
            try:
                cur = store.get_batch(bid)
                if cur is None or cur["status"] in TERMINAL:
                    log.warning("batch %s: %s; stopping", bid, "deleted meanwhile" if cur is None
                                else f"{cur['status']}: finished by another worker")
                    return cur["status"] if cur else None
                if cur.get("cancel_requested"):
                    cancelled = True
                    break
                hold.take_lead()
                part = _chunk_requests(store, b, plan, i, settings)
                results = execute_lines(models, op, [r["body"] for r in part], settings, run_calls,
                                        expected=expected, worker=worker)
                lines = [output_line(bid, r["custom_id"], st, resp) for r, (st, resp) in zip(part, results,
                                                                                              strict=True)]
                ok = sum(1 for st, _ in results if st == 200)
                c = store.commit_chunk(bid, i, lines, ok, len(lines) - ok, b.get("expires_at"))
            finally:
                hold.release(i)
            if c < 0:
                log.warning("batch %s: %s; stopping", bid, "deleted meanwhile" if c == -1 else
                            "finished by another worker")
                cur = store.get_batch(bid)
                return cur["status"] if cur else None
            hold.computed += c == 1
            out_bytes = store.output_bytes(bid)
            if out_bytes > limit:
                n_ok, n_bad = store.counts(bid)
                raise BatchFailure("output_too_large", f"the output reached {out_bytes} bytes after {n_ok + n_bad} "
                                                       f"of {plan['lines']} lines, above the limit of {limit} bytes "
                                                       "(LATENTLM_JOB_MAX_OUTPUT_BYTES); its chunks were deleted")
            if progress is not None:
                progress(i + 1, n_chunks)
            if settings.job_chunk_pause_s > 0:
                time.sleep(settings.job_chunk_pause_s)
        if not cancelled and held == 0 and len(store.chunk_indices(bid)) < n_chunks:
            continue  # a claim lapsed or was given up meanwhile: claim again
        if not hold.take_lead():
            return None  # the lead waits for the chunks still held and finalises
        if cancelled or held == 0:
            return _finalize(store, b, plan, limit, hold.token)
        time.sleep(poll_s)  # the lead: other workers hold the last chunks


def _log_mismatches(models: ModelRegistry, bid: str, expected: Mapping[str, str], worker: str) -> None:
    """One warning per model of the batch that this worker lacks or holds in another version (its lines will
    answer `model_mismatch`), for the operator of this host."""
    for name, want in sorted(expected.items()):
        m = models.models.get(name)
        if m is None or m.content_hash != want:
            log.warning("batch %s: model %s here (%s) is not the batch's (content_hash %s): worker %s answers its "
                        "lines model_mismatch", bid, name, f"content_hash {m.content_hash}" if m else "missing",
                        want, worker)


def _finalize(store: JobStore, b: dict, plan: dict, limit: int, token: str) -> str | None:
    """Stream the output and error files from the committed chunks, one chunk in memory at a time (staged: out of
    sight until placed), then place them and set the terminal status in one conditional step; a completed batch
    has exactly one output line per request (checked), or it fails."""
    bid = b["id"]
    cur = store.get_batch(bid)
    if cur is None or cur["status"] in TERMINAL:
        return cur["status"] if cur else None
    cancelled = bool(cur.get("cancel_requested"))
    if not cancelled and not store.transition(bid, {"status": "finalizing", "finalizing_at": int(time.time())},
                                              token):
        cur = store.get_batch(bid)
        return cur["status"] if cur else None
    n_chunks = len(plan["bounds"]) - 1
    indices = sorted(store.chunk_indices(bid))
    missing = sorted(set(range(n_chunks)) - set(indices))
    if missing and not cancelled:
        raise BatchFailure("lines_missing", f"chunks {missing[:10]} of {n_chunks} have no committed output")
    staged: dict[str, StagedFile] = {}
    try:
        for kind in ("output", "error"):
            staged[kind] = store.stage_file(f"file-{bid}-{kind}")
        n = {"output": 0, "error": 0}
        for i in indices:
            lines = store.chunk(bid, i)
            if lines is None:
                raise BatchFailure("lines_missing", f"chunk {i} vanished while the output was written")
            parts: dict[str, list[str]] = {"output": [], "error": []}
            for ln in lines:
                parts["output" if orjson.loads(ln)["response"]["status_code"] == 200 else "error"].append(ln)
            for kind, part in parts.items():
                if not part:
                    continue
                staged[kind].write(("\n".join(part) + "\n").encode())
                n[kind] += len(part)
                if staged[kind].size > limit:
                    raise BatchFailure("output_too_large", f"the {kind} file has {staged[kind].size} bytes or more, "
                                                           f"above the limit of {limit} bytes "
                                                           "(LATENTLM_JOB_MAX_OUTPUT_BYTES)")
        if not cancelled and n["output"] + n["error"] != plan["lines"]:
            raise BatchFailure("lines_missing", f"{n['output'] + n['error']} output lines for {plan['lines']} "
                                                "requests")
        now = int(time.time())
        fields: dict[str, Any] = {}
        files: list[tuple[dict, StagedFile]] = []
        for kind in ("output", "error"):
            if not n[kind] and kind == "error":
                continue
            meta = {"id": f"file-{bid}-{kind}", "bytes": staged[kind].size, "created_at": now,
                    "expires_at": b.get("expires_at"), "filename": f"{bid}_{kind}.jsonl", "purpose": "batch_output",
                    "owner": b.get("owner")}
            files.append((meta, staged[kind]))
            fields[f"{kind}_file_id"] = meta["id"]
        status = "cancelled" if cancelled else "completed"
        fields.update(status=status, final_counts={"completed": n["output"], "failed": n["error"]},
                      **{f"{status}_at": now})
        if not store.transition(bid, fields, token, files):
            log.warning("batch %s was finished by another worker; its output left as it is", bid)
            cur = store.get_batch(bid)
            return cur["status"] if cur else None
    finally:
        for f in staged.values():
            f.discard()  # what was not placed
    try:
        store.delete_chunks(bid)  # the output files hold them now
    except (OSError, *REDIS_DOWN) as e:
        log.warning("batch %s: chunks not deleted after completion: %s", bid, e)
    return status
