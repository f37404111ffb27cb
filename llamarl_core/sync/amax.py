"""The senders' exchange of FP8 amaxes (fp8.py): before any sender writes a byte of
a version, every sender learns whether any holds NaN or inf, and each gets the
MAX of the amaxes of the groups it shares with others.

Two ways, chosen at registration (WeightSender's `group=`):
- Store keys (the default), under `src/amax/<version>/<n>/<incarnations>/`: each
  rank sets `values/<rank>` (the amaxes of the shared groups it touches, raw
  float32) and then `flag/<rank>` ("ok", "nonfinite"; "timed-out" once it gave
  up), reads every rank's flag and the values of the ranks it shares groups with
  (Fp8Plan.touched_shared: at FSDP 64 a rank shares blocks with its two
  neighbours, not with all 64), and the last rank done deletes the keys. The
  prefix holds the sync id (`SyncId`) and every sender rank's incarnation, so a
  restarted job never reads what a dead one left.
- a MAX all-reduce over a group of the senders' own: the amaxes of every shared
  group, a flag a rank, and the sync id twice (once negated: ranks at different
  sends see it).
"""

from __future__ import annotations

import contextlib
import hashlib
import time
from typing import Callable

import numpy as np
import torch
import torch.distributed as dist

from .errors import SyncError, SyncTimeoutError
from .fp8 import Fp8Sources
from .protocol import SRC, Channel

# How often a sender looks again for the others' registration before its first exchange.
REGISTRATION_POLL_S = 0.01


def amax_prefix(sync_id: tuple[int, int], incarnations: list[int]) -> str:
    """The Store keys of one exchange: its sync id and every sender rank's incarnation."""
    digest = hashlib.sha1(",".join(map(str, incarnations)).encode()).hexdigest()[:16]
    return f"{SRC}/amax/{sync_id[0]}/{sync_id[1]}/{digest}"


class SyncId:
    """(version, n), n = how many FP8 exchanges of `version` this rank has begun
    before: equal on every sender rank for one send of a version, never equal for
    two attempts of one rank, so a version sent again never reads a failed
    attempt's values. A rank that missed an exchange (its send of that version
    never started) puts at most the later sends of that same version out of step
    (they fail on a peer's "timed-out" marker, or time out); the next version
    starts again at n = 0 on every rank."""

    def __init__(self):
        self._last: tuple[int | None, int] = (None, 0)

    def next(self, version: int) -> tuple[int, int]:
        last, n = self._last
        self._last = (version, n + 1 if last == version else 0)
        return self._last


class AmaxExchange:
    """One sender rank's side of the exchange. `run(amax, version, deadline)`
    reduces the shared groups of `amax` (this rank's float32 vector over every
    group, on its device) in place, or takes part with amax None (this rank holds
    NaN or inf); returns the ranks that hold NaN or inf (empty: all is well).
    wait_work(work, deadline, what): waits for a collective (Endpoint._wait_work)."""

    def __init__(self, channel: Channel, rank: int, world: int, fp8: Fp8Sources,
                 group: dist.ProcessGroup | None, wait_work: Callable):
        self.channel, self.rank, self.world, self.fp8, self.group = channel, rank, world, fp8, group
        self.wait_work = wait_work
        self.sync_id = SyncId()
        touched = fp8.plan.touched_shared
        self.mine = torch.from_numpy(touched[rank]).to(fp8.device)
        self.peers = {r: np.intersect1d(touched[rank], touched[r], assume_unique=True, return_indices=True)[1:]
                      for r in range(world) if r != rank}
        self.peers = {r: where for r, where in self.peers.items() if len(where[0])}

    def run(self, amax: torch.Tensor | None, version: int, deadline: float) -> list[int]:
        sync_id = self.sync_id.next(version)
        if self.group is not None:
            return self._over_group(amax, sync_id, deadline)
        return self._through_store(amax, sync_id, deadline)

    def _over_group(self, amax: torch.Tensor | None, sync_id: tuple[int, int], deadline: float) -> list[int]:
        """float64 (exact for amaxes and ids below 2**53): [shared amaxes, a flag a
        rank, sync id, -sync id], MAX all-reduced. Ranks at different sync ids (one
        missed an exchange) raise instead of mixing two sends' amaxes."""
        shared = self.fp8.shared
        count = len(shared)
        buf = torch.zeros(count + self.world + 4, dtype=torch.float64, device=self.fp8.device)
        if amax is None:
            buf[count + self.rank] = 1
        else:
            buf[:count] = amax[shared]
        buf[count + self.world :] = torch.tensor([*sync_id, -sync_id[0], -sync_id[1]], dtype=torch.float64)
        options = dist.AllreduceOptions()
        options.reduceOp = dist.ReduceOp.MAX
        what = f"the FP8 amax all-reduce (sender rank {self.rank}, sync {sync_id})"
        self.wait_work(self.group.allreduce([buf], options), deadline, what)
        ids = buf[count + self.world :].cpu()
        if not torch.equal(ids[:2], -ids[2:]):
            raise SyncError(f"{what}: the sender ranks were at different sends, from {(-ids[2:]).tolist()} to "
                            f"{ids[:2].tolist()} (a rank missed an exchange); nothing was written")
        bad = torch.nonzero(buf[count : count + self.world]).reshape(-1).tolist()
        if amax is not None and not bad:
            amax[shared] = buf[:count].to(torch.float32)
        return bad

    def _prefix(self, sync_id: tuple[int, int], deadline: float) -> str:
        """The exchange's prefix, once every sender rank has registered (until
        `deadline`): a rank that reached its first exchange while another was still
        registering read that one's incarnation as 0, the other read 1, and each
        waited for the other's flag under a prefix of its own until both timed out."""
        while True:
            incarnations = [self.channel.counter(f"{SRC}/{r}/incarnation") for r in range(self.world)]
            if min(incarnations) >= 1 or time.monotonic() > deadline:
                return amax_prefix(sync_id, incarnations)
            time.sleep(REGISTRATION_POLL_S)

    def _done(self, prefix: str, raised: BaseException | None) -> None:
        """Count this rank done with the keys of `prefix`; the last deletes them. A
        Store error here is noted on `raised` (the exchange's own error), if any."""
        try:
            if self.channel.counter(f"{prefix}/done", 1) == self.world:
                touched = self.fp8.plan.touched_shared
                for key in [*(f"{prefix}/flag/{r}" for r in range(self.world)),
                            *(f"{prefix}/values/{r}" for r in range(self.world) if len(touched[r])), f"{prefix}/done"]:
                    self.channel.store.delete_key(key)
        except Exception as failure:
            if raised is None:
                raise
            raised.add_note(f"the FP8 exchange's keys under {prefix} were not deleted: {failure!r}")

    def _through_store(self, amax: torch.Tensor | None, sync_id: tuple[int, int], deadline: float) -> list[int]:
        prefix = self._prefix(sync_id, deadline)
        store = self.channel.store
        flag = f"{prefix}/flag/{self.rank}"
        mine = None if amax is None else amax[self.mine].cpu().numpy()
        if mine is not None and len(mine):
            store.set(f"{prefix}/values/{self.rank}", mine.tobytes())  # before the flag, which readers wait for
        store.set(flag, b"ok" if mine is not None else b"nonfinite")
        if mine is None:
            self._done(prefix, None)
            return [self.rank]  # the others need this rank's flag, not the other way round
        what = f"the FP8 amaxes of sync {sync_id}"
        try:
            flags = self.channel.wait({f"{prefix}/flag/{r}": f"sender rank {r}" for r in range(self.world)},
                                      deadline, f"{what}: every sender's flag")
            values = []
            if b"timed-out" not in flags and b"nonfinite" not in flags and self.peers:
                values = self.channel.wait({f"{prefix}/values/{r}": f"sender rank {r}" for r in self.peers},
                                           deadline, f"{what}: the senders sharing groups with this one")
        except BaseException as exc:
            # A timeout (a rank that never comes), the Store failing, an interrupt: this
            # rank's flag says it gave up, so the others stop waiting for it.
            with contextlib.suppress(Exception):
                store.set(flag, b"timed-out")
            self._done(prefix, exc)
            raise
        self._done(prefix, None)
        if b"timed-out" in flags:
            raise SyncTimeoutError(f"sender rank {flags.index(b'timed-out')} timed out in the FP8 amax exchange "
                                   f"of sync {sync_id}; nothing was written")
        bad = [r for r, value in enumerate(flags) if value == b"nonfinite"]
        if not bad:
            for (here, there), value in zip(self.peers.values(), values):
                mine[here] = np.maximum(mine[here], np.frombuffer(value, dtype=np.float32)[there])
            amax[self.mine] = torch.from_numpy(mine).to(amax.device)
        return bad
