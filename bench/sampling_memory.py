"""Memory and speed of sampling from a blocked HMM (VL-HMM): the chunked inverse CDF that `CategoricalTable`
uses for tables above `sampling.ALIAS_MAX_ENTRIES` against alias tables (what every table used before, the
baseline), each in a fresh process.

Per run: the time to build the temperature-1 tables (once per model, on the first sample request), the
process's peak memory while building them and what they keep (VmHWM / VmRSS against the loaded model), and
ms per sampling step (`BlockedHMM.sample`, n samples x 20 tokens, no stop token) at temperature 1 (tables
built once) and 0.7 (tables built per request, as the service does for any temperature but 1: their build is
in the figure, spread over the 20 steps). "default" is what `CategoricalTable` picks by size (the column
names the transition table's sampler), "alias" forces alias tables on every table, as before, and "torch draws"
is "default" with the chunked sampler's draws at T != 1 taken by its torch path instead of the compiled pass
(`kernels.alias.tempered_draws`), their baseline. Alias tables
are skipped where they would not fit (16 bytes per transition entry kept, 32 at the peak of their build: a
2^15-state model's would keep 16 GiB); `--store DIR --model NAME` samples a stored blocked_hmm instead of a
random one.

    python bench/sampling_memory.py [--shapes 64x64,128x256] [--out bench/results/sampling_memory.md]
    python bench/sampling_memory.py --store DIR --model NAME
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hmm_inference import append_section, machine, run_heading  # noqa: E402

V = 10_000
ALIAS_FITS_BYTES = 8 << 30  # largest alias build this bench attempts (32 bytes per entry at its peak)

CHILD = r"""
import json, sys, time
import torch
from latentlm.models import sampling
from latentlm.models.blocked_hmm import BlockedHMM

def kib(key):
    return int(open('/proc/self/status').read().split(key + ':')[1].split()[0])

shape, method, store, name = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
if store:
    from latentlm import ops
    model = ops.load_model(store, name).impl
else:
    M, k = (int(x) for x in shape.split('x'))
    Z, V = M * k, int(sys.argv[5])
    g = torch.Generator().manual_seed(0)
    trans = torch.rand(Z, Z, generator=g)
    trans /= trans.sum(1, keepdim=True)
    word_cluster = torch.arange(V) % M
    emit = torch.rand(V, k, generator=g)
    emit /= torch.zeros(M, k).index_add_(0, word_cluster, emit)[word_cluster]
    model = BlockedHMM(torch.full((Z,), 1.0 / Z), trans, emit, word_cluster, M)
if method == 'alias':  # the baseline: alias tables whatever the size
    sampling.ALIAS_MAX_ENTRIES = sampling.TEMPERED_ALIAS_MAX_ENTRIES = 1 << 62
if method == 'torch draws':  # the baseline of the compiled draws at T != 1: the torch path for them
    compiled = sampling.ChunkedCDF._compiled
    sampling.ChunkedCDF._compiled = lambda self: self.temperature == 1.0 and compiled(self)
base = kib('VmRSS')
open('/proc/self/clear_refs', 'w').write('5')
t0 = time.perf_counter()
trans_table = model.sampling_tables(1.0)[0]
build = time.perf_counter() - t0
out = {'build_s': build, 'trans_sampler': 'alias' if trans_table.cdf is None else 'chunked',
       'peak_mib': (kib('VmHWM') - base) / 1024, 'kept_mib': (kib('VmRSS') - base) / 1024,
       'step_ms': {}}
for temperature in (1.0, 0.7):
    for n in (1, 16, 256):
        model.sample(n, 2, torch.Generator().manual_seed(1), temperature=temperature)  # warm-up
        t0 = time.perf_counter()
        model.sample(n, 20, torch.Generator().manual_seed(2), temperature=temperature)
        out['step_ms'][f'{temperature} x {n}'] = (time.perf_counter() - t0) / 20 * 1e3
print(json.dumps(out))
"""


def run(shape: str, method: str, store: str, name: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", CHILD, shape, method, store, name, str(V)],
                          capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        return {"error": (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="64x64,128x256", help="clusters x states per cluster, comma-separated")
    ap.add_argument("--store", default="")
    ap.add_argument("--model", default="")
    ap.add_argument("--out", default="bench/results/sampling_memory.md")
    args = ap.parse_args()
    shapes = [args.model] if args.store else args.shapes.split(",")
    lines = run_heading(machine())
    lines += ["Command: `python " + " ".join(sys.argv) + "`", "",
              "| model | states | tables (transition sampler) | build (s) | peak over the model (MiB) | kept (MiB) | "
              "ms/step T=1, n=1 / 16 / 256 | ms/step T=0.7, n=1 / 16 / 256 |", "|---|---|---|---|---|---|---|---|"]
    for shape in shapes:
        if args.store:
            Z = json.loads((Path(args.store) / shape / "manifest.json").read_text())["config"]["num_states"]
        else:
            M, k = (int(x) for x in shape.split("x"))
            Z = M * k
        for method in ("default", "torch draws", "alias"):
            if method == "alias" and 32 * Z * Z > ALIAS_FITS_BYTES:
                got = {"error": f"not run: alias tables would peak at {32 * Z * Z / 2 ** 30:.0f} GiB "
                                f"and keep {16 * Z * Z / 2 ** 30:.0f} GiB"}
            else:
                got = run(shape, method, args.store, args.model)
            print(shape, method, got, flush=True)
            if "error" in got:
                lines.append(f"| {shape} | {Z:,} | {method} | {got['error']} | | | | |")
                continue
            ms = got["step_ms"]
            t1 = " / ".join(f"{ms[f'1.0 x {n}']:.2f}" for n in (1, 16, 256))
            t07 = " / ".join(f"{ms[f'0.7 x {n}']:.1f}" for n in (1, 16, 256))
            label = f"{method}: {got['trans_sampler']}"
            lines.append(f"| {shape} | {Z:,} | {label} | {got['build_s']:.2f} | {got['peak_mib']:,.0f} | "
                         f"{got['kept_mib']:,.0f} | {t1} | {t07} |")
    append_section(Path(args.out), "Sampling tables: memory and speed (bench/sampling_memory.py)", lines + [""])


if __name__ == "__main__":
    main()
