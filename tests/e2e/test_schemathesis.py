"""Issue 16: schema fuzzing in CI. Schemathesis (every check, every phase) against a real `latentlm serve` (uvicorn)
on a tiny model store: at least 1,000 generated requests and zero failures. The run's summary is printed
(`-s`). `LATENTLM_ST_MAX_EXAMPLES` (default 30 per operation) and `LATENTLM_ST_SEED` tune it; a failure prints the
schemathesis report with a curl command reproducing each finding."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.service.conftest import Server, add_model

pytest.importorskip("schemathesis")

CONFIG = """
# schemathesis configuration for the contract test (tests/e2e/test_schemathesis.py)
[dictionaries.models]
values = ["tiny"]

# Every check runs. `positive_data_acceptance` expects a 2xx for every schema-valid request. The document admits only
# what the service accepts where JSON Schema can say it (decode methods as an enum, temperature's exclusiveMinimum,
# text with a non-space character, id lists with at least one id), so the 422s the schema used to admit (method "",
# temperature 0, whitespace-only input) are gone. Expected besides: 400 for an operation the model's family does not
# have (`unsupported_operation`, e.g. embed on an HMM); the statuses the service documents for state (404 no such
# model/file/batch, 409, 413 limits and budgets, 429); and 422 for what no JSON Schema can say: a token id at or
# above the model's vocabulary size (per model, see /v1/models). A number with a zero fractional part (312.0) where
# an integer is due is accepted as JSON Schema's "integer" says.
[checks.positive_data_acceptance]
expected-statuses = ["2XX", 400, 404, 409, 413, 422, 429]

# A multipart form carries text: a "file" part mutated to an integer still arrives as the bytes of a file, so the
# negative check's type mutations of POST /v1/files are not violations the server can see (missing parts are).
# Per-operation check settings do not reach the stateful phase, so it sends valid data only (the coverage and
# fuzzing phases send invalid data to every operation).
[[operations]]
include-path = "/v1/files"
include-method = "POST"
checks.negative_data_rejection.enabled = false

[phases.stateful.generation]
mode = "positive"

[parameters]
"body.model" = { dictionary = "models", probability = 0.7 }
"path.model_id" = { dictionary = "models", probability = 0.7 }
"""


def _schemathesis() -> str:
    exe = Path(sys.executable).with_name("schemathesis")
    return str(exe) if exe.exists() else (shutil.which("schemathesis") or "schemathesis")


@pytest.mark.slow
@pytest.mark.parametrize("keyed", [False, True], ids=["open", "api-key"])
def test_schemathesis_all_checks_zero_failures(tmp_path, keyed):
    """Without keys: 30 examples per operation (>= 1,000 requests). With an API key (the bearer scheme in the
    document, sent by schemathesis; `ignored_auth` checks that a request without it is refused): 12 per operation."""
    store = tmp_path / "store"
    add_model(store, "tiny", "hmm", seed=0)
    env = {
        # small limits keep each generated request cheap on 2 CPU cores (samples, long inputs)
        "LATENTLM_MAX_SAMPLE_TOKENS": "2000",
        "LATENTLM_MAX_REQUEST_TOKENS": "2000",
        "LATENTLM_MAX_FILE_BYTES": "1000000",
        "LATENTLM_JOB_MAX_LINE_BYTES": "100000",
    }
    if keyed:
        env["LATENTLM_API_KEYS"] = "st-key-1"
    srv = Server(store, tmp_path, env=env)
    (tmp_path / "schemathesis.toml").write_text(CONFIG)
    examples = os.environ.get("LATENTLM_ST_MAX_EXAMPLES", "12" if keyed else "30")
    seed = os.environ.get("LATENTLM_ST_SEED", "16")
    args = [_schemathesis(), "--config-file", str(tmp_path / "schemathesis.toml"), "run",
            f"{srv.url}/openapi.json", "--checks", "all", "--max-examples", examples, "--seed", seed,
            "--workers", "2", "--no-color", "--generation-database", "none", "--request-timeout", "60",
            "--report", "junit", "--report-dir", str(tmp_path / "report")]
    if keyed:
        args += ["--header", "Authorization: Bearer st-key-1"]
    try:
        p = subprocess.run(args, cwd=tmp_path, capture_output=True, text=True, timeout=900,
                           env={**os.environ, "NO_COLOR": "1"})
    finally:
        srv.stop()
    out = p.stdout + p.stderr
    summary = out[out.rfind("SUMMARY"):] if "SUMMARY" in out else out[-4000:]
    print(summary)
    m = re.search(r"(\d+) generated", out)
    generated = int(m.group(1)) if m else 0
    print(f"FIGURES schemathesis ({'api key' if keyed else 'no keys'}): {generated} generated test cases, "
          f"exit code {p.returncode}")
    assert p.returncode == 0, out[-30000:]
    assert generated >= (400 if keyed else 1000), summary
    server_log = srv.output()
    assert "Traceback" not in server_log, server_log[-5000:]
