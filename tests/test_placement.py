"""--placement (llamarl_core.pipeline.placement): which torchrun rank plays which
part, checked against the job's size and the run's sizes, on thousands of random
placements and on every kind of bad one."""

from __future__ import annotations

import random

import pytest

from llamarl_core.launch import controller_rank
from llamarl_core.pipeline.placement import ROLES, Placement


def _random_spec(rng: random.Random, counts: dict[str, int]) -> tuple[str, dict[str, list[int]]]:
    """A valid spec for `counts` (controller and reward 1 each): ranks shuffled over
    the roles, each role's ranks written as runs of consecutive ranks (ranges where
    they are), the entries in random order; and the ranks it gives each role."""
    needed = {"controller": 1, "reward": 1, **counts}
    ranks = list(range(sum(needed.values())))
    rng.shuffle(ranks)
    expected, entries, at = {}, [], 0
    for role in ROLES:
        mine = ranks[at:at + needed[role]]
        at += needed[role]
        if rng.random() < 0.5:
            mine.sort()  # consecutive runs become ranges
        expected[role] = mine
        runs, start = [], 0
        for i in range(1, len(mine) + 1):
            if i == len(mine) or mine[i] != mine[i - 1] + 1:
                runs.append((mine[start], mine[i - 1]))
                start = i
        entries.append([f"{role}:{a}" if a == b else f"{role}:{a}-{b}" for a, b in runs])
    # Interleave the roles' entries (each role's own runs stay in order: they give its rank order).
    spec = []
    while any(entries):
        role_entries = rng.choice([e for e in entries if e])
        spec.append(role_entries.pop(0))
    return ",".join(spec), expected


def test_random_placements_round_trip():
    rng = random.Random(0)
    for _ in range(3000):
        counts = {"trainer": rng.randint(1, 8), "generator": rng.randint(1, 12)}
        spec, expected = _random_spec(rng, counts)
        world = 2 + counts["trainer"] + counts["generator"]
        placement = Placement.parse(spec, world, counts)
        assert {role: list(r) for role, r in placement.ranks.items()} == expected, spec
        assert expected["controller"][0] == controller_rank(spec)
        assert placement.world_size == world
        for role in ROLES:
            for executor_rank, global_rank in enumerate(expected[role]):
                assert placement.global_rank(role, executor_rank) == global_rank


def test_default_placement():
    placement = Placement.default(7, {"trainer": 2, "generator": 3})
    assert placement.ranks == {"controller": (0,), "reward": (1,), "trainer": (2, 3), "generator": (4, 5, 6)}
    assert controller_rank(None) == 0


@pytest.mark.parametrize("spec, world, message", [
    ("controller:0,reward:1,trainer:2,generator:3-4", 5, "generator has 2 ranks, the run needs 1"),
    ("controller:0,reward:1,generator:3", 4, "trainer has 0 ranks, the run needs 1 (--trainer-world)"),
    ("controller:0,reward:1,trainer:2,generator:2", 4, "rank 2 is given twice (trainer and generator)"),
    ("controller:0,reward:1,trainer:2,generator:4", 4, "rank 4 is outside the job's 4 ranks (0-3)"),
    ("controller:0,reward:1,trainer:2,gen:3", 4, "unknown role 'gen'"),
    ("controller:0,reward:1,trainer:2,generator:3-", 4, "'generator:3-' is not role:RANK"),
    ("controller:0,reward:1,trainer:3-2,generator:4", 5, "the range ends before it starts"),
    ("controller:0,reward:1,trainer:2,generator:3", 6, "the run needs 4 ranks"),
    ("", 4, "'' is not role:RANK"),
])
def test_bad_placements_name_the_culprit(spec, world, message):
    with pytest.raises(ValueError) as info:
        Placement.parse(spec, world, {"trainer": 1, "generator": 1})
    assert message in str(info.value)


def test_controller_rank_must_be_one():
    for spec in ("reward:1,trainer:2", "controller:0,controller:1", "controller:x"):
        with pytest.raises(SystemExit, match="exactly one controller rank"):
            controller_rank(spec)
