"""Service settings, read from the environment (prefix LATENTLM_; Redis from REDIS_URL)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from pathlib import Path

from latentlm.models.store import default_store


def _env(name: str, default: str | None = None) -> str | None:
    v = os.environ.get(name)
    return default if v is None or v == "" else v


# Defaults where the service's device is CUDA (`--device cuda`, or auto with a GPU), unless set explicitly: a GPU
# batch costs a graph replay whatever its size, so the dynamic batcher and batch jobs hand it large merged batches
# (a batch job's chunk of 512 lines of 8 x 50 tokens is one 200k-token call; on CPU 32 lines and 16k tokens).
CUDA_DEFAULTS = {"max_batch_tokens": 1 << 18, "job_chunk_size": 512}
ENGINES = ("auto", "inline", "process")
CUDA_MAX_AUTO_WORKERS = 8  # API workers `serve` starts by default on CUDA (with Redis): they only parse and answer
INFLIGHT_MARGIN = 128  # requests in the app beyond what the batcher holds (parsing, answering, /v1/models, files)


@dataclass
class Settings:
    """Every knob of the service; `Settings.from_env()` reads LATENTLM_<UPPER NAME> for each field."""

    store: Path = field(default_factory=default_store)
    device: str = "auto"
    dtype: str = "float32"
    storage_dtype: str = "float32"       # fused CUDA scoring (rank_hmm, blocked_hmm) only: float32 (exact),
                                         # tfloat32 (TF32 tensor-core products) or bfloat16 (bf16 storage;
                                         # on CPU, blocked_hmm's matrix held in bfloat16 only)
    torch_threads: int = 0               # intra-op threads for inference; 0 = torch's default
    max_batch_tokens: int = 16384        # padded tokens of one batched call (`from_env` on CUDA: CUDA_DEFAULTS)
    max_queue_delay_ms: float = 2.0      # how long the first request of a batch waits for company
    max_queue: int = 512                 # queued requests before 429
    max_inflight: int = 0                # /v1 requests inside the app at once before a fast 503 `overloaded` +
                                         # Retry-After (answered before the body is read); 0 = max_queue +
                                         # max_heavy_requests + INFLIGHT_MARGIN (`inflight_limit`)
    max_connections: int = 0             # `serve`: open connections (uvicorn's limit_concurrency) before a 503
                                         # `overloaded` + Retry-After; 0 = max(1024, 4 x inflight_limit)
    backlog: int = 0                     # `serve`: connections the kernel queues before the server accepts them
                                         # (every pending one is accepted at once); 0 = min(2048, max(128,
                                         # 2 x inflight_limit))
    max_request_tokens: int = 200_000    # tokens in one request before 413 (a sample's prefix included)
    max_posterior_entries: int = 2_000_000  # posterior response entries (tokens x states returned) before 413;
                                         # a posterior line of a batch job too
    max_stream_entries: int = 8_000_000  # entries of one streamed posterior (NDJSON) before 413: 25-32 bytes
                                         # each (up to ~50 at top_k 1), so 200-400 MB at most; 0 = unbounded
    max_payload_bytes: int = 2_000_000   # request body before 413
    max_file_bytes: int = 200_000_000    # /v1/files upload before 413
    max_sample_tokens: int = 100_000     # n * max_tokens of one /v1/sample before 413
    max_constraint_states: int = 2048    # states of a constraint's minimised automaton before 413 (/v1/constraint,
                                         # /v1/sample with `constraint`)
    max_constraint_bytes: int = 4 << 30  # memory of a constrained request's backward messages before 413
    constraint_compile_seconds: float = 1.0  # wall-clock time one constraint's automaton may take to compile before
                                         # 413 (its regex `constraint.regex`, else `constraint`); it compiles on
                                         # a preparation thread, never on the event loop
    constraint_compile_workers: int = 1  # preparation threads compiling constraints at once (each holds the GIL
                                         # in turns with the event loop); more requests wait, up to
                                         # max_heavy_requests waiting before 429
    max_request_cost: int = 2_000_000_000_000  # estimated work of one request (`ops.operation_cost` units, ~0.05-
                                         # 0.15 ns each on one CPU core: ~2-5 min) before 413 `budget_exceeded`;
                                         # 0 = no budget. The largest request of every operation the other limits
                                         # allow on the default model (4,096-state VL-HMM) passes; on a 1,024-state
                                         # rank HMM, Viterbi over its states (m^2 r per token) stops near 7k tokens
    heavy_request_cost: int = 2_000_000_000  # above this estimated cost a request runs in the heavy lane (its own
                                         # thread, in slices, round robin), so it never delays light requests
    heavy_slice_cost: int = 1_000_000_000  # the heavy lane's slice (whole sequences): its preemption and
                                         # cancellation granularity (~0.05-0.15 s on one CPU core)
    max_heavy_requests: int = 16         # heavy-lane requests queued or running at once before 429 (they share the
                                         # heavy lane's thread slice by slice)
    posterior_stream_positions: int = 1024  # streamed posteriors (NDJSON): token positions per line at most
    api_keys: str = ""                   # comma-separated bearer keys; empty = no auth
    open_docs: bool = False              # with api_keys, /metrics, /docs, /redoc and /openapi.json need a key
                                         # unless this is set (LATENTLM_OPEN_DOCS=1)
    protect_docs: bool = True            # kept for compatibility: 0 opens them as LATENTLM_OPEN_DOCS=1 does
    rate_limit_per_key: float = 0.0      # requests per second per API key (or per client address without keys)
                                         # on /v1; 0 = no limit; over it: 429 + Retry-After
    rate_limit_burst: int = 0            # requests a key may send at once above the rate (0 = max(1, 2 x rate))
    redis_url: str = ""                  # REDIS_URL: cache + batch-job queue
    cache_url: str = ""                  # LATENTLM_CACHE_URL: cache on another Redis (default REDIS_URL)
    cache_ttl_s: int = 3600              # how long a cached response lives; 0 = no response cache
    state_dir: Path = Path(".latentlm")  # local batch-job files when Redis is not configured
    job_chunk_size: int = 32             # batch-job lines committed together (and scored as one merged call)
    job_lease_s: float = 30.0            # a dead worker's batch (or chunk) is picked up again after this
    job_workers_per_batch: int = 0       # `latentlm worker`: how many workers (any hosts) may share one batch, each
                                         # claiming chunks; 0 = every live worker on the queue, 1 = one per batch
    worker_name: str = ""                # `latentlm worker`: its identity in leases, claims and logs (default
                                         # "<host>:<pid>")
    job_chunk_pause_s: float = 0.0       # pause between chunks (leaves CPU to online traffic)
    retry_after_s: int = 1
    shutdown_grace_s: float = 20.0       # SIGTERM: /ready 503 and new work 503 at once; in-flight requests get this
                                         # long to finish, then what is left is answered 503 and uvicorn stops
    job_retention_s: int = 604_800       # files and batches (chunks, outputs) deleted this long after creation
                                         # (`expires_at`; Redis keys get the same TTL); 0 = kept forever
    job_sweep_interval_s: float = 300.0  # how often the local runner and `latentlm worker` delete expired jobs
    job_max_line_bytes: int = 2_000_000  # one line of a batch input file (upload: 413 naming the line)
    job_max_output_bytes: int = 500_000_000  # a batch's output (checked as chunks are committed; Redis caps a
                                         # value at 512 MiB): over it the batch fails and its chunks are deleted
    redis_retry_max_s: float = 30.0      # `latentlm worker`: longest wait between Redis reconnect attempts
    cache_timeout_s: float = 0.25        # socket timeout of one response-cache command
    cache_breaker_failures: int = 3      # consecutive cache failures that open the circuit breaker; 0 = never
    cache_breaker_cooldown_s: float = 30.0  # how long an open breaker skips the cache before one probe
    backend: str = "torch"               # torch, or onnx: scoring through onnxruntime (`latentlm serve --backend`)
    calibrate: bool = True               # at load, time the batch engines and BLAS libraries (MKL, OpenBLAS,
                                         # compiled) on each chain model's matrix and keep the fastest
    otel: bool = False                   # FastAPI's native OpenTelemetry (tracing, metrics, logs to the global
                                         # providers / OTLP exporters); Prometheus /metrics is always on
    workers: int = 0                     # `serve`: API worker processes (one port, connections spread by the
                                         # kernel, SO_REUSEPORT), each model's weights mapped once and shared; 0 =
                                         # one per usable core with Redis (at most 8 on CUDA, with an engine
                                         # process), else 1. More than one needs
                                         # REDIS_URL (cache, rate limits, jobs and reloads are shared through it)
    engine: str = "auto"                 # `serve`: where the models and the batcher live. inline: in every API
                                         # process; process: in one engine process that owns the device, the API
                                         # workers hand it each request over a Unix socket (service/engine.py), so
                                         # single-sentence requests from every worker share its batches; auto:
                                         # process on CUDA with several workers, inline otherwise
    engine_socket: str = ""              # set by `serve` for its API workers: the engine process's socket
    gil_switch_interval_ms: float = 0.1  # `serve`: how soon a busy event loop hands the GIL to the inference
                                         # thread (Python's default, 5 ms, stalls each batch several times); on
                                         # ptb-hmm 5 ms matches it within the runs' spread (service_wrk.md and
                                         # hot_path.md, 2026-12-02)

    @classmethod
    def from_env(cls, **overrides) -> Settings:
        """Defaults (CUDA_DEFAULTS where the device is CUDA) < environment < explicit overrides (CLI flags)."""
        s = cls()
        given = {k for k, v in overrides.items() if v is not None}
        for f in fields(cls):
            raw = _env("REDIS_URL") if f.name == "redis_url" else _env(f"LATENTLM_{f.name.upper()}")
            if raw is None:
                continue
            given.add(f.name)
            cur = getattr(s, f.name)
            try:
                val = Path(raw) if isinstance(cur, Path) else _bool(raw) if isinstance(cur, bool) else type(cur)(raw)
            except ValueError:
                raise ValueError(f"LATENTLM_{f.name.upper()}: cannot parse {raw!r} as {type(cur).__name__}") from None
            setattr(s, f.name, val)
        for k, v in overrides.items():
            if v is not None:
                setattr(s, k, Path(v) if k in ("store", "state_dir") else v)
        if s.open_docs and s.protect_docs and "protect_docs" in given:
            raise ValueError("LATENTLM_OPEN_DOCS=1 and LATENTLM_PROTECT_DOCS=1 contradict each other: set one")
        if s.workers < 0:
            raise ValueError(f"LATENTLM_WORKERS: expected 0 (automatic) or a count of processes, got {s.workers}")
        if s.workers > 1 and not s.redis_url:
            raise ValueError(f"LATENTLM_WORKERS={s.workers} needs REDIS_URL: the workers share the response cache, "
                             "rate limits, batch jobs and model reloads through Redis (without it the service runs "
                             "one process: LATENTLM_WORKERS=1)")
        if s.engine not in ENGINES:
            raise ValueError(f"LATENTLM_ENGINE: expected one of {', '.join(ENGINES)}, got {s.engine!r}")
        if not s.constraint_compile_seconds > 0 or s.constraint_compile_workers < 1:
            raise ValueError("LATENTLM_CONSTRAINT_COMPILE_SECONDS must be positive and "
                             "LATENTLM_CONSTRAINT_COMPILE_WORKERS at least 1")
        if s.workers > 1 and s.engine == "inline" and s.on_cuda:
            raise ValueError(f"LATENTLM_WORKERS={s.workers} with LATENTLM_ENGINE=inline on CUDA would hold every "
                             "model once per worker on the device: let one engine process own it "
                             "(LATENTLM_ENGINE=process or auto), or run one worker (LATENTLM_WORKERS=1)")
        if s.on_cuda:
            for k, v in CUDA_DEFAULTS.items():
                if k not in given:
                    setattr(s, k, v)
        return s

    @property
    def on_cuda(self) -> bool:
        """Whether models load onto a GPU (`device` cuda, or auto on a machine with one)."""
        d = str(self.device).lower()
        if d == "auto":
            import torch

            return torch.cuda.is_available()
        return d.startswith("cuda")

    @property
    def docs_protected(self) -> bool:
        """Whether /metrics, /docs, /redoc and /openapi.json need a key: with API keys, unless opened."""
        return bool(self.keys) and self.protect_docs and not self.open_docs

    @property
    def inflight_limit(self) -> int:
        """/v1 requests inside the app before a fast 503: `max_inflight`, or what the batcher may hold (its queue
        and the heavy lane) plus INFLIGHT_MARGIN for requests being parsed, answered or outside the batcher."""
        return self.max_inflight or self.max_queue + self.max_heavy_requests + INFLIGHT_MARGIN

    @property
    def connection_limit(self) -> int:
        """Open connections before uvicorn answers 503 (its `limit_concurrency`)."""
        return self.max_connections or max(1024, 4 * self.inflight_limit)

    @property
    def listen_backlog(self) -> int:
        """The listening socket's backlog."""
        return self.backlog or min(2048, max(128, 2 * self.inflight_limit))

    @property
    def worker_count(self) -> int:
        """API worker processes of `serve`: `workers`, or with 0 one per usable core where Redis is configured (on
        CUDA at most CUDA_MAX_AUTO_WORKERS, beside an engine process; one process otherwise)."""
        if self.workers > 0:
            return self.workers
        if not self.redis_url or (self.on_cuda and self.engine == "inline"):
            return 1
        cores = len(os.sched_getaffinity(0))
        return max(1, min(cores, CUDA_MAX_AUTO_WORKERS) if self.on_cuda else cores)

    @property
    def engine_mode(self) -> str:
        """Where `serve` runs the models and the batcher: "process" (one engine process, the API workers hand it
        requests) or "inline" (in each API process). `engine`, or with auto: process on CUDA with several
        workers."""
        if self.engine != "auto":
            return self.engine
        return "process" if self.on_cuda and self.worker_count > 1 else "inline"

    @property
    def snapshot_dir(self) -> Path | None:
        """Where several workers keep the verified snapshots of model weights they all map
        (`store.map_weights`): `<state_dir>/weights`, also with an engine process (the API workers map them for
        their checks, the engine on the CPU too); None for one process (weights read into its memory)."""
        return self.state_dir / "weights" if self.worker_count > 1 or self.engine_mode == "process" else None

    def to_env(self) -> dict[str, str]:
        """These settings as the environment `from_env` reads back (LATENTLM_<NAME>, REDIS_URL): how `serve`
        hands them to its worker processes."""
        out = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name == "protect_docs" and v:  # the default; set, it would contradict LATENTLM_OPEN_DOCS=1
                continue
            out["REDIS_URL" if f.name == "redis_url" else f"LATENTLM_{f.name.upper()}"] = (
                ("1" if v else "0") if isinstance(v, bool) else str(v))
        return out

    @property
    def keys(self) -> list[str]:
        return [k.strip() for k in self.api_keys.split(",") if k.strip()]

    @property
    def cache_redis_url(self) -> str:
        return self.cache_url or self.redis_url


def _bool(raw: str) -> bool:
    """1/true/yes/on or 0/false/no/off (any case)."""
    v = raw.strip().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(raw)
