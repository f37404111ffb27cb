"""Where a run's executors run, for the controller: processes it forks on its own
host (`llamarl train`), or torchrun ranks on any number of hosts that wait for an
assignment from the controller's rank (`llamarl_core.launch`). Both start an
executor with `run_executor` on a Store the controller also reaches, and the
controller talks to it through the same queues in that Store either way.

    executors = LocalExecutors()                      # or LaunchedExecutors(store, placement, ...)
    store = executors.open_store(timeout_s)           # the run's Store; executors.secret, the run's secret
    executors.start(GENERATOR, 0, config_dict, extra)
    executors.exited()                                # [(role, rank, why)] of the dead
    executors.stop(GENERATOR, 0)                      # SIGKILL a generator rank (if restartable)
    executors.shutdown(grace_s, unready)              # end the unready at once, then the rest (see shutdown)
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import secrets
import signal
import time
from multiprocessing.process import BaseProcess
from pathlib import Path

import torch.distributed as dist

from .. import forkserver
from ..control import auth
from .executors import GENERATOR, TRAINER, executor_main
from ..control import HeartbeatWatch, StoreQueue

# How long an executor still setting up when its run stops has, after SIGTERM, to exit.
TERMINATE_S = 2.0
# How long a reward executor or one of our generator ranks has to exit after Stop
# before SIGTERM: each reads its inbox between requests, and holds nothing a run keeps.
STOP_S = 2.0


class LocalExecutors:
    """Executor processes forked on this host; a dead one can be replaced. They are
    forked from llamarl_core.forkserver's server, which has imported torch and
    transformers once: three processes no longer import the same modules at once
    (on 2 cores, a cold run's trainer started its warm-up about 3 s in instead of
    5.5 s), and later runs in the same process start their executors at once.
    `llamarl train` launches that server before importing the pipeline, so its
    imports and the controller's run side by side."""

    restartable = True

    def __init__(self, out_dir: Path, engine: bool = False):
        # engine: the generator is an engine that starts processes of its own (vLLM, or one of the user's)
        self.out, self.engine = Path(out_dir), engine
        self.ctx = forkserver.context()
        self.procs: dict[tuple[str, int], BaseProcess] = {}
        self.store: dist.TCPStore | None = None
        self.secret: bytes | None = None

    def open_store(self, timeout_s: float) -> dist.Store:
        """A Store of the run's own, served by this process on the loopback (a
        TCPStore listens on every interface: what it reads is trusted by the run's
        secret, made here and handed to the executors in their arguments)."""
        self.secret = auth.new_secret()
        self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                   timeout=datetime.timedelta(seconds=timeout_s))
        return self.store

    def start(self, role: str, rank: int, config_dict: dict, extra: dict) -> None:
        proc = self.ctx.Process(
            target=executor_main, name=f"llamarl-{role}-{rank}",
            args=(role, rank, config_dict, self.store.port, extra, self.secret),
            # An engine (vLLM's, or a user's) starts processes of its own, which a daemon may not;
            # like every executor it exits by itself once the controller is gone (Link.get).
            daemon=not (role == GENERATOR and self.engine),
        )
        proc.start()
        self.procs[(role, rank)] = proc
        pids = {f"{r}/{k}": p.pid for (r, k), p in self.procs.items()}
        # For monitoring; replaced whole (a reader never sees it half-written).
        tmp = self.out / "executors.json.tmp"
        tmp.write_text(json.dumps(pids, indent=2) + "\n")
        os.replace(tmp, self.out / "executors.json")

    def exited(self) -> list[tuple[str, int, str]]:
        return [(role, rank, f"exited (code {proc.exitcode})") for (role, rank), proc in self.procs.items()
                if not proc.is_alive()]

    def stop(self, role: str, rank: int) -> None:
        self._kill(role, self.procs.pop((role, rank)))

    def _kill(self, role: str, proc) -> None:
        """SIGKILL an executor. An engine generator leads a process group of its own
        (executor_main), which holds its processes (vLLM's engine core and workers,
        which watch for no parent): the whole group goes."""
        if role == GENERATOR and self.engine:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        else:
            proc.kill()
        proc.join(timeout=5)

    def shutdown(self, grace_s: float, unready=frozenset()) -> None:
        """After Stop went to every inbox: end the executors in `unready`
        ((role, rank) of those that never reported ready: still setting up, they
        read no inbox, and hold nothing a run keeps) at once, but an engine
        generator (its engine, once started, shuts down in order): SIGTERM (they
        exit through their clean-up, executor_main), SIGKILL after TERMINATE_S.
        Then wait up to grace_s for the trainer ranks (a checkpoint queued before
        Stop is written) and an engine generator (its engine shuts down in order),
        and up to STOP_S of it for the reward executors and our generator ranks,
        which hold nothing a run keeps: one still busy then (a reward function that
        hangs) gets SIGTERM, then SIGKILL TERMINATE_S later. Kill what is left (an
        engine generator's group always: a dead engine executor may leave its
        engine's processes behind)."""
        self._terminate([(role, self.procs[(role, rank)]) for role, rank in unready
                         if (role, rank) in self.procs and not (role == GENERATOR and self.engine)])
        keeps = {key for key in self.procs if key[0] == TRAINER or (key[0] == GENERATOR and self.engine)}
        start = time.monotonic()
        others = [(key[0], proc) for key, proc in self.procs.items() if key not in keeps]
        for _, proc in others:  # while the trainer ranks go on with their checkpoint
            proc.join(timeout=max(start + min(grace_s, STOP_S) - time.monotonic(), 0.1))
        self._terminate([(role, proc) for role, proc in others if proc.is_alive()])
        for key in keeps:
            self.procs[key].join(timeout=max(start + grace_s - time.monotonic(), 0.1))
        for (role, _), proc in self.procs.items():
            if proc.is_alive() or (role == GENERATOR and self.engine):
                self._kill(role, proc)

    def _terminate(self, ending: list[tuple[str, BaseProcess]]) -> None:
        """SIGTERM each (role, process) of `ending` (an executor exits through its
        clean-up, executor_main), SIGKILL those still alive TERMINATE_S later."""
        for _, proc in ending:
            proc.terminate()
        deadline = time.monotonic() + TERMINATE_S
        for role, proc in ending:
            proc.join(timeout=max(deadline - time.monotonic(), 0.1))
            if proc.is_alive():
                self._kill(role, proc)


def run_secret(job_secret: bytes, prefix: str) -> bytes:
    """The secret of the run whose Store namespace is `prefix`, on a torchrun job."""
    return auth.derive(job_secret, prefix)


def assignment_queue(global_rank: int) -> str:
    """The queue in the job's Store on which rank `global_rank` waits for executors to run."""
    return f"launch/rank/{global_rank}"


def assignment_secret(job_secret: bytes) -> bytes:
    """What the assignment queues sign under: the job's secret bound to torchrun's
    rendezvous id, so that a message recorded in an earlier job with the same secret
    and another id never verifies (the runs' own queues have a secret per run)."""
    return auth.derive(job_secret, f"llamarl/launch/{os.environ['TORCHELASTIC_RUN_ID']}/")


def rank_beat(global_rank: int) -> str:
    """The heartbeat rank `global_rank` keeps in the job's Store for as long as it runs."""
    return f"launch/beat/{global_rank}"


BEAT_CHECK_S = 1.0  # how often the controller reads the ranks' heartbeats (one Store request per rank)


class LaunchedExecutors:
    """torchrun ranks that run `llamarl_core.launch`'s serve loop: each waits on its
    assignment queue and runs the executor it is given in its own process, then
    waits again. The ranks' processes belong to torchrun: a rank that dies ends the
    job through torchrun's agent, but a host that is cut off cannot tell it; so each
    rank keeps a heartbeat in the job's Store, and `exited` names the executors of a
    rank silent for the run's timeout_s. An executor is not
    replaced (not restartable): a failed generator rank is back in its serve loop at
    once while its tensor-parallel peers may wait in a collective with it until the
    process group's timeout (NCCL's watchdog then aborts their process), so a new
    incarnation could not form its group in time."""

    restartable = False

    def __init__(self, store: dist.Store, placement, assignments: dict[int, StoreQueue], job_secret: bytes):
        """assignments: the assignment queue of every rank but the controller's.
        job_secret: the one every rank of the job read from its environment."""
        self.job_store, self.placement, self.assignments = store, placement, assignments
        self.job_secret = job_secret
        self.prefix: str | None = None
        self.secret: bytes | None = None
        self.watches: dict[tuple[str, int], HeartbeatWatch] = {}
        self._next_check = 0.0

    def open_store(self, timeout_s: float) -> dist.Store:
        """The job's Store, in a namespace of this run's own (--compare runs two runs
        on one job; their process groups and syncs must not meet), and a secret of
        its own derived from the job's (a message of one run never verifies in the other)."""
        self.prefix = f"llamarl/run/{secrets.token_hex(4)}/"
        self.secret = run_secret(self.job_secret, self.prefix)
        return dist.PrefixStore(self.prefix, self.job_store)

    def start(self, role: str, rank: int, config_dict: dict, extra: dict) -> None:
        global_rank = self.placement.global_rank(role, rank)
        self.assignments[global_rank].put(
            ("run", {"role": role, "rank": rank, "config": config_dict, "extra": {**extra, "launched": True},
                     "prefix": self.prefix}))
        self.watches[(role, rank)] = HeartbeatWatch(self.job_store, rank_beat(global_rank),
                                                    grace_s=config_dict["run"]["timeout_s"])

    def exited(self) -> list[tuple[str, int, str]]:
        now = time.monotonic()
        if now < self._next_check:
            return []
        self._next_check = now + BEAT_CHECK_S
        silent = []
        for (role, rank), watch in self.watches.items():
            seconds = watch.silent_for()
            if seconds > watch.grace_s:
                silent.append((role, rank, f"is silent: torchrun rank {self.placement.global_rank(role, rank)} has "
                                           f"not beaten for {seconds:.0f} s (its host, or the link to it, is down)"))
        return silent

    def shutdown(self, grace_s: float, unready=frozenset()) -> None:
        """The ranks return to their serve loop on Stop (and end on the launcher's
        "exit"); one still setting up (`unready`) returns when its set-up ends."""
