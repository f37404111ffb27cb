"""The controller's replica and sync bookkeeping (llamarl_core/pipeline/replicas.py),
driven through thousands of random orders of syncs, reports, losses and restarts
against a model of what the executors can do."""

import random

import pytest

from llamarl_core.pipeline.replicas import ReplicaSyncs, RestartPolicy
from llamarl_core.sync.plan import relay_tree


def test_a_restarted_replica_misses_syncs_until_up_and_its_descendants_with_it():
    syncs = ReplicaSyncs(5, trainer_world=1)  # 0 -> 1, 2; 1 -> 3, 4
    assert syncs.targets() == {0: []}  # none up yet: replica 0 is the trainer's, always included
    for r in range(5):
        syncs.ready(r)
    assert syncs.begin(1) == {0: [1, 2], 1: [3, 4], 2: [], 3: [], 4: []}
    assert syncs.lost({1}) == []
    assert syncs.incarnation == [0, 1, 0, 0, 0]
    assert syncs.pending[1].replicas == {0, 2}  # 3 and 4 are cut off with their feed
    assert syncs.receive_failed(1, 3, attempt=1)  # excused: its feed died mid-relay (the caller replaces it)
    assert not syncs.landed(1, 0) and not syncs.sent(1)
    assert syncs.landed(1, 2) and not syncs.pending
    assert syncs.begin(2) == {0: [2], 2: []}  # 1 is down, and 3 and 4 are fed by it
    syncs.ready(1)
    assert syncs.targets() == {0: [1, 2], 1: [3, 4], 2: [], 3: [], 4: []}
    assert not syncs.receive_failed(2, 0, attempt=2)  # fed by the trainer, which is alive: its own fault
    assert syncs.lost({0}) == [] and not syncs.pending  # the trainer reconnects; the caller re-syncs
    syncs.ready(0)
    assert syncs.begin(2) and syncs.pending[2].attempt == 3  # the re-sync of version 2
    assert syncs.pending[2].told == {0, 1, 3, 4}  # 2 already waits for version 2: the re-sync's relay answers it
    assert syncs.receive_failed(2, 1, attempt=2)  # from the abandoned sync of version 2
    assert not syncs.receive_failed(2, 3, attempt=3)


def test_holding_lists_the_replicas_with_weights():
    syncs = ReplicaSyncs(3, trainer_world=2)
    for r in range(3):
        syncs.ready(r)
    syncs.begin(0)
    syncs.landed(0, 0)
    assert syncs.holding(0, settled=True) == {0: False}  # the sync is still in flight
    syncs.landed(0, 1)
    syncs.landed(0, 2)
    syncs.sent(0)
    assert syncs.sent(0) and syncs.holding(0, settled=True) == {0: True, 1: True, 2: True}
    assert syncs.holding(0, settled=False) == {0: False, 1: False, 2: False}
    syncs.begin(1)
    with pytest.raises(ValueError, match="a sync of version 1 is already in flight"):
        syncs.begin(1)


class _World:
    """What the executors can do, for each sync in flight: the trainer ranks report
    it sent; a replica lands it once its feed has (replica 0: any time, the trainer
    writes it), or fails to when its feed died or failed; any replica may fail on
    its own (the controller then replaces it); replicas die and come back up."""

    def __init__(self, seed: int):
        self.rng = random.Random(seed)
        self.n = self.rng.randint(1, 7)
        self.trainer_world = self.rng.randint(1, 3)
        self.syncs = ReplicaSyncs(self.n, self.trainer_world)
        self.parent = {c: r for r, cs in relay_tree(self.n).items() for c in cs}
        self.version = 0
        # version -> {"trainer": reports left, "state": replica -> (incarnation at begin, state)}
        self.flight: dict[int, dict] = {}
        for r in range(self.n):
            self.syncs.ready(r)

    def _complete(self, version: int) -> bool:
        sync = self.flight[version]
        return sync["trainer"] == 0 and all(s != "waiting" for _, s in sync["state"].values())

    def _check_done(self, version: int, done: bool) -> None:
        """The class says a sync completed exactly when the world has nothing left for it."""
        assert done == self._complete(version), (version, self.flight[version])
        if done:
            del self.flight[version]
            assert version not in self.syncs.pending
        else:
            assert version in self.syncs.pending

    def _alive(self, version: int, replica: int) -> bool:
        return self.flight[version]["state"][replica][0] == self.syncs.incarnation[replica]

    def _feed_state(self, version: int, replica: int) -> str:
        """What replica's feed did with `version`: landed, broken (died or failed), or waiting."""
        if replica == 0:
            return "landed"
        parent = self.parent[replica]
        incarnation, state = self.flight[version]["state"][parent]
        if incarnation != self.syncs.incarnation[parent] or state in ("failed", "gone"):
            return "landed" if state == "landed" and self.rng.random() < 0.5 else "broken"
        return state

    def begin(self):
        self.version += 1
        targets = self.syncs.begin(self.version)
        assert 0 in targets
        for r, children in targets.items():
            assert r == 0 or (self.syncs.up[r] and self.parent[r] in targets), (r, targets)
            assert children == [c for c in relay_tree(self.n)[r] if c in targets]
        self.flight[self.version] = {"trainer": self.trainer_world,
                                     "state": {r: (self.syncs.incarnation[r], "waiting") for r in targets}}

    def moves(self) -> list[tuple]:
        """Every report the executors could send now."""
        out = []
        for version, sync in self.flight.items():
            if sync["trainer"]:
                out.append(("sent", version))
            for r, (_, state) in sync["state"].items():
                if state != "waiting" or not self._alive(version, r):
                    continue
                feed = self._feed_state(version, r)
                if feed == "landed":
                    out.append(("landed", version, r))
                elif feed == "broken":
                    out.append(("failed", version, r))
        return out

    def play(self, move) -> None:
        kind, version = move[:2]
        sync = self.flight[version]
        if kind == "sent":
            sync["trainer"] -= 1
            self._check_done(version, self.syncs.sent(version))
        elif kind == "landed":
            r = move[2]
            sync["state"][r] = (sync["state"][r][0], "landed")
            self._check_done(version, self.syncs.landed(version, r))
            assert self.syncs.version[r] == version
        else:
            r = move[2]
            assert self.syncs.receive_failed(version, r, self.syncs.pending[version].attempt), (version, r)
            self.lose({r})  # its feed broke: excused, and replaced (its weights may be torn)

    def own_failure(self):
        """A replica fails on its own: not excused; the controller replaces it."""
        waiting = [(v, r) for v, sync in self.flight.items() for r, (_, s) in sync["state"].items()
                   if s == "waiting" and self._alive(v, r) and self._feed_state(v, r) == "landed"]
        if not waiting:
            return
        version, r = self.rng.choice(waiting)
        assert not self.syncs.receive_failed(version, r, self.syncs.pending[version].attempt)
        self.lose({r})

    def lose(self, replicas: set[int]):
        done = self.syncs.lost(replicas)
        for r in replicas:
            assert not self.syncs.up[r] and self.syncs.version[r] is None
        if 0 in replicas:
            assert done == [] and not self.syncs.pending
            self.flight.clear()  # abandoned: the controller re-syncs replica 0 and everything below it
            return
        cut_off = set(replicas) | {d for r in replicas for d in self.syncs.descendants(r)}
        for version, sync in self.flight.items():
            for r in cut_off:
                if r in sync["state"] and sync["state"][r][1] == "waiting":
                    sync["state"][r] = (sync["state"][r][0], "gone")
        for version in done:
            self._check_done(version, True)
        assert not [v for v in self.flight if self._complete(v)]

    def random_event(self):
        rng = self.rng
        event = rng.choices(["begin", "move", "lose", "ready", "own"], weights=[2, 12, 1, 2, 0.3])[0]
        if event == "begin":
            self.begin()
        elif event == "move" and (moves := self.moves()):
            self.play(rng.choice(moves))
        elif event == "lose":
            self.lose(set(rng.sample(range(self.n), rng.randint(1, min(2, self.n)))))
        elif event == "ready" and (down := [r for r in range(self.n) if not self.syncs.up[r]]):
            self.syncs.ready(rng.choice(down))
        elif event == "own":
            self.own_failure()


@pytest.mark.parametrize("first_seed", range(0, 3000, 1000))
def test_random_orders_complete_every_sync_and_never_wait_on_the_lost(first_seed):
    """1000 seeded runs per case (3,000 in all): 300 random events, then every report
    the executors can still send: every sync then completes, none waiting on a replica
    that died, and a failed receive is excused only when its feed broke."""
    for seed in range(first_seed, first_seed + 1000):
        world = _World(seed)
        try:
            for _ in range(300):
                world.random_event()
            while moves := world.moves():
                world.play(moves[0])
            assert not world.flight and not world.syncs.pending, (world.flight, world.syncs.pending)
        except AssertionError as exc:
            raise AssertionError(f"seed {seed}, {world.n} replicas: {exc}") from exc


def test_the_restart_policy_over_random_losses():
    """2,000 seeded sequences of losses (at a replica's own fault or not, while
    starting or up), on executors that can be restarted or not: a loss is refused
    exactly when a lost replica never started, when the executors cannot be
    restarted (each refusal naming why and where the checkpoint is), or when it is
    the counted restart past the limit; a loss not counted never moves the count."""
    for seed in range(2000):
        rng = random.Random(seed)
        restartable, limit = rng.random() < 0.8, rng.randint(0, 4)
        policy = RestartPolicy(restartable, "/run/checkpoint", "resume it", max_restarts=limit)
        counted_so_far = 0
        for _ in range(rng.randint(1, 12)):
            starting, counted = rng.random() < 0.1, rng.random() < 0.7
            refusal = policy.refusal("replica 1 died", starting=starting, counted=counted)
            if starting:
                assert refusal == "replica 1 died while starting; not restarting it", (seed, refusal)
                break
            if not restartable:
                assert refusal.startswith("replica 1 died; executors on torchrun ranks are not restarted"), seed
                assert "/run/checkpoint; resume it" in refusal, seed
                break
            counted_so_far += counted
            assert policy.restarts == counted_so_far, seed
            if counted_so_far > limit:
                assert refusal == (f"replica 1 died; restarted {limit} times already, stopping (the last checkpoint "
                                   "is in /run/checkpoint)"), (seed, refusal)
                break
            assert refusal is None, (seed, refusal)
