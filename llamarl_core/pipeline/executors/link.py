"""An executor's end of the run's queues (Link), and the names the controller and
the executors share in the run's Store: the events queue, the inboxes, the
controller's heartbeat and the weight syncs."""

from __future__ import annotations

import contextlib
import threading

import torch.distributed as dist

from ...control import HeartbeatWatch, QueueClosed, StoreQueue
from ...control.auth import refused_count
from ...control.hosts import host_identity
from ..messages import Event, Ready, Stop, Working

GENERATOR, TRAINER, REWARD = "generator", "trainer", "reward"
INBOX_POLL_S = 0.2  # how long an idle executor blocks on its inbox before checking on the controller
# The run's queues and the controller's heartbeat, in the run's Store.
EVENTS, CONTROLLER_BEAT = "events", "controller-beat"


def inbox_name(role: str, rank: int, incarnation: int) -> str:
    """The queue of commands to executor rank `rank` of `role` (of generator incarnation
    `incarnation`: a restarted generator never reads its predecessor's commands)."""
    return f"inbox/{role}/{rank}/{incarnation}"


def has_inbox(role: str, rank: int, generator_tp: int) -> bool:
    """Only each replica's generator rank 0 reads commands; it broadcasts them to the
    replica's other ranks (generator.py's CommandFeed)."""
    return role != GENERATOR or rank % generator_tp == 0


def sync_name_of(incarnation: int, replica: int = 0) -> str:
    """The name of the sync that fills generator replica `replica` of this incarnation: the
    trainer's for replica 0, a relay's for the others (each receiver is told its
    children's names, `relay_names`: the run names every sync itself)."""
    return f"weights/{incarnation}/replica{replica}" if replica else f"weights/{incarnation}"


class Link:
    """An executor's end of the queues, with the spans it has not reported yet. inbox is
    None on generator ranks other than a replica's rank 0, which reads the commands for
    all of them. An idle wait for a command checks that the controller still beats.
    incarnation: the generator's (None for the other roles), in every report."""

    def __init__(self, store: dist.Store, role: str, rank: int, incarnation: int | None, inbox: str | None,
                 timeout_s: float, secret: bytes):
        self.role, self.rank, self.incarnation = role, rank, incarnation
        self.secret = secret  # the run's: its weight syncs and process groups use it too
        self._refused_before = refused_count()
        # A connection for the messages alone: the executor's weight syncs wait on `store` for
        # up to their timeout, and the heartbeat thread's reports must not queue behind them.
        messages = store.clone()
        self.events = StoreQueue(messages, EVENTS, secret)
        self.inbox = StoreQueue(messages, inbox, secret) if inbox is not None else None
        self.controller = HeartbeatWatch(messages, CONTROLLER_BEAT, grace_s=timeout_s)
        self.spans: list[tuple[str, float, float, dict]] = []

    def send(self, report) -> None:
        """Report `report` (a messages.py report) with the spans taken since the last one and
        the values this executor refused (auth.py), counted from its start (a torchrun rank
        runs the executors of several runs one after another)."""
        spans, self.spans = self.spans, []
        self.events.put(Event(role=self.role, rank=self.rank, incarnation=self.incarnation,
                              refused=refused_count() - self._refused_before, spans=spans, body=report))

    def ready(self, **fields) -> None:
        """Report this executor set up, with where it runs (the run's hosts.json)."""
        self.send(Ready(host=host_identity(), **fields))

    def span(self, name: str, start: float, end: float, **args) -> None:
        """A trace event. `name` is fixed per kind of work (Perfetto groups events by name); what varies (the
        step, the version) goes into `args`."""
        self.spans.append((name, start, end, args))

    @contextlib.contextmanager
    def heartbeat(self, every_s: float):
        """While inside, tell the controller every `every_s` seconds that this executor
        is alive (Working, from a thread of its own: no spans taken). The
        controller stops a run after timeout_s of silence; a trainer step of a real
        model can be longer than that (SmolLM2-135M: 20-25 s a step on one busy core
        here; a larger model, or a checkpoint of its AdamW state, takes minutes)."""
        stop = threading.Event()

        def beat():
            while not stop.wait(every_s):
                self.events.put(Event(role=self.role, rank=self.rank, incarnation=self.incarnation, refused=None,
                                      spans=[], body=Working()))

        thread = threading.Thread(target=beat, name=f"{self.role}-{self.rank}-heartbeat", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join()

    def get(self, timeout: float):
        """The next command (a messages.py command), or None after `timeout` seconds."""
        try:
            command = self.inbox.get(timeout)
        except QueueClosed:
            raise SystemExit(f"{self.role} {self.rank}: the controller is gone (its Store closed)") from None
        if command is None and not self.controller.alive():
            raise SystemExit(f"{self.role} {self.rank}: the controller is gone (no heartbeat for "
                             f"{self.controller.silent_for():.0f} s)")
        return command

    def commands(self):
        """The controller's commands in order, until Stop."""
        while True:
            command = self.get(INBOX_POLL_S)
            if command is None:
                continue
            if isinstance(command, Stop):
                return
            yield command

    def get_nowait(self):
        return self.inbox.get_nowait()

    def close(self) -> None:
        if self.inbox is not None:
            self.inbox.close()


def dispatch(handlers: dict, command, role: str) -> None:
    """Run the handler `handlers` holds for the command's class; ValueError naming a
    command this role does not take."""
    handler = handlers.get(type(command))
    if handler is None:
        raise ValueError(f"{role}: unknown command {type(command).__name__} (takes "
                         f"{', '.join(sorted(c.__name__ for c in handlers))})")
    handler(command)
