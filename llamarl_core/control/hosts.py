"""Which host and which process this is, as the control plane and the weight
sync's choice of transport compare them: two processes share memory only where
their host identities are equal."""

from __future__ import annotations

import os
import socket
import uuid


def _namespace(kind: str) -> str:
    """This process's namespace of `kind`; where it cannot be read, a value no other
    process has, so that two processes are never taken for one host by default."""
    try:
        return os.readlink(f"/proc/self/ns/{kind}")
    except OSError:
        return f"{kind}:unreadable:{process_identity()}"


def host_identity() -> str:
    """Equal only for processes that can share memory by /dev/shm and /proc/PID/fd:
    one running kernel (the boot id), one network namespace and one PID namespace.
    The hostname, /dev/shm and the boot id alone do not tell hosts apart: processes
    in two network namespaces (containers, or the test hosts of this repository's
    tests) share all three, and must still talk over the network as two hosts do."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "unknown-boot"
    return f"{socket.gethostname()}/{boot}/{_namespace('net')}/{_namespace('pid')}"


# Told apart from the pid: containers on one host (one hostname and boot id) can
# run processes with equal pids, and a pid alone would make them one process. Drawn
# again in a forked child, which would otherwise share its parent's (a forkserver's).
_PROCESS_TOKEN = uuid.uuid4().hex


def _new_process_token() -> None:
    global _PROCESS_TOKEN
    _PROCESS_TOKEN = uuid.uuid4().hex


os.register_at_fork(after_in_child=_new_process_token)


def process_identity() -> str:
    """Equal only within one process (a forked child has another pid)."""
    return f"{os.getpid()}/{_PROCESS_TOKEN}"
