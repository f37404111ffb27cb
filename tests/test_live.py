"""Trainer layouts read off live transformers models past Llama (Qwen3,
Qwen3-MoE, Mixtral): checkpoint names from transformers' own conversion,
placements from real FSDP2 and tensor-parallel DTensors over gloo processes;
every layout executed and compared with the checkpoint tensors
`revert_weight_conversion` gives (what save_pretrained writes)."""

from __future__ import annotations

import datetime
import random
import socket
import threading

import pytest
import torch
from transformers.core_model_loading import revert_weight_conversion

from helpers import run_processes
from live_workers import sharded, tiny_config, tiny_model
from llamarl_core.sync import (Layout, ParamSpec, SyncError, SyncTimeoutError, WeightReceiver, module_layout,
                               module_sender, plan_transfer)
from llamarl_core.sync.live import checkpoint_views, checkpointed, fsdp_layout

KINDS = ("qwen3", "qwen3_moe", "mixtral")


def checkpoint(model) -> dict[str, torch.Tensor]:
    """The checkpoint tensors transformers writes for `model` (real values)."""
    return {n: t.contiguous() for n, t in revert_weight_conversion(
        model, {n: p.detach() for n, p in model.named_parameters()}).items()}


def land(layout: Layout, shards: dict[int, dict[str, torch.Tensor]], expected: dict[str, torch.Tensor]) -> dict:
    """Execute `layout` -> one rank holding every checkpoint tensor whole."""
    dst = Layout(1, [ParamSpec(n, tuple(t.shape), t.dtype) for n, t in expected.items()])
    out = {0: {n: torch.full_like(t, float("nan")) for n, t in expected.items()}}
    plan_transfer(layout, dst).execute_local(shards, out)
    return out[0]


@pytest.mark.parametrize("kind", KINDS)
def test_checkpoint_views_are_transformers_own_conversion(kind):
    """Each checkpoint tensor is exactly the box of its parameter that
    checkpoint_views names (Mixtral: block_sparse_moe.experts.N.w1/w3 in the
    fused mlp.experts.gate_up_proj)."""
    model = tiny_model(kind, 1)
    expected = checkpoint(model)
    params = dict(model.named_parameters())
    seen = set()
    for name, held in checkpoint_views(model).items():
        for ckpt_name, shape, (offset, extent) in held:
            box = params[name].detach()
            for d, (o, n) in enumerate(zip(offset, extent)):
                box = box.narrow(d, o, n)
            assert torch.equal(box.reshape(shape), expected[ckpt_name]), (name, ckpt_name)
            seen.add(ckpt_name)
    assert seen == set(expected)
    if kind == "mixtral":
        assert "model.layers.0.block_sparse_moe.experts.2.w3.weight" in seen


def test_activation_checkpointing_wrappers_are_not_in_checkpoint_names():
    """Layers wrapped by torch's checkpoint_wrapper (as accelerate's FSDP2 plugin
    wraps them for activation checkpointing): the parameters keep their wrapped
    names, the checkpoint names are the model's own (the state dict's), through
    transformers' conversion (Mixtral's fused experts) too."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (apply_activation_checkpointing,
                                                                             checkpoint_wrapper)

    model = tiny_model("mixtral", 1)
    plain = checkpoint_views(model)
    layer = type(model.model.layers[0])
    apply_activation_checkpointing(model, checkpoint_wrapper_fn=checkpoint_wrapper,
                                   check_fn=lambda module: isinstance(module, layer))
    wrapped = checkpoint_views(model)
    assert any("_checkpoint_wrapped_module." in name for name in wrapped)
    assert {n.replace("_checkpoint_wrapped_module.", ""): v for n, v in wrapped.items()} == plain
    assert module_layout(model, 1).logical_shapes() == {ckpt: shape for held in plain.values()
                                                        for ckpt, shape, _ in held}
    # a persistent buffer (a router's trained bias) inside a wrapped layer is still a checkpoint tensor
    layer = torch.nn.Linear(2, 2)
    layer.register_buffer("bias_kept", torch.zeros(2))
    layer.register_buffer("scratch", torch.zeros(2), persistent=False)
    holder = torch.nn.Sequential(checkpoint_wrapper(layer))
    assert set(checkpointed(holder)) == {f"0._checkpoint_wrapped_module.{n}" for n in ("weight", "bias", "bias_kept")}


def test_exact_cover_check_agrees_with_counting_every_element():
    """checkpoint_views refuses a conversion whose boxes miss or overlap part of a
    parameter: its check on the boxes' own grid agrees with counting each element,
    on random tilings, tilings with one box moved or dropped, and random boxes
    (a gap and an overlap of the same size, which a count of elements misses)."""
    from llamarl_core.sync.live import _cover_exactly_once

    rng = random.Random(0)
    verdicts = set()
    for _ in range(3000):
        shape = tuple(rng.randint(0, 5) for _ in range(rng.randint(0, 3)))
        cuts = [sorted({0, n} | {rng.randint(0, n) for _ in range(rng.randint(0, 3))}) for n in shape]
        boxes = [((), ())]
        for c in cuts:
            boxes = [(o + (a,), e + (b - a,)) for o, e in boxes for a, b in zip(c, c[1:])]
        mode = rng.randrange(4)
        if mode == 1 and boxes:
            boxes.pop(rng.randrange(len(boxes)))
        elif mode == 2 and boxes and shape:
            (offset, extent), d = boxes.pop(rng.randrange(len(boxes))), rng.randrange(len(shape))
            moved = offset[d] + rng.choice((-1, 1))
            if 0 <= moved <= shape[d] - extent[d]:
                offset = offset[:d] + (moved,) + offset[d + 1:]
            boxes.append((offset, extent))
        elif mode == 3:
            boxes = []
            for _ in range(rng.randint(0, 4)):
                o = tuple(rng.randint(0, n) for n in shape)
                boxes.append((o, tuple(rng.randint(0, n - a) for n, a in zip(shape, o))))
        count = torch.zeros(shape, dtype=torch.int32)
        for offset, extent in boxes:
            count[tuple(slice(o, o + e) for o, e in zip(offset, extent))] += 1
        expected = bool((count == 1).all())
        assert _cover_exactly_once(boxes, shape) == expected, (shape, boxes)
        verdicts.add(expected)
    assert verdicts == {True, False}


@pytest.mark.parametrize("kind", KINDS)
def test_a_plain_model_sends_checkpoint_tensors(kind):
    model = tiny_model(kind, 2)
    expected = checkpoint(model)
    shards = {0: {n: p.detach() for n, p in model.named_parameters()}}
    got = land(module_layout(model, 1), shards, expected)
    assert all(torch.equal(got[n], expected[n]) for n in expected)


@pytest.mark.parametrize("kind", KINDS)
def test_a_transformers_model_is_a_destination_too(kind):
    """A generator that is a plain transformers model: module_layout gives its
    layout as a receiver (fused experts filled from per-expert checkpoint
    tensors); after the plan runs, every parameter and the logits equal the
    trainer model's exactly."""
    src, dst = tiny_model(kind, 4), tiny_model(kind, 5)
    plan = plan_transfer(module_layout(src, 1), module_layout(dst, 1))
    with torch.no_grad():
        plan.execute_local({0: {n: p.detach() for n, p in src.named_parameters()}},
                           {0: {n: p.data for n, p in dst.named_parameters()}})
    assert [n for n, p in src.named_parameters() if not torch.equal(p, dst.get_parameter(n))] == []
    ids = torch.tensor([[5, 17, 42, 7, 99]])
    with torch.no_grad():
        assert torch.equal(src.eval()(input_ids=ids).logits, dst.eval()(input_ids=ids).logits)


def test_wrapped_models_are_read_through():
    """DDP and torch.compile wrappers (parameter names prefixed `module.` /
    `_orig_mod.`, which no checkpoint has): the layout is the model's own."""
    from torch.nn.parallel import DistributedDataParallel

    model = tiny_model("qwen3_moe", 0)
    expected = module_layout(model, 1)
    assert module_layout(torch.compile(model), 1) == expected
    torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)
    try:
        assert module_layout(DistributedDataParallel(model), 1) == expected
    finally:
        torch.distributed.destroy_process_group()


def test_a_plain_model_on_several_ranks_is_refused():
    with pytest.raises(ValueError, match="plain tensors.*DDP.*world_size=1"):
        module_layout(tiny_model("qwen3", 0), 2)


def test_a_world_size_that_is_not_an_int_of_one_or_more_is_refused():
    """A bool or a float world is refused as Layout refuses it, naming world_size (True passed as 1)."""
    model = tiny_model("qwen3", 0)
    for world in (True, 0, 2.0, -1):
        for build in (lambda: module_layout(model, world), lambda: fsdp_layout(model, world, torch.float32),
                      lambda: Layout(world, [])):
            with pytest.raises(ValueError, match=rf"world_size must be an int >= 1, got {world!r}"):
                build()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("kind,mode,world", [("qwen3_moe", "fsdp", 2), ("mixtral", "fsdp", 2), ("qwen3", "tp", 2),
                                             ("qwen3_moe", "hsdp", 4), ("qwen3", "fsdp_tp", 4)])
def test_sharded_trainers_layouts_land_the_checkpoint(kind, mode, world):
    """Real gloo ranks shard the model (FSDP2, 3 experts over 2 ranks: 2 + 1;
    HSDP, the same shards held by 2 replicas; tensor parallel, column and row;
    FSDP2 over tensor parallel on 4 ranks, the strided shards): module_layout of each rank is the same, executing it from the ranks'
    local shards gives every checkpoint tensor exactly, and (FSDP2) it equals
    fsdp_layout of a meta-device copy. HSDP: one replica's worth of shards is
    sent, nothing twice, no rank sending more than its own."""
    port = free_port()
    results = run_processes([(sharded, dict(rank=r, world=world, port=port, kind=kind, mode=mode))
                             for r in range(world)], timeout=120)
    layouts = {Layout.from_json(r["layout"]).to_json() for r in results}
    assert len(layouts) == 1
    layout = Layout.from_json(layouts.pop())
    if mode == "fsdp":
        assert layout == Layout.from_json(results[0]["fsdp_layout"])
        moe = next(n for n in layout.params if n.endswith("experts.gate_up_proj"))
        assert [layout.local_shape(moe, r)[0] for r in range(2)] == [2, 1]
    elif mode == "hsdp":  # mesh [[0, 1], [2, 3]]: ranks 0 and 2 hold shard 0, ranks 1 and 3 shard 1
        moe = next(n for n in layout.params if n.endswith("experts.gate_up_proj"))
        assert [layout.local_shape(moe, r)[0] for r in range(4)] == [2, 1, 2, 1]
        whole = Layout(1, [ParamSpec(n, s, torch.float32) for n, s in layout.logical_shapes().items()])
        sent = plan_transfer(layout, whole).bytes_sent_by_src_rank()
        own = {r: sum(layout.local_nbytes(n, r) for n in layout.params) for r in range(4)}
        assert sum(sent.values()) == own[0] + own[1] and all(sent.get(r, 0) <= own[r] for r in range(4)), (sent, own)
    elif mode == "fsdp_tp":  # mesh [[0, 1], [2, 3]] (dp, tp): q_proj's 64 rows cut by tp first, then by dp
        assert [layout.local_shape("model.layers.0.self_attn.q_proj.weight", r) for r in range(4)] == [(16, 64)] * 4
        assert [layout.fragments("model.layers.0.self_attn.q_proj.weight", r)[0].src_row for r in range(4)] == \
            [0, 32, 16, 48]
    else:
        assert layout.local_shape("model.layers.0.self_attn.o_proj.weight", 1) == (64, 32)
    expected = checkpoint(tiny_model(kind, 0))
    shards = {r: {n: torch.from_numpy(a) for n, a in res["shards"].items()} for r, res in enumerate(results)}
    got = land(layout, shards, expected)
    assert [n for n in expected if not torch.equal(got[n], expected[n])] == []


def test_shard_runs_match_dtensors_own_indices():
    """Shard and _StridedShard (FSDP2 over tensor parallelism) cut a dim as DTensor
    does: the indices torch's own placements give, on random sizes."""
    from torch.distributed.tensor.placement_types import Shard as DShard
    from torch.distributed.tensor.placement_types import _StridedShard

    from llamarl_core.sync.live import _shard_runs

    rng = random.Random(0)
    for _ in range(2000):
        size, split_factor, chunks = rng.randint(0, 40), rng.randint(1, 5), rng.randint(1, 5)
        strided = _StridedShard(0, split_factor=split_factor)
        for coord in range(chunks):
            _, expected = strided.local_shard_size_and_offset(size, chunks, coord, 1)  # 1: every offset
            got = [i for a, b in _shard_runs([(0, size)] if size else [], strided, chunks, coord) for i in range(a, b)]
            assert got == (expected or []), (size, split_factor, chunks, coord)
            pieces = torch.arange(size).chunk(chunks) if size else ()
            got = [i for a, b in _shard_runs([(0, size)] if size else [], DShard(0), chunks, coord) for i in range(a, b)]
            assert got == (pieces[coord].tolist() if coord < len(pieces) else []), (size, chunks, coord)


def test_fsdp_layout_of_a_meta_model_plans_before_any_trainer():
    with torch.device("meta"):
        from transformers import AutoModelForCausalLM

        meta = AutoModelForCausalLM.from_config(tiny_config("qwen3_moe"))
    layout = fsdp_layout(meta, 4, torch.bfloat16)
    moe = "model.layers.1.mlp.experts.down_proj"
    assert [layout.local_shape(moe, r)[0] for r in range(4)] == [1, 1, 1, 0]
    assert {s.dtype for s in layout.params.values()} == {torch.bfloat16}
    assert "model.layers.1.mlp.experts.2.down_proj.weight" in layout.logical_shapes()


def test_a_parameter_rebound_after_registration_is_refused_before_a_byte_moves():
    """load_state_dict(assign=True) gives the model new storage: the next send
    raises naming a parameter, the receiver's next receive raises quoting it (not
    at its timeout), and the receiver's tensors keep version 1."""
    model = tiny_model("qwen3", 3)
    layout = module_layout(model, 1)
    store = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, timeout=datetime.timedelta(seconds=30))

    def client():
        return torch.distributed.TCPStore("127.0.0.1", store.port, is_master=False,
                                          timeout=datetime.timedelta(seconds=30))

    dst = {n: torch.zeros(shape, dtype=dtype) for n, (shape, dtype) in layout.local_tensor_specs(0).items()}
    outcome = {}

    def receive():
        with WeightReceiver(client(), layout, 0, dst, name="rebind", timeout=30) as receiver:
            outcome["first"] = receiver.receive()
            outcome["v1"] = {n: t.clone() for n, t in dst.items()}
            try:
                receiver.receive(timeout=20)
            except SyncError as exc:
                outcome["second"] = exc

    thread = threading.Thread(target=receive)
    thread.start()
    with module_sender(client(), model, 0, 1, name="rebind", timeout=30) as sender:
        sender.send(1)
        model.load_state_dict({n: p.detach() + 1 for n, p in model.named_parameters()}, assign=True)
        with pytest.raises(SyncError, match="'model.embed_tokens.weight' was rebound after the sender registered"):
            sender.send(2)
    thread.join(timeout=30)
    assert outcome["first"] == 1 and not isinstance(outcome["second"], SyncTimeoutError)
    assert ("sender rank 0 failed: SyncError: trainer parameter 'model.embed_tokens.weight' was rebound"
            in str(outcome["second"]))
    assert all(torch.equal(dst[n], outcome["v1"][n]) for n in dst)


def test_each_trainer_rank_sends_exactly_its_own_shards():
    """FSDP2 over 2 ranks of a Qwen3-MoE (3 experts: 2 + 1): into one receiver
    holding every checkpoint tensor, each rank sends its own shard bytes, no
    gather (bytes_sent_by_src_rank)."""
    with torch.device("meta"):
        from transformers import AutoModelForCausalLM

        meta = AutoModelForCausalLM.from_config(tiny_config("qwen3_moe"))
    src = fsdp_layout(meta, 2, torch.float32)
    dst = Layout(1, [ParamSpec(n, shape, torch.float32) for n, shape in src.logical_shapes().items()])
    own = {r: sum(src.local_nbytes(n, r) for n in src.params) for r in range(2)}
    assert plan_transfer(src, dst).bytes_sent_by_src_rank() == own
    assert own[0] > own[1] > 0
