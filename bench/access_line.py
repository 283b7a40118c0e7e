"""Cost of formatting one access line: uvicorn's `AccessFormatter` against `service.server.PlainAccessFormatter`
(the same text, no record copies), over the same 50,000 access records, `--runs` times each, alternated. Prints
µs per line; the figures are quoted in bench/results/hot_path.md (run 4).

    python bench/access_line.py [--records 50000] [--runs 3]
"""

from __future__ import annotations

import argparse
import logging
import time

import uvicorn.logging

from latentlm.service.server import UVICORN_ACCESS_FORMAT, PlainAccessFormatter


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--records", type=int, default=50_000)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    formatters = {"uvicorn AccessFormatter": uvicorn.logging.AccessFormatter(UVICORN_ACCESS_FORMAT, use_colors=False),
                  "PlainAccessFormatter": PlainAccessFormatter()}
    records = [logging.LogRecord("uvicorn.access", logging.INFO, __file__, 1, '%s - "%s %s HTTP/%s" %d',
                                 (f"127.0.0.1:{5000 + i % 64}", "POST", "/v1/score", "1.1", 200), None)
               for i in range(args.records)]
    assert len({f.format(records[0]) for f in formatters.values()}) == 1  # the same line
    for run in range(args.runs):
        for name, f in formatters.items():
            t0 = time.perf_counter()
            for r in records:
                f.format(r)
            print(f"run {run}: {name}: {(time.perf_counter() - t0) / len(records) * 1e6:.2f} µs a line")


if __name__ == "__main__":
    main()
