"""An executor's life in its process: set up where it computes, run its role's loop
with a heartbeat, report a failure to the controller, clean up."""

from __future__ import annotations

import contextlib
import datetime
import os
import signal
import traceback

import torch.distributed as dist

from ...spelling import set_spelling
from ..config import TrainConfig
from ..messages import Failed
from ..run_folder import executor_hold, executor_release
from .generator import run_generator
from .link import GENERATOR, REWARD, TRAINER, Link
from .resources import end_process_group, select_gpu, setup_threads
from .reward import run_reward
from .trainer import run_trainer

ROLES = {GENERATOR: run_generator, TRAINER: run_trainer, REWARD: run_reward}


def run_executor(role: str, rank: int, config_dict: dict, store: dist.Store, extra: dict, secret: bytes) -> bool:
    """Run executor rank `rank` of `role` until the controller says stop; False when
    it failed (the failure, with its traceback, is reported to the controller).
    extra: "inbox", "launched", "flags" (its messages name CLI flags, as the
    controller's), "mps_env" (gpu_share: the MPS client's variables, set before
    CUDA starts here) and the role's own arguments (the incarnation, the run
    folder). secret: the run's (auth.py), which its messages carry; never in `extra`,
    which may travel through the Store."""
    config = TrainConfig.from_dict(config_dict)
    extra = dict(extra)
    inbox = extra.pop("inbox")  # the queue it reads its commands from (None: its replica's rank 0 reads them)
    launched = extra.pop("launched", False)  # a torchrun rank (llamarl_core.launch), not forked by the controller
    set_spelling(flags=extra.pop("flags", False))  # this process is the executor's own
    os.environ.update(extra.pop("mps_env", None) or {})  # CUDA reads them when it starts (select_gpu)
    link = Link(store, role, rank, extra["incarnation"] if role == GENERATOR else None, inbox, config.run.timeout_s,
                secret)
    folder = None
    try:
        # Held while this executor may write into the run folder: no controller takes it meanwhile.
        folder = executor_hold(extra["out_dir"]) if "out_dir" in extra else None
        setup_threads(config, role, rank, launched)
        if config.run.device == "cuda" and role != REWARD:
            select_gpu(config, role, rank, launched)
        # Their work may outlast timeout_s with nothing to report (loading, a trainer step or
        # checkpoint, a long generation or evaluation, scoring a batch with a reward model):
        # they beat, and the controller counts a beat only while it waits on that work. Every
        # wait of theirs has a timeout of its own (process groups, weight syncs). A rule
        # reward answers at once; silence there stays an error.
        beats = role != REWARD or config.run.reward_model is not None
        with link.heartbeat(config.run.timeout_s / 4) if beats else contextlib.nullcontext():
            ROLES[role](link, config, store, rank, **extra)
        return True
    except SystemExit:
        raise
    except BaseException as exc:  # noqa: BLE001 - every failure goes to the controller
        link.send(Failed(message=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc()))
        return False
    finally:
        end_process_group()
        link.close()
        executor_release(folder)


def exit_on_sigterm(signum, frame) -> None:
    raise SystemExit(128 + signum)


def executor_main(role: str, rank: int, config_dict: dict, store_port: int, extra: dict, secret: bytes) -> None:
    """Process entry point (forked by the controller's forkserver on its host; the
    run's secret comes in the arguments, through the forkserver's local socket)."""
    # Ctrl-C in a terminal reaches the whole process group: the controller alone handles
    # it (it tells every executor to stop, then kills what is left). An executor
    # interrupted on its own would touch the Store after the controller closed it, and
    # each such request makes c10d print a stack trace.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # SIGTERM (the controller ending an executor still setting up when the run stops):
    # out through run_executor's clean-up (its process group destroyed, its Store closed).
    signal.signal(signal.SIGTERM, exit_on_sigterm)
    if role == GENERATOR and config_dict["generator"]["backend"] != "llama":
        # A process group for an engine's processes too (vLLM's, a user's), which the controller kills as one.
        os.setsid()
    store = dist.TCPStore("127.0.0.1", store_port, is_master=False,
                          timeout=datetime.timedelta(seconds=config_dict["run"]["timeout_s"]))
    if not run_executor(role, rank, config_dict, store, extra, secret):
        raise SystemExit(1)
