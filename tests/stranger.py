"""A stranger on a run's Store: someone who can reach its port and has read the
source, but does not hold the run's secret. Run as a script:

    python stranger.py HOST PORT MARKER SECONDS

Until SECONDS pass or the Store goes away, it lists (every few rounds) the Store's keys (TCPStore
answers anyone), and writes forged messages into every queue the source names
(the controller's events, every executor's inbox, under every run namespace it
finds, and torchrun's assignment queues): a pickle whose unpickling would create
the file MARKER, a message tagged under a secret of its own, a message with no tag,
garbage. It takes each slot as a producer would (the tail counter, then the empty
slot). Into every weight sync it finds (a receiver's device info in the keys) it
plants a forged offer of another version, a forged failure report (the count
moved too), a forged ticket board and a forged word that the receivers were
abandoned: values a rank would act on, were they not checked (placed as "sync").
On exit it prints one JSON line: how many it placed, per kind.
"""

from __future__ import annotations

import datetime
import json
import re
import sys
import time

import torch.distributed as dist

from llamarl_core.control import auth
from llamarl_core.control import wire

ROLES = ("reward", "trainer", "generator")


class _CreatesAFile:
    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return open, (self.path, "w")


def queue_namespaces(keys: list[str]) -> set[tuple[str, str]]:
    """(raw key prefix, queue name) of every queue the source uses, under every
    namespace seen in `keys` (a Store's queues are not among its keys): the Store's
    root, torchrun's worker prefix and each run's (a PrefixStore joins its prefix
    and a key with "/")."""
    bases = {""} | {m.group(1) for k in keys if (m := re.match(r"^(.*?)llamarl/", k))}
    bases |= {m.group(1) for k in keys if (m := re.match(r"^(.*?llamarl/run/[0-9a-f]+//)", k))}
    names = {"events"} | {f"inbox/{role}/{rank}/{inc}" for role in ROLES for rank in range(2) for inc in range(2)}
    names |= {f"launch/rank/{rank}" for rank in range(8)}
    return {(f"{base}llamarl/queue/{name}/", name) for base in bases for name in names}


def forged_messages(marker: str, name: str, number: int) -> dict[str, bytes]:
    import pickle

    own = auth.new_secret()
    command = wire.encode(("stop", {}))
    signed = bytes(16) + number.to_bytes(8, "big") + command  # a producer id and number, as a message carries them
    return {
        "pickle": pickle.dumps(_CreatesAFile(marker)),
        "wrong_secret": auth.sign(own, f"llamarl/queue/{name}", signed),
        "untagged": command,
        "garbage": bytes(range(256)) * 4,
    }


def plant_sync_values(store: dist.Store, keys: list[str]) -> int:
    """Forged values at the keys the syncs in `keys` read next; returns how many."""
    own, placed = auth.new_secret(), 0
    for key in keys:
        if not (m := re.match(r"^(.*llamarl/sync/.+?)//dst/(\d+)/info$", key)):
            continue
        namespace, dst = m.groups()
        values = {f"src/0/offer/{dst}": "[999999, 999999]", "src/0/error": '"forged failure"',
                  f"dst/{dst}/board": '{"pid": 1, "fd": 0, "name": "/forged", "nbytes": 256, "incarnation": 1}',
                  "abandoned": '"forged: the receivers are gone"'}
        for name, value in values.items():
            # A PrefixStore joins its prefix and a key with "/"; the tag is bound to prefix + key.
            store.set(f"{namespace}//{name}", auth.sign(own, f"{namespace}/{name}", value.encode()))
            placed += 1
        store.add(f"{namespace}//src/failures", 1)  # as a failing sender does: every waiter reads the reports
    return placed


def main(host: str, port: int, marker: str, seconds: float) -> dict[str, int]:
    store = dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=10))
    placed: dict[str, int] = {}
    deadline = time.monotonic() + seconds
    turn = 0
    namespaces: list[tuple[str, str]] = []
    try:
        while time.monotonic() < deadline:
            if turn % 10 == 0:  # the keys grow with what this stranger leaves in queues nobody reads
                keys = store.list_keys()
                namespaces = sorted(queue_namespaces(keys))
                if planted := plant_sync_values(store, keys):
                    placed["sync"] = placed.get("sync", 0) + planted
            for namespace, name in namespaces:
                kind, value = list(forged_messages(marker, name, turn + 1).items())[turn % 4]
                store.queue_push(f"{namespace}/messages", value)
                placed[kind] = placed.get(kind, 0) + 1
            turn += 1
            time.sleep(0.3)
    except dist.DistError:
        pass  # the run ended and its Store with it
    print("namespaces:", [n for n, _ in namespaces if "attempt" in n or "run" in n][:30], file=sys.stderr)
    return placed


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], int(sys.argv[2]), sys.argv[3], float(sys.argv[4]))), flush=True)
