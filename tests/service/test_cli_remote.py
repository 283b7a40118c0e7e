"""`latentlm <operation> --server URL`: the same output lines from a running service as from a local run."""

from __future__ import annotations

import subprocess
import sys

import pytest

from .conftest import Server, clean_env

LINES = "w1 w2 w3\nw4 w5\nw6 w7 w8 w9 w10\n"


# Both sides run uncalibrated, with the same engine: two processes that each calibrate may pick different CPU GEMM
# engines under load, whose float32 sums differ in the last bit (a flake seen in CI), and the lines are compared
# byte for byte.
UNCALIBRATED = {"LATENTLM_CALIBRATE": "0"}


def cli(*args: str, stdin: str = "", env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "latentlm.cli", *args], input=stdin, capture_output=True, text=True,
                          env=clean_env(**{**UNCALIBRATED, **(env or {})}), timeout=300)


@pytest.fixture(scope="module")
def server(store, tmp_path_factory):
    s = Server(store, tmp_path_factory.mktemp("remote"), env={"LATENTLM_API_KEYS": "k1", **UNCALIBRATED})
    yield s
    s.stop()


@pytest.mark.parametrize("model,op,flags", [
    ("tiny", "score", ["--token-logprobs"]),
    ("blocked", "decode", ["--method", "mbr"]),
    ("rank", "posterior", ["--top-k", "2"]),
    ("tiny", "sample", ["--n", "3", "--seed", "7", "--prefix", "w1 w2", "--max-tokens", "6"]),
])
def test_remote_lines_equal_local_ones(server, store, model, op, flags):
    stdin = "" if op == "sample" else LINES
    local = cli(op, "--model", model, "--store", str(store), *flags, stdin=stdin)
    remote = cli(op, "--model", model, "--server", server.url, "--api-key", "k1", *flags, stdin=stdin)
    assert local.returncode == 0 and remote.returncode == 0, (local.stderr, remote.stderr)
    assert remote.stdout == local.stdout
    assert len(remote.stdout.splitlines()) == 3  # three lines in, or three samples


def test_remote_chunks_keep_line_numbers(server, store):
    """More lines than one request carries: indices count input lines across requests."""
    many = "".join(f"w{1 + i % 30} w{2 + i % 30}\n" for i in range(600))
    local = cli("score", "--model", "tiny", "--store", str(store), stdin=many)
    remote = cli("score", "--model", "tiny", "--server", server.url, "--api-key", "k1", stdin=many)
    assert remote.returncode == 0, remote.stderr
    assert remote.stdout == local.stdout
    assert remote.stdout.splitlines()[-1].startswith('{"index":599,')


def test_remote_errors_name_the_line_or_the_field(server):
    bad = cli("score", "--model", "tiny", "--ids", "--server", server.url, "--api-key", "k1",
              stdin="1 2\n3 4 99999\n")
    assert bad.returncode != 0 and "line 2: token id 99999" in bad.stderr, bad.stderr
    nokey = cli("score", "--model", "tiny", "--server", server.url, stdin=LINES)
    assert nokey.returncode != 0 and "API key" in nokey.stderr, nokey.stderr
    gone = cli("score", "--model", "nope", "--server", server.url, "--api-key", "k1", stdin=LINES)
    assert gone.returncode != 0 and "'nope'" in gone.stderr, gone.stderr
    down = cli("score", "--model", "tiny", "--server", "http://127.0.0.1:9", stdin=LINES)
    assert down.returncode != 0 and "cannot reach" in down.stderr and "Traceback" not in down.stderr
