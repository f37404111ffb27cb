"""Process bodies for the multi-process weight-sync tests (spawned by helpers.run_processes)."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import multiprocessing as mp
import os
import time

import torch
import torch.distributed as dist

from helpers import deltas_by_size, hf_state_dict, small_config
from sync_checks import mismatches, poisoned_destination
from llamarl_core.sync import RelayError, SyncError, WeightReceiver, WeightSender
from llamarl_core.sync.presets import hf_llama_fsdp, vllm_llama_tp
from llamarl_core.sync.reference import reference_fsdp_shards, reference_vllm_tp_shards
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


@contextlib.contextmanager
def _late_registration(rank: int, seconds: float):
    """Within it, sender `rank` counts its registration `seconds` late: the last
    step of its set-up, which the other ranks do not wait for."""
    from llamarl_core.sync.protocol import Channel

    counter = Channel.counter

    def late(self, key, delta=0):
        if key == f"src/{rank}/incarnation" and delta == 1:
            time.sleep(seconds)
        return counter(self, key, delta)

    Channel.counter = late
    try:
        yield
    finally:
        Channel.counter = counter


def version_state(config, s: dict, v: int) -> dict:
    """The trainer's full state at version `v` of scenario `s`: fresh random weights
    for every version, or, where s["changes"] == "few", the first version's with a
    few elements changed by each version after it (what deltas send), the first row
    of the first layer's q_proj scaled up at version 3 (FP8: its scale changes)."""
    if s.get("changes") != "few":
        return hf_state_dict(config, s["seed"] + v)
    state = hf_state_dict(config, s["seed"])
    for k in range(2, v + 1):
        for i, t in enumerate(state.values()):
            flat = t.view(-1)
            flat[(7 * k + 13 * i) % flat.numel()] += 0.125 * k
        if k == 3:
            state["model.layers.0.self_attn.q_proj.weight"][0] *= 4.0
    return state


def sender_body(port: int, rank: int, scenarios: list[dict], versions=(1, 2), interpreter: bool = True) -> dict:
    """For each scenario this rank belongs to: register FSDP shards, send each version
    (the shards updated in place between versions, as an optimizer step does).
    Returns scenario -> the transport, and "<scenario>/failed" -> the lines of the
    sends that raised SyncError as expected.
    A scenario may override `port` (a Store of its own) and `versions`; sends whose
    index is in its "poisoned" carry a NaN in rows only FSDP rank 0 holds (every
    sender's send must then fail); its "send_after" maps a send's index to a Store
    key (or a list of keys) to wait for first; "stall_amax" = (rank, step, seconds) delays that rank's
    FP8 amaxes in that send, so the other ranks reach the exchange first;
    "delta" makes the senders send deltas (WeightSender delta=True);
    "register_late" = (rank, seconds) has that rank count its registration (its
    incarnation, once every rank's set-up info is read) that much later; with
    "amax_group" the senders reduce FP8 amaxes over a gloo group of their own.
    interpreter=False: FP8 is quantized on the torch path, not by the grouped
    kernels in Triton's interpreter (20 s less for test_sync's exchange scenarios,
    whose subject is not the kernels: test_plan.py checks them against that path)."""
    out = {}
    torch.set_num_threads(1)
    deltas_by_size()  # the "delta" scenarios check what goes on the wire
    if not interpreter:
        os.environ["TRITON_INTERPRET"] = "0"
    for s in scenarios:
        if rank >= s["fsdp"]:
            continue
        store = connect(s.get("port", port))
        group = None
        if s.get("amax_group"):
            group = dist.ProcessGroupGloo(dist.PrefixStore(f"test/amax-group/{scenario_name(s)}/", store), rank,
                                          s["fsdp"], datetime.timedelta(seconds=60))
        config, dtype = small_config(s["config"]), DTYPES[s["src_dtype"]]
        device = s.get("device", "cpu")
        shards = {n: t.to(device) for n, t in reference_fsdp_shards(hf_state_dict(config, s["seed"]), s["fsdp"], dtype)[rank].items()}
        failed = out[f"{scenario_name(s)}/failed"] = []
        late = contextlib.nullcontext()
        if rank == s.get("register_late", (None, 0))[0]:
            late = _late_registration(rank, s["register_late"][1])
        with late, WeightSender(store, hf_llama_fsdp(config, s["fsdp"], dtype), rank, shards,
                          name=scenario_name(s), transport=s["transport"], timeout=60, group=group,
                          bucket_bytes=s.get("bucket_bytes", DEFAULT_BUCKET_BYTES),
                          delta=s.get("delta", False)) as sender:
            stall_rank, stall_step, stall_s = s.get("stall_amax", (None, None, 0))
            for step, v in enumerate(s.get("versions", versions)):
                if step in s.get("send_after", {}):
                    keys = s["send_after"][step]
                    store.wait([keys] if isinstance(keys, str) else keys, datetime.timedelta(seconds=60))
                state = version_state(config, s, v)
                if step in s.get("poisoned", ()):
                    state["model.layers.0.self_attn.q_proj.weight"][0, 0] = float("nan")
                fresh = reference_fsdp_shards(state, s["fsdp"], dtype)[rank]
                for name, t in shards.items():
                    t.copy_(fresh[name])
                if (rank, step) == (stall_rank, stall_step):
                    local_amax = sender.fp8.local_amax
                    sender.fp8.local_amax = lambda tensors: (time.sleep(stall_s), local_amax(tensors))[1]
                try:
                    sender.send(v)
                    if sender.delta:
                        out.setdefault(f"{scenario_name(s)}/sent", []).append(dataclasses.asdict(sender.last_send))
                except SyncError as exc:
                    if step not in s.get("poisoned", ()):
                        raise
                    failed.append(f"step {step}: {exc}")
                finally:
                    if sender.fp8 is not None:
                        sender.fp8.__dict__.pop("local_amax", None)
            out[scenario_name(s)] = sender.transport
    return out


def receiver_body(port: int, rank: int, scenarios: list[dict], versions=(1, 2), interpreter: bool = True) -> dict:
    """For each scenario: register NaN-poisoned parameters (as nn.Parameters of a
    module, the generator's own storage), receive each version and compare it
    bitwise with the plain-torch reference. Returns scenario -> mismatch lines.
    A scenario may override `port` and `versions`; receives whose index is in its
    "failing" must raise SyncError (recorded as a line "step i: torn <flag>:
    <message>"), and are followed by polling pending() until the senders send again;
    each such failure seen sets the Store key "saw-failure/<step>/<rank>" (a sender
    retrying too soon would clear its failure before this receiver asked: the receive
    would then get the retry's version, the test's script one step off).
    interpreter=False: the FP8 reference is quantized on the torch path (see
    sender_body)."""
    out = {}
    torch.set_num_threads(1)
    if not interpreter:
        os.environ["TRITON_INTERPRET"] = "0"
    for s in scenarios:
        if rank >= s["tp"]:
            continue
        store = connect(s.get("port", port))
        config = small_config(s["config"])
        layout = vllm_llama_tp(config, s["tp"], torch.bfloat16, fp8=s.get("fp8"))
        module = torch.nn.ParameterDict(
            {n.replace(".", "/"): torch.nn.Parameter(t.to(s.get("device", "cpu")), requires_grad=False)
             for n, t in poisoned_destination(layout, rank).items()}
        )
        params = {n.replace("/", "."): p for n, p in module.items()}
        problems = []
        with WeightReceiver(store, layout, rank, params, name=scenario_name(s), transport=s["transport"],
                            timeout=60) as receiver:
            failing = s.get("failing", ())
            for step, v in enumerate(s.get("versions", versions)):
                if step - 1 in failing:  # the senders' failure stands until they send again
                    _poll_pending(receiver, v)
                try:
                    got = receiver.receive()
                except SyncError as exc:
                    if step not in failing:
                        raise
                    problems.append(f"step {step}: torn {receiver.torn}: {exc}")
                    store.set(f"saw-failure/{step}/{rank}", b"1")
                    continue
                if step in failing:
                    problems.append(f"step {step}: received version {got}, expected SyncError")
                if got != v:
                    problems.append(f"version {got} reported, expected {v}")
                state = version_state(config, s, v)
                if s.get("fp8"):
                    expected = reference_vllm_fp8_shards(state, config, s["tp"], s["fp8"],
                                                         source_dtype=DTYPES[s["src_dtype"]])[rank]
                else:
                    expected = reference_vllm_tp_shards(state, config, s["tp"], torch.bfloat16)[rank]
                # Read through the module: the destination is the generator's own parameters.
                problems += [f"v{v} {line}" for line in mismatches(expected, {n.replace("/", "."): p.data.cpu() for n, p in module.items()})]
        out[scenario_name(s)] = problems
    return out


def _poll_pending(receiver: WeightReceiver, version: int, timeout: float = 60.0) -> None:
    """Poll pending() as a generator does between decode steps until it offers
    `version` (SyncError while a sender's failure stands)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if receiver.pending() == version:
                return
        except SyncError:
            pass
        time.sleep(0.01)
    raise TimeoutError(f"version {version} was not offered within {timeout} s")


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


def late_rank_sender_body(port: int, rank: int, scenario: dict) -> dict:
    """After version 1: sender 1 holds back version 2 while sender 0 sends it and
    waits in its FP8 amax exchange until it times out (5 s); only then does sender
    1 send version 2. Then both send version 3. Reports each send's outcome and
    any amax key of versions 1-3 left in the Store."""
    store = connect(port)
    config, dtype = small_config(scenario["config"]), DTYPES[scenario["src_dtype"]]
    timed_out = f"test/{scenario_name(scenario)}/0-timed-out"
    shards = reference_fsdp_shards(hf_state_dict(config, scenario["seed"]), scenario["fsdp"], dtype)[rank]
    report = {}

    def attempt(version: int, timeout: float | None = None) -> None:
        fresh = reference_fsdp_shards(hf_state_dict(config, scenario["seed"] + version), scenario["fsdp"], dtype)[rank]
        for name, t in shards.items():
            t.copy_(fresh[name])
        try:
            sender.send(version, timeout=timeout)
            report[f"v{version}"] = version
        except SyncError as exc:
            report[f"v{version}"] = f"{type(exc).__name__}: {exc}"

    with WeightSender(store, hf_llama_fsdp(config, scenario["fsdp"], dtype), rank, shards,
                      name=scenario_name(scenario), timeout=60) as sender:
        attempt(1)
        if rank == 0:
            attempt(2, timeout=5.0)
            store.set(timed_out, "1")
        else:
            store.wait([timed_out], datetime.timedelta(seconds=120))
            attempt(2)
        attempt(3)
    report["amax_keys_left"] = amax_keys_left(store, scenario, versions=(1, 2, 3))
    return report


def amax_keys_left(store: dist.Store, scenario: dict, versions) -> list[str]:
    """The FP8 amax exchange's keys of `versions` (two attempts each, every sender
    registered once) still in the Store."""
    from llamarl_core.sync.amax import amax_prefix

    prefixed = dist.PrefixStore(f"llamarl/sync/{scenario_name(scenario)}/", store)
    keys = [f"{amax_prefix((v, n), [1] * scenario['fsdp'])}/{kind}/{r}" for v in versions for n in (0, 1, 2)
            for kind in ("flag", "values") for r in range(scenario["fsdp"])]
    keys += [f"{amax_prefix((v, n), [1] * scenario['fsdp'])}/done" for v in versions for n in (0, 1, 2)]
    return [key for key in keys if prefixed.check([key])]


def polling_receiver_body(port: int, rank: int, scenario: dict) -> dict:
    """Receive version 1, then poll pending() until version 3 is offered (through
    the senders' failures on version 2), receive it and compare it bitwise with
    the reference."""
    store = connect(port)
    config = small_config(scenario["config"])
    layout = vllm_llama_tp(config, scenario["tp"], torch.bfloat16, fp8=scenario["fp8"])
    params = poisoned_destination(layout, rank)
    with WeightReceiver(store, layout, rank, params, name=scenario_name(scenario), timeout=60) as receiver:
        report = {"v1": receiver.receive()}
        _poll_pending(receiver, 3, timeout=120)
        report["v3"] = receiver.receive()
        expected = reference_vllm_fp8_shards(hf_state_dict(config, scenario["seed"] + 3), config, scenario["tp"],
                                             scenario["fp8"], source_dtype=DTYPES[scenario["src_dtype"]])[rank]
        report["v3_mismatches"] = mismatches(expected, params)
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


# ----------------------------------------------------------------------------- FP8 destination memory

FP8_MEMORY = dict(name="fp8-memory", transport="p2p", bucket_bytes=4 << 20, shapes=((4096, 8192), (4096, 8192)),
                  granularities=("channel", "block"))


def _fp8_memory_layouts():
    from llamarl_core.sync import Layout, ParamSpec, Shard

    shapes, kinds = FP8_MEMORY["shapes"], FP8_MEMORY["granularities"]
    src = Layout(1, [ParamSpec(f"w{i}", shape, torch.float32, Shard(0)) for i, shape in enumerate(shapes)])
    dst = Layout(1, [ParamSpec(f"w{i}", shape, torch.bfloat16, Shard(0), fp8=kind)
                     for i, (shape, kind) in enumerate(zip(shapes, kinds))])
    return src, dst


def _fp8_memory_weights(version: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(version)
    return {f"w{i}": torch.randn(shape, generator=gen) for i, shape in enumerate(FP8_MEMORY["shapes"])}


def fp8_memory_sender_body(port: int, device: str = "cpu", transport: str = FP8_MEMORY["transport"]) -> dict:
    """Send versions 1 and 2 of two float32 weights; report the FP8 buffer's size."""
    torch.set_num_threads(1)
    src, _ = _fp8_memory_layouts()
    tensors = {n: t.to(device) for n, t in _fp8_memory_weights(1).items()}
    with WeightSender(connect(port), src, 0, tensors, name=FP8_MEMORY["name"], transport=transport,
                      timeout=120, bucket_bytes=FP8_MEMORY["bucket_bytes"]) as sender:
        for v in (1, 2):
            for name, t in _fp8_memory_weights(v).items():
                tensors[name].copy_(t)
            sender.send(v)
        return {"packed_bytes": sender.fp8.packed.numel() * sender.fp8.packed.element_size()}


def _status_bytes(field: str) -> int:
    """A field of /proc/self/status (VmRSS, VmHWM: the peak since clear_refs), in bytes."""
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith(field + ":"))
    return int(line.split()[1]) * 1024


def fp8_memory_receiver_body(port: int, device: str = "cpu", transport: str = FP8_MEMORY["transport"]) -> dict:
    """The generator's FP8 weights and scales allocated (and touched) first; then
    the receiver registered and versions 1 and 2 received: reports the peak
    memory past that point (CPU: RSS; CUDA: the allocator's), what the registered
    tensors and the staging buffers hold, and the mismatches of version 2
    against ops.fp8's reference."""
    from llamarl_core.ops.fp8 import quantize_fp8_ref
    from llamarl_core.ops.fp8_format import fp8_scale_name

    torch.set_num_threads(1)
    _, dst = _fp8_memory_layouts()
    params = {n: t.to(device) for n, t in poisoned_destination(dst, 0).items()}
    registered = sum(t.numel() * t.element_size() for t in params.values())
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    else:
        with open("/proc/self/clear_refs", "w") as f:  # the peak (VmHWM) starts again at the RSS of now
            f.write("5")
        before = _status_bytes("VmRSS")
    with WeightReceiver(connect(port), dst, 0, params, name=FP8_MEMORY["name"], transport=transport,
                        timeout=120, bucket_bytes=FP8_MEMORY["bucket_bytes"]) as receiver:
        for _ in (1, 2):
            receiver.receive()
        peak_after = torch.cuda.max_memory_allocated() if device == "cuda" else _status_bytes("VmHWM")
        staging = sum(t.numel() for t in receiver._staging_bufs)
        used = receiver.transport
    expected = {}
    for (name, w), kind in zip(_fp8_memory_weights(2).items(), FP8_MEMORY["granularities"]):
        q, scale = quantize_fp8_ref(w, kind)
        expected[name] = q
        expected[fp8_scale_name(name, kind)] = scale
    return {"registered": registered, "staging": staging, "growth": peak_after - before, "transport": used,
            "mismatches": mismatches(expected, {n: t.cpu() for n, t in params.items()})}


# ----------------------------------------------------------------------------- an NCCL peer that dies

NCCL_PAIR = dict(config="llama_gqa_bias", fsdp=1, tp=1, src_dtype="fp32", transport="p2p", seed=4200)


def nccl_dying_sender_body(port: int) -> None:
    """Send version 1 point to point over NCCL from GPU 0, then die without a word."""
    s = NCCL_PAIR
    config, dtype = small_config(s["config"]), DTYPES[s["src_dtype"]]
    shards = {n: t.cuda(0) for n, t in reference_fsdp_shards(hf_state_dict(config, s["seed"]), 1, dtype)[0].items()}
    sender = WeightSender(connect(port), hf_llama_fsdp(config, 1, dtype), 0, shards, name=scenario_name(s),
                          transport="p2p", timeout=10)
    sender.send(1)
    connect(port).wait([f"test/{scenario_name(s)}/v1-checked"], datetime.timedelta(seconds=60))
    os._exit(3)


def nccl_surviving_receiver_body(port: int) -> dict:
    """On GPU 1: receive version 1 over NCCL (a group whose timeout is 10 s), then a receive
    whose sender died (3 s); then stay alive past the group's timeout, when NCCL's
    watchdog finds the receive's work timed out, and report."""
    s = NCCL_PAIR
    config = small_config(s["config"])
    layout = vllm_llama_tp(config, 1, torch.bfloat16)
    params = {n: t.cuda(1) for n, t in poisoned_destination(layout, 0).items()}  # NCCL: one rank a GPU
    store = connect(port)
    receiver = WeightReceiver(store, layout, 0, params, name=scenario_name(s), transport="p2p", timeout=10)
    report = {"v1": receiver.receive()}
    expected = reference_vllm_tp_shards(hf_state_dict(config, s["seed"]), config, 1, torch.bfloat16)[0]
    report["v1_mismatches"] = mismatches(expected, {n: t.cpu() for n, t in params.items()})
    store.set(f"test/{scenario_name(s)}/v1-checked", "1")
    try:
        receiver.receive(timeout=3)
        report["v2"] = "returned"
    except SyncError as exc:
        report["v2"] = f"{type(exc).__name__}: {exc}"
    time.sleep(15)  # past the group's 10 s: the watchdog has seen the timed-out work
    report["alive"] = True
    return report
