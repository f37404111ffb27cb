"""The two moves every DDMA pairing with a vLLM engine makes, shared by the
colocated engine (generation.py) and a `vllm serve` server (server.py): the
trainer's sender registered while the engine initialises its receivers (each
waits for the other), and one version sent while the engine takes it."""

from __future__ import annotations

import threading
from typing import Callable

from ...sync import SendHandle, SyncError, WeightSender


def register_while(make_sender: Callable[[], WeightSender], init_engine: Callable[[], None],
                   timeout_s: float) -> WeightSender:
    """`make_sender()` in a thread of its own while `init_engine()` runs here;
    the sender, or SyncError with the sender's error (or the timeout). An error
    of `init_engine` is raised at once, as it is: the registration, waiting for
    receivers that will not come, gives up by its own timeout in its daemon
    thread."""
    made: dict = {}

    def register() -> None:
        try:
            made["sender"] = make_sender()
        except BaseException as exc:  # noqa: BLE001 - raised below, in the caller's thread
            made["error"] = exc

    thread = threading.Thread(target=register, name="llamarl-sender-setup", daemon=True)
    thread.start()
    init_engine()
    thread.join(timeout=timeout_s)
    if "sender" not in made:
        raise SyncError(f"the trainer's sender did not register: {made.get('error', f'timed out after {timeout_s} s')}")
    return made["sender"]


def send_while(sender: WeightSender, version: int, update_engine: Callable[[], None], timeout_s: float,
               pause_engine: Callable[[], None] | None = None) -> None:
    """Version `version` sent while `update_engine()` (the engine's start / update
    / finish) takes it; returns once every byte is copied (the optimizer may step
    then). pause_engine: where the engine's generation is to pause for the
    update, called once the send has offered the version (SendHandle.offered:
    what the sender does before, a delta's scans on the host, runs while the
    engine generates), before update_engine; a send that failed before then
    raises its own error, the engine neither paused nor updated. An error of
    either aborts the send, waits for it to stop and is raised: no copy is left
    running."""
    handle = sender.send(version, wait=False)
    if pause_engine is not None:
        try:
            handle.offered(timeout=timeout_s)
        except BaseException as exc:  # not offered in time
            _stop(sender, handle, "the send did not offer its version in time", exc, timeout_s)
            raise
        if handle.done():
            handle.wait()  # raises the send's error (its receivers told of it); a send already over returns
    try:
        if pause_engine is not None:
            pause_engine()
        update_engine()
    except BaseException as exc:
        _stop(sender, handle, "the engine's update failed", exc, timeout_s)
        raise
    handle.wait(timeout=timeout_s)


def _stop(sender: WeightSender, handle: SendHandle, why: str, exc: BaseException, timeout_s: float) -> None:
    """The send aborted (`why`, for `exc`), once it has stopped."""
    sender.abort(f"{why}: {type(exc).__name__}: {exc}")
    handle.exception(timeout=timeout_s)
