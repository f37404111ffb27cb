"""The layout algebra past Llama: splits on any dim of N-D tensors, strided views
cut into rectangles, explicit placements; every case executed and compared
element for element with plain torch (torch.chunk, views, copy_)."""

from __future__ import annotations

import random

import pytest
import torch

from helpers import chunks, local_tensors, random_placement
from llamarl_core.sync import Explicit, Layout, ParamSpec, Shard, plan_transfer
from llamarl_core.sync.layout import Fragment, box_fragments, strided_fragments, view_2d


def test_splits_on_any_dim_reshard_exactly():
    """600 random N-D tensors (1-4 dims, sizes 1-5), each split on a random dim
    over 1-4 source ranks and resharded onto another random dim of 1-4
    destination ranks: every destination rank holds exactly torch.chunk's piece."""
    rng = random.Random(22)
    for case in range(600):
        ndim = rng.randint(1, 4)
        shape = tuple(rng.randint(1, 5) for _ in range(ndim))
        full = torch.randn(shape, generator=torch.Generator().manual_seed(case))
        src_world, dst_world = rng.randint(1, 4), rng.randint(1, 4)
        src_p = random_placement(rng, ndim)
        dst_p = Shard(rng.randrange(ndim))
        src = Layout(src_world, [ParamSpec("t", shape, torch.float32, src_p)])
        dst = Layout(dst_world, [ParamSpec("t", shape, torch.float32, dst_p)])
        plan = plan_transfer(src, dst, bucket_bytes=rng.choice([8, 64, 1 << 20]))
        src_shards = {r: {"t": t} for r, t in enumerate(local_tensors(full, src_p, src_world))}
        expected = chunks(full, dst_world, dst_p.dim)
        dst_shards = {r: {"t": torch.full_like(e, float("nan"))} for r, e in enumerate(expected)}
        assert plan.execute_local(src_shards, dst_shards) == full.numel() * 4
        for r, e in enumerate(expected):
            assert torch.equal(dst_shards[r]["t"], e), (case, shape, src_world, src_p, dst_world, dst_p, r)


def test_a_shard_is_rectangles_of_the_2d_view():
    """Shard(1) of [E, H, I] is one rectangle per leading index; Shard(0) and a
    split of the last dim are one rectangle each."""
    layout = Layout(2, [ParamSpec("w", (3, 4, 6), torch.float32, Shard(1)),
                        ParamSpec("x", (3, 4, 6), torch.float32, Shard(0)),
                        ParamSpec("y", (3, 4, 6), torch.float32, Shard(2))])
    assert len(layout.fragments("w", 1)) == 3
    assert len(layout.fragments("x", 0)) == 1 and layout.fragments("x", 0)[0].num_rows == 8
    assert [(f.src_col, f.num_cols, f.num_rows) for f in layout.fragments("y", 1)] == [(3, 3, 12)]


def apply_fragments(fragments, src: torch.Tensor, dst: torch.Tensor) -> None:
    s2, d2 = src.view(view_2d(tuple(src.shape))), dst.view(view_2d(tuple(dst.shape)))
    for f in fragments:
        d2[f.local_row:f.local_row + f.num_rows, f.local_col:f.local_col + f.num_cols] = \
            s2[f.src_row:f.src_row + f.num_rows, f.src_col:f.src_col + f.num_cols]


def random_view(rng: random.Random, t: torch.Tensor) -> torch.Tensor:
    """A chain of narrow views of `t` and selects of any dim but the last (a select
    of the last dim, copied into a row, is a transpose)."""
    for _ in range(rng.randint(0, 3)):
        if t.dim() == 0:
            break
        dim = rng.randrange(t.dim())
        if t.shape[dim] == 0:
            break
        if rng.random() < 0.3 and dim < t.dim() - 1:
            t = t.select(dim, rng.randrange(t.shape[dim]))
        else:
            start = rng.randrange(t.shape[dim])
            t = t.narrow(dim, start, rng.randint(1, t.shape[dim] - start))
    return t


def test_strided_views_cut_into_rectangles_exactly():
    """1000 random copies `dst_view.copy_(src_view)` between narrow / select views
    of random N-D tensors of one shape: the fragments, applied rectangle by
    rectangle in the 2-D views, write exactly what copy_ writes."""
    rng = random.Random(7)
    for case in range(1000):
        shape = tuple(rng.randint(1, 5) for _ in range(rng.randint(1, 4)))
        src = torch.randn(shape, generator=torch.Generator().manual_seed(case))
        src_view = random_view(rng, src)
        # the destination: a box of the view's shape inside a larger local tensor
        pad = [rng.randint(0, 2) for _ in src_view.shape]
        dst = torch.zeros([n + p for n, p in zip(src_view.shape, pad)] or [])
        starts = [rng.randint(0, p) for p in pad]
        dst_view = dst
        for d, (start, n) in enumerate(zip(starts, src_view.shape)):
            dst_view = dst_view.narrow(d, start, n)
        frags = strided_fragments("t", shape, src_view.storage_offset(), src_view.stride(), tuple(dst.shape),
                                  dst_view.storage_offset(), dst_view.stride(), tuple(src_view.shape))
        expected = dst.clone()
        expected_view = expected
        for d, (start, n) in enumerate(zip(starts, src_view.shape)):
            expected_view = expected_view.narrow(d, start, n)
        expected_view.copy_(src_view)
        got = torch.zeros_like(dst)
        apply_fragments(frags, src, got)
        assert torch.equal(got, expected), (case, shape, src_view.shape, frags)


def test_a_transposed_weight_is_refused():
    """A transpose is one rectangle per element: past MAX_FRAGMENTS_PER_VIEW, refused."""
    src, dst = torch.empty(300, 400), torch.empty(400, 300)
    with pytest.raises(ValueError, match="'t'.*more than 65536 rectangles.*transpose"):
        strided_fragments("t", (300, 400), 0, src.t().stride(), (400, 300), 0, dst.stride(), (400, 300))


def test_stacked_experts_through_explicit_placements():
    """A vLLM-style stacked expert tensor [E, 2I/tp, H] per TP rank, written from
    per-expert gate / up tensors [I, H] sharded over two trainer ranks (as an
    Explicit placement lists it): the plan lands every expert's gate then up
    rows of the rank's slice; the layout survives JSON."""
    E, I, H, tp = 3, 4, 5, 2
    gate = [torch.randn(I, H) for _ in range(E)]
    up = [torch.randn(I, H) for _ in range(E)]
    src_params = []
    for e in range(E):
        src_params += [ParamSpec(f"experts.{e}.gate", (I, H), torch.float32, Shard(0)),
                       ParamSpec(f"experts.{e}.up", (I, H), torch.float32, Shard(0))]
    src = Layout(2, src_params)
    step = I // tp
    local = (E, 2 * step, H)
    frags = []
    for r in range(tp):
        mine = []
        for e in range(E):
            for k, part in enumerate(("gate", "up")):
                mine += strided_fragments(f"experts.{e}.{part}", (I, H), r * step * H, (H, 1), local,
                                          (e * 2 * step + k * step) * H, (H, 1), (step, H))
        frags.append(tuple(mine))
    sources = tuple((f"experts.{e}.{p}", (I, H)) for e in range(E) for p in ("gate", "up"))
    dst = Layout(tp, [ParamSpec("w13", local, torch.float32, Explicit(sources, (local,) * tp, tuple(frags)))])
    assert Layout.from_json(dst.to_json()) == dst
    plan = plan_transfer(src, Layout.from_json(dst.to_json()))
    src_shards = {r: {} for r in range(2)}
    for e in range(E):
        for part, full in (("gate", gate[e]), ("up", up[e])):
            for r, piece in enumerate(chunks(full, 2, 0)):
                src_shards[r][f"experts.{e}.{part}"] = piece
    dst_shards = {r: {"w13": torch.full(local, float("nan"))} for r in range(tp)}
    plan.execute_local(src_shards, dst_shards)
    for r in range(tp):
        expected = torch.stack([torch.cat([gate[e][r * step:(r + 1) * step], up[e][r * step:(r + 1) * step]])
                                for e in range(E)])
        assert torch.equal(dst_shards[r]["w13"], expected)


def test_explicit_placements_are_validated():
    with pytest.raises(ValueError, match="'w' rank 0.*outside"):
        Layout(1, [ParamSpec("w", (2, 2), torch.float32, Explicit(
            (("a", (2, 2)),), ((2, 2),), ((Fragment("a", 0, 0, 3, 2, 0, 0),),)))])
    with pytest.raises(ValueError, match="'w'.*not a listed source"):
        Layout(1, [ParamSpec("w", (2, 2), torch.float32, Explicit(
            (("a", (2, 2)),), ((2, 2),), (tuple(box_fragments("b", (2, 2), (0, 0), (2, 2), (2, 2))),)))])
    with pytest.raises(ValueError, match="'w'.*2 fragment lists for world size 1"):
        Layout(1, [ParamSpec("w", (2, 2), torch.float32, Explicit((("a", (2, 2)),), ((2, 2),), ((), ())))])


@pytest.mark.parametrize("kind, named", [("qwen3", "'qwen3'"), ("qwen3_moe", "'qwen3_moe'"), ("mixtral", "'mixtral'")])
def test_llama_presets_and_generator_refuse_other_families(kind, named):
    """A Qwen3 config through the Llama presets once planned a layout without
    q_norm / k_norm; now every preset and LlamaGenerator refuse it by name."""
    from live_workers import tiny_config

    from llamarl_core.models.llama_generator import LlamaGenerator
    from llamarl_core.sync.presets import hf_llama_fsdp, vllm_llama_tp

    config = tiny_config(kind)
    for build in (lambda: hf_llama_fsdp(config, 2, torch.float32), lambda: vllm_llama_tp(config, 1, torch.float32),
                  lambda: LlamaGenerator(config)):
        with pytest.raises(ValueError, match=f"model_type {named} is not of the Llama family"):
            build()


def test_llama_presets_refuse_fields_they_have_no_place_for():
    from types import SimpleNamespace

    from llamarl_core.models.llama_family import hf_llama_shapes

    config = SimpleNamespace(hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
                             vocab_size=10, num_local_experts=4)
    with pytest.raises(ValueError, match=r"num_local_experts \(experts\)"):
        hf_llama_shapes(config)
