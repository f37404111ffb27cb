"""TRL's colocated vLLM fed by DDMA: `DdmaVLLMGeneration`, the engine
`GRPOTrainer(use_vllm=True, vllm_mode="colocate")` generates with.

TRL builds its colocated engine (`trl.generation.vllm_generation.
VLLMGeneration`) in the trainer's process and syncs it by gathering every
parameter whole and calling the engine's `load_weights` once per tensor. Here the
engine is built by this subclass with the `llamarl_ddma` weight-transfer backend
and dummy weights, and `sync_weights` sends the trainer's parameters, in place
and in one transfer, straight into the engine's own (on a CPU engine into its
landing buffers, then re-packed: vLLM's CPU layers compute from packed copies,
which TRL's per-tensor `load_weights` fails on). The trainer's WeightSender and
the engine's receiver live in this one process: the set-up and each sync run
the sender in a thread of its own while the engine's calls run here.

What it does not serve (colocate_refusal: several processes, whose engines
would each need every rank's shards; an engine tensor-parallel group; vLLM's
sleep mode, which discards the weights a sync writes into; a PEFT model, whose
adapters would have to be merged first; a quantized model) GRPOTrainer leaves
to TRL's own engine and sync, with a warning naming the reason.
"""

from __future__ import annotations

import datetime
import os
import threading

import torch
import torch.distributed as dist
from trl.generation.vllm_generation import VLLMGeneration
from trl.trainer.utils import ensure_master_addr_port

from ...auth import new_secret
from ...sync import SyncError, module_layout, module_sender
from ..vllm import ddma_init_info

SYNC_NAME = "trl-colocate"
TIMEOUT_S = 300.0


def colocate_refusal(model, num_processes: int, tensor_parallel_size: int, enable_sleep_mode: bool,
                     peft_config=None, quantization_config=None) -> str | None:
    """Why DDMA cannot feed TRL's colocated engine for this set-up, or None. model:
    the trainer's `model` argument (a folder or hub id, or the model itself)."""
    if num_processes != 1:
        return (f"{num_processes} processes (each rank's colocated engine needs every rank's shards; llamarl's "
                "colocated sync runs on one process for now)")
    if tensor_parallel_size != 1:
        return f"vllm_tensor_parallel_size={tensor_parallel_size} (llamarl's colocated sync feeds one engine worker)"
    if enable_sleep_mode:
        return "vllm_enable_sleep_mode=True (sleep discards the engine's weights, which a sync writes in place)"
    if peft_config is not None or hasattr(model, "peft_config"):
        return "a PEFT model (its adapters are not merged into what the sync sends yet)"
    if quantization_config is not None or (isinstance(model, torch.nn.Module) and any(
            type(module).__module__.startswith("bitsandbytes") for module in model.modules())):
        return "a quantized model"
    return None


class DdmaVLLMGeneration(VLLMGeneration):
    """VLLMGeneration in colocate mode whose engine takes its weights by DDMA
    (module docstring). Same constructor arguments as TRL's."""

    def _init_vllm(self) -> None:
        from vllm import LLM
        from vllm.config import WeightTransferConfig

        if self.mode != "colocate":
            raise ValueError(f"DdmaVLLMGeneration feeds a colocated engine, got vllm_mode={self.mode!r}")
        reason = colocate_refusal(self.model, self.accelerator.num_processes, self.tensor_parallel_size,
                                  self.enable_sleep_mode)
        if reason is not None:  # GRPOTrainer checks it first, from its arguments
            raise ValueError(f"llamarl's colocated vLLM sync cannot serve this run: {reason}")
        # vLLM's external launcher reads the process's place in the job from the environment, as in TRL.
        os.environ["RANK"] = str(self.accelerator.process_index)
        os.environ["LOCAL_RANK"] = str(self.accelerator.local_process_index)
        os.environ["WORLD_SIZE"] = str(self.accelerator.num_processes)
        ensure_master_addr_port()
        self.llm = LLM(
            model=self.model.name_or_path, load_format="dummy", tensor_parallel_size=1,
            gpu_memory_utilization=self.gpu_memory_utilization, max_model_len=self.max_model_length,
            max_num_seqs=self.max_num_seqs, model_impl=self.model_impl, distributed_executor_backend="external_launcher",
            seed=self.accelerator.process_index, max_num_batched_tokens=4096, logprobs_mode="processed_logprobs",
            trust_remote_code=self.trust_remote_code,
            weight_transfer_config=WeightTransferConfig(backend="llamarl_ddma"))
        self._llm_weights_sleeping = False
        # The sync's own Store, served by this process, and its secret, handed to the engine in-process.
        self._store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                    timeout=datetime.timedelta(seconds=TIMEOUT_S))
        secret = new_secret()
        info = ddma_init_info("127.0.0.1", self._store.port, module_layout(self.model, 1), name=SYNC_NAME,
                              timeout_s=TIMEOUT_S, secret=secret)
        made = {}

        def register_sender():
            try:
                made["sender"] = module_sender(self._store, self.model, 0, 1, name=SYNC_NAME, timeout=TIMEOUT_S,
                                               secret=secret)
            except BaseException as exc:  # noqa: BLE001 - raised below, in the constructor's thread
                made["error"] = exc

        thread = threading.Thread(target=register_sender, name="llamarl-trl-sender-setup", daemon=True)
        thread.start()
        self.llm.init_weight_transfer_engine({"init_info": info})  # waits for the sender, as the sender for it
        thread.join(timeout=TIMEOUT_S)
        if "sender" not in made:
            raise SyncError(f"llamarl's colocated sync: the trainer's sender did not register: "
                            f"{made.get('error', 'timed out')}")
        self.sender = made["sender"]
        self.version = 0
        self.accelerator.wait_for_everyone()

    def sync_weights(self) -> None:
        """The trainer's current weights into the engine: one version, sent in
        place while the engine takes it, then the engine's prefix cache reset (its
        KV was computed under the last version)."""
        self.version += 1
        handle = self.sender.send(self.version, wait=False)
        try:
            self.llm.start_weight_update()
            self.llm.update_weights({"update_info": {"version": self.version}})
            self.llm.finish_weight_update(weight_version=str(self.version))
        except BaseException as exc:
            self.sender.abort(f"the colocated engine's update failed: {type(exc).__name__}: {exc}")  # stops the send
            handle.exception(timeout=TIMEOUT_S)
            raise
        handle.wait(timeout=TIMEOUT_S)  # the optimizer may step only once every byte is copied
        self.llm.reset_prefix_cache()
