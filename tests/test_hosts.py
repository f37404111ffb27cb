"""Weight sync between namespace hosts (tests/netns_hosts.py), which share /dev/shm,
the hostname and the boot id but not a network: shared memory is never chosen
across them, a plan whose pairs are partly on one host and partly across hosts
uses both transports in one sync, bitwise equal to the reference, and a link cut
mid-sync times out on both sides."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch

from helpers import hf_state_dict, small_config
from netns_hosts import make_netns_hosts, netns_hosts, read_report  # noqa: F401 (pytest fixtures)

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "host_sync_workers.py")
VERSIONS = [1, 2]


def make_scenario(folder, kind: str, seed: int, **fields) -> dict:
    """What every rank reads (host_sync_workers.py): the config's fields, and the
    versions' states (the real Hugging Face model class's parameters, seeded) in a
    file, computed here once: a rank imports neither transformers nor helpers.py
    (4-5 s of CPU a process)."""
    config = small_config(kind)
    path = folder / "states.pt"
    torch.save({v: hf_state_dict(config, seed + v) for v in VERSIONS}, path)
    return dict(config=config.to_dict(), states=str(path), versions=VERSIONS, **fields)


def start_rank(host, role: str, rank: int, store_addr: str, port: int, scenario: dict) -> subprocess.Popen:
    return host.popen([sys.executable, WORKER, role, str(rank), store_addr, str(port), json.dumps(scenario)],
                      env={"GLOO_SOCKET_IFNAME": host.ifname}, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                      stderr=subprocess.PIPE, text=True)


def start_sync(placement: dict[tuple[str, int], object], scenario: dict) -> dict[tuple[str, int], subprocess.Popen]:
    """Start every (role, rank) on its host, sender 0 first (it serves the Store)."""
    first = placement[("sender", 0)]
    procs = {("sender", 0): start_rank(first, "sender", 0, first.addr, 0, scenario)}
    port = read_report(procs[("sender", 0)], 60)["port"]
    for (role, rank), host in placement.items():
        if (role, rank) != ("sender", 0):
            procs[(role, rank)] = start_rank(host, role, rank, first.addr, port, scenario)
    return procs


def read_versions(procs: dict[tuple[str, int], subprocess.Popen]) -> dict[tuple[str, int], list[dict]]:
    """Each rank's reports up to its last version: its transports, then a line per version received."""
    return {key: [read_report(proc, 120) for _ in range(1 + (len(VERSIONS) if key[0] == "receiver" else 0))]
            for key, proc in procs.items()}


def run_sync(placement: dict[tuple[str, int], object], scenario: dict) -> dict[tuple[str, int], list[dict]]:
    """Every rank's reports, after every rank exited 0."""
    procs = start_sync(placement, scenario)
    reports = read_versions(procs)
    for key, proc in procs.items():
        assert proc.wait(60) == 0, (key, proc.stderr.read()[-3000:])
    return reports


def test_no_shared_memory_across_hosts(netns_hosts, tmp_path):
    """One sender and one receiver on two hosts that share /dev/shm: point-to-point,
    and every version lands bitwise."""
    a, b = netns_hosts
    reports = run_sync({("sender", 0): a, ("receiver", 0): b},
                       make_scenario(tmp_path, "llama_gqa_bias", 7, fsdp=1, tp=1, bucket_bytes=16384))
    sender, receiver = reports[("sender", 0)][0], reports[("receiver", 0)][0]
    assert sender["host"] != receiver["host"]
    assert sender["host"].split("/")[:2] == receiver["host"].split("/")[:2]  # same hostname and boot id
    assert sender["transports"] == receiver["transports"] == {"0->0": "p2p"}
    assert [r["version"] for r in reports[("receiver", 0)][1:]] == VERSIONS
    assert [r["mismatches"] for r in reports[("receiver", 0)][1:]] == [[], []]


def test_shared_memory_within_a_host_and_p2p_across(netns_hosts, tmp_path):
    """FSDP 2 -> TP 2 with a sender and a receiver on each host: the pairs within a
    host share memory, the pairs across hosts go point-to-point, in one sync."""
    a, b = netns_hosts
    placement = {("sender", 0): a, ("receiver", 0): a, ("sender", 1): b, ("receiver", 1): b}
    reports = run_sync(placement, make_scenario(tmp_path, "qwen2", 11, fsdp=2, tp=2, bucket_bytes=16384))
    expected = {"0->0": "shm", "0->1": "p2p", "1->0": "p2p", "1->1": "shm"}
    assert all(r[0]["transports"] == expected for r in reports.values())
    for rank in range(2):
        assert [r["version"] for r in reports[("receiver", rank)][1:]] == VERSIONS
        assert [r["mismatches"] for r in reports[("receiver", rank)][1:]] == [[], []], rank


def test_link_cut_mid_sync_times_out_on_both_sides(netns_hosts, tmp_path):
    """Two versions land across hosts, then the receiver's link is cut: the next
    sync raises SyncTimeoutError on the sender and the receiver within the timeout
    (the time to detect is printed: 3.00 s for a 3 s timeout here), and both exit
    cleanly: nothing hangs."""
    a, b = netns_hosts
    timeout_s = 3.0
    procs = start_sync({("sender", 0): a, ("receiver", 0): b},
                       make_scenario(tmp_path, "mistral", 13, fsdp=1, tp=1, bucket_bytes=16384,
                                     cut_timeout_s=timeout_s))
    try:
        reports = read_versions(procs)
        assert [r["mismatches"] for r in reports[("receiver", 0)][1:]] == [[], []]
        assert all(read_report(proc, 30) == {"event": "ready"} for proc in procs.values())
        b.link_down()
        for proc in procs.values():
            proc.stdin.write("go\n")
            proc.stdin.flush()
        after = {key: read_report(proc, timeout_s + 30) for key, proc in procs.items()}
        for key, got in after.items():
            print(f"{key}: {got['error']} after {got['elapsed_s']:.2f} s")
            assert got["error"] == "SyncTimeoutError", (key, got)
            assert got["elapsed_s"] < timeout_s + 2, (key, got)
        assert [proc.wait(30) for proc in procs.values()] == [0, 0]
    finally:
        b.link_up()
