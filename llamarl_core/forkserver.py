"""The server process that this host's executors (and the test suite's rank
processes) are forked from: a single-threaded process that has imported torch,
torch.distributed and transformers' Llama once (and this package's executors,
where it finds the package its parent imported) and never ran an op, so forking
it is safe and a child starts with those imports done (the executors' part of
it measured in bench/RESULTS.md, the suite's time).

`start()` launches it and returns without waiting for its imports (it first asks
a fresh interpreter where it finds this package, a few hundredths of a second);
it imports PRELOAD while its caller goes on with
imports of its own (on 2 cores, `llamarl train`'s first executor
then starts about 3 s sooner than when the server is launched by that first
start). The first process started through `context()` waits for the imports
to be done; a server already running is reused as it is. Importing this module
imports neither torch nor this package's pipeline.

The server, and every process forked from it, runs with GOMP_SPINCOUNT=10000
(unless the caller's environment sets GOMP_SPINCOUNT or OMP_WAIT_POLICY):
torch's OpenMP threads spin that many times, not libgomp's default 300,000
(milliseconds), before they sleep at the end of a parallel region. The
executors of a host share its cores: a trainer's threads spinning after each op
took the cores its generator and reward executor were waiting for. On 2 cores,
`llamarl train --compare --steps 400` (3 runs each, alternated): sync step
46.8 -> 40.0 ms (medians), the command's CPU time 71-73 -> 61-67 CPU-s, the async
step unchanged (bench/RESULTS.md).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.context
import multiprocessing.forkserver
import multiprocessing.resource_tracker
import multiprocessing.spawn
import os
import select
import signal
import subprocess
import threading
from collections.abc import Sequence

# Third-party modules: the server imports them on a sys.path that need not be its
# parent's (Python 3.11 puts the working directory first: from a source checkout it
# would find this package's unbuilt tree); a process forked from it takes its
# parent's sys.path and working directory. This package's executors (EXECUTORS) are
# preloaded too where a fresh interpreter here finds the package this process
# imported (_finds_this_package); a caller that knows where the server starts adds
# its own modules (start's preload).
PRELOAD = ["torch.distributed", "transformers.models.llama.modeling_llama"]
EXECUTORS = "llamarl_core.pipeline.executors.run"
TRACKER_WAIT_S = 5.0  # stop() waits this long at most for the resource tracker to end
OMP_SPIN = ("GOMP_SPINCOUNT", "10000")  # the server's OpenMP spin (see above)


def context() -> multiprocessing.context.ForkServerContext:
    """The multiprocessing context whose processes fork from the server (launched
    now, as `start()` does, unless it runs already)."""
    _launch()
    return multiprocessing.get_context("forkserver")


def start(preload: Sequence[str] = ()) -> None:
    """Launch the server now, without waiting for its imports (nothing if it runs
    already). It starts with SIGINT ignored (Ctrl-C reaches the terminal's whole
    process group; the server ignores it once its imports are done, and is stopped
    by its parent's exit), and so do the processes forked from it, unless they set
    their own handler; and with OMP_SPIN in its environment (not in this process's).
    `preload`: more modules for the server to import after PRELOAD (and EXECUTORS,
    where it finds this package), when this call launches it (a server running
    already is kept as it is; one relaunched later, the first having died, imports
    PRELOAD alone). The server finds
    them on its own sys.path: on Python 3.11 that begins with this process's
    working directory, not with this process's sys.path (3.12.8 and later take the
    latter). A module that fails to import there is skipped, as the stdlib's
    server skips it. ValueError, before anything starts, for a preload that is not
    a sequence of dotted module names."""
    try:
        names = None if isinstance(preload, (str, bytes)) else tuple(preload)
    except TypeError:  # not iterable
        names = None
    if names is None or not all(isinstance(name, str) and all(part.isidentifier() for part in name.split("."))
                                for name in names):
        raise ValueError(f"preload must be a sequence of dotted module names, got {preload!r}")
    _launch(names)


def _finds_this_package() -> bool:
    """Whether a server launched now would import this package from where this
    process did: asked of a fresh interpreter started as the server is (this
    executable, its flags, environment and working directory), which searches
    sys.path as the server does on Python 3.11 (its working directory first). Not
    where a working directory holds another llamarl_core (a source checkout beside
    an installed package), nor where this process found the package through a
    sys.path entry it added itself; False on any failure of the question."""
    code = ("import importlib.util, sys; spec = importlib.util.find_spec('llamarl_core'); "
            "sys.stdout.write(spec.origin or '' if spec else '')")
    try:
        found = os.fsdecode(subprocess.run([multiprocessing.spawn.get_executable(),
                                            *subprocess._args_from_interpreter_flags(), "-c", code],
                                           capture_output=True, timeout=10, check=True).stdout)
        return bool(found) and os.path.realpath(found) == os.path.realpath(os.path.join(os.path.dirname(__file__),
                                                                                          "__init__.py"))
    except (OSError, ValueError, subprocess.SubprocessError):  # ValueError: a path it could not decode
        return False


def _launch(preload: tuple[str, ...] = ()) -> None:
    context = multiprocessing.get_context("forkserver")
    if multiprocessing.forkserver._forkserver._forkserver_pid is None:  # this call launches it: what it imports
        own = [EXECUTORS] if _finds_this_package() else []
        context.set_forkserver_preload(PRELOAD + own + [name for name in preload if name not in PRELOAD + own])
    main = threading.current_thread() is threading.main_thread()  # signal handlers are the main thread's
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN) if main else None  # ignored stays ignored across exec
    spin = not {OMP_SPIN[0], "OMP_WAIT_POLICY"} & set(os.environ)
    if spin:
        os.environ[OMP_SPIN[0]] = OMP_SPIN[1]
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        # What a relaunch by the stdlib itself (a process started after the server died) imports:
        # the third-party modules alone, wherever the working directory is then.
        context.set_forkserver_preload(PRELOAD)
        if spin:
            del os.environ[OMP_SPIN[0]]
        if main:
            signal.signal(signal.SIGINT, previous)


def stop() -> None:
    """End the server this process started, if any, at once: SIGKILL, for it holds
    nothing to finish, and its own exit spends about a second tearing down torch
    and transformers, which whoever reads this process's output waits for (the
    server writes to the same stdout and stderr). For a process's last moments,
    once every process forked from the server has ended."""
    server = multiprocessing.forkserver._forkserver  # the stdlib's one server per process
    if server._forkserver_pid is not None:
        # OSError: gone already, or its socket's folder removed by multiprocessing's atexit clean-up.
        with contextlib.suppress(OSError):
            os.kill(server._forkserver_pid, signal.SIGKILL)
            server._stop()  # closes the server's "alive" pipe, reaps it, unlinks its socket
    # The resource tracker the server started ends once the last holder of its pipe has
    # closed it (this process, now; the server's copy went with it), after unlinking what
    # was left registered. Waited for, up to TRACKER_WAIT_S, so that no process of this
    # command outlives it; one still holding the pipe (a child not yet gone) is not waited on.
    tracker = multiprocessing.resource_tracker._resource_tracker
    if tracker._fd is not None:
        with contextlib.suppress(OSError):
            os.close(tracker._fd)
            tracker._fd = None
            exited = os.pidfd_open(tracker._pid)
            try:
                if select.select([exited], [], [], TRACKER_WAIT_S)[0]:
                    os.waitpid(tracker._pid, 0)
                    tracker._pid = None
            finally:
                os.close(exited)
