"""How `latentlm serve` runs the app under uvicorn so that a flood is answered, not queued.

- Every pending connection is accepted at once. uvloop (libuv >= 1.45) accepts one connection per event-loop
  iteration; under load an iteration takes ~0.1 s, so a burst of 256 new connections waited up to ~10 s in the
  kernel's accept queue, unseen by any limit (wrk's p99 of 5.6-6.6 s at c=256). `Server` adds a reader on a
  duplicate of each listening socket that accepts every waiting connection in one go, as asyncio's own loop does.
- Connections are bounded by uvicorn's `limit_concurrency` (`Settings.connection_limit`) and the listening
  backlog by `Settings.listen_backlog`, both sized from the queue settings; uvicorn's own refusal (a plain-text
  503 without Retry-After) is replaced by the service's 503 `overloaded` JSON with `Retry-After`
  (`protocol_class`). Requests beyond the in-flight limit are refused by `middleware.Guard`, also with 503 +
  Retry-After, before their body is read.
- `latentlm_open_connections` reads the open connections when scraped; uvicorn's warning per refused request
  is logged at most once every 10 s (with the count), and every log record is redacted of credentials
  (`redact`); access lines are written in blocks, at most half a second late (`BlockWriter`).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import socket
import threading
import time
from typing import Any

import uvicorn
import uvicorn.logging
from uvicorn.protocols.http.flow_control import service_unavailable

from latentlm.service import errors, redact
from latentlm.service.metrics import Metrics
from latentlm.service.middleware import overloaded_error
from latentlm.service.settings import Settings
from latentlm.service.transport import CoalescingHttpToolsProtocol

ACCEPT_BATCH = 1024  # connections accepted per readiness event at most (asyncio accepts up to its backlog)
log = logging.getLogger("latentlm.service")


def protocol_class(settings: Settings, metrics: Metrics | None) -> type[CoalescingHttpToolsProtocol]:
    """The HTTP protocol of `serve`: `CoalescingHttpToolsProtocol` whose refusal beyond uvicorn's
    `limit_concurrency` is the service's 503 `overloaded` (JSON error shape, Retry-After, Connection: close)."""
    e = overloaded_error(settings.connection_limit, settings.retry_after_s)
    e.message = (f"server overloaded: {settings.connection_limit} connections or requests open (max_connections, "
                 "LATENTLM_MAX_CONNECTIONS); retry after the Retry-After delay")
    body = errors.error_body(e)
    start = {"type": "http.response.start", "status": 503, "headers": [
        (b"content-type", b"application/json"), (b"content-length", b"%d" % len(body)),
        (b"retry-after", str(settings.retry_after_s).encode()), (b"connection", b"close")]}
    end = {"type": "http.response.body", "body": body}

    async def refuse(scope, receive, send) -> None:
        if metrics is not None:
            metrics.error(503, "connection_limit")
        await send(start)
        await send(end)

    class Protocol(CoalescingHttpToolsProtocol):
        def _start_asgi_task(self, cycle, app) -> None:  # uvicorn passes `service_unavailable` when over the limit
            super()._start_asgi_task(cycle, refuse if app is service_unavailable else app)

    return Protocol


class Server(uvicorn.Server):
    """uvicorn's server that accepts every pending connection at once (see the module docstring) and reports its
    open connections to `latentlm_open_connections`."""

    def __init__(self, config: uvicorn.Config, metrics: Metrics | None = None):
        super().__init__(config)
        self.metrics = metrics
        self.acceptors: list[socket.socket] = []

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.should_exit or not getattr(self, "servers", None):
            return
        if self.metrics is not None:
            self.metrics.connections.set_function(lambda: len(self.server_state.connections))
        loop = asyncio.get_running_loop()
        config = self.config
        factory = functools.partial(config.http_protocol_class, config=config, server_state=self.server_state,
                                    app_state=self.lifespan.state)
        if config.ssl is not None:  # TLS connections are accepted by the loop's server (it wraps them)
            return
        for server in self.servers:
            for listener in server.sockets:
                if listener.type != socket.SOCK_STREAM:
                    continue
                dup = socket.socket(listener.family, listener.type, fileno=os.dup(listener.fileno()))
                dup.setblocking(False)
                self.acceptors.append(dup)
                loop.add_reader(dup.fileno(), accept_all, loop, dup, factory)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self.stop_accepting()
        await super().shutdown(sockets)
        # the access lines still waiting (`BlockWriter`) are written now: uvicorn then raises the SIGTERM it caught
        # again, which ends the process without Python's exit handlers
        for h in logging.getLogger("uvicorn.access").handlers:
            h.flush()

    def stop_accepting(self) -> None:
        loop = asyncio.get_running_loop()
        for dup in self.acceptors:
            loop.remove_reader(dup.fileno())
            dup.close()
        self.acceptors = []


def accept_all(loop: asyncio.AbstractEventLoop, listener: socket.socket, factory) -> None:
    """Accept every connection waiting on `listener` (up to ACCEPT_BATCH) and hand each to the HTTP protocol."""
    for _ in range(ACCEPT_BATCH):
        try:
            conn, _ = listener.accept()
        except (BlockingIOError, InterruptedError, ConnectionAbortedError):
            return
        except OSError as e:  # EMFILE and the like: the loop's own server takes over once descriptors free up
            log.warning("accepting connections failed: %s", e)
            return
        conn.setblocking(False)
        if conn.family in (socket.AF_INET, socket.AF_INET6):
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        loop.create_task(_connect(loop, conn, factory))


async def _connect(loop: asyncio.AbstractEventLoop, conn: socket.socket, factory) -> None:
    try:
        await loop.connect_accepted_socket(factory, conn)
    except OSError:  # the client went away meanwhile
        conn.close()


class EveryTenSeconds(logging.Filter):
    """Lets uvicorn's "Exceeded concurrency limit." through at most once every 10 s, with the count since."""

    def __init__(self) -> None:
        super().__init__()
        self.next, self.count = 0.0, 0

    def filter(self, record: logging.LogRecord) -> bool:
        if record.getMessage() != "Exceeded concurrency limit.":
            return True
        self.count += 1
        now = time.monotonic()
        if now < self.next:
            return False
        record.msg, record.args = f"Exceeded concurrency limit: {self.count} request(s) answered 503 overloaded", ()
        self.next, self.count = now + 10, 0
        return True


class RefusalLines(logging.Filter):
    """uvicorn's access log under a flood: lines of requests answered 429 or 503 pass at most `per_second` a second;
    the others are counted, and their number is logged (`latentlm.service`, a warning) with the first refusal 10 s
    or more after the first one left out. Formatting and writing an access line costs the event loop about as much
    as the refusal itself: at c=256 it halved the answers per second the server could give."""

    def __init__(self, per_second: int = 20) -> None:
        super().__init__()
        self.per_second = per_second
        self.window, self.passed = 0.0, 0  # the current second, lines passed in it
        self.skipped, self.since = 0, 0.0  # lines left out since `since`

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if not (isinstance(args, tuple) and len(args) == 5 and args[4] in (429, 503)):
            return True
        now = time.monotonic()
        if self.skipped and now - self.since >= 10:
            log.warning("%d request(s) answered 429/503 in the last %.0f s are not in the access log "
                        "(latentlm_errors_total counts every one)", self.skipped, now - self.since)
            self.skipped = 0
        if now >= self.window:
            self.window, self.passed = now + 1.0, 0
        if self.passed < self.per_second:
            self.passed += 1
            return True
        if not self.skipped:
            self.since = now
        self.skipped += 1
        return False


class BlockWriter(logging.Handler):
    """An access-log handler that writes its lines in blocks, as nginx's `access_log ... buffer= flush=` does: a line
    is written at most `max_delay_s` after it was logged (a daemon thread writes what waits), or at once when
    `max_bytes` wait, and everything is written at exit (logging's own shutdown closes the handler). Writing and
    flushing one line per request cost the event loop ~21 of the ~50 us an access line took (formatting included),
    with PYTHONUNBUFFERED or a terminal a write(2) each. A process killed with SIGKILL loses at most `max_delay_s`
    of lines."""

    def __init__(self, stream: Any, formatter: logging.Formatter | None, level: int = logging.NOTSET,
                 max_delay_s: float = 0.5, max_bytes: int = 1 << 16) -> None:
        super().__init__(level)
        self.stream, self.max_delay_s, self.max_bytes = stream, max_delay_s, max_bytes
        self.setFormatter(formatter)
        self.lines: list[str] = []
        self.size = 0
        self._stop = threading.Event()
        threading.Thread(target=self._writer, name="access-log", daemon=True).start()

    def emit(self, record: logging.LogRecord) -> None:
        try:
            line = self.format(record)
        except Exception:
            self.handleError(record)
            return
        self.lines.append(line)  # under the handler's lock (`Handler.handle`)
        self.size += len(line) + 1
        if self.size >= self.max_bytes:
            self.flush()

    def flush(self) -> None:
        with self.lock:  # type: ignore[union-attr]  # an RLock: emit holds it already
            if not self.lines:
                return
            text, self.lines, self.size = "\n".join(self.lines) + "\n", [], 0
            try:
                self.stream.write(text)
                self.stream.flush()
            except (OSError, ValueError):  # the stream went away (closed terminal or pipe): drop the lines
                pass

    def _writer(self) -> None:
        while not self._stop.wait(self.max_delay_s):
            self.flush()

    def close(self) -> None:
        self._stop.set()
        self.flush()
        super().close()


UVICORN_ACCESS_FORMAT = '%(levelprefix)s %(client_addr)s - "%(request_line)s" %(status_code)s'


class PlainAccessFormatter(uvicorn.logging.AccessFormatter):
    """uvicorn's access line without colours, the same text, formatted from the record in one step: uvicorn's
    formatter copies each record twice (its own `formatMessage` and its parent's), looks the status phrase up in
    `HTTPStatus` and formats through `%` a second time (~3% of the event loop at c=64, bench/results/hot_path.md).
    Used only where uvicorn's formatter would print uvicorn's default format without colours (a file or a pipe);
    anything else keeps uvicorn's formatter."""

    def __init__(self) -> None:
        super().__init__(UVICORN_ACCESS_FORMAT, use_colors=False)
        self.phrases: dict[int, str] = {}

    @classmethod
    def replaces(cls, formatter: logging.Formatter | None) -> bool:
        return (type(formatter) is uvicorn.logging.AccessFormatter and not formatter.use_colors
                and formatter._fmt == UVICORN_ACCESS_FORMAT)

    def formatMessage(self, record: logging.LogRecord) -> str:
        args = record.args
        if not (isinstance(args, tuple) and len(args) == 5) or "color_message" in record.__dict__:
            return super().formatMessage(record)
        client_addr, method, full_path, http_version, status_code = args
        status = int(status_code)  # type: ignore[call-overload]
        status_line = self.phrases.get(status)
        if status_line is None:
            status_line = self.phrases.setdefault(status, self.get_status_code(status))
        level = record.levelname
        return (f'{level}:{" " * (8 - len(level))} {client_addr} - "{method} {full_path} HTTP/{http_version}" '
                f"{status_line}")


def buffer_access_log(max_delay_s: float = 0.5) -> None:
    """Replace the stream handlers of uvicorn's access logger (as its logging configuration set them up) by
    `BlockWriter`s on the same streams, levels and filters, and formatters (`PlainAccessFormatter` where it
    prints the same lines)."""
    access = logging.getLogger("uvicorn.access")
    for h in list(access.handlers):
        if type(h) is logging.StreamHandler:
            plain = PlainAccessFormatter.replaces(h.formatter)
            block = BlockWriter(h.stream, PlainAccessFormatter() if plain else h.formatter, h.level, max_delay_s)
            for f in h.filters:
                block.addFilter(f)
            access.removeHandler(h)
            access.addHandler(block)


def reuse_port_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to (host, port) with SO_REUSEPORT, as each of several workers binds its own: the kernel
    spreads new connections over the workers' listening sockets (by a hash of the connection), so no worker
    accepts what another should take. OSError (naming the address) when the port is taken by another program."""
    family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind(addr)
    except OSError as e:
        sock.close()
        raise OSError(e.errno, f"cannot listen on {host}:{port}: {e.strerror}") from None
    sock.set_inheritable(True)
    return sock


def run(app, settings: Settings, host: str, port: int, log_level: str, access_log: bool,
        reuse_port: bool = False) -> None:
    """Serve `app` (from `create_app(settings)`) until SIGTERM/SIGINT, with the bounds above. `reuse_port`: listen
    on a socket of its own in the port's SO_REUSEPORT group (one worker of several, `supervisor`)."""
    redact.install(settings.keys)
    metrics = getattr(app.state, "metrics", None)
    # after the drain (settings.shutdown_grace_s, answered 503 beyond it), responses still being sent get 10 s more
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, http=protocol_class(settings, metrics),
                            access_log=access_log, server_header=False,
                            timeout_graceful_shutdown=int(settings.shutdown_grace_s) + 10,
                            limit_concurrency=settings.connection_limit, backlog=settings.listen_backlog)
    logging.getLogger("uvicorn.error").addFilter(EveryTenSeconds())
    logging.getLogger("uvicorn.access").addFilter(RefusalLines())
    if access_log:
        buffer_access_log()
    # what no log line of the service's formats shows, not gathered for every record (Python's logging HOWTO,
    # "Optimization"): the caller's file and line (a stack walk each), thread and multiprocessing names
    logging._srcfile = None  # type: ignore[attr-defined]
    logging.logThreads = logging.logMultiprocessing = False
    Server(config, metrics).run(sockets=[reuse_port_socket(host, port)] if reuse_port else None)
