"""Batch input files as lines: reading a file in chunks, splitting a byte stream into lines under a per-line
limit (`job_max_line_bytes`), checking an upload's lines as it streams in, and validating JSONL request lines
(`custom_id`, `method`, `url`, `body`) into requests and errors naming the line and the field.

A batch runs from a chunk plan (`plan_chunks`: the byte offset and line number where each chunk of `job_chunk_size`
request lines starts), so a worker reads only the lines of the chunk it computes (`read_requests`), and validation
(`validate_input_file`) keeps a count, the errors and one short key per `custom_id`, never the requests.

Memory: at most the per-line limit plus one chunk (`READ_CHUNK`) of a file is held at a time (validation adds the
`custom_id` keys: at most `MAX_LINES` of them, 16 bytes or the id itself when shorter; and the model names the
lines give: at most `MAX_MODELS` of at most 128 characters)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Iterator
from typing import Any

import orjson

from latentlm.models.store import NAME_RE
from latentlm.service.errors import APIError
from latentlm.service.settings import Settings

MAX_LINES = 100_000
MAX_MODELS = 1024  # distinct model names a batch records the identity of (`validate_input_file`)
READ_CHUNK = 1 << 20          # files are read, written and scanned in pieces of this size, never whole
DEFAULT_MAX_LINE_BYTES = 2_000_000  # `Settings.job_max_line_bytes` (LATENTLM_JOB_MAX_LINE_BYTES)


class LineTooLarge(Exception):
    """A line of a batch input file is longer than the per-line limit (`job_max_line_bytes`)."""

    def __init__(self, line: int, size: int, limit: int):
        super().__init__(f"line {line} has {size} bytes or more, above the limit of {limit} bytes per line "
                         "(LATENTLM_JOB_MAX_LINE_BYTES)")
        self.line, self.size, self.limit = line, size, limit


def max_line_bytes(settings: Settings | None) -> int:
    """The per-line limit of batch input files (`job_max_line_bytes`; 0 or unset: the default)."""
    v = getattr(settings, "job_max_line_bytes", 0) if settings is not None else 0
    return int(v) if v and int(v) > 0 else DEFAULT_MAX_LINE_BYTES


def read_chunks(f: Any, size: int | None = None) -> Iterator[bytes]:
    """The bytes of the open binary file `f` in pieces of `size` (default `READ_CHUNK`; closed at the end)."""
    size = size or READ_CHUNK
    try:
        while chunk := f.read(size):
            yield chunk
    finally:
        f.close()


def iter_lines(chunks: Iterable[bytes], limit: int) -> Iterator[tuple[int, bytes]]:
    """(1-based line number, line without its end of line) of a byte stream split on `\n` (a trailing `\r` is
    dropped); raises `LineTooLarge` as soon as a line exceeds `limit` bytes, before the rest of it is read. At most
    `limit` + one chunk is held at a time."""
    for n, line, _ in iter_lines_at(chunks, limit):
        yield n, line


def iter_lines_at(chunks: Iterable[bytes], limit: int, first_line: int = 1) -> Iterator[tuple[int, bytes, int]]:
    """As `iter_lines`, with the byte offset just past each line's `\n` (from the stream's start): (line number,
    line, end offset). `first_line`: the number of the stream's first line. O(bytes) time."""
    buf = bytearray()
    n, base = first_line, 0
    for chunk in chunks:
        start = 0
        while True:
            i = chunk.find(b"\n", start)
            if i < 0:
                buf += memoryview(chunk)[start:]
                if len(buf) > limit + 1:  # + 1: a `\r` before the `\n` still to come
                    raise LineTooLarge(n, len(buf), limit)
                break
            if buf:
                buf += memoryview(chunk)[start:i]
                line = bytes(buf)
                buf.clear()
            else:
                line = chunk[start:i]
            if line.endswith(b"\r"):
                line = line[:-1]
            if len(line) > limit:
                raise LineTooLarge(n, len(line), limit)
            yield n, line, base + i + 1
            n += 1
            start = i + 1
        base += len(chunk)
    if buf:
        line = bytes(buf[:-1] if buf.endswith(b"\r") else buf)
        if len(line) > limit:
            raise LineTooLarge(n, len(line), limit)
        yield n, line, base


def checked_upload(f: Any, limit: int, counter: list[int]) -> Iterator[bytes]:
    """The chunks of the uploaded file `f`, passed on as they are read while every line's length is checked
    (413 `line_too_large` naming the line and the limit as soon as one is over it); `counter[0]` counts bytes."""

    def too_large(line: int, length: int) -> APIError:
        return APIError(413, f"file: line {line} has {length} bytes or more, above the limit of {limit} bytes per "
                             "line (LATENTLM_JOB_MAX_LINE_BYTES)", param="file", code="line_too_large")

    line, length, last_cr = 1, 0, False
    for chunk in read_chunks(f):
        counter[0] += len(chunk)
        start = 0
        while True:
            i = chunk.find(b"\n", start)
            end = len(chunk) if i < 0 else i
            if end > start:
                length += end - start
                last_cr = chunk[end - 1] == 13  # a `\r` before the `\n` is not part of the line
            if i < 0:
                if length > limit + 1:
                    raise too_large(line, length)
                break
            if length - last_cr > limit:
                raise too_large(line, length - last_cr)
            line, length, last_cr, start = line + 1, 0, False, i + 1
        yield chunk
    if length - last_cr > limit:
        raise too_large(line, length - last_cr)


def parse_input_file(content: bytes | Iterable[bytes] | None, endpoint: str,
                     max_line: int = DEFAULT_MAX_LINE_BYTES) -> tuple[list[dict], list[dict]]:
    """JSONL lines -> (requests, errors). Errors name the 1-based line (blank lines counted, skipped) and the
    field. `content` is the file's bytes or its chunks (streamed: a line over `max_line` bytes is an error,
    `line_too_large`, found before more than the limit is held). Holds every request: a batch is validated by
    `validate_input_file` and run chunk by chunk (`plan_chunks`, `read_requests`) instead."""
    reqs: list[dict] = []
    _, errors = _scan(content, endpoint, max_line, reqs)
    return ([] if any(e["code"] in _WHOLE_FILE for e in errors) else reqs), errors


def validate_input_file(content: bytes | Iterable[bytes] | None, endpoint: str,
                        max_line: int = DEFAULT_MAX_LINE_BYTES,
                        models: set[str] | None = None) -> tuple[int, list[dict]]:
    """(number of request lines, errors) as `parse_input_file`, streamed: no request is kept (memory: one chunk,
    one line and a short key per `custom_id`, at most `MAX_LINES`). `models`: filled with the model names the
    bodies give (`body.model` when it is a valid model name; at most `MAX_MODELS` names). O(bytes) time."""
    return _scan(content, endpoint, max_line, None, models)


_WHOLE_FILE = ("too_many_lines", "invalid_file", "line_too_large")  # errors that void the file, not one line


def _scan(content: bytes | Iterable[bytes] | None, endpoint: str, max_line: int,
          reqs: list[dict] | None, models: set[str] | None = None) -> tuple[int, list[dict]]:
    """Check every line of a JSONL file; valid and invalid requests appended to `reqs` (None: only counted).
    Returns (request lines, errors: at most 100)."""
    errors: list[dict] = []
    seen: set[str | bytes] = set()
    chunks = [content] if isinstance(content, bytes | bytearray) else (content or [])
    n_lines = held = 0
    lines: list[tuple[int, bytes]] = []  # parsed together: at most 1024 lines or about one `READ_CHUNK` of bytes
    try:
        for n, ln in iter_lines(chunks, max_line):
            if not ln.strip():
                continue
            n_lines += 1
            if n_lines > MAX_LINES:
                errors.append({"code": "too_many_lines", "message": f"more than {MAX_LINES} lines",
                               "line": n, "param": None})
                return n_lines, errors
            try:
                ln.decode("utf-8")
            except UnicodeDecodeError:
                return n_lines, [{"code": "invalid_file", "message": f"input file is not UTF-8 text (line {n})",
                                  "line": n, "param": None}]
            lines.append((n, ln))
            held += len(ln)
            if len(lines) >= 1024 or held >= READ_CHUNK:
                _parse_lines(lines, endpoint, reqs, errors, seen, models)
                lines.clear()
                held = 0
    except LineTooLarge as e:
        return n_lines, [{"code": "line_too_large", "message": str(e), "line": e.line, "param": None}]
    _parse_lines(lines, endpoint, reqs, errors, seen, models)
    if not n_lines:
        errors.append({"code": "empty_file", "message": "input file has no request lines", "line": None,
                       "param": None})
    return n_lines, errors[:100]


def plan_chunks(content: Iterable[bytes], size: int, max_line: int = DEFAULT_MAX_LINE_BYTES) -> dict:
    """The chunk plan of a batch input file: chunk i holds request lines (blank lines skipped) i*size ..
    (i+1)*size - 1 and is read from bytes `bounds[i]` to `bounds[i + 1]`, its first line numbered `first_line[i]`.
    Returns {"chunk_size", "lines" (request lines), "bounds" (n_chunks + 1 offsets), "first_line"}; streamed,
    O(bytes) time, O(n_chunks) memory. Raises `LineTooLarge`."""
    size = max(1, size)
    bounds, first = [0], [1]
    k = end = prev_end = prev_n = 0
    for n, ln, end in iter_lines_at(content, max_line):
        if not ln.strip():
            continue
        if k and k % size == 0:  # this line opens a chunk: the previous one ends where this line starts
            bounds.append(prev_end)
            first.append(prev_n + 1)
        k += 1
        prev_end, prev_n = end, n
    if k:
        bounds.append(end)
    return {"chunk_size": size, "lines": k, "bounds": bounds if k else [0], "first_line": first if k else []}


def read_requests(content: Iterable[bytes], endpoint: str, first_line: int = 1,
                  max_line: int = DEFAULT_MAX_LINE_BYTES) -> tuple[list[dict], list[dict]]:
    """The requests (and errors, naming the file's line numbers from `first_line`) of one chunk's bytes
    (`plan_chunks`); `custom_id`s are checked for duplicates within the chunk only (the whole file was checked
    when the batch was created)."""
    reqs: list[dict] = []
    errors: list[dict] = []
    try:
        lines = [(n, ln) for n, ln, _ in iter_lines_at(content, max_line, first_line) if ln.strip()]
    except LineTooLarge as e:
        return [], [{"code": "line_too_large", "message": str(e), "line": e.line, "param": None}]
    _parse_lines(lines, endpoint, reqs, errors, set())
    return reqs, errors


def _cid_key(cid: str) -> str | bytes:
    """What validation keeps of a `custom_id` to find duplicates: the id when short, else a 16-byte BLAKE2b
    digest (a str never equals bytes, so the two kinds cannot collide)."""
    return cid if len(cid) <= 16 else hashlib.blake2b(cid.encode(), digest_size=16).digest()


def _parse_lines(lines: list[tuple[int, bytes]], endpoint: str, reqs: list[dict] | None, errors: list[dict],
                 seen: set[str | bytes], models: set[str] | None = None) -> None:
    """Check (number, line) pairs as request lines: each appended to `reqs` (None: none kept), problems to
    `errors`, the bodies' model names to `models` (None: not collected)."""

    def bad(n: int, param: str, msg: str) -> None:
        errors.append({"code": "invalid_request", "message": f"line {n}: {msg}", "line": n, "param": param})

    for n, ln in lines:
        try:
            obj = orjson.loads(ln)  # a batch file can hold 100,000 lines: 3-5x faster than json.loads
        except json.JSONDecodeError as e:  # orjson's error is a subclass
            bad(n, "line", f"not valid JSON ({e.msg})")
            continue
        if not isinstance(obj, dict):
            bad(n, "line", "expected a JSON object")
            continue
        cid = obj.get("custom_id")
        if not isinstance(cid, str) or not cid:
            bad(n, "custom_id", "custom_id must be a non-empty string")
        elif (key := _cid_key(cid)) in seen:
            bad(n, "custom_id", f"duplicate custom_id {cid!r}")
        else:
            seen.add(key)
        if obj.get("method", "POST") != "POST":
            bad(n, "method", f"method must be POST, got {obj.get('method')!r}")
        if obj.get("url") != endpoint:
            bad(n, "url", f"url {obj.get('url')!r} does not match the batch endpoint {endpoint!r}")
        if not isinstance(obj.get("body"), dict):
            bad(n, "body", "body must be a JSON object")
        elif models is not None and isinstance(name := obj["body"].get("model"), str) and name not in models \
                and len(models) < MAX_MODELS and NAME_RE.fullmatch(name):
            models.add(name)
        extra = sorted(set(obj) - {"custom_id", "method", "url", "body"})
        if extra:
            bad(n, extra[0], f"unknown field {extra[0]!r}")
        if reqs is not None:
            reqs.append(obj)
