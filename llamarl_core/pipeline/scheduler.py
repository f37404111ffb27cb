"""The controller's scheduling decisions as a plain class, with no processes and no
queues: which prompt groups the generator samples, when a group is complete, which
complete groups the trainer's next batch takes and which are dropped as too stale.
The controller (controller.py) feeds it what the executors report and sends what it
decides; tests/test_scheduler.py drives it through thousands of random completion
orders.

A group is a data position: group g is the task's prompt g, sampled
samples_per_prompt times by one generator replica. It is outstanding from the
moment it is issued to a replica until the trainer takes it or it is dropped; at
most groups_in_flight are outstanding at once, and never more than the steps left
to train need (the run's last steps sample nothing they would not train), each new
one dealt to the replica sampling the fewest. Step s trains weight version s on prompts_per_step complete
groups, and every sample it trains has s - oldest_version <= max_staleness (the
oldest version among its tokens: a partial rollout's tokens may span versions).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from .config import TrainConfig
from .rollout import Sample


@dataclass
class Batch:
    """One trainer step's data. groups: prompts_per_step complete groups in the order
    they completed, each samples_per_prompt samples; dropped: samples dropped as stale
    since the previous batch was taken (the step's `dropped` metric)."""

    step: int
    groups: list[list[Sample]]
    dropped: int

    @property
    def samples(self) -> list[Sample]:
        return [sample for group in self.groups for sample in group]


class Scheduler:
    """See the module docstring. step: the step the next batch trains at (the weight
    version the trainer holds); data_position: one past the highest group taken into
    a batch, which a checkpoint keeps: a run resumed from it issues groups from there
    (groups below it that were never trained are skipped, not re-run)."""

    def __init__(self, config: TrainConfig, step: int = 0, data_position: int = 0):
        self.config = config
        self.step, self.data_position = step, data_position
        self.training: Batch | None = None  # handed to the trainer, not trained yet
        self.dropped = 0  # samples dropped as stale since the last batch was taken
        self._next_group = data_position
        self._to_reissue: deque[int] = deque()  # a lost generator's groups, lowest first
        self._sampling: dict[int, list[Sample]] = {}  # issued, not complete: group -> samples so far
        self._replica_of: dict[int, int] = {}  # issued, not complete: group -> the replica sampling it
        self._ready: deque[list[Sample]] = deque()  # complete groups, in completion order

    @property
    def outstanding(self) -> set[int]:
        """Groups issued and not yet taken into a batch or dropped."""
        return set(self._sampling) | {group[0].group for group in self._ready}

    @property
    def to_reissue(self) -> list[int]:
        """Groups a lost generator held, not issued again yet."""
        return list(self._to_reissue)

    def sampling_replicas(self) -> dict[int, int]:
        """Groups issued and not complete, each with the replica sampling it."""
        return dict(self._replica_of)

    def issue(self, replicas: dict[int, bool]) -> dict[int, list[int]]:
        """The groups to hand to each replica now (replica -> groups, lowest first):
        first those a lost generator held (lowest first), then new data positions,
        until groups_in_flight are outstanding, or as many as the steps left to train
        need (those of the batch in training counted), each to the replica sampling
        the fewest (the lowest-numbered of equals): at the run's last step nothing is
        outstanding. `replicas`: the replicas that hold weights,
        each with whether it holds version `step` with no sync or step pending (or
        will, before it reads what is issued now: its receive queued ahead). Sync
        mode (max_staleness 0) takes turns: nothing is issued while a batch is in
        training, nor to a replica without version `step`, so every token of step s is
        sampled with version s."""
        if self.config.run.max_staleness == 0:
            replicas = {r: landed for r, landed in replicas.items() if landed and self.training is None}
        issued: dict[int, list[int]] = {}
        if not replicas:
            return issued
        load = {r: 0 for r in replicas}
        for replica in self._replica_of.values():
            if replica in load:
                load[replica] += 1
        pps = self.config.run.prompts_per_step
        needed = (self.config.run.steps - self.step - (self.training is not None)) * pps
        while len(self._sampling) + len(self._ready) < min(self.config.groups_in_flight, needed):
            if self._to_reissue:
                group = self._to_reissue.popleft()
            else:
                group, self._next_group = self._next_group, self._next_group + 1
            replica = min(load, key=lambda r: (load[r], r))
            load[replica] += 1
            self._sampling[group] = []
            self._replica_of[group] = replica
            issued.setdefault(replica, []).append(group)
        return issued

    def add_samples(self, samples: list[Sample]) -> None:
        """Scored samples from the current generator (the caller discards those of a
        generator since lost: their groups were re-issued). A group is complete, and
        ready for a batch, with its samples_per_prompt-th sample."""
        for sample in samples:
            group = self._sampling.get(sample.group)
            if group is None:
                raise ValueError(f"a sample of group {sample.group}, which is not being sampled "
                                 f"(sampling {sorted(self._sampling)})")
            group.append(sample)
            if len(group) == self.config.run.samples_per_prompt:
                self._ready.append(self._sampling.pop(sample.group))
                del self._replica_of[sample.group]

    def take_batch(self) -> Batch | None:
        """Drop every complete group with a sample too stale for `step` (counted in
        `dropped`; staleness only grows with the step, so it could never train later),
        then hand the first prompts_per_step of the rest, in completion order, to the
        trainer as the batch of `step`. None while a batch is in training or too few
        complete groups are fresh enough."""
        if self.training is not None:
            return None
        fresh: deque[list[Sample]] = deque()
        for group in self._ready:
            if self.step - min(sample.oldest_version for sample in group) > self.config.run.max_staleness:
                self.dropped += len(group)
            else:
                fresh.append(group)
        self._ready = fresh
        if len(fresh) < self.config.run.prompts_per_step:
            return None
        groups = [fresh.popleft() for _ in range(self.config.run.prompts_per_step)]
        self.data_position = max(self.data_position, max(group[0].group for group in groups) + 1)
        self.training = Batch(self.step, groups, self.dropped)
        self.dropped = 0
        return self.training

    def trained(self) -> Batch:
        """The batch in training has been trained: the next batch trains at step + 1.
        Returns the batch."""
        if self.training is None:
            raise RuntimeError(f"step {self.step} was reported trained, but no batch is in training")
        batch, self.training = self.training, None
        self.step += 1
        return batch

    def replicas_lost(self, replicas: set[int]) -> None:
        """These generator replicas died or were replaced: the groups they were
        sampling are issued again from scratch (their samples so far are discarded;
        complete groups, and the other replicas' groups, stay)."""
        lost = {group for group, replica in self._replica_of.items() if replica in replicas}
        self._to_reissue = deque(sorted(set(self._to_reissue) | lost))
        for group in lost:
            del self._sampling[group], self._replica_of[group]
