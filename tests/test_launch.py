"""Runs launched by torchrun (llamarl_core.launch): on one host through the same
controller and executors as `llamarl train`, and across two network-namespace hosts
(tests/netns_hosts.py) with the trainer on one and the generator on the other, the
weights going point-to-point (the hosts share /dev/shm, the hostname and the boot
id: shared memory is never chosen across them) and the default task learning. A bad
placement stops every rank with one line. The job's secret reaches every rank
from its environment (LLAMARL_SECRET on one host, a 0600 LLAMARL_SECRET_FILE on the
other), and a stranger on the second host who reaches torchrun's Store writes
forged messages into every queue while the run learns: none runs, all are counted."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from netns_hosts import netns_hosts  # noqa: F401 (pytest fixture)

from llamarl_core.control import auth

# The executors run the CPU paths of the kernels, as a user's run here does; every rank
# gets the job's secret from its environment, as the launcher's docstring says.
SECRET = auth.new_secret()
RUN_ENV = {**{k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}, auth.SECRET_ENV: SECRET.hex()}
def torchrun(tmp_path: Path) -> list[str]:
    """torchrun, its agent's logs in the test's folder (without --log-dir each agent leaves a
    torchelastic_* folder in /tmp for good)."""
    return [sys.executable, "-m", "torch.distributed.run", "--log-dir", str(tmp_path / "torchelastic")]
LAUNCH = ["-m", "llamarl_core.launch", "train"]
SMALL = ["--steps", "12", "--prompts-per-step", "8", "--samples-per-prompt", "4", "--warmup-steps", "20",
         "--checkpoint-every", "12", "--quiet"]


def _host_parts(identity: str) -> tuple[str, str, str, str]:
    hostname, boot, net, pid = identity.split("/")
    return hostname, boot, net, pid


def test_launch_outside_torchrun_says_so():
    proc = subprocess.run([sys.executable, *LAUNCH], capture_output=True, text=True, timeout=60, cwd="/",
                          env={k: v for k, v in RUN_ENV.items() if k not in ("RANK", "TORCHELASTIC_RUN_ID")})
    assert proc.returncode != 0
    assert "runs under torchrun" in proc.stderr and "llamarl train" in proc.stderr


def test_torchrun_on_one_host(tmp_path):
    """torchrun --standalone with four ranks (controller, reward, trainer,
    generator): the run completes, every executor on this host, the weights by
    shared memory, the generator generating with every version it received."""
    out = tmp_path / "run"
    proc = subprocess.run([*torchrun(tmp_path), "--standalone", "--nproc-per-node", "4", *LAUNCH, *SMALL, "--out",
                           str(out)],
                          capture_output=True, text=True, timeout=240, cwd=tmp_path, env=RUN_ENV)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "async: 12 steps" in proc.stdout
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(12))
    hosts = json.loads((out / "hosts.json").read_text())
    assert set(hosts["executors"]) == {"reward 0", "trainer 0", "generator 0"}
    assert len(set(hosts["executors"].values())) == 1
    assert hosts["weight_transports"] == {"trainer 0 -> generator 0": "shm"}
    spans = [e for e in json.loads((out / "trace.json").read_text())["traceEvents"] if e["ph"] == "X"]
    received = sorted(e["args"]["version"] for e in spans if e["name"] == "receive weights")
    assert received == list(range(13)) and any(e["name"] == "generate" for e in spans)


def test_bad_placement_stops_every_rank(tmp_path):
    """A placement that does not fit the run is refused by the controller's rank in
    one line, and every other rank (waiting for an assignment) ends with it."""
    start = time.monotonic()
    proc = subprocess.run([*torchrun(tmp_path), "--standalone", "--nproc-per-node", "3", *LAUNCH,
                           "--placement", "controller:0,trainer:1,generator:2", *SMALL, "--out", str(tmp_path / "r")],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path, env=RUN_ENV)
    assert proc.returncode != 0
    assert "llamarl train: --placement: reward has 0 ranks, the run needs 1" in proc.stderr, proc.stderr[-3000:]
    assert "/llamarl_core/" not in proc.stderr  # no traceback through our code (torchrun prints its own)
    assert time.monotonic() - start < 90
    assert not (tmp_path / "r").exists()  # refused before anything was written


def _agents_on_two_hosts(hosts, tmp_path: Path, rdzv_id: str, train_args: list[str]) -> list[subprocess.Popen]:
    """A torchrun agent on each namespace host, 2 ranks each, c10d rendezvous on host 0,
    placement controller:0,trainer:1 (host 0), reward:2,generator:3 (host 1); each
    host's output in tmp_path/host<n>.log. The secret: LLAMARL_SECRET on host 0, a
    file of mode 0600 named by LLAMARL_SECRET_FILE on host 1."""
    secret_file = tmp_path / f"{rdzv_id}.secret"
    auth.write_secret_file(secret_file, SECRET)
    secrets = [{auth.SECRET_ENV: SECRET.hex()}, {auth.SECRET_FILE_ENV: str(secret_file)}]
    procs = []
    for node, host in enumerate(hosts):
        argv = [*torchrun(tmp_path / f"host{node}"), "--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
                "--rdzv-endpoint", f"{hosts[0].addr}:29400", "--rdzv-id", rdzv_id,
                "--rdzv-conf", f"is_host={int(node == 0)}",
                # The hosts' shared hostname resolves to 127.0.0.1: each agent names its own address.
                "--local-addr", host.addr, "--max-restarts", "0",
                *LAUNCH, "--placement", "controller:0,trainer:1,reward:2,generator:3", *train_args]
        # Into files: read one after the other, pipes would fill while the other host's are drained.
        with open(tmp_path / f"host{node}.log", "w") as log:
            # popen adds to this process's environment: TRITON_INTERPRET (conftest's) is overridden, not
            # dropped; under the interpreter the trainer's steps took 1.9 s instead of 22 ms.
            env = {"GLOO_SOCKET_IFNAME": host.ifname, "TRITON_INTERPRET": "0", **secrets[node]}
            # Each host has one of the two (the tests' own LLAMARL_SECRET, conftest's, is not a host's).
            unset = ["env", "-u", auth.SECRET_ENV] if auth.SECRET_FILE_ENV in env else []
            procs.append(host.popen([*unset, *argv], env=env, cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT))
    return procs


def _job_store(rdzv_id: str, deadline: float) -> tuple[str, int]:
    """The address of the Store torchrun's workers of job `rdzv_id` share (global rank
    0 serves it at MASTER_PORT, a port anyone can find by scanning host 0): read off
    that worker's environment once it runs."""
    while time.monotonic() < deadline:
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                env = dict(v.split("=", 1) for v in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in v)
            except OSError:
                continue
            if env.get("TORCHELASTIC_RUN_ID") == rdzv_id and env.get("RANK") == "0" and "MASTER_PORT" in env:
                return env["MASTER_ADDR"], int(env["MASTER_PORT"])
        time.sleep(0.2)
    raise TimeoutError(f"no worker of torchrun job {rdzv_id} came up")


def test_run_across_two_hosts_learns(netns_hosts, tmp_path):
    """torchrun agents on two namespace hosts (2 ranks each, c10d rendezvous on host
    0): the controller and trainer on one host, the reward and generator on the
    other, weights sent as deltas (--sync-delta). 300 steps of the default task complete and learn (its reward's last
    tenth well above its first; 0.535 -> 0.801 and 0.527 -> 0.793 on one host here), every weight
    version reaching the generator point-to-point. Meanwhile a stranger on the
    generator's host, who reaches the workers' Store on the other (its port found as
    a port scan would) and lists its keys, forges messages into every queue of the run and of
    the launcher and values into the weight sync's keys: the run learns all the same, nothing of theirs runs, and the
    ranks count what they dropped."""
    out, marker = tmp_path / "run", tmp_path / "pwned"
    procs = _agents_on_two_hosts(netns_hosts, tmp_path, "learns", ["--steps", "300", "--quiet", "--out", str(out),
                                                                   "--sync-delta"])
    address, port = _job_store("learns", deadline=time.monotonic() + 60)
    stranger = netns_hosts[1].popen([sys.executable, str(Path(__file__).with_name("stranger.py")),
                                     address, str(port), str(marker), "280"],
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for node, proc in enumerate(procs):
            assert proc.wait(timeout=300) == 0, (tmp_path / f"host{node}.log").read_text()[-3000:]
        placed_out, placed_err = stranger.communicate(timeout=60)
    finally:
        stranger.kill()
    placed = json.loads(placed_out.splitlines()[-1])
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((out / "summary.json").read_text())
    print(f"across two hosts: reward {summary['reward_first']:.3f} -> {summary['reward_last']:.3f}, "
          f"wall {summary['wall_time_s']:.1f} s, sync {summary['sync_time_s'] * 1e3:.1f} ms; a stranger placed "
          f"{placed}, the run dropped {metrics[-1]['forged_messages']}")
    assert summary["steps"] == 300
    assert summary["reward_last"] > summary["reward_first"] + 0.2
    assert set(placed) == {"pickle", "wrong_secret", "untagged", "garbage", "sync"}, (placed, placed_err[-2000:])
    assert not marker.exists() and metrics[-1]["forged_messages"] > 0, placed_err[-3000:]
    hosts = json.loads((out / "hosts.json").read_text())["executors"]
    trainer, generator = _host_parts(hosts["trainer 0"]), _host_parts(hosts["generator 0"])
    assert trainer[:2] == generator[:2] and trainer[2] != generator[2]  # one hostname and boot id, two networks
    assert _host_parts(hosts["reward 0"]) == generator
    assert json.loads((out / "hosts.json").read_text())["weight_transports"] == {"trainer 0 -> generator 0": "p2p"}
    spans = [e for e in json.loads((out / "trace.json").read_text())["traceEvents"] if e["ph"] == "X"]
    received = [e["args"]["version"] for e in spans if e["name"] == "receive weights"]
    assert sorted(received) == list(range(301))
    # --sync-delta: the first version went whole, every later one against the base the generator held (the
    # toy's float32 generator changes most elements each step: most buckets still go whole by their size).
    sent = sorted((e["args"] for e in spans if e["name"] == "send weights"), key=lambda a: a["version"])
    assert len(sent) == 301 and sent[0]["full_receivers"] == 1 and sent[0]["delta_buckets"] == 0
    assert all(a["full_receivers"] == 0 for a in sent[1:]) and sum(a["delta_buckets"] for a in sent) > 0
    assert Path(out / "model" / "config.json").exists()


def test_a_link_cut_mid_run_stops_it_naming_its_checkpoint(netns_hosts, tmp_path):
    """The generator host's link cut mid-run (its switch port down: silence, no
    error): the run stops on the controller's host, naming what failed and the
    checkpoint to resume from; that host's agent exits instead of hanging. What
    fails first depends on where the cut finds the run: the trainer's weight sync
    times out (--sync-timeout-s 3) when the trainer had the samples for a step;
    the trainer waiting for samples (a loaded machine's generator falls behind),
    the controller names a rank of the cut host whose heartbeat stopped, or the
    generator replica it waited on, after --timeout-s (30 s)."""
    out = tmp_path / "run"
    procs = _agents_on_two_hosts(netns_hosts, tmp_path, "cut", [
        "--steps", "100000", "--warmup-steps", "5", "--checkpoint-every", "10", "--sync-timeout-s", "3", "--timeout-s",
        "30", "--quiet",
        "--out", str(out)])
    metrics = out / "metrics.jsonl"
    try:
        deadline = time.monotonic() + 150
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 25):
            assert time.monotonic() < deadline and procs[0].poll() is None, (tmp_path / "host0.log").read_text()[-3000:]
            time.sleep(0.2)
        cut_at = time.monotonic()
        netns_hosts[1].link_down()
        code = procs[0].wait(timeout=90)
        stopped_s = time.monotonic() - cut_at
    finally:
        netns_hosts[1].link_up()
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
                proc.wait(timeout=30)
    log = (tmp_path / "host0.log").read_text()
    print(f"link cut -> the controller's host stopped in {stopped_s:.1f} s")
    assert code != 0
    # Host 1 holds torchrun ranks 2 and 3 (the reward executor and generator replica 0).
    assert re.search(r"llamarl train: the run stopped: (weight sync of version \d+"
                     r"|\w+ rank \d+ is silent: torchrun rank [23] has not beaten for 30 s \(its host, or the link to it, "
                     r"is down\)"
                     r"|no executor reported anything for 30 s while waiting for .*issued to generator replica 0)",
                     log), log[-3000:]
    assert f"the last checkpoint is in {out / 'checkpoint'}" in log, log[-3000:]
    assert stopped_s < 60
    from llamarl_core.pipeline.checkpoints import checkpoint_info

    assert checkpoint_info(out)["step"] >= 20


def test_a_run_folder_the_trainer_cannot_see_is_refused_at_once(tmp_path):
    """Under torchrun --out must be on a filesystem the controller and every trainer
    rank share (each writes its checkpoint shards there): a trainer host without the folder says so before its first step, not at the
    end of the run when the controller exports the checkpoint it cannot find."""
    import pytest

    from llamarl_core.pipeline.config import TrainConfig
    from llamarl_core.pipeline.executors.trainer import run_trainer

    with pytest.raises(ValueError, match="is not on trainer rank 0's host .* every trainer rank writes its checkpoint shards there"):
        run_trainer(None, TrainConfig(), None, 0, incarnation=0, out_dir=str(tmp_path / "elsewhere"))
