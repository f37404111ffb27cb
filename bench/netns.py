"""Several "hosts" on one machine, for tests and benchmarks: Linux network namespaces on a private
subnet, joined by a bridge that lives in a "switch" namespace of its own.

    with NetnsHosts(num_hosts=2) as hosts:
        a, b = hosts
        server = a.popen([sys.executable, "server.py", "--bind", a.addr])
        b.run([sys.executable, "client.py", "--connect", a.addr], timeout=10)
        b.link_down()            # pull b's cable at the switch: packets vanish, no error
        a.shape(rate="1gbit")    # a sends at 1 Gbit/s (token bucket on its veth)

Nothing is ever added to the root namespace: each veth pair is created with one
end in the switch namespace and the other in its host, so the root namespace has
no interface, address or route for the test subnet, and the hosts' addresses are
reachable only from the hosts themselves. Processes in the hosts still share the
filesystem, /dev/shm, the hostname and the boot id with everything else.

Names carry the pid namespace, the pid and a random token
(`llamarl-<pidns>-<pid>-<token>-h0`), so concurrent test runs never collide, and
namespaces left by a run that was killed (SIGKILL: no cleanup could run) are
recognised by their dead pid and removed when the next instance starts.
Teardown runs on `close()`, at the end of the `with` block (also when the body
raises), at interpreter exit and on SIGTERM / SIGHUP.

Needs root and iproute2 (`ip`, `tc`); without them `NetnsUnavailable` says why
(the tests' fixtures skip with that reason). `llamarl bench sync --hosts` times the
weight sync between such hosts over links shaped to a fixed rate.
"""

from __future__ import annotations

import atexit
import os
import re
import secrets
import signal
import subprocess
import threading
import time
from typing import Iterator, Mapping, Sequence

NAME_PREFIX = "llamarl"
# 10.237.<random>.0/24: a private block no real network on the test machines uses.
# The hosts are unreachable from the root namespace anyway, so two runs that draw
# the same third octet do not interfere; the draw only keeps logs unambiguous.
SUBNET_FIRST_OCTETS = "10.237"
SUBNET_PREFIX_LEN = 24
# `ip`/`tc` finish in milliseconds; a bound keeps a wedged kernel call from hanging a test.
IP_COMMAND_TIMEOUT_S = 10.0
# A process is asked to stop (SIGTERM) and killed after this long.
TERMINATE_GRACE_S = 2.0
CLOSE_TIMEOUT_S = 10.0

_OUR_NAMESPACE_NAME = re.compile(rf"^{NAME_PREFIX}-(\d+)-(\d+)-[0-9a-f]{{6}}-(?:sw|h\d+)$")


class NetnsUnavailable(RuntimeError):
    """Network namespace hosts cannot be made here; the message says why."""


def _run_ip(argv: Sequence[str]) -> str:
    """Run an iproute2 command; its stderr is in the error when it fails."""
    result = subprocess.run(list(argv), capture_output=True, text=True, timeout=IP_COMMAND_TIMEOUT_S)
    if result.returncode != 0:
        raise subprocess.CalledProcessError(result.returncode, list(argv), result.stdout, result.stderr)
    return result.stdout


def _describe(error: subprocess.CalledProcessError) -> str:
    return f"`{' '.join(error.cmd)}` failed (exit {error.returncode}): {(error.stderr or '').strip()}"


def list_namespaces() -> list[str]:
    """Names of all namespaces `ip netns add` made (in /run/netns)."""
    # Lines look like "name (id: 3)" or just "name".
    return [line.split()[0] for line in _run_ip(["ip", "netns", "list"]).splitlines() if line.strip()]


def namespace_pids(namespace: str) -> list[int]:
    """Live processes in `namespace` (zombies have no namespace and are not listed)."""
    try:
        out = _run_ip(["ip", "netns", "pids", namespace])
    except subprocess.CalledProcessError:
        return []  # the namespace is gone
    return [int(pid) for pid in out.split()]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # it exists, owned by another user
    return True


def _own_pid_namespace() -> int:
    return os.stat("/proc/self/ns/pid").st_ino


def _kill_namespace_processes(namespace: str, deadline: float) -> list[int]:
    """SIGKILL every process in `namespace`; the pids still there at `deadline`."""
    pids = namespace_pids(namespace)
    while pids and time.monotonic() < deadline:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.02)
        pids = namespace_pids(namespace)
    return pids


def remove_stale_namespaces() -> list[str]:
    """Delete namespaces of ours whose creating process is dead (a run killed with
    SIGKILL); returns their names. Only names with this pid namespace's id are
    considered, so another container's live namespaces are never touched."""
    own_pidns = _own_pid_namespace()
    stale = []
    for name in list_namespaces():
        match = _OUR_NAMESPACE_NAME.match(name)
        if match and int(match.group(1)) == own_pidns and not _pid_alive(int(match.group(2))):
            stale.append(name)
    deadline = time.monotonic() + CLOSE_TIMEOUT_S
    for name in stale:
        _kill_namespace_processes(name, deadline)
        try:
            _run_ip(["ip", "netns", "delete", name])
        except subprocess.CalledProcessError:
            pass  # removed by a concurrent run doing the same clean-up
    return stale


class NetnsHost:
    """One namespace host: `name` (the namespace), `addr` (its IPv4 address),
    `ifname` (its veth, e.g. for GLOO_SOCKET_IFNAME)."""

    def __init__(self, owner: NetnsHosts, name: str, addr: str, ifname: str, switch_port: str):
        self._owner = owner
        self.name = name
        self.addr = addr
        self.ifname = ifname
        self._switch_port = switch_port

    def __repr__(self) -> str:
        return f"NetnsHost(name={self.name!r}, addr={self.addr!r}, ifname={self.ifname!r})"

    def command(self, argv: Sequence[str]) -> list[str]:
        """`argv` prefixed to run inside this host (`ip netns exec` execs it: same pid)."""
        return ["ip", "netns", "exec", self.name, *argv]

    def popen(self, argv: Sequence[str], env: Mapping[str, str] | None = None, **popen_kwargs) -> subprocess.Popen:
        """Start `argv` in this host. `env` is added to (and overrides) this process's
        environment. The process leads a session of its own, so teardown can stop it
        with everything it started; it is stopped at teardown if it still runs."""
        if self._owner.closed:
            raise RuntimeError(f"{self.name}: the hosts are closed")
        full_env = {**os.environ, **(env or {})}
        proc = subprocess.Popen(self.command(argv), env=full_env, start_new_session=True, **popen_kwargs)
        # Forget the finished ones (poll reaps them) so a long module does not accumulate them.
        self._owner._processes = [p for p in self._owner._processes if p.poll() is None] + [proc]
        return proc

    def run(self, argv: Sequence[str], timeout: float = 30.0, env: Mapping[str, str] | None = None,
            check: bool = True, input: str | None = None, cwd: str | None = None) -> subprocess.CompletedProcess:
        """Run `argv` in this host (in folder `cwd`) to completion, text stdout/stderr
        captured. After `timeout` seconds the process group is killed and
        TimeoutExpired raised; a non-zero exit raises CalledProcessError (with
        stderr) when `check`."""
        proc = self.popen(argv, env=env, stdin=subprocess.PIPE if input is not None else subprocess.DEVNULL,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cwd)
        try:
            stdout, stderr = proc.communicate(input, timeout=timeout)
        except subprocess.TimeoutExpired:
            _signal_group(proc, signal.SIGKILL)
            stdout, stderr = proc.communicate()
            raise subprocess.TimeoutExpired(proc.args, timeout, stdout, stderr) from None
        if check and proc.returncode != 0:
            raise subprocess.CalledProcessError(proc.returncode, proc.args, stdout, stderr)
        return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)

    def link_down(self) -> None:
        """Cut this host's link: its switch port goes down, as if the cable were
        pulled at the switch. The host keeps its address and route; what it sends
        is dropped silently, so open connections see no error, only silence."""
        _run_ip(["ip", "-n", self._owner.switch, "link", "set", self._switch_port, "down"])

    def link_up(self) -> None:
        """Restore the link cut by `link_down`."""
        _run_ip(["ip", "-n", self._owner.switch, "link", "set", self._switch_port, "up"])

    def shape(self, rate: str = "10gbit", burst_bytes: int | None = None) -> None:
        """Limit what this host sends to `rate` (tc syntax: "100mbit", "10gbit") with
        a token bucket (tbf) on its veth. Shape both hosts for both directions.
        tbf, not netem: netem is not built into every CI kernel (this sandbox's
        lacks it); tbf at 50mbit gave 49 Mbit/s, at 1gbit 0.95 Gbit/s here.
        `burst_bytes` defaults to 1 ms at `rate` and at least 64 KiB: veth sends
        64 KiB GSO packets, and a bucket smaller than the timer's tick underruns."""
        if burst_bytes is None:
            burst_bytes = max(64 * 1024, parse_rate_bits(rate) // 8 // 1000)
        _run_ip(["tc", "-n", self.name, "qdisc", "replace", "dev", self.ifname, "root",
                 "tbf", "rate", rate, "burst", str(burst_bytes), "latency", "100ms"])

    def unshape(self) -> None:
        """Remove the limit set by `shape` (no error when there is none)."""
        try:
            _run_ip(["tc", "-n", self.name, "qdisc", "del", "dev", self.ifname, "root"])
        except subprocess.CalledProcessError as error:
            # What tc says when the default qdisc (handle 0: nothing set) is in place.
            if "handle of zero" not in (error.stderr or ""):
                raise

    def pids(self) -> list[int]:
        """Live processes in this host (started here or not)."""
        return namespace_pids(self.name)


def parse_rate_bits(rate: str) -> int:
    """tc's rate syntax in bits per second: "10gbit" -> 10**10, "500kbit" -> 5 * 10**5."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kmgt]?)bit", rate.strip().lower())
    if match is None:
        raise ValueError(f"rate: expected a tc rate such as '100mbit' or '10gbit', got {rate!r}")
    scale = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}[match.group(2)]
    return int(float(match.group(1)) * scale)


def _signal_group(proc: subprocess.Popen, signum: int) -> None:
    try:
        os.killpg(proc.pid, signum)
    except ProcessLookupError:
        pass


class NetnsHosts:
    """`num_hosts` namespace hosts on one bridge; a context manager (also `start()` /
    `close()`). Index or iterate it for the `NetnsHost`s."""

    def __init__(self, num_hosts: int = 2):
        if not 1 <= num_hosts <= 250:
            raise ValueError(f"num_hosts: expected 1 to 250, got {num_hosts}")
        self.num_hosts = num_hosts
        self.token = secrets.token_hex(3)
        self.prefix = f"{NAME_PREFIX}-{_own_pid_namespace()}-{os.getpid()}-{self.token}"
        self.subnet = f"{SUBNET_FIRST_OCTETS}.{secrets.randbelow(256)}.0/{SUBNET_PREFIX_LEN}"
        self.switch = f"{self.prefix}-sw"
        self.hosts: list[NetnsHost] = []
        self.closed = False
        self._namespaces: list[str] = []  # made so far, deleted at close
        self._processes: list[subprocess.Popen] = []
        self._owner_pid = os.getpid()  # a forked child must not tear down its parent's hosts

    def __enter__(self) -> NetnsHosts:
        return self.start()

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            self.close()
        except RuntimeError as teardown_error:
            if exc is None:
                raise
            # Keep the body's error as the one reported; say what teardown left.
            exc.add_note(f"NetnsHosts teardown also failed: {teardown_error}")

    def __getitem__(self, host_idx: int) -> NetnsHost:
        return self.hosts[host_idx]

    def __iter__(self) -> Iterator[NetnsHost]:
        return iter(self.hosts)

    def __len__(self) -> int:
        return len(self.hosts)

    def start(self) -> NetnsHosts:
        """Create the namespaces and links (once: a started instance is returned as
        is, so one started already can still open a `with` block); NetnsUnavailable (with
        the reason) when this machine cannot, after removing whatever was made."""
        if self.closed:
            raise RuntimeError(f"{self.prefix}: closed hosts cannot be started again")
        if self.hosts:
            return self
        if os.geteuid() != 0:
            raise NetnsUnavailable(f"network namespaces need root (running as uid {os.geteuid()})")
        _register_cleanup(self)
        try:
            remove_stale_namespaces()
            self._create()
        except FileNotFoundError as error:
            self.close()
            raise NetnsUnavailable(f"iproute2 is not installed: {error}") from error
        except subprocess.CalledProcessError as error:
            self.close()
            raise NetnsUnavailable(_describe(error)) from error
        return self

    def _add_namespace(self, name: str) -> None:
        _run_ip(["ip", "netns", "add", name])
        self._namespaces.append(name)
        _run_ip(["ip", "-n", name, "link", "set", "lo", "up"])

    def _create(self) -> None:
        # Interface names are limited to 15 characters: "lr" + 6-hex token + role.
        bridge = f"lr{self.token}br"
        self._add_namespace(self.switch)
        _run_ip(["ip", "-n", self.switch, "link", "add", bridge, "type", "bridge"])
        _run_ip(["ip", "-n", self.switch, "link", "set", bridge, "up"])
        network = self.subnet.rsplit(".", 1)[0]
        for host_idx in range(self.num_hosts):
            name = f"{self.prefix}-h{host_idx}"
            ifname, switch_port = f"lr{self.token}h{host_idx}", f"lr{self.token}s{host_idx}"
            addr = f"{network}.{host_idx + 1}"
            self._add_namespace(name)
            # Created directly with one end in each namespace: never in the root namespace.
            _run_ip(["ip", "-n", self.switch, "link", "add", switch_port, "type", "veth",
                     "peer", "name", ifname, "netns", name])
            _run_ip(["ip", "-n", self.switch, "link", "set", switch_port, "master", bridge, "up"])
            _run_ip(["ip", "-n", name, "addr", "add", f"{addr}/{SUBNET_PREFIX_LEN}", "dev", ifname])
            _run_ip(["ip", "-n", name, "link", "set", ifname, "up"])
            self.hosts.append(NetnsHost(self, name, addr, ifname, switch_port))

    def close(self, timeout: float = CLOSE_TIMEOUT_S, grace: float = TERMINATE_GRACE_S) -> None:
        """Stop the processes started here (SIGTERM to each one's group, SIGKILL
        after `grace` seconds), kill anything else still in the namespaces, delete
        the namespaces (and with them every interface made). Bounded by `timeout`;
        idempotent. RuntimeError names what could not be removed."""
        if self.closed or os.getpid() != self._owner_pid:
            return
        self.closed = True
        _LIVE.discard(self)
        deadline = time.monotonic() + timeout
        running = [proc for proc in self._processes if proc.poll() is None]
        for proc in running:
            _signal_group(proc, signal.SIGTERM)
        grace_end = min(deadline, time.monotonic() + grace)
        for proc in running:
            try:
                proc.wait(timeout=max(0.0, grace_end - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal_group(proc, signal.SIGKILL)
        for proc in running:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass  # reported below through the namespace's pids
        problems = []
        for name in self._namespaces:
            leftover_pids = _kill_namespace_processes(name, deadline)
            if leftover_pids:
                problems.append(f"{name}: processes {leftover_pids} survived SIGKILL")
            try:
                _run_ip(["ip", "netns", "delete", name])
            except subprocess.CalledProcessError as error:
                problems.append(_describe(error))
        if problems:
            raise RuntimeError("; ".join(problems))


_LIVE: set[NetnsHosts] = set()
_cleanup_lock = threading.Lock()
_cleanup_registered = False
# Signals whose default action ends the process without running atexit handlers.
_TERMINATING_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


def _close_live_hosts() -> None:
    for hosts in list(_LIVE):
        try:
            hosts.close()
        except RuntimeError:
            pass  # at exit nothing can report it; the next run's stale sweep retries


def _register_cleanup(hosts: NetnsHosts) -> None:
    """Track `hosts` for clean-up at exit and on SIGTERM / SIGHUP (KeyboardInterrupt
    unwinds normally and reaches the `with` block or the fixture's teardown)."""
    global _cleanup_registered
    _LIVE.add(hosts)
    with _cleanup_lock:
        if _cleanup_registered:
            return
        _cleanup_registered = True
    atexit.register(_close_live_hosts)
    if threading.current_thread() is not threading.main_thread():
        return  # signal handlers can only be installed from the main thread
    for signum in _TERMINATING_SIGNALS:
        previous = signal.getsignal(signum)
        if previous is signal.SIG_IGN or previous is None:
            continue  # ignored (nohup) or set outside Python: leave it alone
        signal.signal(signum, _make_signal_handler(previous))


def _make_signal_handler(previous):
    def handler(signum, frame):
        _close_live_hosts()
        if callable(previous):
            previous(signum, frame)
            return
        # Default action: die of the same signal, as without this handler.
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)

    return handler
