"""Every BLAS and batch engine the process can call gives the same numbers (so the measured choice of
`models.calibrate` only changes speed), and the choice is recorded, used and reported."""

from __future__ import annotations

import pytest
import torch

from latentlm.models import backend as dispatch
from latentlm.models import calibrate, chain
from latentlm.models.backend import Backend, Choice
from latentlm.models.hmm import DenseHMM
from latentlm.models.kernels import blas
from latentlm.models.kernels.jit import HAVE_NUMBA
from latentlm.models.synthetic import random_hmm

pytestmark = pytest.mark.skipif(not HAVE_NUMBA, reason="numba unavailable: no compiled engines to choose from")


def _problem(K: int, dtype: torch.dtype, B: int = 7, T: int = 9):
    g = torch.Generator().manual_seed(K)
    trans = torch.softmax(torch.randn(K, K, generator=g, dtype=dtype) * 2, 1)
    emit = torch.rand(B, T, K, generator=g, dtype=dtype)
    init = torch.softmax(torch.randn(B, K, generator=g, dtype=dtype), 1)
    lengths = torch.tensor([T, 1, 4, T, 0, 2, T - 1][:B])
    return init, emit, trans, lengths


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("K", [5, 64, 200, 600])
def test_every_blas_and_engine_gives_the_same_results(dtype, K):
    init, emit, trans, lengths = _problem(K, dtype)
    ref_lc, _ = chain.forward(init, emit, trans, lengths, backend="torch")
    ref_post, _ = chain.posterior(init, emit, trans, lengths, backend="torch")
    tol = dict(rtol=2e-4, atol=2e-5) if dtype == torch.float32 else dict(rtol=1e-10, atol=1e-12)
    ran = []
    for engine, provider in calibrate.candidates(K):
        for marginals in (False, True):
            dispatch.CHOICES[(K, dtype, marginals)] = Choice(engine, provider, {})
            assert dispatch.provider(K, dtype, marginals) == (provider or blas.DEFAULT_PROVIDER)
        lc, _ = chain.forward(init, emit, trans, lengths, backend=engine)
        post, _ = chain.posterior(init, emit, trans, lengths, backend=engine)
        torch.testing.assert_close(lc, ref_lc, **tol)
        torch.testing.assert_close(post, ref_post, **tol)
        ran.append(calibrate.label(engine, provider))
    assert "torch" in ran and len(ran) >= 2


def test_both_blas_libraries_load_here():
    """torch's wheel exports MKL and numpy's bundles OpenBLAS on x86-64 Linux: both must be callable, or
    the choice between them silently degrades to one."""
    import platform

    if platform.machine() != "x86_64":
        pytest.skip("the wheels differ off x86-64")
    assert set(blas.PROVIDERS) == {"mkl", "openblas"}
    assert blas.PROVIDERS["openblas"].int_dtype.__name__ == "int64"  # numpy's OpenBLAS is ILP64


def test_calibration_records_the_fastest_and_the_auto_choice_follows_it(monkeypatch):
    t, c = random_hmm(48, 30, 0)
    m = DenseHMM.from_tensors(t, c)
    described = m.calibrate()
    assert described is not None and described["calibrated"]
    default = calibrate.label(*calibrate.candidates(48)[0])
    for op, marginals in calibrate.OPERATIONS.items():  # scoring and posteriors, each measured
        choice = dispatch.CHOICES[(48, torch.float32, marginals)]
        ms = choice.timings_ms
        chosen, fastest = calibrate.label(choice.engine, choice.provider), min(ms, key=ms.get)
        assert chosen == fastest or (chosen == default and ms[fastest] > calibrate.MARGIN * ms[default])
        assert set(ms) == {calibrate.label(e, p) for e, p in calibrate.candidates(48)}
        assert described["engines"][op] == chosen
    assert m.describe()["backend"]["engines"] == described["engines"]
    # the auto engine of a batch call is the recorded one, whichever it is, per kind of call
    init, emit, trans, _ = _problem(48, torch.float32)
    dispatch.CHOICES[(48, torch.float32, False)] = Choice(Backend.TORCH, "", {})
    dispatch.CHOICES[(48, torch.float32, True)] = Choice(Backend.GROUPS, "", {})
    assert dispatch.sum_product(Backend.AUTO, emit, trans, init, rows=8) is Backend.TORCH
    assert dispatch.sum_product(Backend.AUTO, emit, trans, init, rows=8, marginals=True) is Backend.GROUPS
    assert dispatch.sum_product(Backend.AUTO, emit, trans, init, rows=1) is Backend.SINGLE  # one sequence


def test_calibration_declines_what_no_compiled_engine_runs():
    trans = torch.softmax(torch.randn(8, 8, requires_grad=True), 1)
    assert calibrate.calibrate(trans) is None
    assert not dispatch.CHOICES


def test_one_sequence_with_marginals_is_not_given_the_batch_choice():
    """The calibration times batches; one sequence's posterior runs on "groups" whatever it chose (a one-row
    GEMM per step on one thread measured 1.4k tokens/s where "groups" ran 5.5k at Z = 1,024)."""
    init, emit, trans, lengths = _problem(600, torch.float32, B=1)
    for marginals in (False, True):
        dispatch.CHOICES[(600, torch.float32, marginals)] = Choice(Backend.LOCKSTEP, None, {})
    assert dispatch.sum_product("auto", emit, trans, init, rows=1, marginals=True) is Backend.GROUPS
    assert dispatch.sum_product("auto", emit, trans, init, rows=1) is Backend.SINGLE
    assert dispatch.sum_product("auto", emit, trans, init, rows=8, marginals=True) is Backend.LOCKSTEP


def _calibrate_shared(path: str, K: int, start: float) -> tuple[dict, bool]:
    """In a fresh process: share calibrations through `path`, calibrate a K x K matrix; (choices, read?)."""
    import logging
    import time

    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda r: records.append(r.getMessage())  # type: ignore[method-assign]
    logging.getLogger("latentlm.models.calibrate").addHandler(handler)
    logging.getLogger("latentlm.models.calibrate").setLevel(logging.INFO)
    torch.set_num_threads(1)
    calibrate.share_with(path)
    time.sleep(max(0.0, start - time.time()))  # both processes start together
    chosen = calibrate.calibrate(_problem(K, torch.float32)[2], rounds=2)
    assert chosen is not None
    return ({op: (c.engine.value, c.provider) for op, c in chosen.items()},
            any("read from" in m for m in records))


def test_processes_that_share_a_file_measure_once_and_agree(tmp_path):
    """Two workers calibrating the same matrix size together: one measures (the other waits on the file's lock)
    and both use its choice; a file that is not JSON, or names a BLAS this process lacks, is measured again."""
    import concurrent.futures
    import json
    import multiprocessing
    import time

    path = tmp_path / "calibration.json"
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(2, mp_context=ctx) as pool:
        start = time.time() + 5
        a, b = pool.map(_calibrate_shared, [str(path)] * 2, [96, 96], [start, start])
    assert a[0] == b[0]
    assert sorted([a[1], b[1]]) == [False, True]  # one measured, one read
    data = json.loads(path.read_text())
    assert list(data) == ["96/float32/1 threads"] and set(data["96/float32/1 threads"]) == {"score", "posterior"}

    entry = data["96/float32/1 threads"]
    entry["score"]["provider"] = "no-such-blas"
    path.write_text(json.dumps(data))
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=ctx) as pool:
        _, read = pool.submit(_calibrate_shared, str(path), 96, 0.0).result()
    remeasured = json.loads(path.read_text())["96/float32/1 threads"]["score"]["provider"]
    assert not read and (remeasured == "" or remeasured in blas.PROVIDERS)  # "": an engine that calls no BLAS
    path.write_text("not json")
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=ctx) as pool:
        _, read = pool.submit(_calibrate_shared, str(path), 96, 0.0).result()
    assert not read and "96/float32/1 threads" in json.loads(path.read_text())
