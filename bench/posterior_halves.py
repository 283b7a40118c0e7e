"""One sequence's posterior: two threads meeting in the middle (`sum_product.posterior_halves`) against the
step-by-step recursion on one thread ("groups" engine), over lengths T and state counts K; places
`models.backend.HALVES_MIN_WORK` / `HALVES_STEP_COST` (where handing the halves to two threads pays).

    python bench/posterior_halves.py > table.md

Random row-stochastic matrix, emissions read by row from a 1,000-row table; each time is the best of at least
5 calls (0.3 s). Prints a markdown table.
"""

from __future__ import annotations

import time

import torch

from latentlm.models import chain
from latentlm.models.chain import RowLookup
from latentlm.models.kernels import sum_product


def timed(f, budget: float = 0.3) -> float:
    f()
    n, best, t_end = 0, 1e9, time.perf_counter() + budget
    while n < 5 or time.perf_counter() < t_end:
        t0 = time.perf_counter()
        f()
        best = min(best, time.perf_counter() - t0)
        n += 1
    return best


def main() -> None:
    torch.manual_seed(0)
    print("| K | T | T K^2 | one thread ms | halves ms | halves / one |")
    print("|---|---|---|---|---|---|")
    for K in (32, 64, 128, 256, 512, 1024):
        trans = torch.rand(K, K) ** 3
        trans /= trans.sum(1, keepdim=True)
        table, init = torch.rand(1000, K), torch.full((1, K), 1.0 / K)
        for T in (20, 50, 200, 1000, 10000):
            if K >= 512 and T > 1000:
                continue
            rows, lengths = torch.randint(1000, (1, T)), torch.tensor([T])

            def one(rows=rows, lengths=lengths, trans=trans, table=table, init=init):
                emit = RowLookup(table, rows)
                log_cond, alphas = chain._forward_steps(init, emit, trans, lengths, True, None, "groups")
                return chain.backward(emit, trans, lengths, log_cond, alphas=alphas, backend="groups")

            def halves_call(rows=rows, trans=trans, table=table, init=init, T=T):
                return sum_product.posterior_halves(init, table, rows, trans, T)

            halves = timed(halves_call)
            step = timed(one)
            print(f"| {K} | {T} | {T * K * K:,} | {step * 1e3:.3f} | {halves * 1e3:.3f} | {step / halves:.2f}x |",
                  flush=True)


if __name__ == "__main__":
    main()
