"""`latentlm serve` with several API worker processes (`Settings.worker_count` > 1), or with an engine process.

The supervisor starts `worker_count` copies of `latentlm serve`, each a whole service (the one FastAPI app, its
batcher and its inference threads) on a socket of its own in the port's SO_REUSEPORT group, so the kernel spreads
connections over them. What the workers share:
- each model's weights, once in memory: every worker maps the same verified snapshot of the weights
  (`store.map_weights`, under `<state_dir>/weights`), read-only pages of one file;
- the response cache, rate limits, batch jobs and model reloads, through Redis (required: `Settings.from_env`
  refuses several workers without REDIS_URL); a reload in one worker reaches the others (`reload.ReloadWatcher`);
- /metrics: summed over the workers (prometheus_client's multiprocess mode in a directory the supervisor makes
  and removes; `service.metrics`).
Each worker answers /ready for itself (200 once it has loaded the models). Signals: SIGTERM or SIGINT is passed to
every worker, which drains as one process does (`app.install_sigterm`: /ready and new work 503, in-flight requests
finish within `shutdown_grace_s`); a second one is passed on too (the workers then stop at once). A worker that
dies is started again (its metric files marked dead); one that dies within `EARLY_EXIT_S` of its start, twice in
a row, stops the service (exit status 1), e.g. a port taken by another program.

With an engine process (`Settings.engine_mode` "process": CUDA with several workers, or LATENTLM_ENGINE=process), the
supervisor also starts `latentlm engine` (`service.engine`): it alone loads the models onto the device and runs the
batcher, on a Unix socket in a directory only this user can enter; the workers run on the CPU with one thread each,
prepare every request and hand it to the engine. The engine is started again like a worker when it dies; at
shutdown it gets SIGTERM once every worker has drained and exited.
"""

from __future__ import annotations

import ctypes
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from latentlm.service.settings import Settings

log = logging.getLogger("latentlm.service")

EARLY_EXIT_S = 30.0  # a worker that exits this soon after its start, twice in a row, stops the service
POLL_S = 0.2
WORKER_INDEX = "LATENTLM_WORKER_INDEX"  # set in each worker's environment: 0 .. worker_count - 1


def is_worker() -> bool:
    """Whether this process is one of the supervisor's workers."""
    return bool(os.environ.get(WORKER_INDEX))


def worker_threads(settings: Settings) -> int:
    """Intra-op threads of one worker: `torch_threads`, or with 0 the usable cores shared out over the workers
    (so N workers do not run N x cores threads on the cores)."""
    if settings.torch_threads > 0:
        return settings.torch_threads
    return max(1, len(os.sched_getaffinity(0)) // settings.worker_count)


def engine_threads(settings: Settings) -> int:
    """Intra-op threads of the engine process: `torch_threads`, or with 0 the usable cores the workers leave (each
    worker's event loop keeps about one core busy under load, and torch threads sharing a busy core stall small
    products), at least one."""
    if settings.torch_threads > 0:
        return settings.torch_threads
    return max(1, len(os.sched_getaffinity(0)) - settings.worker_count)


class Supervisor:
    """Starts, watches and stops the workers: `run()` returns the service's exit status."""

    def __init__(self, settings: Settings, host: str, port: int, log_level: str):
        self.settings, self.n = settings, settings.worker_count
        self.metrics_dir = Path(tempfile.mkdtemp(prefix="latentlm-metrics-"))
        env = {k: v for k, v in os.environ.items() if not k.startswith("LATENTLM_") and k != "REDIS_URL"}
        env.update(settings.to_env())
        env["LATENTLM_TORCH_THREADS"] = str(worker_threads(settings))
        env["PROMETHEUS_MULTIPROC_DIR"] = str(self.metrics_dir)
        self.env = env
        self.args = [sys.executable, "-m", "latentlm.cli", "serve", "--store", str(settings.store),
                     "--host", host, "--port", str(port), "--log-level", log_level]
        self.engine: int | None = None  # index of the engine process in `procs` (the last), if there is one
        self.socket_dir: Path | None = None
        if settings.engine_mode == "process":
            # the engine owns the device, the models and the batcher; the workers parse, prepare and answer (CPU
            # only, one thread each, the weights mapped for their checks, no calibration: they run no model)
            self.socket_dir = Path(tempfile.mkdtemp(prefix="latentlm-engine-"))  # 0700: only this user connects
            socket = str(self.socket_dir / "engine.sock")
            self.engine = self.n
            self.engine_env = {**env, "LATENTLM_ENGINE": "process", "LATENTLM_TORCH_THREADS": str(
                engine_threads(settings))}
            self.engine_args = [sys.executable, "-m", "latentlm.cli", "engine", "--store", str(settings.store),
                                "--socket", socket, "--log-level", log_level]
            env.update({"LATENTLM_ENGINE": "process", "LATENTLM_ENGINE_SOCKET": socket, "LATENTLM_DEVICE": "cpu",
                        "LATENTLM_CALIBRATE": "0", "LATENTLM_TORCH_THREADS": "1"})
        total = self.n + (self.engine is not None)
        self.procs: list[subprocess.Popen | None] = [None] * total
        self.started = [0.0] * total
        self.early = [0] * total
        self.stopping = 0  # signals received
        self.engine_told = False  # the engine got its SIGTERM

    def spawn(self, i: int) -> None:
        # its own process group: a signal to the supervisor's group (a terminal's Ctrl-C, `kill -- -PGID`) reaches
        # the workers once, forwarded, not twice (a second SIGTERM would cut the drain short); and it gets SIGTERM
        # should the supervisor die without passing one on
        args, env = (self.engine_args, self.engine_env) if i == self.engine else (
            self.args, {**self.env, WORKER_INDEX: str(i + 1)})
        self.procs[i] = subprocess.Popen(args, env=env, process_group=0, preexec_fn=_term_with_parent)
        self.started[i] = time.monotonic()

    def name(self, i: int) -> str:
        return "the engine" if i == self.engine else f"worker {i + 1}"

    def forward(self, sig: int, frame=None) -> None:
        """SIGTERM to every worker (the first drains, a second stops a worker at once); the engine gets it once the
        workers have exited (`watch`), since their draining requests still run on it, or at a second signal."""
        self.stopping += 1
        for i, p in enumerate(self.procs):
            if p is not None and p.poll() is None and (i != self.engine or self.stopping > 1):
                p.send_signal(signal.SIGTERM)

    def run(self) -> int:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self.forward)
        if self.engine is not None:
            log.warning("latentlm serve: %d API workers and one engine process that runs the models on %s; weights "
                        "mapped from %s", self.n, self.settings.device, self.settings.snapshot_dir)
        else:
            log.warning("latentlm serve: %d workers (%d torch threads each), weights shared from %s", self.n,
                        int(self.env["LATENTLM_TORCH_THREADS"]), self.settings.snapshot_dir)
        try:
            for i in range(len(self.procs)):
                self.spawn(i)
            return self.watch()
        finally:
            for p in self.procs:
                if p is not None and p.poll() is None:
                    p.kill()
                    p.wait()
            shutil.rmtree(self.metrics_dir, ignore_errors=True)
            if self.socket_dir is not None:
                shutil.rmtree(self.socket_dir, ignore_errors=True)

    def watch(self) -> int:
        from prometheus_client import multiprocess

        status = 0
        while True:
            time.sleep(POLL_S)
            alive = 0
            engine = self.procs[self.engine] if self.engine is not None else None
            if self.stopping and engine is not None and engine.poll() is None and all(
                    p is None for i, p in enumerate(self.procs) if i != self.engine):
                if not self.engine_told:
                    engine.send_signal(signal.SIGTERM)  # the workers have drained and exited: the engine goes too
                    self.engine_told = True
            for i, p in enumerate(self.procs):
                if p is None:
                    continue
                rc = p.poll()
                if rc is None:
                    alive += 1
                    continue
                multiprocess.mark_process_dead(p.pid, str(self.metrics_dir))
                self.procs[i] = None
                if self.stopping:
                    status = max(status, 0 if rc in (0, -signal.SIGTERM, -signal.SIGINT) else 1)
                    continue
                self.early[i] = self.early[i] + 1 if time.monotonic() - self.started[i] < EARLY_EXIT_S else 0
                if self.early[i] >= 2:
                    log.error("latentlm serve: %s exited with status %s twice within %.0f s of its start; "
                              "stopping", self.name(i), rc, EARLY_EXIT_S)
                    self.forward(signal.SIGTERM)
                    status = 1
                    continue
                log.error("latentlm serve: %s (pid %d) exited with status %s; starting it again", self.name(i),
                          p.pid, rc)
                self.spawn(i)
                alive += 1
            if alive == 0:
                return status


def _term_with_parent() -> None:
    """In a new worker, before it runs: SIGTERM when its parent (the supervisor) dies (Linux prctl
    PR_SET_PDEATHSIG; elsewhere nothing)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG = 1
    except (OSError, AttributeError):
        pass


def run(settings: Settings, host: str, port: int, log_level: str) -> int:
    """Serve with `settings.worker_count` workers until SIGTERM/SIGINT; the exit status."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s:     %(message)s")
    return Supervisor(settings, host, port, log_level).run()
