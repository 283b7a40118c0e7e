"""Issue 16, item 10: batch input lines are bounded (`LATENTLM_JOB_MAX_LINE_BYTES`), files are streamed rather than
read whole, and the work is off the event loop. A one-line upload far over the limit answers 413 naming the line
and the limit, while a concurrent `/health` keeps answering and the server's peak resident memory stays small."""

from __future__ import annotations

import io
import json
import os
import threading
import time

import httpx
import pytest
from fastapi.testclient import TestClient

from latentlm.service import jobs
from latentlm.service.app import create_app
from latentlm.service.errors import APIError
from latentlm.service.settings import Settings
from tests.service.conftest import Server, err

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def line(cid: str, body: dict) -> bytes:
    return json.dumps({"custom_id": cid, "method": "POST", "url": "/v1/score", "body": body}).encode()


def test_iter_lines_and_checked_upload(monkeypatch):
    data = b"ab\r\n\ncdef\nxyz"
    for size in (1, 2, 3, 5, 100):  # every split of the lines across chunks
        chunks = [data[i:i + size] for i in range(0, len(data), size)]
        assert list(jobs.iter_lines(chunks, 4)) == [(1, b"ab"), (2, b""), (3, b"cdef"), (4, b"xyz")]
        with pytest.raises(jobs.LineTooLarge) as e:
            list(jobs.iter_lines(chunks, 3))
        assert e.value.line == 3 and "line 3" in str(e.value) and "limit of 3 bytes" in str(e.value)
    assert list(jobs.iter_lines([b"abcd\r"], 4)) == [(1, b"abcd")]

    monkeypatch.setattr(jobs.jsonl, "READ_CHUNK", 3)
    n = [0]
    assert b"".join(jobs.checked_upload(io.BytesIO(data), 4, n)) == data and n[0] == len(data)
    with pytest.raises(APIError) as e:
        b"".join(jobs.checked_upload(io.BytesIO(data), 3, [0]))
    assert e.value.status == 413 and e.value.code == "line_too_large" and "line 3" in e.value.message
    assert "limit of 3 bytes per line" in e.value.message and "LATENTLM_JOB_MAX_LINE_BYTES" in e.value.message
    b"".join(jobs.checked_upload(io.BytesIO(b"abc\r\nabc\r"), 3, [0]))  # \r\n line ends do not count
    with pytest.raises(APIError):
        b"".join(jobs.checked_upload(io.BytesIO(b"ok\n" + b"x" * 50), 3, [0]))  # a last line with no \n


def test_line_limit_in_process(tmp_path, monkeypatch):
    assert Settings().job_max_line_bytes == 2_000_000
    monkeypatch.setenv("LATENTLM_JOB_MAX_LINE_BYTES", "1234")
    assert Settings.from_env().job_max_line_bytes == 1234
    monkeypatch.delenv("LATENTLM_JOB_MAX_LINE_BYTES")
    settings = Settings(store=tmp_path / "store", device="cpu", state_dir=tmp_path / "state", job_max_line_bytes=200)
    app = create_app(settings)
    ok = line("a", {"model": "tiny", "input": "w1 w2"})
    big = line("b", {"model": "tiny", "input": "w1 " * 100})
    with TestClient(app) as c:
        r = c.post("/v1/files", files={"file": ("in.jsonl", ok + b"\n\n" + big + b"\n")}, data={"purpose": "batch"})
        e = err(r, 413, "file", "line 3 has")
        assert e["code"] == "line_too_large" and "limit of 200 bytes per line" in e["message"]
        assert not [p for p in (tmp_path / "state" / "jobs" / "files").iterdir()]  # nothing stored, no .tmp
        r = c.post("/v1/files", files={"file": ("in.jsonl", ok + b"\r\n")}, data={"purpose": "batch"})
        assert r.status_code == 200 and r.json()["bytes"] == len(ok) + 2
        assert c.get(f"/v1/files/{r.json()['id']}/content").content == ok + b"\r\n"
        # a file stored under a larger limit (the setting lowered since): the batch fails naming the line
        fid = jobs.create_file(app.state.service.jobs, ok + b"\n" + big + b"\n", "old.jsonl", "batch",
                               max_line=10_000)["id"]
        b = c.post("/v1/batches", json={"input_file_id": fid, "endpoint": "/v1/score"}).json()
        assert b["status"] == "failed" and b["errors"]["data"][0]["code"] == "line_too_large"
        assert "line 2 has" in b["errors"]["data"][0]["message"]
        assert "limit of 200 bytes" in b["errors"]["data"][0]["message"]


def _vm(pid: int, field: str) -> int:
    """A `/proc/<pid>/status` memory figure in bytes (VmHWM: the peak resident set)."""
    for ln in open(f"/proc/{pid}/status"):
        if ln.startswith(field + ":"):
            return int(ln.split()[1]) * 1024
    raise KeyError(field)


def test_one_line_upload_over_uvicorn(store, tmp_path, redis_url):
    """A one-line file of LATENTLM_TEST_BIG_LINE_MB (default 60; the issue's case is 199) uploaded to a real server,
    once with local job storage and once on Redis: 413 naming line 1 and the limit; `/health` probed every 20 ms
    meanwhile; peak resident memory of the server read from /proc (VmHWM)."""
    mb = int(os.environ.get("LATENTLM_TEST_BIG_LINE_MB", "60"))
    blob = b'{"custom_id": "x", "method": "POST", "url": "/v1/score", "body": {"model": "tiny", "input": [' + \
        b"1, " * (mb * (1 << 20) // 3) + b"1]}}\n"
    for mode, env in (("local", {}), ("redis", {"REDIS_URL": redis_url})):
        (tmp_path / mode).mkdir()
        srv = Server(store, tmp_path / mode, env={"LATENTLM_MAX_FILE_BYTES": str(300 << 20), **env})
        try:
            base = _vm(srv.p.pid, "VmRSS")
            gaps: list[float] = []
            stop = threading.Event()

            def probe(url=srv.url, stop=stop, gaps=gaps):
                with httpx.Client(base_url=url, timeout=30) as h:
                    while not stop.is_set():
                        t = time.perf_counter()
                        assert h.get("/health").status_code == 200
                        gaps.append(time.perf_counter() - t)
                        time.sleep(0.02)

            th = threading.Thread(target=probe)
            th.start()
            time.sleep(0.3)
            t0 = time.perf_counter()
            r = srv.client.post("/v1/files", files={"file": ("big.jsonl", blob)}, data={"purpose": "batch"},
                                timeout=120)
            took = time.perf_counter() - t0
            time.sleep(0.3)
            stop.set()
            th.join()
            e = err(r, 413, "file", "line 1 has")
            assert e["code"] == "line_too_large" and "limit of 2000000 bytes per line" in e["message"]
            peak = _vm(srv.p.pid, "VmHWM")
            ok = srv.client.post("/v1/files", files={"file": ("ok.jsonl", line("a", {"model": "tiny", "input": "w1"}))},
                                 data={"purpose": "batch"})
            assert ok.status_code == 200, ok.text
            b = srv.client.post("/v1/batches", json={"input_file_id": ok.json()["id"], "endpoint": "/v1/score"})
            assert b.status_code == 200 and b.json()["status"] == "in_progress", b.text
            print(f"FIGURES item10 {mode}: {len(blob) / 1e6:.1f} MB one-line upload -> 413 after {took:.2f} s; "
                  f"/health probes {len(gaps)}, max {max(gaps) * 1000:.0f} ms, "
                  f"p50 {sorted(gaps)[len(gaps) // 2] * 1000:.1f} ms; server RSS before {base / 2**20:.0f} MiB, "
                  f"peak (VmHWM) {peak / 2**20:.0f} MiB")
            assert max(gaps) < 1.0, gaps  # the event loop was never blocked for long
            assert peak - base < 400 << 20, (base, peak)  # never the whole body (nor several copies) in memory
        finally:
            srv.stop()
