"""The trainer at scale, on CPU: models built on the meta device and filled shard
by shard (random initialisation, a safetensors checkpoint), no rank holding the
whole model (peak memory measured); DCP checkpoints written by every rank and
read back at the same or another world size, the next step reproduced exactly;
the policy exported one group of tensors at a time."""

from __future__ import annotations

import datetime
import json
import re

import pytest
import torch
import torch.distributed as dist
import transformers
from helpers import run_processes
from safetensors.torch import load_file

from llamarl_core.models.checkpoint import save_model_folder
from llamarl_core.models.sharded import (
    copy_shards,
    empty_model,
    init_random,
    load_shards,
    local_part,
)
from llamarl_core.pipeline import checkpoints
from llamarl_core.pipeline.checkpoints import TrainerCheckpoints, checkpoint_info
from llamarl_core.pipeline.export import export_policy
from llamarl_core.pipeline.task import reverse_task


def _config(tie: bool = False, **sizes) -> transformers.LlamaConfig:
    shape = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1)
    return transformers.LlamaConfig(**{**shape, **sizes}, tie_word_embeddings=tie)


def _full(model) -> dict[str, torch.Tensor]:
    """Every parameter and persistent buffer of `model`, whole (DTensors gathered)."""
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
            for k, v in model.state_dict().items()}


def _portable(value):
    """`value` with every tensor as a numpy array (bfloat16 as float32, exact): what
    a rank process can hand back through a pipe after it exits."""
    if isinstance(value, torch.Tensor):
        return value.float().numpy() if value.dtype == torch.bfloat16 else value.numpy()
    if isinstance(value, dict):
        return {k: _portable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_portable(v) for v in value)
    return value


def _tensors(value):
    if isinstance(value, dict):
        return {k: _tensors(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_tensors(v) for v in value)
    return torch.from_numpy(value) if hasattr(value, "dtype") and hasattr(value, "shape") else value


def _in_group(rank: int, world: int, port: int, job, **kwargs):
    """Run job(rank, world, mesh, **kwargs) as rank `rank` of a gloo group of `world`;
    its result with tensors as numpy arrays."""
    from torch.distributed.device_mesh import init_device_mesh

    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    try:
        return _portable(job(rank, world, init_device_mesh("cpu", (world,)), **kwargs))
    finally:
        dist.destroy_process_group()


def _ranks(world: int, job, timeout: float = 180, start_method: str = "forkserver", **kwargs) -> list:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=datetime.timedelta(seconds=60))
    return _tensors(run_processes([(_in_group, dict(rank=r, world=world, port=store.port, job=job, **kwargs))
                                   for r in range(world)], timeout=timeout, start_method=start_method))


# ----------------------------------------------------------------------------- building and filling


def _random_job(rank, world, mesh, config, seed):
    model = empty_model(config, dtype=torch.float32, device="cpu", mesh=mesh)
    init_random(model, seed)
    local = {n: local_part(p).numel() for n, p in model.named_parameters()}
    return {"full": _full(model), "local": local, "tied": model.lm_head.weight is model.model.embed_tokens.weight}


@pytest.mark.parametrize("tie", [False, True])
def test_random_init_is_the_same_at_any_world_size_and_has_the_models_own_distribution(tie):
    config = _config(tie)
    one = empty_model(config, dtype=torch.float32, device="cpu")
    init_random(one, 7)
    assert (one.lm_head.weight is one.model.embed_tokens.weight) == tie  # to_empty leaves ties as they were
    expect = _full(one)
    hf = transformers.LlamaForCausalLM(config)  # transformers' own initialisation, for its statistics
    for name, t in expect.items():
        theirs = hf.state_dict()[name]
        if name.endswith("norm.weight") or "inv_freq" in name:
            assert torch.equal(t, theirs), name
        else:
            assert abs(t.std().item() - config.initializer_range) < 0.2 * config.initializer_range, name
            assert abs(t.mean().item()) < 0.2 * config.initializer_range, name
    other = empty_model(config, dtype=torch.float32, device="cpu")
    init_random(other, 8)
    up = "model.layers.0.mlp.up_proj.weight"
    assert not torch.equal(_full(other)[up], expect[up])
    for world in (3,) if tie else (2,):  # one spawn a case: ranks start slowly
        ranks = _ranks(world, _random_job, config=config, seed=7)
        for r in ranks:
            assert r["full"].keys() == expect.keys() and r["tied"] == tie
            assert all(torch.equal(r["full"][k], expect[k]) for k in expect), world
            # each rank holds its shard only: about 1 / world of every parameter's rows
            assert all(r["local"][n] <= -(-p.shape[0] // world) * p[0].numel()
                       for n, p in one.named_parameters()), r["local"]


def _checkpoint(tmp_path, config, name: str, dtype=torch.bfloat16, **save) -> tuple:
    torch.manual_seed(3)
    model = transformers.LlamaForCausalLM(config).to(dtype)
    folder = tmp_path / name
    model.save_pretrained(folder, **save)
    return folder, transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)


def _load_job(rank, world, mesh, config, folder):
    model = empty_model(config, dtype=torch.float32, device="cpu", mesh=mesh)
    load_shards(model, folder)
    return _full(model)


@pytest.mark.gpu
def test_random_init_on_a_gpu_is_drawn_there_seeded_with_the_models_own_distribution():
    """A model on a GPU draws its weights there (a CPU thread takes 13 s for 1B): the
    same seed gives the same weights, another seed others; the model's own statistics;
    the buffers as the CPU computes them; the CPU's and the GPU's generators as before."""
    config = _config(intermediate_size=256, hidden_size=128)
    cpu_state, gpu_state = torch.get_rng_state(), torch.cuda.get_rng_state()
    built = []
    for seed in (7, 7, 8):
        model = empty_model(config, dtype=torch.float32, device="cuda")
        init_random(model, seed)
        built.append({k: v.cpu() for k, v in _full(model).items()})
    assert torch.equal(torch.get_rng_state(), cpu_state) and torch.equal(torch.cuda.get_rng_state(), gpu_state)
    assert all(torch.equal(built[0][k], built[1][k]) for k in built[0])
    up = "model.layers.0.mlp.up_proj.weight"
    assert not torch.equal(built[0][up], built[2][up])
    on_cpu = empty_model(config, dtype=torch.float32, device="cpu")
    init_random(on_cpu, 7)
    for name, t in _full(on_cpu).items():
        if name.endswith("norm.weight") or "inv_freq" in name:
            assert torch.equal(built[0][name], t), name
        else:
            assert abs(built[0][name].std().item() - config.initializer_range) < 0.2 * config.initializer_range, name
            assert abs(built[0][name].mean().item()) < 0.2 * config.initializer_range, name



@pytest.mark.parametrize("tie", [False, True])
def test_a_safetensors_checkpoint_loads_shard_by_shard_equal_to_transformers(tmp_path, tie):
    config = _config(tie)
    single, expect = _checkpoint(tmp_path, config, "single")
    several, _ = _checkpoint(tmp_path, config, "several", max_shard_size="8KB")
    assert (several / "model.safetensors.index.json").is_file() and (single / "model.safetensors").is_file()
    want = expect.state_dict()
    for folder in (single, several):
        model = empty_model(config, dtype=torch.float32, device="cpu")
        load_shards(model, folder)
        assert all(torch.equal(t, want[k]) for k, t in _full(model).items())
    for r in _ranks(2, _load_job, config=config, folder=several) if tie else ():  # tied: the harder case
        assert r.keys() == want.keys() and all(torch.equal(t, want[k]) for k, t in r.items())


def test_a_checkpoint_that_does_not_hold_the_models_parameters_is_refused_before_a_tensor_is_read(tmp_path):
    """Other shapes, other names (NotByName: the trainer then asks transformers'
    loader), an FP8 weight or quantization scales (never cast as if they were
    weights): refused naming the tensor, the model untouched."""
    from safetensors.torch import save_file

    from llamarl_core.models.sharded import NotByName

    folder, _ = _checkpoint(tmp_path, _config(hidden_size=64), "wider")
    model = empty_model(_config(), dtype=torch.float32, device="cpu")
    init_random(model, 1)
    before = _full(model)
    with pytest.raises(ValueError, match=r"shaped or typed otherwise: model.embed_tokens.weight \[96, 64\] "
                                         r"\(the model's \[96, 32\]\), .* and \d+ more \(nothing was read\)$"):
        load_shards(model, folder)
    smaller, _ = _checkpoint(tmp_path, _config(num_hidden_layers=1), "shallower")
    with pytest.raises(NotByName, match=r"names: missing model.layers.1.self_attn.q_proj.weight, .* and 5 more$"):
        load_shards(model, smaller)
    same, _ = _checkpoint(tmp_path, _config(), "fp8")
    state = load_file(same / "model.safetensors")
    up = "model.layers.0.mlp.up_proj.weight"
    save_file({**state, up: state[up].to(torch.float8_e4m3fn)}, same / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=rf"typed otherwise: {up} in F8_E4M3 \(nothing was read\)$"):
        load_shards(model, same)
    save_file({**state, up + "_scale_inv": torch.ones(1, 1)}, same / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=rf"quantization tensors {up}_scale_inv \(nothing was read\)$"):
        load_shards(model, same)
    assert all(torch.equal(t, before[k]) for k, t in _full(model).items())  # nothing half-written
    with pytest.raises(ValueError, match="holds no safetensors checkpoint"):
        load_shards(model, tmp_path)


def _hwm_kib() -> int:
    return int(re.search(r"VmHWM:\s+(\d+)", open("/proc/self/status").read()).group(1))


def _rss_kib() -> int:
    return int(re.search(r"VmRSS:\s+(\d+)", open("/proc/self/status").read()).group(1))


def _peak_job(rank, world, mesh, config, folder):
    """Build and load this rank's shards; the peak resident memory it took (the
    kernel's high-water mark, reset first), the mapped checkpoint pages included."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS
    before = _rss_kib()
    model = empty_model(config, dtype=torch.float32, device="cpu", mesh=mesh)
    load_shards(model, folder)
    return (_hwm_kib() - before) * 1024


def test_no_rank_ever_holds_the_whole_model_while_it_loads(tmp_path):
    """Four ranks load a 229 MiB float32 model (a bfloat16 checkpoint): each rank's
    peak resident memory grows by its shards (a quarter), the checkpoint pages of its
    rows it maps (an eighth) and one tensor's rows, about half the model (0.46-0.55x
    spawned in one run); a rank that held the whole model once would grow by all of it
    (1.0x) and more. The ranks fork from the forkserver: their growth also counts
    the forkserver's library pages they first touch while loading (6-7 MiB more than
    spawned ranks in one run, 0.48-0.58x), which only makes the bound stricter."""
    config = _config(vocab_size=32000, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
                     num_attention_heads=8, num_key_value_heads=8)
    folder, model = _checkpoint(tmp_path, config, "big")
    model_bytes = sum(p.numel() for p in model.parameters()) * 4
    del model
    peaks = _ranks(4, _peak_job, timeout=300, config=config, folder=folder)
    print(f"model {model_bytes / 2**20:.0f} MiB (float32); each rank's peak growth while it loads: "
          f"{', '.join(f'{p / 2**20:.0f}' for p in peaks)} MiB")
    assert all(p < 0.75 * model_bytes for p in peaks), peaks


# ----------------------------------------------------------------------------- checkpoints


def _step(model, optimizer, seed: int) -> None:
    """One AdamW step on a batch drawn from `seed` (the same on every rank)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (2, 7), generator=g)
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _optimizer(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0, fused=True)


def _optimizer_full(model, optimizer) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    state = get_optimizer_state_dict(model, optimizer)["state"]
    return {f"{fqn}/{k}": (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
            for fqn, stats in state.items() for k, v in stats.items()}


def _train_and_save_job(rank, world, mesh, config, run_dir):
    model = empty_model(config, dtype=torch.float32, device="cpu", mesh=mesh)
    init_random(model, 11)
    optimizer = _optimizer(model)
    saved = TrainerCheckpoints(run_dir, rank, world)
    _step(model, optimizer, 0)
    _step(model, optimizer, 1)
    saved.save(model, optimizer, step=2, data_position=16)
    _step(model, optimizer, 2)
    return _full(model), _optimizer_full(model, optimizer)


def _resume_job(rank, world, mesh, config, run_dir):
    model = empty_model(config, dtype=torch.float32, device="cpu", mesh=mesh)
    optimizer = _optimizer(model)
    info = TrainerCheckpoints(run_dir, rank, world).load(model, optimizer)
    _step(model, optimizer, 2)
    return info, _full(model), _optimizer_full(model, optimizer)


def _assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    bad = [k for k in a if not torch.equal(a[k], b[k])]
    assert not bad, bad


def test_a_checkpoint_of_two_ranks_resumes_the_next_step_exactly_at_two_ranks_and_at_one(tmp_path):
    """Every rank writes its own shards; a resumed run (2 ranks, or 1: DCP reshards)
    takes the next step to the same weights and AdamW moments, bit for bit. Each
    rank steps on the same batch, so the averaged gradient is the one rank's. With
    a rank's file gone, the load is refused."""
    config = _config()
    (model, optim), _ = _ranks(2, _train_and_save_job, config=config, run_dir=tmp_path)
    info = checkpoint_info(tmp_path)
    assert {k: info[k] for k in ("format", "step", "data_position", "world", "serial")} == \
        {"format": checkpoints.FORMAT, "step": 2, "data_position": 16, "world": 2, "serial": 1}
    files = sorted(p.name for p in (tmp_path / "checkpoint" / info["folder"]).iterdir())
    assert len([f for f in files if f.endswith(".safetensors")]) == 2, files  # one a rank
    for r in _ranks(2, _resume_job, config=config, run_dir=tmp_path):
        assert r[0]["step"] == 2 and r[0]["data_position"] == 16
        _assert_same(r[1], model)
        _assert_same(r[2], optim)
    one = empty_model(config, dtype=torch.float32, device="cpu")
    optimizer = _optimizer(one)
    TrainerCheckpoints(tmp_path, 0, 1).load(one, optimizer)
    _step(one, optimizer, 2)
    _assert_same(_full(one), model)
    _assert_same(_optimizer_full(one, optimizer), optim)
    # A rank's file lost: refused, naming what the folder lacks, before a read.
    (tmp_path / "checkpoint" / info["folder"] / "shard-00002-model-00001-of-00001.safetensors").unlink()
    with pytest.raises(ValueError, match=r"does not hold model/\S+ \(pieces cover \d+ of \d+ elements\).* a rank's "
                                         r"file is missing"):
        TrainerCheckpoints(tmp_path, 0, 1).load(one, optimizer)


def test_a_save_that_never_committed_leaves_the_last_checkpoint_whole(tmp_path):
    """A crash after some ranks wrote their shards and before the commit record was
    replaced: the record still names the previous folder, whose files are whole;
    the next save clears the partial folder (another world size's shards never mix
    in). An earlier llamarl's trainer.pt, or another model's folder, is refused."""
    config = _config()
    model = empty_model(config, dtype=torch.float32, device="cpu")
    init_random(model, 2)
    optimizer = _optimizer(model)
    saved = TrainerCheckpoints(tmp_path, 0, 1)
    saved.save(model, optimizer, step=1, data_position=4)
    expect = _full(model)
    partial = tmp_path / "checkpoint" / "000002-step-00000002.partial"
    partial.mkdir()
    (partial / "shard-00007-model-00001-of-00001.safetensors").write_bytes(b"junk")
    assert checkpoint_info(tmp_path)["step"] == 1
    again = empty_model(config, dtype=torch.float32, device="cpu")
    TrainerCheckpoints(tmp_path, 0, 1).load(again, _optimizer(again))
    _assert_same(_full(again), expect)
    _step(model, optimizer, 0)
    saved.save(model, optimizer, step=2, data_position=8)
    folder = tmp_path / "checkpoint" / checkpoint_info(tmp_path)["folder"]
    assert sorted(p.name for p in (tmp_path / "checkpoint").iterdir()) == [folder.name, "trainer.json"]
    assert [p.name for p in folder.iterdir()] == ["shard-00001-model-00001-of-00001.safetensors"]
    other = empty_model(_config(num_hidden_layers=3), dtype=torch.float32, device="cpu")
    with pytest.raises(ValueError, match=r"does not hold model/model.layers.2.\S+ \(absent\)"):
        TrainerCheckpoints(tmp_path, 0, 1).load(other, _optimizer(other))
    old = tmp_path / "old"
    (old / "checkpoint").mkdir(parents=True)
    torch.save({"step": 3}, old / "checkpoint" / "trainer.pt")
    with pytest.raises(ValueError, match="an earlier llamarl's checkpoint"):
        checkpoint_info(old)


def test_the_kl_reference_is_a_sharded_copy_in_the_compute_dtype_saved_once(tmp_path):
    config = _config()
    policy = empty_model(config, dtype=torch.float32, device="cpu")
    init_random(policy, 4)
    reference = empty_model(config, dtype=torch.bfloat16, device="cpu")
    copy_shards(reference, policy)
    saved = TrainerCheckpoints(tmp_path, 0, 1)
    assert not saved.has_reference()
    saved.save_reference(reference)
    back = empty_model(config, dtype=torch.bfloat16, device="cpu")
    TrainerCheckpoints(tmp_path, 0, 1).load_reference(back)
    want = {k: v.to(torch.bfloat16) for k, v in _full(policy).items()}
    _assert_same(_full(back), want)
    with pytest.raises(ValueError, match="the models' parameters differ"):
        copy_shards(empty_model(_config(num_hidden_layers=1), dtype=torch.float32, device="cpu"), policy)


# ----------------------------------------------------------------------------- export


def _exported_in_parts(tmp_path, monkeypatch, config, tokenizer, reference, want):
    """The run's export in groups of a few KiB, checked to hold `want` (what
    save_pretrained wrote to `reference`) in several files and their index, with
    the reference's config and generation config; returns its folder."""
    monkeypatch.setattr(checkpoints, "_GROUP_BYTES", 16 << 10)
    parts = export_policy(tmp_path / "run", config, tokenizer, tmp_path / "parts")
    index = json.loads((parts / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and index["weight_map"].keys() == want.keys()
    _assert_same({k: v for f in files for k, v in load_file(parts / f).items()}, want)
    for name in ("config.json", "generation_config.json"):
        assert json.loads((parts / name).read_text()) == json.loads((reference / name).read_text()), name
    return parts


@pytest.mark.parametrize("tie", [False, True])
def test_export_streams_the_same_folder_transformers_writes(tmp_path, monkeypatch, tie):
    """The policy exported a group of tensors at a time (groups of a few KiB here,
    so several files and their index) holds what save_pretrained writes of the same
    weights: the same names (a tied lm_head left out), tensors, config and
    generation config; transformers loads it back exactly."""
    config = _config(tie)
    model = empty_model(config, dtype=torch.float32, device="cpu")
    init_random(model, 5)
    TrainerCheckpoints(tmp_path / "run", 0, 1).save(model, _optimizer(model), step=1, data_position=0)
    tokenizer = reverse_task().tokenizer()
    plain = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(_full(model))
    reference = save_model_folder(plain, tokenizer.to_transformers(), tmp_path / "reference")
    whole = export_policy(tmp_path / "run", config, tokenizer, tmp_path / "whole")
    want = load_file(reference / "model.safetensors")
    assert sorted(p.name for p in whole.iterdir()) == sorted(p.name for p in reference.iterdir())
    _assert_same(load_file(whole / "model.safetensors"), want)
    for name in ("config.json", "generation_config.json"):
        assert json.loads((whole / name).read_text()) == json.loads((reference / name).read_text()), name
    parts = _exported_in_parts(tmp_path, monkeypatch, config, tokenizer, reference, want)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(parts)
    _assert_same(_full(loaded), _full(plain))


def _trained_buffers(model) -> None:
    """Random values in every router bias buffer (GLM4-MoE's e_score_correction_bias),
    which a checkpoint holds and no initialisation reproduces."""
    for module in model.modules():
        bias = getattr(module, "e_score_correction_bias", None)
        if bias is not None:
            bias.copy_(torch.randn_like(bias))


def _moe_config(family: str):
    if family == "glm4_moe":  # its router's trained bias is a persistent buffer
        return transformers.Glm4MoeConfig(vocab_size=96, hidden_size=32, intermediate_size=64,
                                          moe_intermediate_size=16, num_hidden_layers=2, num_attention_heads=2,
                                          num_key_value_heads=1, head_dim=16, n_routed_experts=4,
                                          num_experts_per_tok=2, first_k_dense_replace=0, n_group=1, topk_group=1)
    if family == "qwen3_moe":
        return transformers.Qwen3MoeConfig(vocab_size=96, hidden_size=32, intermediate_size=64,
                                           moe_intermediate_size=16, num_hidden_layers=2, num_attention_heads=2,
                                           num_key_value_heads=1, head_dim=16, num_experts=4, num_experts_per_tok=2)
    return transformers.MixtralConfig(vocab_size=96, hidden_size=32, intermediate_size=16, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1, head_dim=16, num_local_experts=4,
                                      num_experts_per_tok=2)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "glm4_moe"])
def test_a_family_transformers_converts_is_streamed_under_its_checkpoint_names(tmp_path, monkeypatch, family):
    """Qwen3-MoE, Mixtral and GLM4-MoE: transformers fuses their experts on load (and
    Mixtral's `block_sparse_moe` is `mlp`), and splits and renames them on save.
    The export, a group of a few KiB at a time (several files and their index),
    holds exactly what save_pretrained writes of the same weights (GLM4-MoE's
    router bias, a persistent buffer, too), and loads back."""
    config = _moe_config(family)
    model = empty_model(config, dtype=torch.float32, device="cpu")
    init_random(model, 6)
    with torch.no_grad():
        _trained_buffers(model)
    TrainerCheckpoints(tmp_path / "run", 0, 1).save(model, _optimizer(model), step=1, data_position=0)
    tokenizer = reverse_task().tokenizer()
    plain = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(_full(model))
    reference = save_model_folder(plain, tokenizer.to_transformers(), tmp_path / "reference")
    want = {k: v for f in reference.glob("*.safetensors") for k, v in load_file(f).items()}
    assert any(".experts.0." in k for k in want)  # written one expert at a time
    out = _exported_in_parts(tmp_path, monkeypatch, config, tokenizer, reference, want)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out)
    _assert_same(_full(loaded), _full(model))


def _fill_policy_job(rank, world, mesh, config, folder):
    from types import SimpleNamespace

    from llamarl_core.models.checkpoint import ModelSource
    from llamarl_core.pipeline.executors.trainer import fill_policy

    model = empty_model(config, dtype=torch.float32, device="cpu", mesh=mesh)
    fill_policy(model, SimpleNamespace(model=ModelSource(folder)), 0, rank)
    return _full(model)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "glm4_moe"])
def test_a_checkpoint_transformers_converts_is_read_rank_by_rank(tmp_path, capfd, family):
    """Qwen3-MoE, Mixtral and GLM4-MoE (experts stored one by one, fused by
    transformers on load; Mixtral's modules renamed; GLM4-MoE's router bias a
    persistent buffer; a bf16 checkpoint): at 1 and 2 trainer ranks each rank
    reads the parts of the per-expert tensors inside its own rows, and the float32
    ranks hold transformers' model exactly, buffers included; nothing is loaded whole."""
    config = _moe_config(family)
    torch.manual_seed(9)
    saved = transformers.AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    with torch.no_grad():
        _trained_buffers(saved)
    saved.save_pretrained(tmp_path / "moe")
    assert any(".experts.0." in k for k in load_file(tmp_path / "moe" / "model.safetensors"))  # stored one by one
    want = _full(transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "moe", dtype=torch.float32))
    for world in (1, 2):
        for r in _ranks(world, _fill_policy_job, config=transformers.AutoConfig.from_pretrained(tmp_path / "moe"),
                        folder=tmp_path / "moe"):
            _assert_same(r, want)
    assert "loads it whole" not in capfd.readouterr().out


def test_a_checkpoint_under_other_names_is_loaded_by_rank_0_and_broadcast(tmp_path, capfd):
    """The base model alone (LlamaModel: no `model.` prefix, tied embeddings, bf16),
    which transformers maps onto the causal LM: the trainer's float32 ranks get
    transformers' model exactly, rank 0 alone having loaded it (in bf16), and say so."""
    torch.manual_seed(9)
    transformers.AutoModel.from_config(_config(True)).to(torch.bfloat16).save_pretrained(tmp_path / "base")
    assert not any(k.startswith("model.") for k in load_file(tmp_path / "base" / "model.safetensors"))
    want = _full(transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32))
    for world in (1, 2):
        for r in _ranks(world, _fill_policy_job, config=transformers.AutoConfig.from_pretrained(tmp_path / "base"),
                        folder=tmp_path / "base"):
            _assert_same(r, want)
    assert "trainer rank 0 loads it whole in bfloat16 with transformers and broadcasts it" in capfd.readouterr().out


def _unshared_job(rank, world, mesh, config, run_dir):
    """Rank 1 sees another folder: first at construction (refused on every rank),
    then (its folder redirected after a first good save) at a save's commit."""
    errors = []
    try:
        TrainerCheckpoints(run_dir / ("elsewhere" if rank else ""), rank, world)
    except ValueError as exc:
        errors.append(str(exc))
    model = empty_model(config, dtype=torch.float32, device="cpu", mesh=mesh)
    init_random(model, 3)
    optimizer = _optimizer(model)
    saved = TrainerCheckpoints(run_dir, rank, world)
    saved.save(model, optimizer, step=1, data_position=2)
    if rank == 1:
        saved.dir = run_dir / "elsewhere" / "checkpoint"
    _step(model, optimizer, 0)
    try:
        saved.save(model, optimizer, step=2, data_position=4)
    except RuntimeError as exc:
        errors.append(str(exc))
    return errors


def test_ranks_that_do_not_share_the_run_folder_are_refused_and_the_last_checkpoint_stays(tmp_path):
    (tmp_path / "elsewhere").mkdir()
    for rank, errors in enumerate(_ranks(2, _unshared_job, config=_config(), run_dir=tmp_path)):
        assert len(errors) == 2, errors
        if rank == 1:
            assert re.match(r"the run folder: trainer rank 1 does not see in .* what rank 0 wrote there", errors[0])
        else:
            assert errors[0] == "the run folder: another trainer rank failed (its error names why)"
        assert re.match(r"checkpoint 000002-step-00000002 not committed: ", errors[1]), errors[1]
        if rank == 0:
            assert re.search(r"\.partial does not hold .*: every trainer rank must write into one folder that rank 0 "
                             r"sees", errors[1]), errors[1]
    info = checkpoint_info(tmp_path)
    assert info["step"] == 1 and (tmp_path / "checkpoint" / info["folder"]).is_dir()
    assert not (tmp_path / "checkpoint" / "000002-step-00000002").exists()


def test_a_ranks_state_is_written_in_files_of_bounded_size(tmp_path, monkeypatch):
    """DCP's safetensors writer builds each file in memory: a rank's state goes into
    files of about _FILE_BYTES (4 KiB here), and reads back whole."""
    monkeypatch.setattr(checkpoints, "_FILE_BYTES", 4096)
    model = empty_model(_config(), dtype=torch.float32, device="cpu")
    init_random(model, 12)
    optimizer = _optimizer(model)
    _step(model, optimizer, 0)
    TrainerCheckpoints(tmp_path, 0, 1).save(model, optimizer, step=1, data_position=0)
    folder = tmp_path / "checkpoint" / checkpoint_info(tmp_path)["folder"]
    sizes = [p.stat().st_size for p in folder.glob("*.safetensors")]
    largest = max(t.nbytes for t in model.state_dict().values())
    assert len(sizes) > 10 and max(sizes) < 4096 + largest + 4096, sizes  # a file closes once past the bound
    again = empty_model(_config(), dtype=torch.float32, device="cpu")
    other = _optimizer(again)
    TrainerCheckpoints(tmp_path, 0, 1).load(again, other)
    _assert_same(_full(again), _full(model))
    _assert_same(_optimizer_full(again, other), _optimizer_full(model, optimizer))
