"""The scheduler alone (llamarl_core/pipeline/scheduler.py): its rules on small
examples, then thousands of random runs in which groups complete out of order, the
samples of a group arrive interleaved with other groups', weight versions advance
as steps are trained and land on the generator later, and the generator is lost at
random moments."""

import itertools
import random

import pytest

from llamarl_core.pipeline import Sample, TrainConfig
from llamarl_core.pipeline.scheduler import Scheduler


def group(g, versions):
    """A complete group: one sample per list of token versions."""
    return [Sample(g, [1], [3] * len(v), [0.0] * len(v), v, True, 0.0) for v in versions]


def test_stale_groups_are_dropped_wherever_they_wait_and_counted_in_the_next_batch():
    sched = Scheduler(TrainConfig(prompts_per_step=2, samples_per_prompt=2, max_staleness=2), step=3)
    assert sched.issue({0: True}) == {0: [0, 1, 2, 3]}  # groups_in_flight: 2 steps x 2 prompts
    sched.add_samples(group(0, [[3], [1, 2]]))  # fresh at step 3: 3 - 1 <= 2
    sched.add_samples(group(1, [[3], [0]]))  # stale, behind a fresh group
    assert sched.take_batch() is None and sched.dropped == 2  # one fresh group: not enough
    assert sched.outstanding == {0, 2, 3}
    assert sched.issue({0: True}) == {0: [4]}
    sched.add_samples(group(4, [[3], [3]]))
    batch = sched.take_batch()
    assert batch.step == 3 and [g[0].group for g in batch.groups] == [0, 4] and len(batch.samples) == 4
    assert batch.dropped == 2 and sched.dropped == 0 and sched.data_position == 5
    assert sched.take_batch() is None  # one batch in training at a time
    assert sched.trained() is batch and sched.step == 4
    with pytest.raises(RuntimeError, match="no batch is in training"):
        sched.trained()


def test_lost_generator_groups_are_reissued_first_and_complete_groups_kept():
    sched = Scheduler(TrainConfig(prompts_per_step=2, samples_per_prompt=2, max_staleness=1))
    assert sched.issue({0: True}) == {0: [0, 1]}
    sched.add_samples(group(1, [[0], [0]]))
    sched.add_samples(group(0, [[0]]))  # half of group 0
    sched.replicas_lost({0})
    assert sched.to_reissue == [0] and sched.outstanding == {1}
    with pytest.raises(ValueError, match="group 0, which is not being sampled"):
        sched.add_samples(group(0, [[0]]))  # the controller discards a lost generator's samples
    assert sched.issue({0: True}) == {0: [0]}
    sched.add_samples(group(0, [[0], [0]]))
    assert [g[0].group for g in sched.take_batch().groups] == [1, 0]


def test_sync_mode_issues_a_step_only_when_its_weights_have_landed():
    sched = Scheduler(TrainConfig(mode="sync", prompts_per_step=2, samples_per_prompt=2))
    assert sched.issue({0: False}) == {}
    assert sched.issue({0: True}) == {0: [0, 1]}
    sched.add_samples(group(0, [[0], [0]]) + group(1, [[0], [0]]))
    sched.take_batch()
    assert sched.issue({0: True}) == {}  # step 0 in training
    sched.trained()
    assert sched.issue({0: False}) == {}  # version 1 not on the generator yet
    assert sched.issue({0: True}) == {0: [2, 3]}


def test_the_last_steps_issue_only_what_they_train():
    sched = Scheduler(TrainConfig(steps=2, prompts_per_step=2, samples_per_prompt=2, max_staleness=3))
    assert sched.issue({0: True}) == {0: [0, 1, 2, 3]}  # two steps' worth, not three
    sched.add_samples(group(0, [[0], [0]]) + group(1, [[0], [0]]))
    sched.take_batch()
    sched.trained()
    assert sched.issue({0: True}) == {}  # the last step's groups are out
    sched.add_samples(group(2, [[0], [0]]) + group(3, [[0], [0]]))
    sched.take_batch()
    sched.trained()
    assert sched.step == 2 and not sched.outstanding and sched.issue({0: True}) == {}


def test_resumed_scheduler_issues_from_its_data_position():
    sched = Scheduler(TrainConfig(prompts_per_step=2, samples_per_prompt=2, max_staleness=1), 10, 37)
    assert sched.issue({0: True}) == {0: [37, 38]} and sched.step == 10


# ----------------------------------------------------------------------------- random runs

# Per run of 400 events: about 5.5 trained steps and 1.4 lost generators (0.1 of 28.1 weights).
# Half the runs are 1-8 steps long, so that they end among the events or in the drain.
EVENTS = ("issue", "decode", "finish", "score", "deliver", "take", "train", "land", "lose")
EVENT_CUM_WEIGHTS = tuple(itertools.accumulate([2, 6, 4, 3, 4, 3, 3, 3, 0.1]))


class _Run:
    """One random run against a Scheduler, checking every decision it takes. The
    generator (1 to 3 replicas) samples the issued groups token by token, each
    replica with the version it holds, any sample at any time; finished samples are
    scored in random subsets and the scorings reach the scheduler in random order (a
    lost generator's are discarded, as the controller does); trained versions land on
    each replica in order, each at a random later time; the generator (every
    replica) is lost at random moments."""

    def __init__(self, seed: int):
        self.rng = rng = random.Random(seed)
        mode = rng.choice(["async", "async", "sync"])
        self.config = TrainConfig(mode=mode, prompts_per_step=rng.randint(1, 4), samples_per_prompt=rng.randint(2, 3),
                                  max_staleness=rng.randint(1, 3), steps=rng.choice([rng.randint(1, 8), 1200]))
        self.sched = Scheduler(self.config)
        self.num_replicas = rng.randint(1, 3)
        self.versions: list[int | None] = [0] * self.num_replicas  # per replica; None: waiting for its weights
        self.incarnation = [0] * self.num_replicas
        self.replica_of: dict[int, int] = {}  # group -> the replica it was last issued to
        self.sampling: list[tuple[int, Sample]] = []  # the generator's unfinished samples, with their replica
        self.scorings: list[tuple[int, int, list[Sample]]] = []  # (replica, incarnation, samples) on their way
        self.finished: list[tuple[int, Sample]] = []  # finished, not yet in a scoring, with their replica
        self.issued: set[int] = set()
        self.lost: set[int] = set()  # groups a lost generator held, not issued again yet
        self.delivered: dict[int, list[Sample]] = {}  # group -> samples of its current issue delivered
        self.trained: set[int] = set()
        self.dropped_reported = 0
        self.next_fresh = 0

    # -- the scheduler's calls, each checked --------------------------------------------
    def issue(self):
        holding = {r: v == self.sched.step for r, v in enumerate(self.versions) if v is not None}
        before = len(self.sched.outstanding)
        issued = self.sched.issue(holding)
        groups = sorted(g for gs in issued.values() for g in gs)
        for replica, gs in issued.items():
            assert replica in holding and gs == sorted(gs), (replica, gs, holding)
            if self.config.run.mode == "sync":
                assert self.sched.training is None and self.versions[replica] == self.sched.step
            self.sampling += [(replica, Sample(g, [1])) for g in gs for _ in range(self.config.run.samples_per_prompt)]
            self.replica_of.update({g: replica for g in gs})
        for g in groups:
            if g in self.lost:
                self.lost.remove(g)
            else:
                assert g == self.next_fresh and not self.lost, (g, self.next_fresh, self.lost)
                self.next_fresh += 1
            self.issued.add(g)
            self.delivered[g] = []
        assert len(self.sched.outstanding) == before + len(groups) <= self.config.groups_in_flight
        self.check_left_to_train()

    def take(self):
        before, step, position = self.sched.outstanding, self.sched.step, self.sched.data_position
        batch = self.sched.take_batch()
        taken = set() if batch is None else {g[0].group for g in batch.groups}
        for g in before - self.sched.outstanding - taken:  # dropped now: must be stale
            assert step - min(x.oldest_version for x in self.delivered[g]) > self.config.run.max_staleness
        if batch is None:
            return
        assert batch.step == step and len(batch.groups) == self.config.run.prompts_per_step
        for samples in batch.groups:
            g = samples[0].group
            assert g not in self.trained, f"group {g} trained twice"
            assert len(samples) == self.config.run.samples_per_prompt and all(x.group == g for x in samples)
            assert sorted(map(id, samples)) == sorted(map(id, self.delivered[g]))
            self.trained.add(g)
        for sample in batch.samples:  # the bound, for every sample ever trained
            assert step - sample.oldest_version <= self.config.run.max_staleness, (step, sample.versions)
        assert self.sched.data_position == max(position, max(taken) + 1)
        self.dropped_reported += batch.dropped

    def train(self):
        batch = self.sched.training
        if batch is not None:
            assert self.sched.trained() is batch and self.sched.step == batch.step + 1

    def deliver(self, scoring):
        replica, incarnation, samples = scoring
        if incarnation != self.incarnation[replica]:
            return  # sampled by a lost replica: the controller discards it
        for x in samples:
            self.delivered[x.group].append(x)
        self.sched.add_samples(samples)

    def lose_replicas(self, replicas: set[int]):
        self.lost |= {g for g, got in self.delivered.items() if g in self.sched.outstanding
                      and len(got) < self.config.run.samples_per_prompt and self.replica_of[g] in replicas}
        self.sched.replicas_lost(replicas)
        assert set(self.sched.to_reissue) == self.lost
        self.sampling = [entry for entry in self.sampling if entry[0] not in replicas]
        self.finished = [entry for entry in self.finished if entry[0] not in replicas]
        for replica in replicas:
            self.incarnation[replica] += 1
            self.versions[replica] = None

    # -- the world around it ---------------------------------------------------------------
    def land(self, replica):
        """The next trained version lands on a replica (a new one gets the latest)."""
        if self.versions[replica] is None:
            self.versions[replica] = self.sched.step
        elif self.versions[replica] < self.sched.step:
            self.versions[replica] += 1

    def decode(self, replica, sample):
        sample.tokens.append(3)
        sample.logprobs.append(0.0)
        sample.versions.append(self.versions[replica])

    def finish(self, entry):
        self.sampling.remove(entry)
        self.finished.append(entry)

    def score(self, replica, count):
        """Up to `count` of one replica's finished samples go to scoring (one message of its)."""
        mine = [entry for entry in self.finished if entry[0] == replica]
        self.rng.shuffle(mine)
        self.scorings.append((replica, self.incarnation[replica], [sample for _, sample in mine[:count]]))
        for entry in mine[:count]:
            self.finished.remove(entry)

    def random_event(self):
        rng = self.rng
        event = rng.choices(EVENTS, cum_weights=EVENT_CUM_WEIGHTS)[0]
        if event == "issue":
            self.issue()
        elif event == "decode" and self.sampling:
            for replica, sample in rng.sample(self.sampling, rng.randint(1, len(self.sampling))):
                self.decode(replica, sample)  # a replica samples only once it holds weights: it was issued then
        elif event == "finish":
            started = [entry for entry in self.sampling if entry[1].tokens]
            for entry in rng.sample(started, rng.randint(0, len(started))):
                self.finish(entry)
        elif event == "score" and self.finished:
            self.score(rng.choice(self.finished)[0], rng.randint(1, len(self.finished)))
        elif event == "deliver" and self.scorings:
            self.deliver(self.scorings.pop(rng.randrange(len(self.scorings))))
        elif event == "take":
            self.take()
        elif event == "train":
            self.train()
        elif event == "land":
            self.land(rng.randrange(self.num_replicas))
        elif event == "lose":
            self.lose_replicas(set(rng.sample(range(self.num_replicas), rng.randint(1, self.num_replicas))))

    def drain_round(self):
        """Everything in order, no generator lost: what is in flight gets trained or dropped."""
        for replica in range(self.num_replicas):
            while self.versions[replica] != self.sched.step:
                self.land(replica)
        self.issue()
        for entry in list(self.sampling):
            self.decode(*entry)
            self.finish(entry)
        for replica in range(self.num_replicas):
            self.score(replica, len(self.finished))
        while self.scorings:
            self.deliver(self.scorings.pop())
        self.take()
        self.train()

    def check_left_to_train(self):
        """No group is held beyond what the steps left to train take: at the last step,
        none."""
        run, sched = self.config.run, self.sched
        held = len(sched.outstanding) + len(sched.to_reissue) + (sched.training is not None) * run.prompts_per_step
        assert held <= (run.steps - sched.step) * run.prompts_per_step, (held, sched.step, run.steps)

    def check_accounting(self):
        """Every group issued is trained, or dropped (and counted), or still held."""
        held = self.sched.outstanding | set(self.sched.to_reissue)
        assert not held & self.trained
        dropped = self.issued - self.trained - held
        assert self.dropped_reported + self.sched.dropped == len(dropped) * self.config.run.samples_per_prompt


@pytest.mark.parametrize("first_seed", range(0, 3000, 500))
def test_random_runs_never_train_a_sample_staler_than_the_bound(first_seed):
    """500 seeded runs per case (3,000 in all, about 1 s each case): 400 random events,
    then drain rounds until every group issued during them is trained or dropped."""
    for seed in range(first_seed, first_seed + 500):
        run = _Run(seed)
        try:
            for _ in range(400):
                run.random_event()
                run.check_left_to_train()
                if run.rng.random() < 0.05:
                    run.check_accounting()
            in_flight = run.issued | run.lost
            for _ in range(4 + run.config.run.max_staleness):
                run.drain_round()
            assert not in_flight & (run.sched.outstanding | set(run.sched.to_reissue) | run.lost)
            run.check_accounting()
            run.check_left_to_train()
        except AssertionError as exc:
            raise AssertionError(f"seed {seed}, {run.config}: {exc}") from exc
