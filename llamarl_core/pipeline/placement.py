"""Which torchrun rank plays which part of a run (`--placement`).

    controller:0,reward:1,trainer:2-3,generator:4-7

Entries are `role:RANKS`, separated by commas; RANKS is one global rank (`4`) or
an inclusive range (`4-7`). A role may appear more than once: its ranks are taken
in the order written. The roles:

- controller: exactly one rank; it runs the controller (it holds no model).
- reward: exactly one rank.
- trainer: --trainer-world ranks; the n-th listed is trainer rank n.
- generator: --generator-tp x --generator-replicas ranks; the n-th listed is
  tensor-parallel rank n mod tp of replica n // tp.

Every rank of the job appears exactly once. Without --placement the roles take the
ranks in the order above: controller 0, reward 1, then the trainer's, then the
generator's. torchrun numbers ranks node by node (node 0's --nproc-per-node ranks
first), so a placement decides which roles share a host.
"""

from __future__ import annotations

import dataclasses
import re

CONTROLLER = "controller"
ROLES = (CONTROLLER, "reward", "trainer", "generator")
_ENTRY = re.compile(r"^(\w+):(\d+)(?:-(\d+))?$")


@dataclasses.dataclass(frozen=True)
class Placement:
    """ranks[role]: the global ranks of `role`, in executor-rank order."""

    ranks: dict[str, tuple[int, ...]]

    @property
    def world_size(self) -> int:
        return sum(len(r) for r in self.ranks.values())

    def global_rank(self, role: str, rank: int) -> int:
        """The job rank that runs executor rank `rank` of `role`."""
        return self.ranks[role][rank]

    @classmethod
    def parse(cls, spec: str, world_size: int, counts: dict[str, int]) -> Placement:
        """`spec` checked against the job's `world_size` and the ranks each role needs
        (`counts`: reward 1, trainer and generator from the run's sizes); ValueError
        naming the entry, role or rank at fault."""
        ranks: dict[str, list[int]] = {role: [] for role in ROLES}
        owner: dict[int, str] = {}
        for entry in (e.strip() for e in spec.split(",")):
            match = _ENTRY.match(entry)
            if match is None:
                raise ValueError(f"--placement: {entry!r} is not role:RANK or role:FIRST-LAST (e.g. trainer:2-3)")
            role, first = match.group(1), int(match.group(2))
            last = int(match.group(3)) if match.group(3) is not None else first
            if role not in ROLES:
                raise ValueError(f"--placement: unknown role {role!r} in {entry!r}; the roles: {', '.join(ROLES)}")
            if last < first:
                raise ValueError(f"--placement: {entry!r}: the range ends before it starts")
            for rank in range(first, last + 1):
                if rank >= world_size:
                    raise ValueError(f"--placement: {entry!r}: rank {rank} is outside the job's {world_size} ranks "
                                     f"(0-{world_size - 1})")
                if rank in owner:
                    raise ValueError(f"--placement: rank {rank} is given twice ({owner[rank]} and {role})")
                owner[rank] = role
                ranks[role].append(rank)
        return cls._checked(ranks, world_size, counts)

    @classmethod
    def default(cls, world_size: int, counts: dict[str, int]) -> Placement:
        """Controller, reward, trainer, generator, in rank order."""
        ranks, next_rank = {}, 0
        for role, count in _needed(counts).items():
            ranks[role] = list(range(next_rank, next_rank + count))
            next_rank += count
        return cls._checked(ranks, world_size, counts)

    @classmethod
    def _checked(cls, ranks: dict[str, list[int]], world_size: int, counts: dict[str, int]) -> Placement:
        needed = _needed(counts)
        for role in ROLES:
            if len(ranks[role]) != needed[role]:
                raise ValueError(f"--placement: {role} has {len(ranks[role])} ranks, the run needs {needed[role]}"
                                 + _why(role))
        total = sum(needed.values())
        if total != world_size:
            raise ValueError(f"the run needs {total} ranks (controller 1, reward 1, trainer {needed['trainer']}, "
                             f"generator {needed['generator']}); torchrun started {world_size} (--nnodes x "
                             "--nproc-per-node)")
        return cls({role: tuple(r) for role, r in ranks.items()})


def _needed(counts: dict[str, int]) -> dict[str, int]:
    """Ranks per role, in ROLES order: one controller, one reward, and `counts`."""
    return {role: {CONTROLLER: 1, "reward": 1, **counts}[role] for role in ROLES}


def _why(role: str) -> str:
    return {"trainer": " (--trainer-world)", "generator": " (--generator-tp x --generator-replicas)"}.get(role, "")
