"""`latentlm serve` with several API worker processes (`Settings.worker_count` > 1).

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
        self.procs: list[subprocess.Popen | None] = [None] * self.n
        self.started = [0.0] * self.n
        self.early = [0] * self.n
        self.stopping = 0  # signals received

    def spawn(self, i: int) -> None:
        # its own process group: a signal to the supervisor's group (a terminal's Ctrl-C, `kill -- -PGID`) reaches
        # the workers once, forwarded, not twice (a second SIGTERM would cut the drain short); and it gets SIGTERM
        # should the supervisor die without passing one on
        self.procs[i] = subprocess.Popen(self.args, env={**self.env, WORKER_INDEX: str(i + 1)}, process_group=0,
                                         preexec_fn=_term_with_parent)
        self.started[i] = time.monotonic()

    def forward(self, sig: int, frame=None) -> None:
        self.stopping += 1
        for p in self.procs:
            if p is not None and p.poll() is None:
                p.send_signal(signal.SIGTERM)  # the first drains, a second stops the worker at once

    def run(self) -> int:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self.forward)
        log.warning("latentlm serve: %d workers (%d torch threads each), weights shared from %s", self.n,
                    int(self.env["LATENTLM_TORCH_THREADS"]), self.settings.snapshot_dir)
        try:
            for i in range(self.n):
                self.spawn(i)
            return self.watch()
        finally:
            for p in self.procs:
                if p is not None and p.poll() is None:
                    p.kill()
                    p.wait()
            shutil.rmtree(self.metrics_dir, ignore_errors=True)

    def watch(self) -> int:
        from prometheus_client import multiprocess

        status = 0
        while True:
            time.sleep(POLL_S)
            alive = 0
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
                    log.error("latentlm serve: worker %d exited with status %s twice within %.0f s of its start; "
                              "stopping", i + 1, rc, EARLY_EXIT_S)
                    self.forward(signal.SIGTERM)
                    status = 1
                    continue
                log.error("latentlm serve: worker %d (pid %d) exited with status %s; starting it again", i + 1,
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
