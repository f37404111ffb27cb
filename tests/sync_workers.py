"""Process bodies for the multi-process weight-sync tests (spawned by helpers.run_processes)."""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import time

import torch
import torch.distributed as dist

from helpers import hf_state_dict, mismatches, poisoned_destination, small_config
from llamarl_core.sync import (
    RelayError,
    SyncError,
    WeightReceiver,
    WeightSender,
    hf_llama_fsdp,
    reference_fsdp_shards,
    reference_vllm_tp_shards,
    vllm_llama_tp,
)
from llamarl_core.sync.plan import DEFAULT_BUCKET_BYTES
from llamarl_core.sync.reference import reference_vllm_fp8_shards

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def connect(port) -> dist.Store:
    """The parent's TCPStore (an int port) or a FileStore (a path)."""
    if isinstance(port, str):
        store = dist.FileStore(port, -1)
        store.set_timeout(datetime.timedelta(seconds=60))
        return store
    return dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=60))


def scenario_name(s: dict) -> str:
    return f"{s['config']}-fsdp{s['fsdp']}-tp{s['tp']}-{s['src_dtype']}-{s['transport']}-fp8{s.get('fp8')}-seed{s['seed']}"


def sender_body(port: int, rank: int, scenarios: list[dict], versions=(1, 2)) -> dict:
    """For each scenario this rank belongs to: register FSDP shards, send each version
    (the shards updated in place between versions, as an optimizer step does).
    A scenario may override `port` (a Store of its own) and `versions`; sends whose
    index is in its "poisoned" carry a NaN in rows only TP rank 0 holds; its
    "send_after" maps a send's index to a Store key to wait for first."""
    out = {}
    torch.set_num_threads(1)
    for s in scenarios:
        if rank >= s["fsdp"]:
            continue
        store = connect(s.get("port", port))
        config, dtype = small_config(s["config"]), DTYPES[s["src_dtype"]]
        device = s.get("device", "cpu")
        shards = {n: t.to(device) for n, t in reference_fsdp_shards(hf_state_dict(config, s["seed"]), s["fsdp"], dtype)[rank].items()}
        with WeightSender(store, hf_llama_fsdp(config, s["fsdp"], dtype), rank, shards,
                          name=scenario_name(s), transport=s["transport"], timeout=60,
                          bucket_bytes=s.get("bucket_bytes", DEFAULT_BUCKET_BYTES)) as sender:
            for step, v in enumerate(s.get("versions", versions)):
                if step in s.get("send_after", {}):
                    store.wait([s["send_after"][step]], datetime.timedelta(seconds=60))
                state = hf_state_dict(config, s["seed"] + v)
                if step in s.get("poisoned", ()):
                    state["model.layers.0.self_attn.q_proj.weight"][0, 0] = float("nan")
                fresh = reference_fsdp_shards(state, s["fsdp"], dtype)[rank]
                for name, t in shards.items():
                    t.copy_(fresh[name])
                sender.send(v)
            out[scenario_name(s)] = sender.transport
    return out


def receiver_body(port: int, rank: int, scenarios: list[dict], versions=(1, 2)) -> dict:
    """For each scenario: register NaN-poisoned parameters (as nn.Parameters of a
    module, the generator's own storage), receive each version and compare it
    bitwise with the plain-torch reference. Returns scenario -> mismatch lines.
    A scenario may override `port` and `versions`; receives whose index is in its
    "failing" must raise SyncError and leave the weights torn (recorded as a line
    "step i: <message>"); "stall_amax" = (rank, step, seconds) delays that rank's
    FP8 amax computation in that receive, so the other ranks reach the exchange
    first; with "amax_group" the receivers reduce FP8 amaxes over a gloo group
    of their own."""
    out = {}
    torch.set_num_threads(1)
    for s in scenarios:
        if rank >= s["tp"]:
            continue
        store = connect(s.get("port", port))
        group = None
        if s.get("amax_group"):
            group = dist.ProcessGroupGloo(dist.PrefixStore(f"test/amax-group/{scenario_name(s)}/", store), rank, s["tp"],
                                          datetime.timedelta(seconds=60))
        config = small_config(s["config"])
        layout = vllm_llama_tp(config, s["tp"], torch.bfloat16, fp8=s.get("fp8"))
        module = torch.nn.ParameterDict(
            {n.replace(".", "/"): torch.nn.Parameter(t.to(s.get("device", "cpu")), requires_grad=False)
             for n, t in poisoned_destination(layout, rank).items()}
        )
        params = {n.replace("/", "."): p for n, p in module.items()}
        problems = []
        with WeightReceiver(store, layout, rank, params, name=scenario_name(s), transport=s["transport"],
                            timeout=60, group=group) as receiver:
            local_amax = receiver.fp8.local_amax
            stall_rank, stall_step, stall_s = s.get("stall_amax", (None, None, 0))

            def stalled(landing):
                time.sleep(stall_s)
                return local_amax(landing)

            failing = s.get("failing", ())
            for step, v in enumerate(s.get("versions", versions)):
                if (rank, step) == (stall_rank, stall_step):
                    receiver.fp8.local_amax = stalled
                try:
                    got = receiver.receive()
                except SyncError as exc:
                    if step not in failing or not receiver.torn:
                        raise
                    problems.append(f"step {step}: {exc}")
                    continue
                finally:
                    receiver.fp8.local_amax = local_amax
                if step in failing:
                    problems.append(f"step {step}: received version {got}, expected SyncError")
                if got != v:
                    problems.append(f"version {got} reported, expected {v}")
                state = hf_state_dict(config, s["seed"] + v)
                if s.get("fp8"):
                    expected = reference_vllm_fp8_shards(state, config, s["tp"], s["fp8"])[rank]
                else:
                    expected = reference_vllm_tp_shards(state, config, s["tp"], torch.bfloat16)[rank]
                # Read through the module: the destination is the generator's own parameters.
                problems += [f"v{v} {line}" for line in mismatches(expected, {n.replace("/", "."): p.data.cpu() for n, p in module.items()})]
        out[scenario_name(s)] = problems
    return out


def stalling_sender_body(port: int, rank: int, scenario: dict, stall_in_version: int) -> None:
    """Send version 1, then stall inside version `stall_in_version` after its first
    bucket has landed (and say so in the Store), waiting to be SIGKILLed."""
    import llamarl_core.sync.sender as sender_module

    store, real_run = connect(port), sender_module.run_segment_table
    state = {"version": None, "calls": 0}

    def run_then_stall(*args, **kwargs):
        written = real_run(*args, **kwargs)
        state["calls"] += 1
        if state["version"] == stall_in_version:
            store.set(f"test/stalled/{rank}", str(state["calls"]))
            time.sleep(600)
        return written

    sender_module.run_segment_table = run_then_stall
    config, dtype = small_config(scenario["config"]), DTYPES[scenario["src_dtype"]]
    shards = reference_fsdp_shards(hf_state_dict(config, scenario["seed"]), scenario["fsdp"], dtype)[rank]
    sender = WeightSender(store, hf_llama_fsdp(config, scenario["fsdp"], dtype), rank, shards,
                          name=scenario_name(scenario), timeout=60, bucket_bytes=scenario["bucket_bytes"])
    for v in (1, stall_in_version):
        state["version"] = v
        fresh = reference_fsdp_shards(hf_state_dict(config, scenario["seed"] + v), scenario["fsdp"], dtype)[rank]
        for name, t in shards.items():
            t.copy_(fresh[name])
        sender.send(v)


def torn_receiver_body(port: int, rank: int, scenario: dict, torn_timeout: float) -> dict:
    """Receive version 1; then a receive that must time out (a sender dies); then
    the next complete version. Reports what it saw at each step."""
    from llamarl_core.sync import SyncTimeoutError, TornWeightsError

    store = connect(port)
    config = small_config(scenario["config"])
    layout = vllm_llama_tp(config, scenario["tp"], torch.bfloat16)
    params = poisoned_destination(layout, rank)
    report = {}
    receiver = WeightReceiver(store, layout, rank, params, name=scenario_name(scenario), timeout=60,
                              bucket_bytes=scenario["bucket_bytes"])
    report["v1"] = receiver.receive()
    v1_copy = {n: t.clone() for n, t in params.items()}
    start = time.monotonic()
    try:
        receiver.receive(timeout=torn_timeout)
        report["torn_receive"] = "returned"
    except SyncTimeoutError as exc:
        report["torn_receive"] = f"SyncTimeoutError: {exc}"
    report["torn_elapsed"] = time.monotonic() - start
    report["version_after_torn"] = receiver.version
    report["torn_flag"] = receiver.torn
    try:
        receiver.weights()
        report["weights_while_torn"] = "served"
    except TornWeightsError as exc:
        report["weights_while_torn"] = f"TornWeightsError: {exc}"
    report["changed_by_torn_sync"] = sum(
        int(not torch.equal(v1_copy[n].view(torch.uint8), params[n].view(torch.uint8))) for n in params
    )
    report["v3"] = receiver.receive()
    expected = reference_vllm_tp_shards(hf_state_dict(config, scenario["seed"] + 3), config, scenario["tp"],
                                        torch.bfloat16)[rank]
    report["v3_mismatches"] = mismatches(expected, receiver.weights())
    receiver.close()
    return report


def late_rank_receiver_body(port: int, rank: int, scenario: dict) -> dict:
    """After version 1: receiver 1 gives up on version 2 (1 s) before the sender,
    which waits for that, serves it; receiver 0 takes version 2 and waits in its
    FP8 amax exchange until it times out; only then does receiver 1 ask again
    (and is served version 2). Then both take version 3. Reports each receive's
    outcome, the version 3 mismatches and any amax key of versions 1-3 left."""
    store = connect(port)
    config = small_config(scenario["config"])
    layout = vllm_llama_tp(config, scenario["tp"], torch.bfloat16, fp8=scenario["fp8"])
    params = poisoned_destination(layout, rank)
    gave_up, timed_out = f"test/{scenario_name(scenario)}/1-gave-up", f"test/{scenario_name(scenario)}/0-timed-out"
    report = {}

    def wait(key: str) -> None:
        store.wait([key], datetime.timedelta(seconds=120))

    def attempt(key: str, timeout: float | None = None) -> None:
        try:
            report[key] = receiver.receive(timeout=timeout)
        except SyncError as exc:
            report[key] = f"{type(exc).__name__}: {exc}"

    with WeightReceiver(store, layout, rank, params, name=scenario_name(scenario), timeout=60) as receiver:
        attempt("v1")
        if rank == 0:
            wait(gave_up)
            attempt("v2", timeout=15.0)  # ample to land version 2, then spent waiting for receiver 1
            store.set(timed_out, "1")
        else:
            attempt("v2 early", timeout=1.0)
            store.set(gave_up, "1")
            wait(timed_out)
            attempt("v2")
        attempt("v3")
        expected = reference_vllm_fp8_shards(hf_state_dict(config, scenario["seed"] + 3), config, scenario["tp"],
                                             scenario["fp8"])[rank]
        report["v3_mismatches"] = mismatches(expected, params)
    prefixed = dist.PrefixStore(f"llamarl/sync/{scenario_name(scenario)}/dst/amax/", store)
    report["amax_keys_left"] = [f"{v}/0/{k}" for v in (1, 2, 3) for k in ("0", "1", "done") if prefixed.check([f"{v}/0/{k}"])]
    return report


# ----------------------------------------------------------------------------- a relay that breaks off

RELAY = dict(name="broken-relay", transport="p2p", bucket_bytes=4096)  # many buckets: forwarded one by one


def _relay_model():
    config = small_config("llama_gqa_bias")
    return config, hf_llama_fsdp(config, 1, torch.float32), vllm_llama_tp(config, 1, torch.bfloat16)


def _relay_state(version: int):
    return hf_state_dict(_relay_model()[0], 900 + version)


def _relay_mismatches(version: int, weights) -> list:
    config = _relay_model()[0]
    return mismatches(reference_vllm_tp_shards(_relay_state(version), config, 1, torch.bfloat16)[0], weights)


def relay_trainer_body(port: int, versions: tuple[int, ...]) -> str:
    _, src, _ = _relay_model()
    shards = {n: t.clone() for n, t in reference_fsdp_shards(_relay_state(versions[0]), 1, torch.float32)[0].items()}
    with WeightSender(connect(port), src, 0, shards, timeout=60, **RELAY) as sender:
        for v in versions:
            for n, t in reference_fsdp_shards(_relay_state(v), 1, torch.float32)[0].items():
                shards[n].copy_(t)
            sender.send(v)
    return "sent"


def relay_parent_body(port: int, new_child: str) -> dict:
    """Replica 0: version 1 reaches replica 1; replica 1 dies in the middle of version
    2; version 3 lands, its relay failing at once; replace_relay feeds version 4 to
    the new replica 1 registered under `new_child`."""
    _, _, dst = _relay_model()
    out = {}
    with WeightReceiver(connect(port), dst, 0, poisoned_destination(dst, 0), timeout=60, replica=0, num_replicas=2,
                        **RELAY) as parent:
        out["1"] = parent.receive()
        for v in (2, 3):
            start = time.monotonic()
            try:
                parent.receive(timeout=10)
                out[str(v)] = "relayed"
            except RelayError as exc:
                out[str(v)] = {"version": exc.version, "failed": exc.failed, "seconds": time.monotonic() - start}
            out[f"mismatches{v}"] = _relay_mismatches(v, parent.weights())
        parent.replace_relay(1, f"{new_child}/replica1")
        out["4"] = parent.receive(timeout=60)
        out["mismatches4"] = _relay_mismatches(4, parent.weights())
    return out


def _receive_then_die_mid_version(port: int) -> None:
    _, _, dst = _relay_model()
    child = WeightReceiver(connect(port), dst, 0, poisoned_destination(dst, 0), timeout=60, replica=1, num_replicas=2,
                           **RELAY)
    assert child.receive() == 1 and _relay_mismatches(1, child.weights()) == []
    import llamarl_core.sync.receiver as receiver_module

    unpack, unpacked = receiver_module.run_segment_table, []

    def unpack_then_die(*args, **kwargs):
        unpacked.append(1)
        if len(unpacked) > 3:
            os._exit(17)  # killed in the middle of version 2: its sockets close with it
        return unpack(*args, **kwargs)

    receiver_module.run_segment_table = unpack_then_die
    child.receive()


def dying_relay_child_body(port: int) -> int:
    """Replica 1, in a process of its own that dies mid-version; returns its exit code."""
    proc = mp.get_context("spawn").Process(target=_receive_then_die_mid_version, args=(port,))
    proc.start()
    proc.join(timeout=120)
    return proc.exitcode


def relay_child_body(port: int, name: str) -> dict:
    """The new replica 1, registered under `name`: fed version 4 once its parent replaces the relay."""
    _, _, dst = _relay_model()
    with WeightReceiver(connect(port), dst, 0, poisoned_destination(dst, 0), timeout=60, replica=1, num_replicas=2,
                        **{**RELAY, "name": name}) as child:
        version = child.receive(timeout=60)
        return {"version": version, "mismatches": _relay_mismatches(version, child.weights())}
