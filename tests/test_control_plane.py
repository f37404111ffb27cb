"""The control plane is a trust boundary: a real `llamarl train` run with a stranger
on its Store (who found its port as anyone on the host can, and knows the source,
but not the run's secret) writing forged messages into every queue: nothing of
theirs runs, the run learns as it does alone, and what they wrote is counted. The
secret's sources (auth.py) and the launcher's refusal to run without one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from llamarl_core.control import auth

HERE = Path(__file__).parent
RUN_ENV = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
TRAIN = [sys.executable, "-m", "llamarl_core.cli", "train"]


def listening_ports(pid: int) -> set[int]:
    """The TCP ports process `pid` listens on, read as `ss -ltnp` does (/proc/net/tcp*
    for the listening sockets, the process's fds for which of them are its own)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # state LISTEN
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def test_a_stranger_on_the_store_runs_nothing_and_changes_nothing(tmp_path):
    """The stranger writes, every 0.3 s for the whole run, a pickle that would create
    a file, messages under a secret of its own, untagged messages and garbage into
    the events queue and every executor's inbox, and (every 3 s) a forged offer,
    failure report, ticket board and word of abandoned receivers into the weight
    sync. The run completes its 150 steps and
    learns (reward up as in a run alone), the file never appears, the executors and
    the controller count what they dropped, and the log names the keys."""
    out, marker = tmp_path / "run", tmp_path / "pwned"
    proc = subprocess.Popen([*TRAIN, "--out", str(out), "--steps", "150", "--quiet"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd="/", env=RUN_ENV)
    try:
        deadline = time.monotonic() + 60
        while not (out / "executors.json").exists():  # the Store is up once executors start
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
            time.sleep(0.1)
        ports = listening_ports(proc.pid)
        assert len(ports) == 1, ports  # the run's TCPStore, on every interface
        stranger = subprocess.run([sys.executable, str(HERE / "stranger.py"), "127.0.0.1", str(ports.pop()),
                                   str(marker), "240"], capture_output=True, text=True, timeout=300, env=RUN_ENV)
        stdout, stderr = proc.communicate(timeout=240)
    finally:
        proc.kill()
    assert proc.returncode == 0, stderr[-3000:]
    placed = json.loads(stranger.stdout.splitlines()[-1])
    assert set(placed) == {"pickle", "wrong_secret", "untagged", "garbage", "sync"}, (placed, stranger.stderr[-2000:])
    assert not marker.exists()
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((out / "summary.json").read_text())
    print(f"stranger placed {sum(placed.values())} messages ({placed}); the run dropped "
          f"{metrics[-1]['forged_messages']}; reward {summary['reward_first']:.3f} -> {summary['reward_last']:.3f}")
    assert summary["steps"] == 150 and summary["reward_last"] > summary["reward_first"] + 0.1
    assert 0 < metrics[-1]["forged_messages"] <= sum(placed.values())
    assert [m["forged_messages"] for m in metrics] == sorted(m["forged_messages"] for m in metrics)
    assert "dropped the message at key llamarl/queue/events/" in stderr
    assert "dropped the message at key llamarl/queue/inbox/trainer/0/0/" in stderr


def test_secret_from_the_environment(tmp_path):
    secret = auth.new_secret()
    assert auth.secret_from_env({auth.SECRET_ENV: secret.hex()}) == secret
    assert auth.secret_from_env({}) is None
    path = tmp_path / "secret"
    auth.write_secret_file(path, secret)
    assert path.stat().st_mode & 0o777 == 0o600
    assert auth.secret_from_env({auth.SECRET_FILE_ENV: str(path)}) == secret
    with pytest.raises(FileExistsError):
        auth.write_secret_file(path, secret)  # never over an existing file
    path.chmod(0o640)
    with pytest.raises(PermissionError, match="mode 0640.*chmod 600"):
        auth.secret_from_env({auth.SECRET_FILE_ENV: str(path)})
    for bad, match in [("zz" * 32, "hex digits"), ("ab" * 8 + "a", "hex digits"), ("ab" * 15, "15 bytes")]:
        with pytest.raises(ValueError, match=match):
            auth.secret_from_env({auth.SECRET_ENV: bad})
    with pytest.raises(ValueError, match="both"):
        auth.secret_from_env({auth.SECRET_ENV: secret.hex(), auth.SECRET_FILE_ENV: str(path)})
    # Derived run secrets: one per namespace, none equal to the job's.
    assert len({auth.derive(secret, "llamarl/run/a/"), auth.derive(secret, "llamarl/run/b/"), secret}) == 3


def test_the_old_auth_module_still_serves_its_names_with_a_warning_naming_their_home():
    """llamarl_core.auth moved into the control plane's package: its names still
    import from the old module for one release, the same objects, each use warning."""
    import llamarl_core.auth as old

    for name in ("new_secret", "secret_from_env", "SECRET_ENV", "AuthenticatedStore", "sign", "verify"):
        with pytest.warns(DeprecationWarning, match=rf"llamarl_core\.auth\.{name} is now llamarl_core\.control\.auth\.{name};"):
            assert getattr(old, name) is getattr(auth, name)
    with pytest.raises(AttributeError, match="has no attribute '_tag'"):
        old._tag  # noqa: B018


def test_the_launchers_queues_of_one_job_refuse_another_jobs_messages(monkeypatch):
    """The assignment queues sign under the job's secret bound to torchrun's
    rendezvous id: a message of job "a" pushed into job "b"'s queue is dropped."""
    import torch.distributed as dist

    from llamarl_core.control import StoreQueue
    from llamarl_core.pipeline.processes import assignment_queue, assignment_secret

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    job_secret = auth.new_secret()
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "a")
    StoreQueue(store, assignment_queue(1), assignment_secret(job_secret)).put(("exit", {"code": 0}))
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "b")
    later = StoreQueue(store, assignment_queue(1), assignment_secret(job_secret))
    assert later.get(0.5) is None and later.dropped == 1
    StoreQueue(store, assignment_queue(1), assignment_secret(job_secret)).put(("exit", {"code": 3}))
    assert later.get(5) == ("exit", {"code": 3})
    later.close()


def test_launch_without_a_secret_says_how_to_make_one(tmp_path):
    """Every rank checks its environment before it reaches the Store: no secret, one
    line naming both variables and a command that makes one."""
    env = {k: v for k, v in RUN_ENV.items() if k not in (auth.SECRET_ENV, auth.SECRET_FILE_ENV)}
    env.update(RANK="0", TORCHELASTIC_RUN_ID="x")
    proc = subprocess.run([sys.executable, "-m", "llamarl_core.launch", "train"], capture_output=True, text=True,
                          timeout=60, cwd="/", env=env)
    assert proc.returncode != 0
    assert "set LLAMARL_SECRET (or LLAMARL_SECRET_FILE" in proc.stderr and "token_hex(32)" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_an_executors_process_group_keeps_its_python_store_usable_from_cpp():
    """The group's authenticated Store is a Store written in Python: C++ holds only
    its C++ part, and once the Python object was gone every later use from C++
    (NCCL's monitor thread checks a key once a second, new_group) raised "Tried to
    call pure virtual function". After the call returns and a collection, the
    default group's store answers check and a new group forms over it."""
    script = """
import datetime, gc, secrets
import torch.distributed as dist
from llamarl_core.pipeline import TrainConfig
from llamarl_core.pipeline.executors.resources import process_group
store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=datetime.timedelta(seconds=20))
process_group(store, "trainer", 0, 1, TrainConfig(), secrets.token_bytes(32))
gc.collect()
default = dist.distributed_c10d._get_default_store()
default.set("seen", b"1")
print(default.check(["seen"]), default.check(["never-set"]), dist.new_group([0]) is not None)
dist.destroy_process_group()
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["True", "False", "True"], proc.stdout + proc.stderr[-2000:]
