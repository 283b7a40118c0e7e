"""Batch scoring on several hosts: `latentlm worker` processes against one real redis-server, each in its own
working directory with its own copy of the model store and its own identity (`LATENTLM_WORKER_NAME`), as on
separate machines, share nothing else.

- three workers drain one batch together: every line answered exactly once, in input order, equal to one worker's
  answer; the work is spread (each worker logs the chunks it computed) and all follow one chunk plan, even the
  worker whose own `LATENTLM_JOB_CHUNK_SIZE` differs;
- a worker killed (SIGKILL) while it holds the claim on a chunk it has not committed: the other worker computes
  that chunk once its claim lapses, and the batch completes exactly once;
- a large input file is streamed in (upload, validation) and the output streamed out (chunk plan, output files):
  tracemalloc's peak stays a small fraction of the file, on both stores;
- chunk plans and chunk reads against the whole-file parse; an upload above the Redis store's file size answers
  413 naming the field;
- hosts' model stores checked: a batch records the identity (content hash) of each model its lines name as the
  API's store holds it; a worker whose store holds another model under the same name, or none, answers those
  lines 503 `model_mismatch` naming the model, the worker and both hashes, never from its own model (alone, and
  beside a worker with the right store: exactly the chunks each one computed are answered / refused); on the local
  store too;
- a batch of `/v1/completions` lines through the real API and a real worker: each line answers what the route
  answers for the same body (but the fresh `id` and `created`)."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

import pytest
import redis

from latentlm.service import jobs
from latentlm.service.errors import APIError
from latentlm.service.registry import ModelRegistry
from latentlm.service.settings import Settings
from tests.service.conftest import Proc, Server, add_model, clean_env, close
from tests.service.test_api import score_lines, upload, wait_batch

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
CHUNK = 4
JOB_ENV = {"LATENTLM_JOB_CHUNK_SIZE": str(CHUNK), "LATENTLM_JOB_LEASE_S": "1", "LATENTLM_REDIS_RETRY_MAX_S": "1"}
COMPUTED = re.compile(r"batch (batch_\w+): (\d+) of (\d+) chunks computed by (\S+)/")


class HostWorker(Proc):
    """`latentlm worker` as on its own host: working directory `d`, a copy of the model store in it, identity
    `name`, log `d/worker.log`."""

    def __init__(self, store: Path, d: Path, name: str, env: dict[str, str]):
        d.mkdir(parents=True, exist_ok=True)
        own = d / "store"
        if not own.exists():
            shutil.copytree(store, own)
        self.name, self.log = name, d / "worker.log"
        self._fh = open(self.log, "ab")
        args = [sys.executable, "-m", "latentlm.cli", "worker", "--store", str(own), "--device", "cpu",
                "--log-level", "info"]
        self.p = subprocess.Popen(args, env=clean_env(LATENTLM_WORKER_NAME=name, **env), cwd=d, stdout=self._fh,
                                  stderr=subprocess.STDOUT, start_new_session=True)

    def computed(self, bid: str) -> list[tuple[int, int]]:
        """(chunks computed here, chunks in the plan) for each run of batch `bid` this worker logged."""
        return [(int(m[2]), int(m[3])) for m in COMPUTED.finditer(self.output()) if m[1] == bid and
                m[4] == self.name]


@pytest.fixture
def url(redis_url):
    """A database of the session's redis-server of its own (its rq queue too), emptied before and after."""
    u = redis_url.rsplit("/", 1)[0] + "/7"
    r = redis.Redis.from_url(u)
    r.flushdb()
    yield u
    r.flushdb()
    r.close()


def write_lines(path: Path, lines: list[dict]) -> Path:
    path.write_text("".join(json.dumps(ln) + "\n" for ln in lines))
    return path


def submit(s: jobs.RedisJobStore, url: str, path: Path) -> dict:
    """What POST /v1/files and POST /v1/batches do: the file streamed in from disk, the batch validated (and its
    models' identities recorded when `s` has the API's `model_identities`) and queued."""
    with path.open("rb") as f:
        fid = jobs.create_file(s, f, path.name, "batch", retention_s=3600)["id"]
    b = jobs.create_batch(s, fid, "/v1/score", retention_s=3600)
    assert b["status"] == "in_progress", b
    s.claim_requeue(b["id"], 2)
    jobs.RQRunner(s, url).submit(b["id"])
    return b


def wait_done(s: jobs.RedisJobStore, bid: str, workers: list[HostWorker], timeout: float = 120) -> dict:
    deadline = time.time() + timeout
    while (b := s.get_batch(bid))["status"] not in jobs.TERMINAL:
        assert time.time() < deadline, (b, [w.output()[-3000:] for w in workers])
        time.sleep(0.05)
    return jobs.batch_object(s, b)


def wait_registered(url: str, n: int, workers: list[HostWorker], timeout: float = 120) -> None:
    from rq import Queue, Worker

    conn = redis.Redis.from_url(url)
    deadline = time.time() + timeout
    while Worker.count(connection=conn, queue=Queue(jobs.QUEUE_NAME, connection=conn)) < n:
        for w in workers:
            assert w.alive(), w.output()
        assert time.time() < deadline, [w.output() for w in workers]
        time.sleep(0.1)


def output_lines(s, b: dict) -> list[dict]:
    out = []
    for key in ("output_file_id", "error_file_id"):
        if b.get(key):
            out += [json.loads(ln) for ln in b"".join(s.iter_file(b[key])).splitlines()]
    return out


def one_worker_answer(store: Path, tmp: Path, path: Path) -> dict[str, dict]:
    """custom_id -> response body from one worker in this process (the local store, the same chunk size)."""
    s = jobs.LocalJobStore(tmp / "single")
    with path.open("rb") as f:
        fid = jobs.create_file(s, f, path.name, "batch")["id"]
    b = jobs.create_batch(s, fid, "/v1/score")
    settings = Settings(store=store, device="cpu", job_chunk_size=CHUNK)
    assert jobs.process_batch(s, ModelRegistry(store), b["id"], settings) == "completed"
    return {o["custom_id"]: o["response"]["body"] for o in output_lines(s, s.get_batch(b["id"]))}


def check_exactly_once_in_order(s, done: dict, lines: list[dict], reference: dict[str, dict]) -> None:
    n = len(lines)
    assert done["status"] == "completed", done
    assert done["request_counts"] == {"total": n, "completed": n, "failed": 0}, done
    out = output_lines(s, done)
    assert [o["custom_id"] for o in out] == [ln["custom_id"] for ln in lines]  # each once, in input order
    for o in out:
        close(o["response"]["body"], reference[o["custom_id"]], path=o["custom_id"])


# == several hosts, one Redis ===========================================================================
def test_three_workers_share_one_batch(store, tmp_path, url):
    lines = score_lines(240, seed=31)
    path = write_lines(tmp_path / "in.jsonl", lines)
    env = {"REDIS_URL": url, **JOB_ENV, "LATENTLM_JOB_CHUNK_PAUSE_S": "0.05"}
    # host-c's own chunk size differs: it follows the batch's recorded plan all the same
    ws = [HostWorker(store, tmp_path / f"host-{h}", f"host-{h}",
                     {**env, **({"LATENTLM_JOB_CHUNK_SIZE": "7"} if h == "c" else {})}) for h in "abc"]
    try:
        reference = one_worker_answer(store, tmp_path, path)
        wait_registered(url, 3, ws)
        s = jobs.RedisJobStore(url)
        t0 = time.monotonic()
        b = submit(s, url, path)
        done = wait_done(s, b["id"], ws)
        took = time.monotonic() - t0
        check_exactly_once_in_order(s, done, lines, reference)
        time.sleep(0.3)  # the helpers' last log lines
        runs = {w.name: w.computed(b["id"]) for w in ws}
    finally:
        for w in ws:
            w.kill()
    # one plan, followed by all whatever each one's chunk size: that of the worker that took the batch first
    # (host-c's 7 when it was first to take the job)
    plans = {n for rs in runs.values() for _, n in rs}
    assert len(plans) == 1 and plans <= {math.ceil(240 / CHUNK), math.ceil(240 / 7)}, runs
    per_host = {name: sum(c for c, _ in rs) for name, rs in runs.items()}
    assert sum(per_host.values()) == plans.pop(), runs  # every chunk computed once
    assert sum(1 for c in per_host.values() if c) >= 2, runs  # the work was shared
    print(f"\nFIGURES three workers: 240 lines in {took:.1f} s; chunks per worker {per_host}")


def test_killed_worker_chunk_is_claimed_again(store, tmp_path, url):
    lines = score_lines(600, seed=32)
    path = write_lines(tmp_path / "in.jsonl", lines)
    env = {"REDIS_URL": url, **JOB_ENV}
    ws = [HostWorker(store, tmp_path / f"host-{h}", f"host-{h}", env) for h in "ab"]
    r = redis.Redis.from_url(url)
    try:
        reference = one_worker_answer(store, tmp_path, path)
        wait_registered(url, 2, ws)
        s = jobs.RedisJobStore(url)
        b = submit(s, url, path)
        bid = b["id"]
        deadline = time.time() + 60
        while r.hlen(f"latentlm:batch:{bid}:counts") < 10:  # mid-job: some chunks committed
            assert time.time() < deadline and s.get_batch(bid)["status"] in jobs.LIVE, "the batch did not start"
            time.sleep(0.005)
        # freeze one worker at a time until one is caught holding the claim on a chunk it has not committed
        victim = orphan = None
        while victim is None:
            assert time.time() < deadline and s.get_batch(bid)["status"] in jobs.LIVE, "no worker caught"
            for w in ws:
                os.kill(w.p.pid, signal.SIGSTOP)
                held = [int(k.decode().rsplit(":", 1)[1]) for k in r.scan_iter(f"latentlm:batch:{bid}:claim:*")
                        if (r.get(k) or b"").decode().startswith(f"{w.name}/")]
                held = [i for i in held if not r.hexists(f"latentlm:batch:{bid}:counts", i)]
                if held:
                    victim, orphan = w, held[0]
                    led = (s.lease_holder(bid) or "").startswith(f"{w.name}/")
                    w.kill(signal.SIGKILL)
                    break
                os.kill(w.p.pid, signal.SIGCONT)
            time.sleep(0.01)
        survivor = next(w for w in ws if w is not victim)
        done = wait_done(s, bid, ws)
        check_exactly_once_in_order(s, done, lines, reference)
        assert not r.exists(f"latentlm:batch:{bid}:counts")  # the chunks were folded into the output file
        assert survivor.alive(), survivor.output()
    finally:
        for w in ws:
            if w.alive():
                os.kill(w.p.pid, signal.SIGCONT)
            w.kill()
    print(f"\nFIGURES killed worker: {victim.name} ({'lead' if led else 'helper'}) killed holding chunk {orphan}; "
          f"{survivor.name} completed the batch, every line once")


# == streamed in, streamed out: bounded memory ===========================================================
def big_lines(n: int, words: int) -> list[dict]:
    text = " ".join(f"w{i % 38}" for i in range(words))
    return [{"custom_id": f"req-{i}", "method": "POST", "url": "/v1/score", "body": {"model": "tiny", "input": text}}
            for i in range(n)]


@pytest.mark.parametrize("backend", ["redis", "local"])
def test_large_input_and_output_stream_in_bounded_memory(tmp_path, url, backend):
    """A 40 MB input file is uploaded and validated, then a batch over it is planned and its 41 MB output
    written, each with tracemalloc's peak below 8 read pieces (8 MiB) and a quarter of the file. The chunks' outputs are
    committed through
    the store as a worker commits them (synthetic bodies, so that the test does not spend minutes scoring)."""
    n = 8000
    path = write_lines(tmp_path / "big.jsonl", big_lines(n, 1300))
    size = path.stat().st_size
    assert size > 35_000_000
    s = jobs.RedisJobStore(url) if backend == "redis" else jobs.LocalJobStore(tmp_path / "jobs")
    tracemalloc.start()
    try:
        with path.open("rb") as f:
            fid = jobs.create_file(s, f, "big.jsonl", "batch")["id"]
        b = jobs.create_batch(s, fid, "/v1/score")
        _, peak_in = tracemalloc.get_traced_memory()
        assert b["status"] == "in_progress" and b["request_counts"]["total"] == n, b
        # every chunk's output committed, as workers would; then the batch runs: its plan, then its output files
        size_chunk = 100
        pad = "x" * (size // n)
        for i in range(n // size_chunk):
            out = [jobs.output_line(b["id"], f"req-{k}", 200, {"object": "list", "data": [], "pad": pad})
                   for k in range(i * size_chunk, (i + 1) * size_chunk)]
            assert s.commit_chunk(b["id"], i, out, len(out), 0) == 1
        empty = tmp_path / "models"  # nothing is scored: no model loaded, whose weights would count here
        settings = Settings(store=empty, device="cpu", job_chunk_size=size_chunk)
        registry = ModelRegistry(empty)
        tracemalloc.reset_peak()
        assert jobs.process_batch(s, registry, b["id"], settings) == "completed"
        _, peak_out = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    done = s.get_batch(b["id"])
    meta = s.file_meta(done["output_file_id"])
    assert meta["bytes"] > size
    ids = [json.loads(ln)["custom_id"] for ln in b"".join(s.iter_file(done["output_file_id"])).splitlines()]
    assert ids == [f"req-{k}" for k in range(n)]
    # a few read pieces (the piece, Redis's reply buffer, the lines parsed together), whatever the file's size
    bound = 8 * jobs.READ_CHUNK
    assert peak_in < min(size / 4, bound) and peak_out < min(meta["bytes"] / 4, bound), (peak_in, peak_out, size)
    print(f"\nFIGURES streamed ({backend}): {size / 1e6:.1f} MB in, peak {peak_in / 1e6:.2f} MB; "
          f"{meta['bytes'] / 1e6:.1f} MB out, peak {peak_out / 1e6:.2f} MB")


def test_chunk_plan_reads_what_the_whole_parse_reads():
    lines = [json.dumps(ln) for ln in score_lines(11, seed=33)]
    data = ("\n".join(lines[:3]) + "\n\n  \r\n" + "\r\n".join(lines[3:])).encode()  # blank lines, CRLF, no final \n
    want, errors = jobs.parse_input_file(data, "/v1/score")
    assert not errors and jobs.validate_input_file(data, "/v1/score") == (11, [])
    for size in (1, 2, 3, 11, 20):
        for piece in (1, 7, 1 << 20):
            plan = jobs.plan_chunks([data[i:i + piece] for i in range(0, len(data), piece)], size)
            assert plan["lines"] == 11 and len(plan["bounds"]) - 1 == math.ceil(11 / size)
            got = []
            for i in range(len(plan["bounds"]) - 1):
                part = data[plan["bounds"][i]:plan["bounds"][i + 1]]
                reqs, errs = jobs.read_requests([part], "/v1/score", plan["first_line"][i])
                assert not errs and len(reqs) == min(size, 11 - i * size)
                got += reqs
            assert got == want
    # errors name the line of the whole file
    bad = data.replace(lines[5].encode(), b"{not json")
    plan = jobs.plan_chunks([bad], 4)
    _, errs = jobs.read_requests([bad[plan["bounds"][1]:plan["bounds"][2]]], "/v1/score", plan["first_line"][1])
    assert errs[0]["line"] == 8 and errs[0]["param"] == "line", errs  # 3 lines, 2 blank, then the 3rd of chunk 1
    _, errs = jobs.validate_input_file(bad, "/v1/score")
    assert errs[0]["line"] == 8


def test_redis_store_file_size_limit(url):
    s = jobs.RedisJobStore(url)
    s.max_file_bytes = 1000
    data = b"".join(json.dumps(ln).encode() + b"\n" for ln in score_lines(20, seed=34))
    with pytest.raises(APIError) as e:
        jobs.create_file(s, data, "in.jsonl", "batch")
    assert (e.value.status, e.value.param, e.value.code) == (413, "file", "file_too_large")
    assert "1000 bytes" in e.value.message
    assert not list(s.redis.scan_iter("latentlm:file:*"))  # nothing stored, no half upload left


def test_compose_files_scale_the_worker():
    """docker-compose.yml: the worker service scales (`deploy.replicas`, `--scale worker=N`: no fixed container
    name or host port), the other services unchanged; docker-compose.workers.yml: workers alone, for other hosts."""
    import yaml

    root = Path(__file__).resolve().parents[2]
    main = yaml.safe_load((root / "docker-compose.yml").read_text())["services"]
    assert set(main) == {"redis", "cache", "api", "worker"}
    remote = yaml.safe_load((root / "docker-compose.workers.yml").read_text())["services"]
    assert set(remote) == {"worker"}
    for w in (main["worker"], remote["worker"]):
        assert w["command"] == ["latentlm", "worker"] and "REDIS_URL" in w["environment"]
        assert w["deploy"]["replicas"] == "${LATENTLM_WORKER_REPLICAS:-1}"
        assert "container_name" not in w and "ports" not in w
    assert main["redis"]["command"] == ["redis-server", "--maxmemory-policy", "noeviction", "--appendonly", "yes"]


# == hosts' model stores checked ========================================================================
def other_store(store: Path, d: Path) -> Path:
    """A host's store as `HostWorker` would copy it, but its `tiny` another model (another seed) and no `rank`."""
    own = d / "store"
    shutil.copytree(store, own)
    shutil.rmtree(own / "tiny")
    add_model(own, "tiny", "hmm", seed=9)
    shutil.rmtree(own / "rank")
    return own


def mixed_lines(n: int, seed: int) -> list[dict]:
    """Score lines naming tiny, blocked and rank in turn."""
    lines = score_lines(n, seed=seed)
    for i, ln in enumerate(lines):
        ln["body"]["model"] = ("tiny", "blocked", "rank")[i % 3]
    return lines


def check_mismatch(o: dict, worker: str, expected: str, found: str | None) -> None:
    """`o` is a `model_mismatch` error line naming its model, `worker` and both hashes."""
    assert o["response"]["status_code"] == 503 and o["error"]["code"] == "model_mismatch", o
    e = o["response"]["body"]["error"]
    assert (e["code"], e["param"], e["worker"], e["expected_content_hash"], e["content_hash"]) == \
        ("model_mismatch", "model", worker, expected, found), e
    assert worker in e["message"] and expected in e["message"] and repr(e["model"]) in e["message"], e
    assert (found or "has no such model") in e["message"], e


def test_a_worker_with_another_model_never_answers_from_it(store, tmp_path, url):
    """host-b's store holds another `tiny` and no `rank`. Alone, it answers every tiny and rank line
    `model_mismatch` (naming itself and both hashes) and every blocked line as the right store does; beside host-a
    (the right store), each line is answered by host-a's model or refused by host-b, never answered by host-b's
    tiny: exactly the chunks host-b logged are refused."""
    env = {"REDIS_URL": url, **JOB_ENV, "LATENTLM_JOB_CHUNK_PAUSE_S": "0.02"}
    bad_store = other_store(store, tmp_path / "host-b")
    api_models = ModelRegistry(store)
    wrong, right = ModelRegistry(bad_store).identities(["tiny"])["tiny"], api_models.identities(["tiny"])["tiny"]
    assert wrong != right
    s = jobs.RedisJobStore(url, model_identities=api_models.identities)  # the API's job store (service/app.py)
    bad = HostWorker(store, tmp_path / "host-b", "host-b", env)
    ws = [bad]
    try:
        # 1. host-b alone
        lines = mixed_lines(24, seed=35)
        path = write_lines(tmp_path / "in1.jsonl", lines)
        reference = one_worker_answer(store, tmp_path / "ref1", path)
        wrong_answers = one_worker_answer(bad_store, tmp_path / "wrong1", write_lines(
            tmp_path / "tiny1.jsonl", [ln for ln in lines if ln["body"]["model"] == "tiny"]))
        for cid, body in wrong_answers.items():  # host-b's tiny answers otherwise: a line from it would be caught
            assert abs(body["data"][0]["logprob"] - reference[cid]["data"][0]["logprob"]) > 1e-3
        wait_registered(url, 1, ws)
        b = submit(s, url, path)
        rec = s.get_batch(b["id"])
        assert rec["model_hashes"] == api_models.identities(["tiny", "blocked", "rank"]) and \
            rec["model_hashes"]["tiny"] == right, rec
        assert "model_hashes" not in b  # internal: the public batch object is unchanged
        done = wait_done(s, b["id"], ws)
        assert done["status"] == "completed" and done["request_counts"] == {"total": 24, "completed": 8,
                                                                             "failed": 16}, done
        out = {o["custom_id"]: o for o in output_lines(s, done)}
        assert sorted(out) == sorted(ln["custom_id"] for ln in lines)
        for ln in lines:
            o, model = out[ln["custom_id"]], ln["body"]["model"]
            if model == "blocked":
                assert o["response"]["status_code"] == 200, o
                close(o["response"]["body"], reference[ln["custom_id"]], path=ln["custom_id"])
            else:
                check_mismatch(o, "host-b", rec["model_hashes"][model], wrong if model == "tiny" else None)
        assert "is not the batch's" in bad.output()  # the operator of host-b is told, once per model and batch
        # 2. host-a (the right store) joins: the lines are shared, none answered from host-b's tiny
        good = HostWorker(store, tmp_path / "host-a", "host-a", env)
        ws.append(good)
        lines = score_lines(120, seed=36)  # all tiny
        path = write_lines(tmp_path / "in2.jsonl", lines)
        reference = one_worker_answer(store, tmp_path / "ref2", path)
        wait_registered(url, 2, ws)
        b = submit(s, url, path)
        done = wait_done(s, b["id"], ws)
        time.sleep(0.3)  # the helpers' last log lines
        out = output_lines(s, done)
        assert sorted(o["custom_id"] for o in out) == sorted(ln["custom_id"] for ln in lines)
        refused = 0
        for o in out:
            if o["response"]["status_code"] == 200:
                close(o["response"]["body"], reference[o["custom_id"]], path=o["custom_id"])
            else:
                check_mismatch(o, "host-b", right, wrong)
                refused += 1
        chunks = {w.name: sum(c for c, _ in w.computed(b["id"])) for w in ws}
        assert sum(chunks.values()) == 120 // CHUNK and all(chunks.values()), chunks  # both worked on it
        assert refused == CHUNK * chunks["host-b"] and len(out) - refused == CHUNK * chunks["host-a"], chunks
        assert done["request_counts"]["failed"] == refused
    finally:
        for w in ws:
            w.kill()
    print(f"\nFIGURES model check: host-b alone refused 16 of 24 lines (tiny: another version, rank: missing); "
          f"beside host-a: chunks {chunks}, {refused} lines refused, {len(out) - refused} answered by host-a")


def test_the_local_store_records_and_checks_models_too(store, tmp_path):
    """The local store records the API's identities with the batch; run on another store (a model replaced
    after the batch was created), its lines are refused naming the worker, the others answered."""
    api_models = ModelRegistry(store)
    s = jobs.LocalJobStore(tmp_path / "jobs", model_identities=api_models.identities)
    lines = mixed_lines(6, seed=37)
    lines[5]["body"]["model"] = "nosuch"  # a model the API lacks: not recorded, answered 404 as before
    fid = jobs.create_file(s, write_lines(tmp_path / "in.jsonl", lines).read_bytes(), "in.jsonl", "batch")["id"]
    b = jobs.create_batch(s, fid, "/v1/score")
    rec = s.get_batch(b["id"])
    assert rec["model_hashes"] == api_models.identities(["tiny", "blocked", "rank"]) and "model_hashes" not in b
    bad_store = other_store(store, tmp_path / "later")
    settings = Settings(store=bad_store, device="cpu", job_chunk_size=CHUNK, worker_name="here")
    assert jobs.process_batch(s, ModelRegistry(bad_store), b["id"], settings) == "completed"
    out = {o["custom_id"]: o for o in output_lines(s, s.get_batch(b["id"]))}
    wrong = ModelRegistry(bad_store).identities(["tiny"])["tiny"]
    for ln in lines:
        o, model = out[ln["custom_id"]], ln["body"]["model"]
        if model == "blocked":
            assert o["response"]["status_code"] == 200, o
        elif model == "nosuch":
            assert (o["response"]["status_code"], o["error"]["code"]) == (404, "model_not_found"), o
        else:
            check_mismatch(o, "here", rec["model_hashes"][model], wrong if model == "tiny" else None)
    # without the API's identities nothing is recorded: lines run unchecked, as before
    plain = jobs.LocalJobStore(tmp_path / "plain")
    fid = jobs.create_file(plain, write_lines(tmp_path / "in.jsonl", lines).read_bytes(), "in.jsonl", "batch")["id"]
    assert plain.get_batch(jobs.create_batch(plain, fid, "/v1/score")["id"])["model_hashes"] == {}


def test_validation_collects_model_names_bounded():
    names: set[str] = set()
    lines = [{"custom_id": f"c{i}", "url": "/v1/score", "body": {"model": m, "input": "w1"}}
             for i, m in enumerate(["a", "b", "a", "../x", "x" * 129, 7, None, "ok.v-1_2"])]
    assert jobs.validate_input_file("\n".join(json.dumps(ln) for ln in lines).encode(), "/v1/score",
                                    models=names) == (8, [])
    assert names == {"a", "b", "ok.v-1_2"}  # only valid model names (models.store.NAME_RE)
    many = "\n".join(json.dumps({"custom_id": f"c{i}", "url": "/v1/score", "body": {"model": f"m{i}", "input": "w1"}})
                     for i in range(jobs.MAX_MODELS + 10)).encode()
    names.clear()
    assert jobs.validate_input_file(many, "/v1/score", models=names)[1] == []
    assert len(names) == jobs.MAX_MODELS


# == completions through a real worker ==================================================================
COMPLETIONS = [
    {"model": "tiny", "prompt": ["w1", "w2 w3"], "max_tokens": 6, "n": 2, "seed": 7, "logprobs": 2},
    {"model": "tiny", "prompt": "w4 w5", "max_tokens": 5, "seed": 3, "temperature": 0.7, "top_p": 0.9},
    {"model": "tiny", "prompt": "w1", "max_tokens": 4, "seed": 1, "constraint": {"include": [["w5"]]}},
    {"model": "blocked", "prompt": "w4", "max_tokens": 0, "echo": True, "logprobs": 1},
    {"model": "rank", "prompt": [[3, 4, 5]], "max_tokens": 3, "seed": 11, "logprobs": 1},
    {"model": "pcfg", "prompt": "w1"},  # refused: not a chain family
    {"model": "tiny", "prompt": "w1", "suffix": "w2"},  # refused: a field latentlm cannot honour
]


def test_a_completions_batch_through_a_worker_answers_as_the_route(store, tmp_path, url):
    """POST /v1/files + POST /v1/batches (endpoint /v1/completions) on a real API with Redis, run by a real
    `latentlm worker`: each output or error line is the route's answer to the same body (status and body; of an
    answer, all but its fresh `id` and `created`); the batch recorded each model's `content_hash` as GET
    /v1/models reports it."""
    env = {"REDIS_URL": url, **JOB_ENV, "LATENTLM_CALIBRATE": "0"}
    w = HostWorker(store, tmp_path / "host-a", "host-a", env)
    server = Server(store, tmp_path, env)
    try:
        lines = [{"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions", "body": body}
                 for i, body in enumerate(COMPLETIONS)]
        fid = upload(server.client, lines)
        r = server.client.post("/v1/batches", json={"input_file_id": fid, "endpoint": "/v1/completions"})
        assert r.status_code == 200, r.text
        wait_registered(url, 1, [w])
        done = wait_batch(server.client, r.json()["id"], timeout=120)
        assert done["status"] == "completed" and done["request_counts"] == {"total": 7, "completed": 5,
                                                                             "failed": 2}, (done, w.output()[-3000:])
        out = []
        for key in ("output_file_id", "error_file_id"):
            got = server.client.get(f"/v1/files/{done[key]}/content")
            assert got.status_code == 200
            out += [json.loads(ln) for ln in got.text.splitlines()]
        out = {o["custom_id"]: o for o in out}
        for ln in lines:
            o, want = out[ln["custom_id"]], server.client.post("/v1/completions", json=ln["body"])
            got = o["response"]["body"]
            assert o["response"]["status_code"] == want.status_code, (ln, o, want.text)
            want = want.json()
            if want.get("object") == "text_completion":
                assert got.pop("id").startswith("cmpl-") and got.pop("created") >= done["created_at"]
                want.pop("id"), want.pop("created")
            else:
                assert o["error"] == {"code": want["error"]["code"], "message": want["error"]["message"]}
            close(got, want, path=ln["custom_id"])
        hashes = jobs.RedisJobStore(url).get_batch(done["id"])["model_hashes"]
        assert hashes == {m: server.client.get(f"/v1/models/{m}").json()["content_hash"]
                          for m in ("tiny", "blocked", "rank", "pcfg")}, hashes
    finally:
        server.stop()
        w.kill()
