"""`GRPOTrainer`: trl's GRPOTrainer with its completions scored by llamarl's
fused log-prob op and, with a colocated vLLM engine, its weights synced by DDMA.
Changing `from trl import GRPOTrainer` to `from llamarl_core.integrations.trl
import GRPOTrainer` is the whole migration: the same arguments, the same loss for
every `loss_type` and option (TRL's own code computes it, from the per-token
log-probs and entropies the head returns), the same metrics under the same
names."""

from __future__ import annotations

import inspect
import warnings

import torch
import transformers
import trl
from accelerate import PartialState

from .generation import (DTENSORS, FSDP2, DdmaVLLMGeneration, checkpoint_dtype, colocate_refusal, dtensor_shards,
                         engine_device_type, several_hosts, sharding_of, sync_delta, sync_timeout_s)
from .head import add_fused_lm_head, unsupported_config

_SIGNATURE = inspect.signature(trl.GRPOTrainer.__init__)


class GRPOTrainer(trl.GRPOTrainer):
    """trl.GRPOTrainer (same arguments, same behaviour) with:
    - its policy model scoring its completions (the loss's log-probs and
      entropies, the old policy's) with llamarl's fused LM head (head.py) in
      place of TRL's; ValueError at construction naming what that head does not
      reproduce (a logit soft-cap or scale, an lm-head bias, DeepSpeed ZeRO-3):
      before TRL builds anything where the model's config tells (the bias once
      the model is built).
      The reference model keeps TRL's head: its log-probs are values, never
      differentiated;
    - with `use_vllm=True, vllm_mode="colocate"`, the colocated engine built
      with the llamarl_ddma backend and synced by DDMA (generation.py): several
      DDP processes each sync their own engine, FSDP2 ranks send their shards
      into every rank's engine; a set-up DDMA does not serve (FSDP1 on several
      processes, FSDP2 over several hosts or with CPU offload, a PEFT
      model with FSDP2, engine tensor parallelism, sleep mode, a quantized model
      (`quantization_config`, or in `args.model_init_kwargs`), a model of experts
      on a GPU, a model vLLM holds in a dtype the sync cannot write the
      trainer's into, a PEFT method other than plain LoRA) keeps TRL's own engine
      and sync, with a warning naming why, on a GPU; on the CPU, where TRL's sync
      fails on vLLM's re-packed layers, ValueError naming it;
    - with `use_vllm=True, vllm_mode="server"`, a server running the
      llamarl_ddma backend synced by DDMA (server.py), another server by TRL.
    """

    def __init__(self, *args, **kwargs):
        try:
            bound = _SIGNATURE.bind(self, *args, **kwargs)
        except TypeError as exc:  # as Python words it for trl.GRPOTrainer
            raise TypeError(f"GRPOTrainer.__init__() {exc}") from None
        config = bound.arguments.get("args")
        init_kwargs = (getattr(config, "model_init_kwargs", None) or {}) if config is not None else {}
        # Before TRL builds anything (its engine, a reference model): what the head refuses, as far as
        # the model's config tells (a model given by name: its config.json; the rest once it is built).
        # As TRL reads it: its model_init_kwargs' trust_remote_code, else the config's.
        trust = init_kwargs.get("trust_remote_code", getattr(config, "trust_remote_code", False))
        model_config = _model_config(bound.arguments["model"], init_kwargs, trust)
        reason = unsupported_config(model_config)
        if reason is not None:
            raise ValueError(f"llamarl's fused LM head cannot score this model: {reason}")
        ours = config is not None and config.use_vllm and config.vllm_mode in ("colocate", "server")
        if ours:  # the sync's variables, refused before TRL builds anything
            sync_timeout_s()
            if config.vllm_mode == "server":
                sync_delta()
        if ours and config.vllm_mode == "colocate":
            state, sharding, model = PartialState(), sharding_of(config), bound.arguments["model"]
            if sharding is None and isinstance(model, torch.nn.Module) and dtensor_shards(model):
                sharding = DTENSORS  # sharded by the caller
            # where the ranks run matters to shards only (a collective: every rank constructs the trainer)
            apart = sharding in (FSDP2, DTENSORS) and several_hosts(state.num_processes, state.device)
            engine_config = model_config
            if isinstance(model, torch.nn.Module) and getattr(model, "name_or_path", ""):
                # The engine reads the checkpoint's config.json: a loaded model's own config holds the
                # dtype it was loaded in, not the checkpoint's.
                engine_config = _model_config(model.name_or_path, init_kwargs, trust) or model_config
            engine_device = engine_device_type() or state.device.type

            def refusal(probe):
                return colocate_refusal(probe, state.num_processes, config.vllm_tensor_parallel_size,
                                        config.vllm_enable_sleep_mode, bound.arguments.get("quantization_config")
                                        or init_kwargs.get("quantization_config"), bound.arguments.get("peft_config"),
                                        sharding=sharding, hosts_apart=apart, model_config=engine_config,
                                        device_type=engine_device,
                                        trainer_dtype=_trainer_dtype(model, init_kwargs, model_config))

            reason = refusal(model)
            if reason is None and bound.arguments.get("peft_config") is not None and isinstance(model, str):
                # A model given by name: its modules on the meta device, for the embeddings an adapter may reach.
                reason = refusal(_skeleton(model_config, trust) or model)
            if reason is not None and engine_device == "cpu":
                raise ValueError(f"llamarl's colocated vLLM sync does not serve {reason}, and TRL's own fails on "
                                 "vLLM's CPU engine (its load_weights on the layers the CPU backend re-packs)")
            if reason is not None:
                warnings.warn(f"llamarl: the colocated vLLM engine is TRL's own, synced by TRL: DDMA does not serve "
                              f"{reason}", stacklevel=2)
                ours = False
        if ours:  # TRL's own engine is never built: this class builds its own after TRL's set-up
            config.use_vllm = False
        given = bound.arguments["model"]
        given = given.get_base_model() if hasattr(given, "get_base_model") else given
        before = given.__dict__.get("forward") if isinstance(given, torch.nn.Module) else None
        try:
            super().__init__(*bound.args[1:], **bound.kwargs)
        finally:
            if ours:
                config.use_vllm = True  # the same object: what TRL's set-up changed on it is kept
        policy = self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model
        # llamarl's head in place of TRL's, over the forward the model had before TRL's (a
        # user's override on the instance kept)
        if policy is given and before is not None:
            policy.forward = before
        else:
            policy.__dict__.pop("forward", None)
        add_fused_lm_head(policy, temperature=self.temperature, cast_lm_head_to_fp32=self.args.cast_lm_head_to_fp32,
                          outputs=("log_probs", "entropy"))
        if ours:
            self._vllm(config)

    def _vllm(self, args: trl.GRPOConfig) -> None:
        """What TRL's constructor does for its vLLM engine, with DdmaVLLMGeneration
        as the engine: TRL's own checks of the vespo loss's correction mode and of
        a server's log-prob mode."""
        self.use_vllm, self.vllm_mode = True, args.vllm_mode
        if (self.loss_type == "vespo" and self.vllm_importance_sampling_correction
                and self.vllm_importance_sampling_mode not in ("token_truncate", "token_mask")):
            raise ValueError("VESPO loss requires `vllm_importance_sampling_mode` to be either 'token_truncate' or "
                             f"'token_mask'. Got: {self.vllm_importance_sampling_mode}.")
        self.vllm_generation = DdmaVLLMGeneration(
            model=self.model, accelerator=self.accelerator, processing_class=self.processing_class,
            mode=args.vllm_mode, structured_outputs_regex=args.vllm_structured_outputs_regex,
            server_base_url=args.vllm_server_base_url, server_host=args.vllm_server_host,
            server_port=args.vllm_server_port, group_port=args.vllm_group_port, server_timeout=args.vllm_server_timeout,
            tensor_parallel_size=args.vllm_tensor_parallel_size,
            gpu_memory_utilization=args.vllm_gpu_memory_utilization, max_model_length=args.vllm_max_model_length,
            max_num_seqs=args.per_device_train_batch_size * args.vllm_tensor_parallel_size * args.steps_per_generation,
            enable_sleep_mode=args.vllm_enable_sleep_mode, model_impl=args.vllm_model_impl,
            trust_remote_code=args.trust_remote_code, repetition_penalty=self.repetition_penalty,
            temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
            max_completion_length=self.max_completion_length, logprobs=0, generation_kwargs=args.generation_kwargs)
        self._last_loaded_step = -1
        if args.vllm_mode == "server" and self.vllm_importance_sampling_correction and self.accelerator.is_main_process:
            logprobs_mode = self.vllm_generation.vllm_client.get_server_info()["model_config"]["logprobs_mode"]
            if logprobs_mode != "processed_logprobs":
                warnings.warn(f"the vLLM server runs with --logprobs-mode {logprobs_mode}, which biases the importance "
                              "sampling correction: restart it with --logprobs-mode processed_logprobs, or set "
                              "vllm_importance_sampling_correction=False", stacklevel=3)


GRPOTrainer.__init__.__signature__ = _SIGNATURE


def _model_config(model, init_kwargs: dict, trust_remote_code: bool):
    """The transformers config of the trainer's `model` argument: the model's own,
    or a folder's or hub id's config.json (read as TRL reads it: with
    trust_remote_code and its model_init_kwargs' revision, token, cache and
    subfolder); None where it cannot be read here (the checks of the built model
    and of the first sync still refuse)."""
    if isinstance(model, torch.nn.Module):
        config = getattr(model, "config", None)
    else:
        given = {k: init_kwargs[k] for k in ("revision", "token", "cache_dir", "subfolder") if k in init_kwargs}
        try:
            config = transformers.AutoConfig.from_pretrained(
                model, trust_remote_code=trust_remote_code, **given)
        except Exception:  # noqa: BLE001 - unreadable here (offline, remote code): checked once built
            config = None
    return config if hasattr(config, "get_text_config") else None


def _skeleton(model_config, trust_remote_code: bool):
    """The causal LM of `model_config` built on the meta device (no memory), or
    None where transformers cannot build it here (remote code not trusted, a
    config without a causal LM class)."""
    if model_config is None:
        return None
    try:
        with torch.device("meta"):
            return transformers.AutoModelForCausalLM.from_config(model_config,
                                                                  trust_remote_code=bool(trust_remote_code))
    except Exception:  # noqa: BLE001 - the check of the built model still refuses
        return None


def _trainer_dtype(model, init_kwargs: dict, model_config) -> str | None:
    """The dtype of the trainer's parameters as TRL will load them ("float32": its
    default, "auto" or None: the checkpoint's), None where not known."""
    if isinstance(model, torch.nn.Module):
        dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), None)
    else:
        dtype = init_kwargs.get("dtype", "float32")
        if dtype in ("auto", None):  # None: transformers reads it as "auto"
            return checkpoint_dtype(model_config) if model_config is not None else None
    return None if dtype is None else str(dtype).removeprefix("torch.")
