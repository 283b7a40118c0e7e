"""What the service benchmarks share (`hot_path.py`, `service_workloads.py`, `workers_memory.py`): free ports, the
CPU's name, a process's children, a throwaway redis-server, and wrk (its Lua script of request bodies, one run
parsed)."""

from __future__ import annotations

import re
import socket
import subprocess
import time
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_name() -> str:
    """`lscpu`'s model name."""
    for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
        if line.startswith("Model name"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


def children(pid: int) -> list[int]:
    """The pids whose parent is `pid` (a supervisor's workers), from /proc."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if int((d / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(d.name))
            except OSError:
                continue
    return sorted(out)


def start_redis(workdir: Path) -> tuple[subprocess.Popen, str]:
    """A redis-server without persistence on a free port: (its process, its URL)."""
    port = free_port()
    proc = subprocess.Popen(["redis-server", "--port", str(port), "--save", "", "--appendonly", "no", "--dir",
                             str(workdir)], stdout=subprocess.DEVNULL)
    time.sleep(0.5)
    return proc, f"redis://127.0.0.1:{port}/0"


def wrk_script(bodies: list[str] | list[bytes], path: Path) -> None:
    """A wrk Lua script sending `bodies` in turn (POST, JSON), writing each non-200 answer to stderr."""
    items = ",\n".join("[==[" + (b.decode() if isinstance(b, bytes) else b) + "]==]" for b in bodies)
    path.write_text(f"""local bodies = {{{items}}}
wrk.method = "POST"
wrk.body = bodies[1]
wrk.headers["Content-Type"] = "application/json"
local n = 0
function request()
  n = n % #bodies + 1
  return wrk.format(nil, nil, nil, bodies[n])
end
function response(status, headers, body)
  if status ~= 200 then io.stderr:write("status " .. status .. ": " .. body .. "\\n") end
end
""")


def run_wrk(url: str, script: Path, conns: int, seconds: float) -> dict:
    """One `wrk -t1 --latency` run: requests/s, requests, p50 and p99 (ms), non-200 answers (`errors`)."""
    p = subprocess.run(["wrk", "-t1", f"-c{conns}", f"-d{int(seconds)}s", "--latency", "-s", str(script), url],
                       capture_output=True, text=True, timeout=seconds + 60, check=True)

    def ms(q: str) -> float:
        v, unit = re.search(rf"{q}%\s+([\d.]+)(us|ms|s)", p.stdout).groups()
        return float(v) * {"us": 1e-3, "ms": 1.0, "s": 1e3}[unit]

    return {"rps": float(re.search(r"Requests/sec:\s+([\d.]+)", p.stdout).group(1)),
            "requests": int(re.search(r"(\d+) requests in", p.stdout).group(1)),
            "p50": ms("50"), "p99": ms("99"), "errors": p.stderr.count("status ")}
