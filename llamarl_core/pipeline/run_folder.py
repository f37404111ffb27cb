"""The run folder as the controller finds it: held by one controller at a time
(an flock on LOCK inside it), and either fresh or holding a run that this
configuration may resume. Checked before the run writes a byte there."""

from __future__ import annotations

import fcntl
import os
import weakref
from pathlib import Path

from .checkpoints import checkpoint_dir, checkpoint_info, checkpoint_metadata
from .config import RESUME_CHANGES, TrainConfig

LOCK = ".llamarl-run.lock"  # in the run folder: held (flock) by the controller that runs in it
# In the run folder: held shared (flock) by each executor that writes there, for its life.
EXECUTORS_LOCK = ".llamarl-executors.lock"


class RunFolderError(ValueError):
    """The run folder holds another run, or a run to resume without resume=True."""


class FolderLock:
    """The run folder `out` held for one controller, from construction until
    release() (or the end of a `with` block, or this object's collection):
    RunFolderError, before the run reads or writes anything there, while another
    controller holds it (a run still going, into the same folder or resumed from
    it, or one writing its inputs), or while executors of an earlier run still
    hold theirs (`executor_hold`: a controller killed outright, whose executors
    go on until they find it gone, within --timeout-s of its silence). Flocks: the
    system drops each with its holder, however that ends. On a filesystem without
    flock (Lustre without -o flock, NFS without its lock service) the run goes on
    unlocked, said through `warn`."""

    def __init__(self, out: Path, warn):
        fd = os.open(out / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            _no_executors(out)
        except BlockingIOError:
            os.close(fd)
            raise RunFolderError(f"{out} is in use by another run (its controller holds {out / LOCK}): wait for it "
                                 "to end, or pick another folder") from None
        except RunFolderError:
            os.close(fd)
            raise
        except OSError as exc:
            warn(f"llamarl: {out} cannot be locked ({exc.strerror}: its filesystem has no flock): another run into "
                 "it is not refused")
        self.release = weakref.finalize(self, os.close, fd)  # closes the file once, called or not

    def __enter__(self) -> FolderLock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _no_executors(out: Path) -> None:
    """RunFolderError while an executor holds `out`'s EXECUTORS_LOCK (asked by a
    controller holding LOCK, before any executor of its own has started)."""
    fd = os.open(out / EXECUTORS_LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        pids = flock_holders(out / EXECUTORS_LOCK)
        named = f"processes {', '.join(map(str, sorted(pids)))} hold" if pids else "they hold"
        raise RunFolderError(f"{out} is in use by executors of an earlier run ({named} {out / EXECUTORS_LOCK}: its "
                             "controller was killed outright, and they end once they find it gone, within its "
                             "--timeout-s; or end them): wait for them, or pick another folder") from None
    finally:
        os.close(fd)  # the test's lock, if taken, with it


def flock_holders(path: Path) -> set[int]:
    """The pids of the processes that took the flocks on the file `path` (Linux's
    /proc/locks; none where it is not there)."""
    try:
        st, lines = os.stat(path), Path("/proc/locks").read_text().splitlines()
    except OSError:
        return set()
    file = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"  # as /proc/locks names it
    holders = set()
    for line in lines:
        fields = line.split()  # "1: FLOCK  ADVISORY  READ  1234 00:2a:5678 0 EOF" (a blocked one: "-> FLOCK ...")
        if "FLOCK" in fields and len(fields) >= 4 and fields[-3] == file:
            holders.add(int(fields[-4]))
    return holders


def executor_hold(out: Path) -> int | None:
    """For an executor that writes into the run folder `out`: a shared flock on its
    EXECUTORS_LOCK, held until executor_release(the returned fd) (at the latest
    when the process ends; a process forked from it, such as an engine's, does
    not keep it), so that no controller takes the folder while this executor may
    still write there (FolderLock). SystemExit when a controller is taking the
    folder now (this executor's own holds it from before any executor starts: it
    is gone); None where the folder cannot be locked (no such folder on this host,
    a filesystem without flock: as FolderLock, unlocked)."""
    try:
        fd = os.open(Path(out) / EXECUTORS_LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise SystemExit(f"{out}: another controller is taking the run folder (this executor's is gone)") from None
    except OSError:
        os.close(fd)
        return None
    _HELD.add(fd)
    return fd


def executor_release(fd: int | None) -> None:
    """End an executor_hold (None: nothing held)."""
    if fd is not None:
        _HELD.discard(fd)
        os.close(fd)


_HELD: set[int] = set()  # this process's executor_hold fds


def _drop_held_in_child() -> None:
    """In a process just forked (an engine's, say): its copies of the holds closed
    (the hold is its parent's: an flock lasts while any copy of its fd is open)."""
    for fd in _HELD:
        os.close(fd)
    _HELD.clear()


os.register_at_fork(after_in_child=_drop_held_in_child)

def check_run_folder(out: Path, config: TrainConfig, resume: bool) -> None:
    """RunFolderError, before anything is written, unless `out` holds no run
    (no config.json) or `resume` and `config` resumes the saved one: the same but
    for steps (no fewer than the checkpoint's) and the trainer's world (its shards
    are read back at any), and the checkpoint's record readable (its fields, its
    folder there, its files' headers)."""
    saved = out / "config.json"
    if not saved.exists():
        return
    if not resume:
        raise RunFolderError(f"{out} already holds a run ({saved}); resume=True (llamarl train --resume) "
                             "continues it from its last checkpoint, or pick another folder")
    before = TrainConfig.load(saved).flat()
    changed = [name for name, value in config.flat().items() if name not in RESUME_CHANGES and before[name] != value]
    if changed:
        raise RunFolderError(f"{out} holds a run with a different configuration ({saved}): {', '.join(changed)} "
                             "differ; a resumed run may change only steps and trainer_world")
    try:
        info = checkpoint_info(out)
        if info is not None:  # its files' headers readable (a file cut short fails here, not in a trainer)
            checkpoint_metadata(checkpoint_dir(out) / info["folder"])
    except ValueError as exc:
        raise RunFolderError(f"{out}: {exc}") from None
    if info is not None and config.run.steps < info["step"]:
        raise RunFolderError(f"{out}: steps {config.run.steps} is below the step of its checkpoint, {info['step']}: a "
                             "resumed run goes on from there")
