"""One GPU shared by the trainer and the generator processes: NVIDIA MPS.

Two processes on one GPU each hold a CUDA context of their own, and the GPU
time-slices between contexts: a generator's kernels never run beside a
trainer's, so an asynchronous run on one GPU pays both phases one after the
other plus the switches (an H100 ran the ~1B pipeline 1.47x slower async than
sync). CUDA's green contexts split the SMs among contexts of one process only.
The Multi-Process Service runs every client process's work in one server
context, whose kernels do run side by side, and caps each client at a
percentage of the SMs (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE, read when the client
initialises CUDA). Its control daemon needs no change to the GPU's settings
(compute mode, persistence): it is a user process with a pipe folder of its own.

`gpu_share="mps:P"` (TrainConfig, --gpu-share; async mode, our generator on a
GPU): the controller starts a private daemon (its pipe in a fresh 0700 temporary
folder, its log in the run folder's mps/) before any executor, each generator
rank initialises CUDA as a client capped at P% of the SMs and each trainer rank
at 100 - P%, and the daemon is told to quit after the executors have ended.
CUDA IPC between clients of one server works as between plain processes. Rule
rewards touch no GPU and are not clients.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from ..spelling import option

CONTROL = "nvidia-cuda-mps-control"
# Longest wait for the daemon to start or to quit.
DAEMON_TIMEOUT_S = 30.0


def generator_percent(gpu_share: str) -> int | None:
    """The generator's percentage of the SMs for `gpu_share` "mps:P" (1 <= P <= 99),
    None for "none"; ValueError naming gpu_share otherwise."""
    if gpu_share == "none":
        return None
    kind, _, percent = gpu_share.partition(":")
    if kind == "mps" and percent.isdigit() and 1 <= int(percent) <= 99:
        return int(percent)
    raise ValueError(f"{option('gpu_share', gpu_share)}: must be 'none' or 'mps:P' (the generator's percentage of "
                     "the GPU's SMs, 1 to 99; the trainer gets the rest)")


def role_percent(gpu_share: str, role: str) -> int | None:
    """The SM percentage an executor of `role` ("generator", "trainer", "reward") is
    capped at under `gpu_share`; None: not an MPS client."""
    percent = generator_percent(gpu_share)
    if percent is None or role not in ("generator", "trainer"):
        return None
    return percent if role == "generator" else 100 - percent


class MpsDaemon:
    """A private MPS control daemon: `start()`, `client_env(percent)` for each client
    process (set before it initialises CUDA), `stop()` once its clients have ended."""

    def __init__(self, control: str, folder: Path, log: Path):
        self.control, self.folder = control, folder  # folder: the private temporary one, holding the pipe
        self.pipe, self.log = folder / "pipe", log

    @classmethod
    def start(cls, log_folder: Path | None = None, timeout_s: float = DAEMON_TIMEOUT_S) -> "MpsDaemon":
        """Start the daemon, its control socket in a fresh 0700 temporary folder and its
        log in `log_folder` (default: beside the socket, removed with it); RuntimeError
        naming gpu_share when it cannot (the control program missing, it exits with
        an error, or nothing listens on its socket within timeout_s), nothing left
        running."""
        control = shutil.which(CONTROL)
        if control is None:
            raise RuntimeError(f"{option('gpu_share')} mps: {CONTROL} is not on PATH (it comes with the NVIDIA driver)")
        folder = Path(tempfile.mkdtemp(prefix="llamarl-mps-"))
        daemon = cls(control, folder, Path(log_folder) if log_folder is not None else folder / "log")
        daemon.pipe.mkdir()
        daemon.log.mkdir(parents=True, exist_ok=True)
        try:
            proc = subprocess.run([control, "-d"], env=daemon._env(), capture_output=True, text=True,
                                  timeout=timeout_s)
            if proc.returncode != 0:
                raise RuntimeError(f"{option('gpu_share')} mps: {CONTROL} -d exited {proc.returncode}: "
                                   f"{(proc.stderr or proc.stdout).strip()[-500:]}")
            deadline = time.monotonic() + timeout_s
            while not daemon._listening():
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{option('gpu_share')} mps: the MPS daemon did not listen on its control "
                                       f"socket in {daemon.pipe} within {timeout_s:.0f} s; its log: {daemon._log_tail()}")
                time.sleep(0.05)
        except BaseException:
            daemon.stop(timeout_s)
            raise
        return daemon

    def _env(self) -> dict[str, str]:
        return {**os.environ, **self.client_env(None)}

    def client_env(self, percent: int | None) -> dict[str, str]:
        """The variables a client process sets before it initialises CUDA: this
        daemon's pipe and log folders and, with `percent`, its cap on the SMs."""
        env = {"CUDA_MPS_PIPE_DIRECTORY": str(self.pipe), "CUDA_MPS_LOG_DIRECTORY": str(self.log)}
        if percent is not None:
            env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(percent)
        return env

    def _log_tail(self) -> str:
        log = self.log / "control.log"
        return log.read_text(errors="replace")[-800:] if log.exists() else "(none written)"

    def answers(self) -> bool:
        """Whether a daemon listens on this daemon's control socket. Not whether the
        socket's file exists: the daemon leaves it behind when it quits (an H200 run
        of stop() waited out its 30 s for the file to go, the daemon gone 22 ms
        after `quit` by its log). OSError for a socket it cannot reach (its path too
        long, say)."""
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            probe.settimeout(1.0)
            try:
                probe.connect(str(self.pipe / "control"))
            except (FileNotFoundError, ConnectionRefusedError):  # no file; a file nobody listens on
                return False
            except TimeoutError:  # its queue full: alive
                return True
            return True

    def _listening(self) -> bool:
        """answers(), with a socket it cannot reach said as start() says its failures."""
        try:
            return self.answers()
        except OSError as exc:
            raise RuntimeError(f"{option('gpu_share')} mps: its control socket {self.pipe / 'control'} cannot be "
                               f"reached: {exc}") from None

    def stop(self, timeout_s: float = DAEMON_TIMEOUT_S) -> bool:
        """Tell the daemon to quit (its server ends with it) and wait until nothing
        listens on its control socket; True when it has quit (or never started), the
        temporary folder then removed. False: it still answered after timeout_s; its
        folder stays, so that `echo quit | CUDA_MPS_PIPE_DIRECTORY=<pipe>
        nvidia-cuda-mps-control` can still end it. Never raises (it runs on error
        paths)."""
        try:
            if self.answers():
                subprocess.run([self.control], input="quit\n", env=self._env(), capture_output=True, text=True,
                               timeout=timeout_s)
                deadline = time.monotonic() + timeout_s
                while self.answers() and time.monotonic() < deadline:
                    time.sleep(0.05)
            if self.answers():
                return False
        except (OSError, subprocess.SubprocessError):  # its socket unreachable: whether it quit is not known
            return False
        shutil.rmtree(self.folder, ignore_errors=True)
        return True
