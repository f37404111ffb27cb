"""The messages between the controller and its executors: one frozen dataclass per
kind, registered with the wire (control/wire.py), so that a message arrives as the
same class or not at all (a name or a field the wire does not know is refused,
never guessed). Each side dispatches on the class through a table of its own
(controller.py, executors/): a class nobody handles is an error naming it.

Commands, controller -> an executor's inbox (the message itself):
    generator: Prompts, Receive, Relay, Stop
    trainer:   Sync, Train, Checkpoint, Reconnect, Stop
    reward:    Score, Stop

Reports, executor -> the controller's events queue, each in an Event (who sent it,
the spans it has not reported yet, the values it refused so far):
    every role: Ready, Working (a heartbeat), Failed
    generator:  Samples, Received, ReceiveFailed
    trainer:    Trained, Synced, SyncFailed, Checkpointed
    reward:     Scored
"""

from __future__ import annotations

import dataclasses

from ..control import wire
from .learner import StepStats
from .rollout import Sample

wire.register(StepStats)  # a trainer rank's step statistics travel in Trained


def message(cls: type) -> type:
    """A frozen dataclass, its fields keyword-only, registered with the wire (a decorator)."""
    return wire.register(dataclasses.dataclass(frozen=True, kw_only=True)(cls))


# ----------------------------------------------------------------------------- commands


@message
class Stop:
    """End the executor's loop (every role)."""


@message
class Prompts:
    """Sample these prompt groups: (group, prompt token ids), samples_per_prompt each."""

    groups: list


@message
class Receive:
    """Take `version` between two decode steps, relaying it to the child replicas
    `relay_to`; `evaluate`: (prompt index, token ids) of the held-out prompts to run
    greedily on it first (replica 0; None: none); `attempt`: the sync's id
    (replicas.py), reported back on failure."""

    version: int
    evaluate: list | None
    relay_to: list
    attempt: int


@message
class Relay:
    """Child replica `child` was restarted: relay to its new incarnation."""

    child: int
    incarnation: int


@message
class Sync:
    """Send `version` of the trainer's weights to generator replica 0."""

    version: int


@message
class Train:
    """Train step `step` on this rank's share of the batch."""

    step: int
    samples: list


@message
class Checkpoint:
    """Save the trainer's state, with the data position after the last batch taken."""

    data_position: int


@message
class Reconnect:
    """Generator replica 0 was restarted: send to its incarnation `incarnation` from now on."""

    incarnation: int


@message
class Score:
    """Score bunch `bunch`: each completion's prompt group, whether it is held out, and its tokens."""

    bunch: int
    groups: list
    eval: list
    tokens: list


# ----------------------------------------------------------------------------- reports


@message
class Ready:
    """The executor is set up. host: where it runs (control/hosts.py). A trainer rank
    adds where a resumed run goes on and its weight-sync transports."""

    host: dict
    step: int = 0
    data_position: int = 0
    transports: dict = dataclasses.field(default_factory=dict)


@message
class Working:
    """A heartbeat: alive in a long computation (executors' Link.heartbeat)."""


@message
class Failed:
    """The executor failed: its error and traceback."""

    message: str
    traceback: str


@message
class Samples:
    """Finished samples (training or held-out ones) and the generating seconds since
    the replica last reported them."""

    samples: list[Sample]
    busy: float


@message
class Received:
    """`version` landed on the replica (its receive took `seconds`); `relay_failed`:
    child replica -> why relaying it there failed (empty: it did not)."""

    version: int
    busy: float
    seconds: float
    relay_failed: dict


@message
class ReceiveFailed:
    """The replica's receive of `version` (sync `attempt`) failed; stale: no weight was
    touched (the version will not come)."""

    version: int
    attempt: int
    message: str
    stale: bool


@message
class Scored:
    """The rewards of bunch `bunch`, in its order."""

    bunch: int
    rewards: list


@message
class Trained:
    """Step `step` trained on this rank in `seconds`; hook: what the step hook returned."""

    step: int
    seconds: float
    hook: dict
    stats: StepStats


@message
class Synced:
    """`version` sent to generator incarnation `generator` in `seconds`."""

    version: int
    seconds: float
    generator: int


@message
class SyncFailed:
    """Sending `version` to generator incarnation `generator` failed."""

    version: int
    message: str
    generator: int


@message
class Checkpointed:
    """The trainer rank's checkpoint of step `step` is written."""

    step: int


@message
class Event:
    """A report as it travels: executor rank `rank` of `role` (of generator
    incarnation `incarnation`; None for the other roles), its spans (name, start,
    end, args) since its last report, the values it refused since it started
    (control/auth.py; None in a heartbeat), and the report itself."""

    role: str
    rank: int
    incarnation: int | None
    refused: int | None
    spans: list
    body: object
