"""The point-to-point wire format of one version, from a trainer rank's
WeightSender or from a generator replica's relay (relay.py) to one receiver."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .engine import run_segment_table

if TYPE_CHECKING:
    from .sender import WeightSender

# A header's bucket count when the sender wrote nothing of the version to that receiver
# (WeightSender._tell_nothing_follows).
NOTHING_FOLLOWS = -1


class P2PStream:
    """One version from a sender to one point-to-point receiver: a header (tag 0:
    version, bucket count, how many sends this sender offered the receiver; a
    count of NOTHING_FOLLOWS: this sender wrote nothing of that version to the
    receiver, see WeightSender._tell_nothing_follows), then bucket i packed into
    staging buffer i % 2 and sent
    (tag 1 + i), so that packing bucket i + 1 overlaps the send of bucket i.
    Packing is done when run_segment_table returns (on GPU its stream waited for
    the current one, so the optimizer's pending writes came first): what is in
    flight reads the staging buffers only, never the sender's tensors. `forward`
    sends the buckets one at a time (a relay sends each as it lands on its own
    rank); `finish` sends the rest and waits for every send. The receiver is
    offered the version first (here, or by the caller: `offered`): a pair's
    versions arrive in order, so the receiver counts what it took."""

    def __init__(self, sender: WeightSender, dst: int, version: int, deadline: float, offered: bool = False):
        self.sender, self.deadline = sender, deadline
        sender._finish_header(dst, deadline)
        if not offered:
            sender._offer(dst, version)
        self.peer = sender.plan.src_layout.world_size + dst
        self.tables = sender._tables[dst]
        self.what = f"sending version {version} to receiver {dst}"
        self.header = torch.tensor([version, len(self.tables), sender.book.sends[dst]], dtype=torch.int64,
                                   device=sender.device)
        self.in_flight = [sender._post("send", self.header, self.peer, 0, self.what), None, None]
        self.sent = 0  # buckets posted
        self.written = 0

    def forward(self) -> None:
        """Pack and post the next bucket, once the send still reading its buffer is done."""
        s, i = self.sender, self.sent
        table, nbytes = self.tables[i]
        if self.in_flight[1 + i % 2] is not None:
            s._wait_work(self.in_flight[1 + i % 2], self.deadline, self.what)
        self.written += run_segment_table(table, s.device, s.num_threads, s._copy_timeout(self.deadline))
        self.in_flight[1 + i % 2] = s._post("send", s._staging_bufs[i % 2][:nbytes], self.peer, 1 + i, self.what)
        self.sent += 1

    def finish(self) -> int:
        """Send the buckets not sent yet, wait for every send; returns the bytes packed."""
        while self.sent < len(self.tables):
            self.forward()
        for work in self.in_flight:
            if work is not None:
                self.sender._wait_work(work, self.deadline, self.what)
        return self.written
