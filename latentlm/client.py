"""A small Python client for a latentlm server: `Client` (sync) and `AsyncClient` (async), over httpx.

Every operation is a typed call: `score`, `posterior`, `decode`, `sample`, `embed`, `constraint`, `completions` (OpenAI
shape), `models`, and the batch API (`upload_file`, `create_batch`, `get_batch`, `cancel_batch`, `batch_results`, ...);
`operation(name, body)` posts to any other operation route. Streams are iterators: `posterior_stream` (NDJSON
lines), `sample_stream` and `completions_stream` (server-sent events up to `data: [DONE]`).

Retries: a 429 or 503 answer (queue full, rate limit, not ready, shutting down) is retried after the server's
`Retry-After` (seconds or an HTTP date), or after an exponential backoff without one, at most `max_retries`
times; a `Retry-After` longer than `max_retry_wait_s` is not waited for (the error is raised). Connection errors
are retried the same way. A stream is retried only before its first byte. Every other error raises `APIError`
with the server's `status`, `message`, `type`, `param` (the field at fault) and `code`.

Its length (over 600 lines) is earned: every operation and batch call is written twice, once per client class
(`Client`, `AsyncClient`), with the shared request building and retry policy kept once.

This module imports only httpx and the standard library: responses are plain dicts and lists (typed below as
`TypedDict`s), so it can be vendored into any program that talks to the service.
"""

from __future__ import annotations

import asyncio
import email.utils
import json
import random
import time
from collections.abc import AsyncIterator, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Literal, NotRequired, TypedDict

import httpx

__all__ = ["APIError", "AsyncClient", "Client", "Input", "ListResponse", "Completion", "BatchObject",
           "FileObject", "Usage", "RETRY_STATUSES"]

RETRY_STATUSES = frozenset({429, 503})
TERMINAL_BATCH = frozenset({"completed", "failed", "cancelled", "expired"})
Input = str | list[str] | list[list[int]]  # a text, texts, or token-id lists (taken as is)


class Usage(TypedDict, total=False):
    input_tokens: int
    output_tokens: int
    total_tokens: int
    prompt_tokens: int
    completion_tokens: int


class ListResponse(TypedDict):
    """Every operation's answer: one item of `data` per input (or sample), in order (`index`)."""

    object: str
    model: str
    data: list[dict[str, Any]]
    usage: Usage


class CompletionChoice(TypedDict):
    text: str
    index: int
    logprobs: dict[str, list] | None
    finish_reason: Literal["stop", "length"] | None


class Completion(TypedDict):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: NotRequired[Usage | None]
    system_fingerprint: NotRequired[str]


class FileObject(TypedDict, total=False):
    id: str
    object: str
    bytes: int
    created_at: int
    filename: str
    purpose: str


class BatchObject(TypedDict, total=False):
    id: str
    object: str
    endpoint: str
    status: str
    input_file_id: str
    output_file_id: str | None
    error_file_id: str | None
    request_counts: dict[str, int]
    errors: Any


class APIError(Exception):
    """An error answer: `status` (HTTP), `message`, `type`, `param` (the field at fault), `code`; `retry_after`
    (seconds) when the server sent Retry-After. status 0: the server could not be reached; 200: an error line in a
    stream that had begun (its HTTP status was already sent)."""

    def __init__(self, status: int, message: str, *, type: str | None = None, param: str | None = None,
                 code: str | None = None, retry_after: float | None = None):
        super().__init__(f"{status} {code or type or 'error'}: {message}" + (f" (param {param})" if param else ""))
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.retry_after = retry_after

    @classmethod
    def from_response(cls, status: int, headers: Mapping[str, str], body: bytes) -> APIError:
        """The `{"error": {message, type, param, code}}` body (or whatever text came back)."""
        try:
            err = json.loads(body)["error"]
            if not isinstance(err, dict):
                raise TypeError
        except (ValueError, KeyError, TypeError):
            return cls(status, body.decode("utf-8", "replace")[:500] or f"HTTP {status}",
                       retry_after=retry_after_s(headers))
        return cls(status, str(err.get("message", "")), type=err.get("type"), param=err.get("param"),
                   code=err.get("code"), retry_after=retry_after_s(headers))


def retry_after_s(headers: Mapping[str, str]) -> float | None:
    """Retry-After as seconds from now (delta-seconds or an HTTP date); None when absent or unreadable."""
    raw = headers.get("retry-after")
    if raw is None:
        return None
    raw = raw.strip()
    try:
        return max(0.0, float(raw))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(raw)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


@dataclass
class RetryPolicy:
    """At most `max_retries` retries of a 429/503 or a connection error; the wait is Retry-After when sent,
    else `backoff_s` x 2^attempt (+-25% jitter), never above `max_wait_s` (a longer Retry-After raises)."""

    max_retries: int = 3
    max_wait_s: float = 60.0
    backoff_s: float = 0.5

    def wait(self, attempt: int, err: APIError) -> float | None:
        """Seconds to wait before retry number attempt + 1, or None to give up and raise `err`."""
        if attempt >= self.max_retries or (err.status not in RETRY_STATUSES and err.status != 0):
            return None
        if err.retry_after is not None:
            return err.retry_after if err.retry_after <= self.max_wait_s else None
        return min(self.max_wait_s, self.backoff_s * 2 ** attempt * random.uniform(0.75, 1.25))


@dataclass
class Call:
    """One request: method, path, and its JSON body, query or multipart files."""

    method: str
    path: str
    json: Any = None
    params: dict[str, Any] | None = None
    files: dict[str, Any] | None = None
    data: dict[str, Any] | None = None
    headers: dict[str, str] = field(default_factory=dict)

    def kwargs(self) -> dict[str, Any]:
        out: dict[str, Any] = {"headers": self.headers}
        for k in ("json", "params", "files", "data"):
            v = getattr(self, k)
            if v is not None:
                out[k] = v
        return out


def _body(model: str, **fields: Any) -> dict[str, Any]:
    """A request body: the model and every field given (None = left to the server's default)."""
    return {"model": model, **{k: v for k, v in fields.items() if v is not None}}


# -- the requests, shared by both clients ----------------------------------------------------------------------
class Calls:
    """What each typed call sends (both clients build their requests here)."""

    @staticmethod
    def score(model: str, input: Input, token_logprobs: bool) -> Call:
        return Call("POST", "/v1/score", _body(model, input=input, token_logprobs=token_logprobs or None))

    @staticmethod
    def posterior(model: str, input: Input, top_k: int | Literal["all"] | None, stream: bool) -> Call:
        return Call("POST", "/v1/posterior", _body(model, input=input, top_k=top_k, stream=stream or None))

    @staticmethod
    def decode(model: str, input: Input, method: str | None) -> Call:
        return Call("POST", "/v1/decode", _body(model, input=input, method=method))

    @staticmethod
    def embed(model: str, input: Input, causal: bool) -> Call:
        return Call("POST", "/v1/embed", _body(model, input=input, causal=causal or None))

    @staticmethod
    def sample(model: str, stream: bool, fields: dict[str, Any]) -> Call:
        return Call("POST", "/v1/sample", _body(model, **fields, stream=stream or None))

    @staticmethod
    def constraint(model: str, constraint: dict[str, Any], fields: dict[str, Any]) -> Call:
        return Call("POST", "/v1/constraint", _body(model, constraint=constraint, **fields))

    @staticmethod
    def completions(model: str, prompt: Any, stream: bool, fields: dict[str, Any]) -> Call:
        return Call("POST", "/v1/completions", _body(model, prompt=prompt, **fields, stream=stream or None))

    @staticmethod
    def upload(content: bytes | str | Path | BinaryIO, filename: str | None) -> Call:
        """A path is read whole here; the clients' `upload_file` streams it (an open file is sent in pieces, from
        its start again on a retry)."""
        if isinstance(content, Path):
            filename, content = filename or content.name, content.read_bytes()
        data = content.encode() if isinstance(content, str) else content
        return Call("POST", "/v1/files", files={"file": (filename or "batch.jsonl", data, "application/jsonl")},
                    data={"purpose": "batch"})

    @staticmethod
    def create_batch(input_file_id: str, endpoint: str, completion_window: str,
                     metadata: dict[str, str] | None) -> Call:
        return Call("POST", "/v1/batches", {"input_file_id": input_file_id, "endpoint": endpoint,
                                            "completion_window": completion_window,
                                            **({"metadata": metadata} if metadata else {})})


def _fields(given: dict[str, Any], *skip: str) -> dict[str, Any]:
    """A typed call's keyword arguments (its `locals()`) as request fields: all but `self` and `skip`; None values
    are left to the server's default by `_body`."""
    return {k: v for k, v in given.items() if k != "self" and k not in skip}


def batch_lines(requests: list[tuple[str, dict[str, Any]]], url: str) -> str:
    """A batch input file (JSONL) from (custom_id, body) pairs, all for the operation route `url`."""
    return "".join(json.dumps({"custom_id": cid, "method": "POST", "url": url, "body": body}) + "\n"
                   for cid, body in requests)


DONE = object()  # the end of a server-sent-event stream (`data: [DONE]`)


def _sse_data(line: str) -> Any:
    """A server-sent-event line -> its JSON payload; None for blank lines, comments and other fields; DONE at
    `data: [DONE]`."""
    if not line.startswith("data:"):
        return None
    data = line[5:].strip()
    return DONE if data == "[DONE]" else json.loads(data)


class _Base:
    def __init__(self, base_url: str, api_key: str | None, timeout: float, max_retries: int, max_retry_wait_s: float,
                 backoff_s: float):
        self.base_url = base_url.rstrip("/")
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.timeout = timeout
        self.retry = RetryPolicy(max_retries, max_retry_wait_s, backoff_s)


class Client(_Base):
    """Synchronous client. `Client("http://127.0.0.1:8000", api_key=...)`; use as a context manager or `close()`.
    `transport`: an httpx transport (tests, proxies)."""

    def __init__(self, base_url: str = "http://127.0.0.1:8000", *, api_key: str | None = None, timeout: float = 60.0,
                 max_retries: int = 3, max_retry_wait_s: float = 60.0, backoff_s: float = 0.5,
                 transport: httpx.BaseTransport | None = None):
        super().__init__(base_url, api_key, timeout, max_retries, max_retry_wait_s, backoff_s)
        self.http = httpx.Client(base_url=self.base_url, headers=self.headers, timeout=timeout, transport=transport)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        self.http.close()

    # -- transport with retries ---------------------------------------------------------------------------------
    def _send(self, call: Call, stream: bool = False) -> httpx.Response:
        attempt = 0
        while True:
            try:
                req = self.http.build_request(call.method, call.path, **call.kwargs())
                resp = self.http.send(req, stream=stream)
            except httpx.TransportError as e:
                err = APIError(0, f"cannot reach {self.base_url}: {type(e).__name__}: {e}", code="connection_error")
            else:
                if resp.status_code < 400:
                    return resp
                body = resp.read()
                resp.close()
                err = APIError.from_response(resp.status_code, resp.headers, body)
            wait = self.retry.wait(attempt, err)
            if wait is None:
                raise err
            time.sleep(wait)
            attempt += 1

    def _json(self, call: Call) -> Any:
        return self._send(call).json()

    def _lines(self, call: Call) -> Iterator[str]:
        resp = self._send(call, stream=True)
        try:
            yield from resp.iter_lines()
        finally:
            resp.close()

    def _ndjson(self, call: Call) -> Iterator[dict[str, Any]]:
        for line in self._lines(call):
            if line.strip():
                item = json.loads(line)
                if "error" in item:  # an error after the stream began
                    raise APIError.from_response(200, {}, line.encode())
                yield item

    def _events(self, call: Call) -> Iterator[dict[str, Any]]:
        for line in self._lines(call):
            item = _sse_data(line)
            if item is DONE:
                return
            if item is not None:
                yield item

    # -- models -------------------------------------------------------------------------------------------------
    def models(self) -> list[dict[str, Any]]:
        """GET /v1/models: every loaded model (id, family, operations, ...)."""
        return self._json(Call("GET", "/v1/models"))["data"]

    def model(self, model_id: str) -> dict[str, Any]:
        return self._json(Call("GET", f"/v1/models/{model_id}"))

    def reload_models(self) -> dict[str, Any]:
        return self._json(Call("POST", "/v1/models/reload"))

    def ready(self) -> bool:
        """GET /ready once: True when every model is loaded (no retries)."""
        try:
            return self.http.get("/ready").status_code == 200
        except httpx.TransportError:
            return False

    # -- operations ---------------------------------------------------------------------------------------------
    def score(self, model: str, input: Input, *, token_logprobs: bool = False) -> ListResponse:
        """log p(x), perplexity per input [, tokens and per-token log p(x_t | x_<t)]."""
        return self._json(Calls.score(model, input, token_logprobs))

    def posterior(self, model: str, input: Input, *, top_k: int | Literal["all"] | None = None) -> ListResponse:
        """Per-token state marginals, most probable first."""
        return self._json(Calls.posterior(model, input, top_k, False))

    def posterior_stream(self, model: str, input: Input, *, top_k: int | Literal["all"] | None = None
                         ) -> Iterator[dict[str, Any]]:
        """The posterior as NDJSON: `posterior.chunk` items, then one `posterior.usage` item."""
        return self._ndjson(Calls.posterior(model, input, top_k, True))

    def decode(self, model: str, input: Input, *, method: str | None = None) -> ListResponse:
        """Viterbi path or MBR states (the family's default method without `method`)."""
        return self._json(Calls.decode(model, input, method))

    def embed(self, model: str, input: Input, *, causal: bool = False) -> ListResponse:
        return self._json(Calls.embed(model, input, causal))

    def sample(self, model: str, *, n: int | None = None, max_tokens: int | None = None,
               seed: int | None = None, prefix: str | list[int] | None = None, temperature: float | None = None,
               stop_at_eos: bool | None = None, top_k: int | None = None, top_p: float | None = None,
               stop: str | list[str | list[int]] | None = None,
               constraint: dict[str, Any] | None = None) -> ListResponse:
        """n samples (continuations of `prefix`; with `constraint`, drawn exactly from the model conditioned on it);
        None leaves a field to the server's default."""
        return self._json(Calls.sample(model, False, _fields(locals(), "model")))

    def sample_stream(self, model: str, *, n: int | None = None, max_tokens: int | None = None,
                      seed: int | None = None, prefix: str | list[int] | None = None, temperature: float | None = None,
                      stop_at_eos: bool | None = None, top_k: int | None = None, top_p: float | None = None,
                      stop: str | list[str | list[int]] | None = None,
                      constraint: dict[str, Any] | None = None) -> Iterator[dict[str, Any]]:
        """The samples as server-sent events: `sample.chunk` items, then a `sample.usage` item."""
        return self._events(Calls.sample(model, True, _fields(locals(), "model")))

    def constraint(self, model: str, constraint: dict[str, Any], *, prefix: str | list[int] | None = None,
                   temperature: float | None = None, weights: bool | None = None, beam: int | None = None,
                   n_best: int | None = None, generated: list[int] | None = None) -> dict[str, Any]:
        """POST /v1/constraint: log P(C | prefix[, generated]) (`log_prob`), the automaton's sizes, and on request the
        next-token `weights` and the beam's `completions`."""
        return self._json(Calls.constraint(model, constraint, _fields(locals(), "model", "constraint")))

    def completions(self, model: str, prompt: str | list[str] | list[int] | list[list[int]], **fields: Any
                    ) -> Completion:
        """POST /v1/completions (OpenAI's fields: max_tokens, temperature, top_p, n, stop, seed, logprobs, echo,
        ...)."""
        return self._json(Calls.completions(model, prompt, False, fields))

    def completions_stream(self, model: str, prompt: str | list[str] | list[int] | list[list[int]],
                           **fields: Any) -> Iterator[Completion]:
        """The completion as `text_completion` chunks (server-sent events up to `data: [DONE]`)."""
        return self._events(Calls.completions(model, prompt, True, fields))

    def operation(self, name: str, body: dict[str, Any]) -> Any:
        """POST /v1/<name> with `body` (an operation this client has no typed call for)."""
        return self._json(Call("POST", f"/v1/{name}", body))

    # -- batches --------------------------------------------------------------------------------------------------
    def upload_file(self, content: bytes | str | Path | BinaryIO, *, filename: str | None = None) -> FileObject:
        """POST /v1/files: a JSONL file of `{"custom_id", "method", "url", "body"}` lines (`batch_lines`). A path or
        an open binary file is streamed (read in 64 KiB pieces as it is sent, never whole)."""
        if isinstance(content, Path):
            with content.open("rb") as f:
                return self._json(Calls.upload(f, filename or content.name))
        return self._json(Calls.upload(content, filename))

    def get_file(self, file_id: str) -> FileObject:
        return self._json(Call("GET", f"/v1/files/{file_id}"))

    def file_content(self, file_id: str) -> bytes:
        return self._send(Call("GET", f"/v1/files/{file_id}/content")).content

    def delete_file(self, file_id: str) -> dict[str, Any]:
        return self._json(Call("DELETE", f"/v1/files/{file_id}"))

    def create_batch(self, input_file_id: str, endpoint: str, *, completion_window: str = "24h",
                     metadata: dict[str, str] | None = None) -> BatchObject:
        return self._json(Calls.create_batch(input_file_id, endpoint, completion_window, metadata))

    def get_batch(self, batch_id: str) -> BatchObject:
        return self._json(Call("GET", f"/v1/batches/{batch_id}"))

    def list_batches(self, limit: int = 20) -> dict[str, Any]:
        return self._json(Call("GET", "/v1/batches", params={"limit": limit}))

    def cancel_batch(self, batch_id: str) -> BatchObject:
        return self._json(Call("POST", f"/v1/batches/{batch_id}/cancel"))

    def delete_batch(self, batch_id: str) -> dict[str, Any]:
        return self._json(Call("DELETE", f"/v1/batches/{batch_id}"))

    def wait_batch(self, batch_id: str, *, timeout_s: float = 600.0, poll_s: float = 0.5) -> BatchObject:
        """Poll until the batch is completed, failed, cancelled or expired; APIError(408) after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while True:
            b = self.get_batch(batch_id)
            if b["status"] in TERMINAL_BATCH:
                return b
            if time.monotonic() > deadline:
                raise APIError(408, f"batch {batch_id} still {b['status']} after {timeout_s} s", code="timeout")
            time.sleep(poll_s)

    def batch_results(self, batch_id: str) -> Iterator[dict[str, Any]]:
        """The output lines of a finished batch (`{"id", "custom_id", "response": {"status_code", "body"}}`), then
        its error lines, in the server's order."""
        b = self.get_batch(batch_id)
        for fid in (b.get("output_file_id"), b.get("error_file_id")):
            if fid:
                for line in self._lines(Call("GET", f"/v1/files/{fid}/content")):
                    if line.strip():
                        yield json.loads(line)


class AsyncClient(_Base):
    """The asynchronous client: the same calls as `Client`, awaited (`async with AsyncClient(url) as c: await
    c.score(...)`); streams are async iterators."""

    def __init__(self, base_url: str = "http://127.0.0.1:8000", *, api_key: str | None = None, timeout: float = 60.0,
                 max_retries: int = 3, max_retry_wait_s: float = 60.0, backoff_s: float = 0.5,
                 transport: httpx.AsyncBaseTransport | None = None):
        super().__init__(base_url, api_key, timeout, max_retries, max_retry_wait_s, backoff_s)
        self.http = httpx.AsyncClient(base_url=self.base_url, headers=self.headers, timeout=timeout,
                                      transport=transport)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    async def close(self) -> None:
        await self.http.aclose()

    async def _send(self, call: Call, stream: bool = False) -> httpx.Response:
        attempt = 0
        while True:
            try:
                req = self.http.build_request(call.method, call.path, **call.kwargs())
                resp = await self.http.send(req, stream=stream)
            except httpx.TransportError as e:
                err = APIError(0, f"cannot reach {self.base_url}: {type(e).__name__}: {e}", code="connection_error")
            else:
                if resp.status_code < 400:
                    return resp
                body = await resp.aread()
                await resp.aclose()
                err = APIError.from_response(resp.status_code, resp.headers, body)
            wait = self.retry.wait(attempt, err)
            if wait is None:
                raise err
            await asyncio.sleep(wait)
            attempt += 1

    async def _json(self, call: Call) -> Any:
        return (await self._send(call)).json()

    async def _lines(self, call: Call) -> AsyncIterator[str]:
        resp = await self._send(call, stream=True)
        try:
            async for line in resp.aiter_lines():
                yield line
        finally:
            await resp.aclose()

    async def _ndjson(self, call: Call) -> AsyncIterator[dict[str, Any]]:
        async for line in self._lines(call):
            if line.strip():
                item = json.loads(line)
                if "error" in item:
                    raise APIError.from_response(200, {}, line.encode())
                yield item

    async def _events(self, call: Call) -> AsyncIterator[dict[str, Any]]:
        async for line in self._lines(call):
            item = _sse_data(line)
            if item is DONE:
                return
            if item is not None:
                yield item

    async def models(self) -> list[dict[str, Any]]:
        return (await self._json(Call("GET", "/v1/models")))["data"]

    async def model(self, model_id: str) -> dict[str, Any]:
        return await self._json(Call("GET", f"/v1/models/{model_id}"))

    async def reload_models(self) -> dict[str, Any]:
        return await self._json(Call("POST", "/v1/models/reload"))

    async def ready(self) -> bool:
        try:
            return (await self.http.get("/ready")).status_code == 200
        except httpx.TransportError:
            return False

    async def score(self, model: str, input: Input, *, token_logprobs: bool = False) -> ListResponse:
        return await self._json(Calls.score(model, input, token_logprobs))

    async def posterior(self, model: str, input: Input, *, top_k: int | Literal["all"] | None = None
                        ) -> ListResponse:
        return await self._json(Calls.posterior(model, input, top_k, False))

    def posterior_stream(self, model: str, input: Input, *, top_k: int | Literal["all"] | None = None
                         ) -> AsyncIterator[dict[str, Any]]:
        return self._ndjson(Calls.posterior(model, input, top_k, True))

    async def decode(self, model: str, input: Input, *, method: str | None = None) -> ListResponse:
        return await self._json(Calls.decode(model, input, method))

    async def embed(self, model: str, input: Input, *, causal: bool = False) -> ListResponse:
        return await self._json(Calls.embed(model, input, causal))

    async def sample(self, model: str, *, n: int | None = None, max_tokens: int | None = None,
                     seed: int | None = None, prefix: str | list[int] | None = None, temperature: float | None = None,
                     stop_at_eos: bool | None = None, top_k: int | None = None, top_p: float | None = None,
                     stop: str | list[str | list[int]] | None = None,
                     constraint: dict[str, Any] | None = None) -> ListResponse:
        return await self._json(Calls.sample(model, False, _fields(locals(), "model")))

    def sample_stream(self, model: str, *, n: int | None = None, max_tokens: int | None = None,
                      seed: int | None = None, prefix: str | list[int] | None = None, temperature: float | None = None,
                      stop_at_eos: bool | None = None, top_k: int | None = None, top_p: float | None = None,
                      stop: str | list[str | list[int]] | None = None,
                      constraint: dict[str, Any] | None = None) -> AsyncIterator[dict[str, Any]]:
        return self._events(Calls.sample(model, True, _fields(locals(), "model")))

    async def constraint(self, model: str, constraint: dict[str, Any], *, prefix: str | list[int] | None = None,
                         temperature: float | None = None, weights: bool | None = None, beam: int | None = None,
                         n_best: int | None = None, generated: list[int] | None = None
                         ) -> dict[str, Any]:
        return await self._json(Calls.constraint(model, constraint, _fields(locals(), "model", "constraint")))

    async def completions(self, model: str, prompt: str | list[str] | list[int] | list[list[int]],
                          **fields: Any) -> Completion:
        return await self._json(Calls.completions(model, prompt, False, fields))

    def completions_stream(self, model: str, prompt: str | list[str] | list[int] | list[list[int]],
                           **fields: Any) -> AsyncIterator[Completion]:
        return self._events(Calls.completions(model, prompt, True, fields))  # type: ignore[return-value]

    async def operation(self, name: str, body: dict[str, Any]) -> Any:
        return await self._json(Call("POST", f"/v1/{name}", body))

    async def upload_file(self, content: bytes | str | Path | BinaryIO, *,
                          filename: str | None = None) -> FileObject:
        """As `Client.upload_file` (a path or an open file streamed)."""
        if isinstance(content, Path):
            with content.open("rb") as f:
                return await self._json(Calls.upload(f, filename or content.name))
        return await self._json(Calls.upload(content, filename))

    async def get_file(self, file_id: str) -> FileObject:
        return await self._json(Call("GET", f"/v1/files/{file_id}"))

    async def file_content(self, file_id: str) -> bytes:
        return (await self._send(Call("GET", f"/v1/files/{file_id}/content"))).content

    async def delete_file(self, file_id: str) -> dict[str, Any]:
        return await self._json(Call("DELETE", f"/v1/files/{file_id}"))

    async def create_batch(self, input_file_id: str, endpoint: str, *, completion_window: str = "24h",
                           metadata: dict[str, str] | None = None) -> BatchObject:
        return await self._json(Calls.create_batch(input_file_id, endpoint, completion_window, metadata))

    async def get_batch(self, batch_id: str) -> BatchObject:
        return await self._json(Call("GET", f"/v1/batches/{batch_id}"))

    async def list_batches(self, limit: int = 20) -> dict[str, Any]:
        return await self._json(Call("GET", "/v1/batches", params={"limit": limit}))

    async def cancel_batch(self, batch_id: str) -> BatchObject:
        return await self._json(Call("POST", f"/v1/batches/{batch_id}/cancel"))

    async def delete_batch(self, batch_id: str) -> dict[str, Any]:
        return await self._json(Call("DELETE", f"/v1/batches/{batch_id}"))

    async def wait_batch(self, batch_id: str, *, timeout_s: float = 600.0, poll_s: float = 0.5) -> BatchObject:
        deadline = time.monotonic() + timeout_s
        while True:
            b = await self.get_batch(batch_id)
            if b["status"] in TERMINAL_BATCH:
                return b
            if time.monotonic() > deadline:
                raise APIError(408, f"batch {batch_id} still {b['status']} after {timeout_s} s", code="timeout")
            await asyncio.sleep(poll_s)

    async def batch_results(self, batch_id: str) -> AsyncIterator[dict[str, Any]]:
        b = await self.get_batch(batch_id)
        for fid in (b.get("output_file_id"), b.get("error_file_id")):
            if fid:
                async for line in self._lines(Call("GET", f"/v1/files/{fid}/content")):
                    if line.strip():
                        yield json.loads(line)
