"""A weight-sync rank run inside a namespace host by tests/test_hosts.py:
`python host_sync_workers.py ROLE RANK STORE_ADDR STORE_PORT SCENARIO_JSON`.
The scenario holds the model config's fields and the path of the versions' states,
which the test computed (test_hosts.make_scenario): a rank imports neither transformers
nor helpers.py. Sender 0 serves the Store (port 0: it reports the port it got). Each rank reports
JSON lines: its host identity and the transport of each of its pairs, then, for
a receiver, the mismatches against the plain-torch reference of every version.
With "cut_timeout_s" in the scenario, after the versions each rank reports
"ready", waits for a line on stdin (the test cuts the link meanwhile), tries one
more version with that timeout and reports the error it got and when."""

from __future__ import annotations

import datetime
import json
import sys
import time
import types

import torch
import torch.distributed as dist

from sync_checks import mismatches, poisoned_destination
from llamarl_core.sync import SyncError, WeightReceiver, WeightSender
from llamarl_core.sync.presets import hf_llama_fsdp, vllm_llama_tp
from llamarl_core.sync.reference import reference_fsdp_shards, reference_vllm_tp_shards
from llamarl_core.control.hosts import host_identity

TIMEOUT_S = 60


def report(**fields) -> None:
    print(json.dumps(fields), flush=True)


def main(role: str, rank: int, addr: str, port: int, scenario: dict) -> None:
    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=TIMEOUT_S)
    store = dist.TCPStore(addr, port, is_master=(role, rank) == ("sender", 0), timeout=timeout)
    if (role, rank) == ("sender", 0):
        report(port=store.port)
    config = types.SimpleNamespace(**scenario["config"])  # what the layouts read of a transformers config
    fsdp, tp, versions = scenario["fsdp"], scenario["tp"], scenario["versions"]
    states = torch.load(scenario["states"], weights_only=True)
    if role == "sender":
        shards = reference_fsdp_shards(states[versions[0]], fsdp, torch.float32)[rank]
        with WeightSender(store, hf_llama_fsdp(config, fsdp, torch.float32), rank, shards, name="hosts",
                          timeout=TIMEOUT_S, bucket_bytes=scenario["bucket_bytes"]) as sender:
            report(host=host_identity(), transports={f"{s}->{d}": t for (s, d), t in sender.transports.items()})
            for v in versions:
                for name, t in reference_fsdp_shards(states[v], fsdp, torch.float32)[rank].items():
                    shards[name].copy_(t)
                sender.send(v)
            after_cut(scenario, lambda timeout: sender.send(versions[-1] + 1, timeout=timeout))
        if rank == 0 and "cut_timeout_s" not in scenario:
            # This process serves the Store: it stays until every receiver is done with it (a receive's
            # last requests, closing its ticket, come after the senders' answers).
            deadline = time.monotonic() + TIMEOUT_S
            while store.add("test/receivers_done", 0) < tp and time.monotonic() < deadline:
                time.sleep(0.01)
        return
    layout = vllm_llama_tp(config, tp, torch.bfloat16)
    params = poisoned_destination(layout, rank)
    with WeightReceiver(store, layout, rank, params, name="hosts", timeout=TIMEOUT_S) as receiver:
        report(host=host_identity(), transports={f"{s}->{d}": t for (s, d), t in receiver.transports.items()})
        for v in versions:
            got = receiver.receive()
            expected = reference_vllm_tp_shards(states[v], config, tp, torch.bfloat16)[rank]
            report(version=got, mismatches=mismatches(expected, receiver.weights()))
        after_cut(scenario, lambda timeout: receiver.receive(timeout=timeout))
    if "cut_timeout_s" not in scenario:
        store.add("test/receivers_done", 1)


def after_cut(scenario: dict, attempt) -> None:
    if "cut_timeout_s" not in scenario:
        return
    report(event="ready")
    sys.stdin.readline()
    start = time.monotonic()
    try:
        attempt(scenario["cut_timeout_s"])
        report(error=None, elapsed_s=time.monotonic() - start)
    except SyncError as exc:
        report(error=type(exc).__name__, message=str(exc)[:300], elapsed_s=time.monotonic() - start)


if __name__ == "__main__":
    role, rank, addr, port, scenario = sys.argv[1:]
    main(role, int(rank), addr, int(port), json.loads(scenario))
