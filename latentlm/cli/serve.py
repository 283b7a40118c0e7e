"""`latentlm serve` and `latentlm worker`; an empty store first gets the default model (built by
`latentlm.training.default`), so that the service package never needs training code."""

from __future__ import annotations

import argparse
import gc
import logging
import sys
from pathlib import Path

from latentlm import ops
from latentlm.models.errors import LatentLMError
from latentlm.models.store import list_models
from latentlm.training.default import build_default_model

GC_GEN0_THRESHOLD = 7000  # `serve`: allocations between young-generation collections (Python's default 700)


class ServeError(LatentLMError):
    pass


def ensure_default_model(store: Path, builder=None) -> list[str]:
    """An empty store first gets the default model (`builder`, by default
    `latentlm.training.default.build_default_model`)."""
    names = list_models(store)
    if names:
        return names
    builder = builder or build_default_model
    print(f"latentlm serve: store {store} is empty; building the default model first", file=sys.stderr)
    store.mkdir(parents=True, exist_ok=True)
    builder(store)
    names = list_models(store)
    if not names:
        raise ServeError(f"building the default model left no model in {store}", param="store")
    return names


def set_threads(n: int) -> None:
    """LATENTLM_TORCH_THREADS=n: small batches on a busy CPU run faster with 1-2 threads than with all cores."""
    if n > 0:
        import torch

        torch.set_num_threads(n)


def settings_from_env(settings_class, **overrides):
    """`Settings.from_env`; a variable that does not parse, or settings that contradict each other, exit with one
    line naming them (not a traceback)."""
    try:
        return settings_class.from_env(**overrides)
    except ValueError as e:
        raise ServeError(str(e), param="environment") from None


def cmd_serve(args: argparse.Namespace) -> None:
    # the service's modules load with the command that needs them (`latentlm score` starts faster)
    from latentlm.service import server, supervisor
    from latentlm.service.settings import Settings

    settings = settings_from_env(Settings, store=args.store, device=args.device, backend=args.backend)
    ops.resolve_device(settings.device)  # fail early on --device cuda without a GPU
    ensure_default_model(settings.store)
    workers = supervisor.is_worker()
    if (settings.worker_count > 1 or settings.engine_mode == "process") and not workers:
        # start the workers (each of which runs the code below) and, where there is one, the engine process
        sys.exit(supervisor.run(settings, args.host, args.port, args.log_level))
    from latentlm.models import calibrate
    from latentlm.service.app import create_app
    from latentlm.service.metrics import multiprocess_dir

    set_threads(settings.torch_threads)
    shared = multiprocess_dir() if workers else None
    if shared:  # the workers measure each matrix size once, together (`models.calibrate.share_with`)
        calibrate.share_with(Path(shared) / "calibration.json")
    if settings.gil_switch_interval_ms > 0:
        sys.setswitchinterval(settings.gil_switch_interval_ms / 1000)
    # each request allocates a few hundred container objects: with Python's gen0 threshold (700) the cyclic GC ran
    # every few requests and took 8% of the event loop's CPU at c=64; 7000 cut its CPU per request x0.86
    # (bench/results/hot_path.md); the models and other long-lived objects are frozen out of it after each load
    gc.set_threshold(GC_GEN0_THRESHOLD, 10, 10)
    app = create_app(settings)
    # httptools with each response's head and body in one write (service.transport), every pending connection
    # accepted at once, connections and requests in flight bounded with 503 + Retry-After (service.server); access
    # lines are INFO records (redacted of credentials), so below that level they are not formatted at all
    try:
        server.run(app, settings, args.host, args.port, args.log_level,
                   access_log=args.log_level in ("info", "debug"), reuse_port=workers)
    except OSError as e:  # a worker's own socket: the port taken by a program without SO_REUSEPORT
        if not workers:
            raise
        raise ServeError(str(e), param="port") from None


def cmd_engine(args: argparse.Namespace) -> None:
    from latentlm.service import engine, redact
    from latentlm.service.settings import Settings

    logging.basicConfig(level=getattr(logging, args.log_level.upper()), format="%(levelname)s:     %(message)s")
    settings = settings_from_env(Settings, store=args.store, device=args.device)
    ops.resolve_device(settings.device)
    redact.install(settings.keys)
    set_threads(settings.torch_threads)
    gc.set_threshold(GC_GEN0_THRESHOLD, 10, 10)
    engine.run(settings, args.socket)


def cmd_worker(args: argparse.Namespace) -> None:
    from latentlm.service import redact
    from latentlm.service.settings import Settings
    from latentlm.service.worker import run_worker

    logging.basicConfig(level=getattr(logging, args.log_level.upper()), format="%(asctime)s %(name)s %(message)s")
    settings = settings_from_env(Settings, store=args.store, device=args.device)
    redact.install(settings.keys)  # no credential (e.g. a Redis URL's password) reaches a log line
    set_threads(settings.torch_threads)
    run_worker(settings, burst=args.burst)


def register(sub) -> None:
    p = sub.add_parser("serve", help="serve every model in the store over HTTP (builds a default model first "
                                     "when the store is empty)")
    p.add_argument("--store", type=Path, default=None, help="model store (default: $LATENTLM_STORE or ./artifacts)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default=None, help="default auto")
    p.add_argument("--backend", choices=ops.BACKENDS, default=None,
                   help="torch (default) or onnx: score through onnxruntime where the family has a graph; "
                        "/v1/models says which backend runs each operation")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("engine", help="the engine process `serve` starts beside its API workers with "
                                      "LATENTLM_ENGINE=process: it loads the models onto the device and runs the "
                                      "batcher; the workers hand it requests over the Unix socket --socket")
    p.add_argument("--socket", type=Path, required=True, help="the Unix socket to listen on (replaced if present)")
    p.add_argument("--store", type=Path, default=None, help="model store (default: $LATENTLM_STORE or ./artifacts)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default=None, help="default auto")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.set_defaults(func=cmd_engine)

    p = sub.add_parser("worker", help="run batch jobs from Redis (REDIS_URL)")
    p.add_argument("--store", type=Path, default=None, help="model store (default: $LATENTLM_STORE or ./artifacts)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default=None, help="default auto")
    p.add_argument("--burst", action="store_true", help="exit when the queue is empty")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.set_defaults(func=cmd_worker)
