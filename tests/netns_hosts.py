"""The namespace hosts (llamarl_core.bench.netns) as pytest fixtures, and reading
the JSON reports of processes run in them."""

from __future__ import annotations

import json
import queue
import subprocess
import threading
from typing import Iterator

import pytest

from llamarl_core.bench.netns import (  # noqa: F401 (re-exported for the tests)
    NetnsHosts,
    NetnsUnavailable,
    list_namespaces,
    parse_rate_bits,
    remove_stale_namespaces,
)


def read_report(proc: subprocess.Popen, timeout_s: float) -> dict:
    """The next JSON line `proc` prints, waiting at most `timeout_s`. Lines come
    through a reader thread per process: a select() on the pipe misses lines that
    an earlier readline() already pulled into the stream's buffer (two reports
    written back to back arrive in one read)."""
    lines = getattr(proc, "report_lines", None)
    if lines is None:
        lines = proc.report_lines = queue.Queue()

        def pump():
            for line in proc.stdout:
                lines.put(line)
            lines.put("")  # end of output

        threading.Thread(target=pump, name=f"reports-{proc.pid}", daemon=True).start()
    try:
        line = lines.get(timeout=timeout_s)
    except queue.Empty:
        raise TimeoutError(f"no report from {proc.args} within {timeout_s} s") from None
    if not line:
        raise RuntimeError(f"{proc.args} exited ({proc.wait()}) without a report: {proc.stderr.read()}")
    return json.loads(line)


def _open_or_skip(num_hosts: int) -> NetnsHosts:
    try:
        return NetnsHosts(num_hosts).start()
    except NetnsUnavailable as error:
        pytest.skip(f"network namespace hosts unavailable: {error}")


@pytest.fixture(scope="module")
def netns_hosts() -> Iterator[NetnsHosts]:
    """Two namespace hosts shared by a test module. A test that cuts or shapes a
    link restores it (link_up / unshape) before it ends."""
    hosts = _open_or_skip(2)
    try:
        yield hosts
    finally:
        hosts.close()


@pytest.fixture
def make_netns_hosts():
    """Factory: `make_netns_hosts(num_hosts=3)` -> NetnsHosts, closed when the test ends."""
    made: list[NetnsHosts] = []

    def make(num_hosts: int = 3) -> NetnsHosts:
        hosts = _open_or_skip(num_hosts)
        made.append(hosts)
        return hosts

    yield make
    errors = []
    for hosts in made:
        try:
            hosts.close()
        except RuntimeError as error:
            errors.append(str(error))
    if errors:
        raise RuntimeError("; ".join(errors))
