"""TrainConfig in sections (llamarl_core/pipeline/config.py): built from sections,
from the flat names the CLI spells, or both; saved as sections; a config.json of
before the sections loads as it ran."""

import dataclasses
import json
import random
import warnings

import pytest

from llamarl_core.pipeline.config import (
    FLAT,
    SECTIONS,
    GeneratorConfig,
    LossConfig,
    RunConfig,
    SyncConfig,
    TrainConfig,
    TrainerConfig,
)

# A value of each field's type that passes the checks alone, beside its default.
OTHER = {"mode": "sync", "steps": 7, "seed": 3, "eval_every": 2, "reward_batch": 5, "log_rollouts": True,
         "prompts_per_step": 4, "samples_per_prompt": 3, "checkpoint_every": 9, "timeout_s": 30.0,
         "num_layers": 3, "generator_tp": 2, "temperature": 0.7, "segment_tokens": 8, "max_new_tokens": 12,
         "trainer_world": 2, "lr": 5e-4, "lr_schedule": "constant", "min_lr_ratio": 0.5, "max_grad_norm": 1.0,
         "micro_batch_size": 4, "warmup_steps": 0, "advantage": "rloo", "rho": 2.0, "kl_coef": 0.1,
         "entropy_coef": 0.01, "loss_normalizer": "dr_grpo", "mask_truncated": True, "sync_timeout_s": 5.0}


def test_every_flat_name_has_one_home_and_every_field_a_flat_name():
    homes = list(FLAT.values())
    assert len(set(homes)) == len(homes) == sum(len(dataclasses.fields(cls)) for cls in SECTIONS.values())
    assert {(s, f.name) for s, cls in SECTIONS.items() for f in dataclasses.fields(cls)} == set(homes)
    assert FLAT["generator_tp"] == ("generator", "tp") and FLAT["trainer_world"] == ("trainer", "world")
    assert FLAT["loss"] == ("loss", "objective") and FLAT["sync_timeout_s"] == ("sync", "timeout_s")
    assert FLAT["timeout_s"] == ("run", "timeout_s")


def test_random_mixes_of_sections_and_flat_names_build_the_same_config(tmp_path):
    """500 random subsets of fields given other values, each built three ways (flat
    names; sections; sections with the flat names of half of them over): the same
    config, each value in its section, the sections given never changed, and a
    round trip through config.json (sections) and through the flat names equal."""
    rng = random.Random(0)
    names = sorted(OTHER)
    for _ in range(500):
        chosen = {name: OTHER[name] for name in rng.sample(names, rng.randint(0, len(names)))}
        flat = TrainConfig(**chosen)
        per_section = {name: {} for name in SECTIONS}
        for name, value in chosen.items():
            section, field = FLAT[name]
            per_section[section][field] = value
        given = {name: SECTIONS[name](**fields) for name, fields in per_section.items()}
        before = {name: dataclasses.replace(section) for name, section in given.items()}
        assert TrainConfig(**given) == flat, chosen
        assert given == before  # copied, not changed (a sync run sets its copy's max_staleness to 0)
        half = dict(rng.sample(sorted(chosen.items()), len(chosen) // 2))
        assert TrainConfig(**{n: SECTIONS[n]() for n in SECTIONS}, **chosen) == flat
        assert TrainConfig(**given, **half) == flat
        for name, value in chosen.items():
            section, field = FLAT[name]
            if name != "max_staleness":
                assert getattr(getattr(flat, section), field) == value, name
        flat.save(tmp_path / "config.json")
        saved = json.loads((tmp_path / "config.json").read_text())
        assert set(saved) == set(SECTIONS) and TrainConfig.load(tmp_path / "config.json") == flat
        assert TrainConfig.from_dict(flat.flat()) == flat and flat.replace() == flat


def test_the_shorthand_of_generator_and_loss_and_what_is_refused():
    assert TrainConfig(generator="vllm", hidden_size=128, intermediate_size=256).generator.backend == "vllm"
    assert TrainConfig(generator=GeneratorConfig(tp=2)).generator.tp == 2
    assert TrainConfig(loss="ppo").loss.objective == "ppo"
    assert TrainConfig(loss=LossConfig(objective="gspo"), eps_low=0.1).loss == LossConfig(objective="gspo",
                                                                                           eps_low=0.1)
    assert TrainConfig(run=RunConfig(steps=3), trainer=TrainerConfig(lr=0.5), sync=SyncConfig(timeout_s=2.0)).flat()[
        "sync_timeout_s"] == 2.0
    with pytest.raises(TypeError, match=r"unknown fields \['learning_rate'\]"):
        TrainConfig(learning_rate=1e-4)
    with pytest.raises(TypeError, match="run= takes a RunConfig"):
        TrainConfig(run={"steps": 3})
    with pytest.raises(ValueError, match=r"unknown config fields \['trainer.learning_rate'\]"):
        TrainConfig.from_dict({"trainer": {"learning_rate": 1.0}})
    with pytest.raises(ValueError, match="TrainConfig lr must be float, got '1e-5'"):
        TrainConfig(trainer=TrainerConfig(lr="1e-5"))  # a section's values are checked as the flat names are
    with pytest.raises(ValueError, match="generator_tp.* must be >= 1"):
        TrainConfig(generator=GeneratorConfig(tp=0))


def test_a_config_json_of_before_the_sections_loads_as_it_ran(tmp_path):
    """A flat config.json (every run saved before the sections) loads into the
    same sections as the flat names build, its legacy fields read as before."""
    old = {**TrainConfig().flat(), "steps": 40, "generator_tp": 2, "loss": "ppo", "lr": 2e-4, "mode": "sync"}
    (tmp_path / "config.json").write_text(json.dumps(old))
    loaded = TrainConfig.load(tmp_path / "config.json")
    assert loaded == TrainConfig(steps=40, generator_tp=2, loss="ppo", lr=2e-4, mode="sync")
    assert (loaded.run.steps, loaded.generator.tp, loaded.loss.objective, loaded.trainer.lr) == (40, 2, "ppo", 2e-4)


def test_a_flat_name_still_reads_and_sets_for_one_release_with_a_warning():
    config = TrainConfig(lr=2e-4, generator_tp=2)
    with pytest.warns(DeprecationWarning, match=r"TrainConfig.generator_tp is TrainConfig.generator.tp"):
        assert config.generator_tp == 2
    with pytest.warns(DeprecationWarning, match=r"TrainConfig.torch_dtype is TrainConfig.run.torch_dtype"):
        assert config.torch_dtype == config.run.torch_dtype
    with pytest.warns(DeprecationWarning, match=r"TrainConfig.steps is TrainConfig.run.steps now; the old name sets"):
        config.steps = 10
    assert config.run.steps == 10 and config.to_dict()["run"]["steps"] == 10  # set where it is saved
    with pytest.warns(DeprecationWarning, match=r"TrainConfig.loss is TrainConfig.loss.objective"):
        config.loss = "ppo"  # the shorthand's string sets the objective; the section stays
    assert config.loss.objective == "ppo"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert config.trainer.lr == 2e-4
        config.trainer.lr = 1e-4
    with pytest.raises(AttributeError, match="no attribute 'learning_rate'"):
        config.learning_rate
    with pytest.raises(AttributeError, match="TrainConfig has no field 'learning_rate'"):
        config.learning_rate = 1.0


def test_a_changed_copy_keeps_what_it_does_not_change():
    """replace() takes what the constructor takes, over the config's own values: a
    flat name, the shorthand objective (the loss section's other fields kept), a
    whole section; dataclasses.replace, which would rebuild a section from its
    defaults, is refused; so is a sectioned dict whose section a string shadows."""
    config = TrainConfig(loss="gspo", kl_coef=0.1, entropy_coef=0.01, generator_tp=2, temperature=0.7, steps=5)
    ppo = config.replace(loss="ppo")
    assert (ppo.loss.objective, ppo.loss.kl_coef, ppo.loss.entropy_coef) == ("ppo", 0.1, 0.01)
    assert ppo.generator == config.generator and ppo.run == config.run and config.loss.objective == "gspo"
    vllm = config.replace(generator="vllm", hidden_size=128, intermediate_size=256)
    assert (vllm.generator.backend, vllm.generator.tp, vllm.generator.temperature) == ("vllm", 2, 0.7)
    assert config.replace(loss=LossConfig(objective="cispo")).loss == LossConfig(objective="cispo")
    assert config.replace(run=RunConfig(steps=9), lr=0.5).run.steps == 9
    with pytest.raises(ValueError, match="lr_warmup_steps=10 is more than the run's steps=5"):
        config.replace(lr_warmup_steps=10)  # checked again
    with pytest.raises(TypeError, match="should be called on dataclass instances"):
        dataclasses.replace(config, loss="ppo")
    with pytest.raises(TypeError, match=r"generator= takes a GeneratorConfig \(or the backend as shorthand\), got dict"):
        TrainConfig(generator={"tp": 2})
    with pytest.raises(ValueError, match=r"config fields \['loss'\]: beside sections each is its section"):
        TrainConfig.from_dict({**config.to_dict(), "loss": "ppo"})
