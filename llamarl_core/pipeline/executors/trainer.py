"""The trainer executor: one process per data-parallel rank (FSDP2 over them), taking
a step per batch the controller hands it and sending each new version of the
weights straight into generator replica 0 (WeightSender)."""

from __future__ import annotations

import time
from pathlib import Path

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

from ...control.hosts import host_identity
from ...models.sharded import NotByName, copy_shards, empty_model, init_random, load_shards
from ...sync import SyncError, module_sender
from ..checkpoints import TrainerCheckpoints
from ..config import TrainConfig
from ..data import RunData
from ..learner import (
    StepContext,
    check_packed_rows_attend_within_samples,
    learning_rate,
    run_with_hook,
    supervised_warmup,
    train_step,
    trainer_plugins,
)
from ..messages import Checkpoint, Checkpointed, Reconnect, Sync, Synced, SyncFailed, Train, Trained
from .link import TRAINER, Link, dispatch, sync_name_of
from .resources import every_core, process_group


def trainer_model(data: RunData, config: TrainConfig, mesh, dtype: torch.dtype = torch.float32):
    """The trainer's model, built on the meta device and sharded over `mesh` (FSDP2;
    None: one rank), its parameters not filled (models/sharded.py), checked first
    for keeping packed samples apart."""
    import transformers

    with torch.device("meta"):
        meta = transformers.AutoModelForCausalLM.from_config(data.model_config)
    check_packed_rows_attend_within_samples(meta)  # before any step trains on packed rows
    return empty_model(data.model_config, dtype=dtype, device=config.run.device, mesh=mesh)


def fill_policy(model, data: RunData, seed: int, rank: int) -> None:
    """The weights RL (or the warm-up) starts from: the pretrained checkpoint
    (--model), each rank reading its own rows (of a family transformers converts
    on load too: load_shards), or the built-in Llama initialised from `seed`. A
    checkpoint that is not float safetensors under the model's or its family's
    checkpoint names (GGUF, a quantized checkpoint, other names) is loaded whole
    by transformers on trainer rank 0 alone (in its 16-bit dtype if it has one)
    and broadcast shard by shard (said once); one of other shapes or dtypes is
    refused (load_shards), before anything is read."""
    if data.model is None:
        init_random(model, seed)
        return
    if data.model.gguf_file:
        why = "a GGUF file"
    elif getattr(model.config, "quantization_config", None) is not None:
        why = "a quantized checkpoint"
    else:
        try:
            load_shards(model, data.model.folder)
            return
        except NotByName as exc:
            why = str(exc)
    # In the checkpoint's own 16-bit dtype when it has one (half the host memory; the
    # broadcast casts each shard to float32 exactly), else float32 (GGUF is dequantized).
    saved = getattr(data.model.config(), "dtype", None)  # the checkpoint's (the model's config says float32)
    dtype = saved if saved in (torch.bfloat16, torch.float16) and not data.model.gguf_file else torch.float32
    if rank == 0:
        print(f"llamarl: {data.model}: {why}; trainer rank 0 loads it whole in {str(dtype).removeprefix('torch.')} "
              "with transformers and broadcasts it", flush=True)
    full = data.model.load_model(dtype).state_dict() if rank == 0 else {}
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))



class TrainerRank:
    """Trainer rank `rank`: its model (resumed from the run's checkpoint, or filled
    and warmed up), optimizer, KL reference and sender to generator incarnation
    `incarnation`, set up in the constructor; then the controller's commands."""

    def __init__(self, link: Link, config: TrainConfig, store, rank: int, incarnation: int, out_dir: str):
        data = RunData(config)
        world, device = config.trainer.world, config.run.device
        self.objective, self.advantage, self.step_hook = trainer_plugins(config)
        if not Path(out_dir).is_dir():  # the controller made it: a host of its own sees no such folder
            raise ValueError(f"the run folder {out_dir} is not on trainer rank {rank}'s host ({host_identity()}), and "
                             "every trainer rank writes its checkpoint shards there: under torchrun, give --out a "
                             "folder on a filesystem the controller's and every trainer rank's hosts share")
        self.link, self.config, self.data, self.store, self.rank, self.world = link, config, data, store, rank, world
        process_group(store, TRAINER, rank, world, config, link.secret)
        mesh = None
        if world > 1:
            from torch.distributed.device_mesh import init_device_mesh

            mesh = init_device_mesh(device, (world,))
        model = self.model = trainer_model(data, config, mesh)
        # fused: one kernel over all parameters (0.6 vs 1.2 ms a step for the default model).
        optimizer = self.optimizer = torch.optim.AdamW(model.parameters(), lr=config.trainer.lr, weight_decay=0.0,
                                                       fused=True)
        checkpoints = self.checkpoints = TrainerCheckpoints(out_dir, rank, world)
        self.step, self.data_position, self.reference = 0, 0, None
        if checkpoints.latest() is not None:
            saved = checkpoints.load(model, optimizer)
            self.step, self.data_position = saved["step"], saved["data_position"]
        else:
            fill_policy(model, data, config.run.seed, rank)
        if config.loss.kl_coef:
            reference = self.reference = trainer_model(data, config, mesh, dtype=config.run.torch_dtype)
            if checkpoints.has_reference():
                checkpoints.load_reference(reference)
            elif self.step > 0:
                raise ValueError(f"{out_dir} holds a checkpoint at step {self.step} but no KL reference "
                                 "(checkpoint/reference): the weights RL started from are lost; start the run anew")
            reference.eval().requires_grad_(False)
        if self.step == 0 and data.supervised_warmup:
            start = time.monotonic()
            with every_core(world):
                loss = supervised_warmup(model, optimizer, data.task, config.trainer.warmup_steps,
                                         config.trainer.warmup_batch, rank,
                                         world)
            link.span("supervised warm-up", start, time.monotonic(), steps=config.trainer.warmup_steps, loss=loss)
        if config.loss.kl_coef and not checkpoints.has_reference():  # the weights RL starts from
            copy_shards(self.reference, model)
            if config.run.checkpoint_every:  # saved once, for a resumed run
                checkpoints.save_reference(self.reference)
        self.autocast = config.run.torch_dtype if config.run.torch_dtype != torch.float32 else None
        self.generator = incarnation  # the generator incarnation the sender serves
        self.sender = self._connect()
        self.handlers = {Sync: self.sync, Train: self.train, Checkpoint: self.checkpoint, Reconnect: self.reconnect}

    def _connect(self):
        """This rank's sender to generator incarnation `self.generator` (its own Store namespace);
        set-up waits as long as a generator may take to start, each send sync_timeout_s; deltas to
        generator ranks on other hosts with sync_delta."""
        return module_sender(self.store, self.model, self.rank, self.world, name=sync_name_of(self.generator),
                             timeout=self.config.run.timeout_s, num_threads=1, secret=self.link.secret,
                             delta=self.config.sync.delta)

    def run(self) -> None:
        transports = {f"trainer {src} -> generator {dst}": t for (src, dst), t in self.sender.transports.items()
                      if src == self.rank}
        self.link.ready(step=self.step, data_position=self.data_position, transports=transports)
        for command in self.link.commands():
            dispatch(self.handlers, command, TRAINER)

    def sync(self, command: Sync) -> None:
        start = time.monotonic()
        try:
            self.sender.send(command.version, timeout=self.config.sync.timeout_s)
        except SyncError as exc:  # e.g. the generator died mid-sync: the controller decides
            self.link.send(SyncFailed(version=command.version, message=str(exc), generator=self.generator))
            return
        end = time.monotonic()
        sent = self.sender.last_send
        self.link.span("send weights", start, end, version=command.version, wire_bytes=sent.wire_bytes,
                       full_bytes=sent.full_bytes, full_receivers=sent.full_receivers,
                       delta_buckets=sent.delta_buckets)
        self.link.send(Synced(version=command.version, seconds=end - start, generator=self.generator))

    def train(self, command: Train) -> None:
        trainer, loss, data = self.config.trainer, self.config.loss, self.data
        model, optimizer = self.model, self.optimizer
        start = time.monotonic()
        lr = learning_rate(command.step, base_lr=trainer.lr, warmup_steps=trainer.lr_warmup_steps,
                           total_steps=self.config.run.steps, schedule=trainer.lr_schedule,
                           min_lr_ratio=trainer.min_lr_ratio)
        samples = command.samples
        normalizer = len(samples) * data.max_new_tokens if loss.normalizer == "dr_grpo" else None
        stats, hook_metrics = run_with_hook(
            self.step_hook, StepContext(command.step, model, optimizer, samples, self.rank, self.world, lr),
            lambda: train_step(model, optimizer, samples, pad_token_id=data.tokenizer.pad_token_id,
                               temperature=self.config.generator.temperature, lr=lr,
                               micro_batch_size=trainer.micro_batch_size or None,
                               max_grad_norm=trainer.max_grad_norm or None, mask_truncated=loss.mask_truncated,
                               kl_coef=loss.kl_coef, reference_model=self.reference, autocast_dtype=self.autocast,
                               loss=self.objective, advantage=self.advantage, normalizer=normalizer,
                               reduction=loss.reduction, entropy_coef=loss.entropy_coef,
                               nonfinite_logprobs=loss.nonfinite_logprobs, **loss.parameters))
        self.step = command.step + 1
        end = time.monotonic()
        self.link.span("train step", start, end, step=command.step, samples=len(samples))
        self.link.send(Trained(step=command.step, seconds=end - start, hook=hook_metrics, stats=stats))

    def checkpoint(self, command: Checkpoint) -> None:
        start = time.monotonic()
        self.checkpoints.save(self.model, self.optimizer, step=self.step, data_position=command.data_position)
        self.link.span("checkpoint", start, time.monotonic(), step=self.step)
        self.link.send(Checkpointed(step=self.step))

    def reconnect(self, command: Reconnect) -> None:
        self.sender.close()
        self.generator = command.incarnation
        self.sender = self._connect()


def run_trainer(link: Link, config: TrainConfig, store, rank: int, incarnation: int, out_dir: str) -> None:
    """Run trainer rank `rank` until the controller says stop."""
    TrainerRank(link, config, store, rank, incarnation, out_dir).run()
