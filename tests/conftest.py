import atexit
import os
import shutil
import sys
import tempfile
import time

# Two pytest-xdist workers, and the processes their tests start, share the cores. An
# OpenMP thread done with its part of an op sleeps at once instead of spinning for the
# next: spinning, it took the core another process needed (a SmolLM2 test took 20 s
# beside a copy of itself, 7.5 s alone, 7.6 s beside it with this). Set before torch
# loads its OpenMP runtime; inherited by every process a test starts.
# (A pytest plugin that imported torch first leaves this process's OpenMP as it was; the
# processes its tests start still take the setting.)
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# vLLM's engines (TRL's server's, ours) make their ZeroMQ sockets in this folder and leave them there: a
# folder of this process's, removed when it exits (every engine it started has stopped by then).
_VLLM_SOCKETS = tempfile.mkdtemp(prefix="llamarl-test-vllm-ipc-")
os.environ["VLLM_RPC_BASE_PATH"] = _VLLM_SOCKETS
atexit.register(shutil.rmtree, _VLLM_SOCKETS, ignore_errors=True)

import pytest  # noqa: E402
import torch  # noqa: E402

from llamarl_core.control.auth import SECRET_ENV, new_secret

# The weight syncs authenticate their Store values with a secret (auth.py): the tests'
# processes, and the workers they start, share one through the environment, as a
# user's ranks may. The README's examples run without it (test_readme.py): they pass
# theirs explicitly.
os.environ.setdefault(SECRET_ENV, new_secret().hex())

# Without a GPU the Triton kernels run on CPU tensors in Triton's interpreter. The
# variable must be set before any @triton.jit decorator runs (set later, launches
# fail with "0 active drivers").
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    if os.environ["TRITON_INTERPRET"] not in ("", "0"):
        # Decorated now, with the interpreter on: a test that turns it off (the torch
        # CPU path) and happens to import a kernel module first would leave its
        # kernels decorated for a GPU, and every later interpreted launch failing.
        import llamarl_core.kernels.fp8_quant  # noqa: F401
        import llamarl_core.kernels.logprob  # noqa: F401

sys.path.insert(0, os.path.dirname(__file__))


def _simd_levels():
    """The host's vector levels this CPU runs (host/simd.h: 0 plain, 1 AVX2, 2 AVX-512)."""
    from llamarl_core._native import native

    native().set_host_simd(2)
    return list(range(native().host_simd() + 1))


@pytest.fixture(params=_simd_levels(), ids=lambda level: ["plain", "avx2", "avx512"][level])
def simd(request):
    """The host's byte loops (checksum, delta codec, copy cast) capped at each vector
    level the CPU has, then uncapped: a test taking it runs once a level."""
    from llamarl_core._native import native

    before = native().set_host_simd(request.param)
    yield request.param
    native().set_host_simd(before)


@pytest.hookimpl(trylast=True)  # after -m / -k have deselected: the order of the tests that run
def pytest_collection_modifyitems(config, items):
    items[:] = gpu_order(items)
    # With a GPU the CPU tests' Triton cases run on CUDA tensors ("triton-cuda"); they are
    # not marked gpu: `pytest -m gpu` (llamarl check gpu) takes only the tests written for a GPU.
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def gpu_order(items: list) -> list:
    """The tests marked gpu(seconds=N) first, longest first, each followed by one other
    test, then the rest in their collected order (every pytest-xdist worker computes
    the same order). `pytest -m gpu -n 8 --dist load` (llamarl check gpu) hands each
    worker two consecutive tests first, then more from the front as it finishes: the
    long tests start at once, none behind another on one worker (a 58 s test collected
    late set an H200's 118 s for `pytest -m gpu -n 6`). N: the test's seconds on an H200
    (bench/gpu/), for this order alone. Without such a test the order is unchanged."""
    long = sorted((item for item in items if _gpu_seconds(item)), key=_gpu_seconds, reverse=True)
    rest = [item for item in items if not _gpu_seconds(item)]
    paired = [item for pair in zip(long, rest) for item in pair]
    return paired + long[len(rest):] + rest[len(long):]


def _gpu_seconds(item) -> float:
    marker = item.get_closest_marker("gpu")
    return marker.kwargs.get("seconds", 0) if marker is not None else 0


def pytest_addoption(parser):
    parser.addoption("--cpu-log", metavar="PATH",
                     help="append each test's id, wall seconds and the machine's busy CPU seconds over it (all cores, "
                          "from /proc/stat), its pytest-xdist worker and its start (Unix time) to PATH, "
                          "tab-separated: where the suite's time goes, whether a test computes or waits, and how "
                          "the workers' loads end")


def _busy_cpu_seconds() -> float:
    with open("/proc/stat") as f:
        ticks = [int(x) for x in f.readline().split()[1:]]
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")  # all but idle and iowait


def pytest_sessionstart(session):
    if session.config.pluginmanager.hasplugin("dsession"):
        return  # pytest-xdist's controller: it runs no test
    # The forkserver the tests' rank processes are forked from (helpers.run_processes)
    # starts now, before the test modules are imported, with the session's environment
    # and sys.path: started inside a test, it would keep that test's monkeypatched
    # variables for the rest of the session.
    # TRITON_INTERPRET stays on there: Triton's own @jit builtins (tl.max among them) are
    # interpretable only if the interpreter was on when the server imported Triton (with
    # transformers), whatever the environment of a rank process forked later.
    # It imports the rank processes' own modules too (helpers, and through it this
    # package's sync; the pipeline): each forked process starts with them imported.
    # Python 3.11's server finds them from its working directory first: launched from
    # tests/, not from the repository's root, whose unbuilt package would shadow the
    # installed one (the session is single-threaded here: the chdir is undone at once).
    from llamarl_core import forkserver

    cwd = os.getcwd()
    os.chdir(os.path.dirname(os.path.abspath(__file__)))
    try:
        forkserver.start(preload=["llamarl_core.pipeline", "helpers"])
    finally:
        os.chdir(cwd)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    path = item.config.getoption("--cpu-log")
    if path is None:
        yield
        return
    busy, start, began = _busy_cpu_seconds(), time.monotonic(), time.time()
    yield
    worker = os.environ.get("PYTEST_XDIST_WORKER", "-")
    with open(path, "a") as log:
        log.write(f"{item.nodeid}\t{time.monotonic() - start:.2f}\t{_busy_cpu_seconds() - busy:.2f}\t{worker}"
                  f"\t{began:.1f}\n")
