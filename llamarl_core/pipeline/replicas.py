"""The controller's view of the generator replicas and the weight syncs in flight, as
a plain class with no processes and no queues (tests/test_replicas.py drives it
through thousands of random orders of syncs, reports, losses and restarts).

The trainer ranks send each version to replica 0; it reaches the others down the
relay tree (replica r feeds 2r + 1 and 2r + 2). A replica that dies is replaced
alone, under a new incarnation, while the others go on sampling:
- replica r != 0: its parent relays to the new one (under the new incarnation's
  sync name) from the first sync begun once the new one is up;
- replica 0: the trainer reconnects to the new one, which is re-synced with the
  current version before the trainer trains again (the caller's resync).
The new replica's relays to its children take over their senders' place: the
children keep their receivers.

A sync includes replica 0 and every replica that is up and whose parent is
included (a replica still starting, or cut off from the trainer by one, misses
the version and gets the next). A sync is complete
once the trainer ranks have sent it and every replica it includes has reported it
landed or is cut off (it, or a replica above it, died). A replica whose receive
failed may hold torn weights: it is replaced too (excused when its feed died),
unless nothing was written (the version it waited for will not come).

Whether a lost replica is replaced at all is RestartPolicy's decision.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..sync.plan import relay_tree


MAX_GENERATOR_RESTARTS = 3


class RestartPolicy:
    """Whether lost generator replicas are replaced: never one that failed while
    starting (before it was ever ready: a new one would fail the same way), never
    executors the controller cannot start again (torchrun's ranks), and at most
    `max_restarts` times a run, counting the restarts at a replica's own fault (not
    one cut off by another's loss: `counted` False). checkpoint: where a stopped run's
    last checkpoint is, for the refusal; resume: how to go on from it."""

    def __init__(self, restartable: bool, checkpoint: str, resume: str, max_restarts: int = MAX_GENERATOR_RESTARTS):
        self.restartable, self.checkpoint, self.resume = restartable, checkpoint, resume
        self.max_restarts = max_restarts
        self.restarts = 0  # counted restarts so far

    def refusal(self, why: str, starting: bool, counted: bool) -> str | None:
        """Why the replicas lost now (`why`) are not replaced, or None (counted
        towards the limit if `counted`). starting: one of them was never ready."""
        if starting:
            return f"{why} while starting; not restarting it"
        if not self.restartable:
            return (f"{why}; executors on torchrun ranks are not restarted: stopping (the last checkpoint is in "
                    f"{self.checkpoint}; {self.resume})")
        self.restarts += counted
        if self.restarts > self.max_restarts:
            return (f"{why}; restarted {self.max_restarts} times already, stopping (the last checkpoint is in "
                    f"{self.checkpoint})")
        return None


@dataclass
class PendingSync:
    """A version on its way: trainer ranks yet to report it sent, replicas yet to
    report it landed, the replicas told to receive it (the others of the sync were
    already waiting for this version), and the id that tells this sync from an
    abandoned one of the same version (a re-sync)."""

    trainer: int
    replicas: set[int]
    told: set[int]
    attempt: int


class ReplicaSyncs:
    """See the module docstring. incarnation[r]: replica r's current incarnation (its
    processes, inbox and sync name); up[r]: every rank of it reported ready;
    version[r]: the version it holds (None: none yet); receiving[r]: the versions it
    was told to receive and has not reported."""

    def __init__(self, num_replicas: int, trainer_world: int):
        self.tree = relay_tree(num_replicas)
        self.parent = {child: r for r, children in self.tree.items() for child in children}
        self.trainer_world = trainer_world
        self.incarnation = [0] * num_replicas
        self.up = [False] * num_replicas
        self.version: list[int | None] = [None] * num_replicas
        self.receiving: list[set[int]] = [set() for _ in range(num_replicas)]
        self.pending: dict[int, PendingSync] = {}
        self.attempts = 0

    def descendants(self, replica: int) -> list[int]:
        below, stack = [], list(self.tree[replica])
        while stack:
            r = stack.pop()
            below.append(r)
            stack.extend(self.tree[r])
        return sorted(below)

    def targets(self) -> dict[int, list[int]]:
        """The replicas a sync begun now includes, each with the children it relays
        to: replica 0, and each replica that is up and whose parent is included. (A
        replica still waiting for an older version that will not come, its feed
        replaced, is told so by the new feed's relay, untouched, before this one.)"""
        included = [0]
        for r in range(1, len(self.tree)):  # a parent's index is below its children's
            if self.up[r] and self.parent[r] in included:
                included.append(r)
        return {r: [c for c in self.tree[r] if c in included] for r in included}

    def begin(self, version: int) -> dict[int, list[int]]:
        """Record a sync of `version` to targets(); returns them. Those already
        waiting for this version (told by a sync abandoned with replica 0) are not
        told again (pending[version].told): the relay of this sync answers them."""
        if version in self.pending:
            raise ValueError(f"a sync of version {version} is already in flight")
        targets = self.targets()
        told = {r for r in targets if version not in self.receiving[r]}
        for r in told:
            self.receiving[r].add(version)
        self.attempts += 1
        self.pending[version] = PendingSync(self.trainer_world, set(targets), told, self.attempts)
        return targets

    def ready(self, replica: int) -> None:
        self.up[replica] = True

    def sent(self, version: int) -> bool:
        """A trainer rank reports `version` sent; True when that completes the sync."""
        sync = self.pending.get(version)
        if sync is None:
            return False  # a sync abandoned when replica 0 was lost
        sync.trainer -= 1
        return self._maybe_done(version)

    def landed(self, version: int, replica: int) -> bool:
        """Replica `replica` reports `version` landed; True when that completes the sync."""
        self.version[replica] = version
        self.receiving[replica].discard(version)
        sync = self.pending.get(version)
        if sync is None:
            return False
        sync.replicas.discard(replica)
        return self._maybe_done(version)

    def receive_failed(self, version: int, replica: int, attempt: int) -> bool:
        """Replica `replica`'s receive of `version` (sync `attempt`) failed: its weights
        may be torn, and the caller replaces it (lost). Returns whether it is excused:
        its feed died during the sync, or the sync was abandoned; else the replica
        itself is at fault."""
        self.receiving[replica].discard(version)
        sync = self.pending.get(version)
        return sync is None or sync.attempt != attempt or replica not in sync.replicas

    def lost(self, replicas: set[int]) -> list[int]:
        """These replicas died (or are being replaced): each gets a new incarnation and
        counts as down until ready(). Replica 0 among them abandons every sync in
        flight (the trainer reconnects and the caller re-syncs); else the lost and
        their descendants (whose feed is gone) leave the syncs they were in. Returns
        the syncs this completes, in order."""
        for r in replicas:
            self.incarnation[r] += 1
            self.up[r] = False
            self.version[r] = None
            self.receiving[r] = set()
        if 0 in replicas:
            self.pending.clear()
            return []
        done = []
        cut_off = set(replicas) | {d for r in replicas for d in self.descendants(r)}
        for version, sync in list(self.pending.items()):
            sync.replicas -= cut_off
            if self._maybe_done(version):
                done.append(version)
        return done

    def holding(self, step: int, settled: bool) -> dict[int, bool]:
        """The replicas holding weights, each with whether it holds version `step`,
        with no sync in flight and `settled` (the caller's: no trained step waiting
        for its weights): the scheduler's `issue` argument."""
        landed = settled and not self.pending
        return {r: landed and v == step for r, v in enumerate(self.version) if v is not None}

    def _maybe_done(self, version: int) -> bool:
        sync = self.pending[version]
        if sync.trainer > 0 or sync.replicas:
            return False
        del self.pending[version]
        return True
