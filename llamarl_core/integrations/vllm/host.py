"""A vLLM engine (`vllm.LLM`, dummy weights, the llamarl_ddma backend) in a
process of its own, driven over a pipe: what the tests and `llamarl bench sync
--into vllm` run against. Everything the engine prints, its logs included, goes
to stderr.

Its own process because vLLM's CPU worker pins the threads of the process it
runs in and replaces `torch.set_num_threads` there; the engine core runs inside
that process too (VLLM_ENABLE_V1_MULTIPROCESSING=0: 12 s to start here instead
of 37 s with an engine-core process of its own), so tensors handed to
`collective_rpc` reach the worker as they are.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import tempfile
import time
import traceback

from ... import forkserver
from . import ddma_pending_version

ENGINE_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    # Eager throughout, as enforce_eager asks: vLLM still wraps a few helpers in
    # torch.compile (the sampler's log-prob ranks), which cost each engine process
    # 4 s of Inductor on its first request with log-probs, for one comparison a step.
    "TORCHDYNAMO_DISABLE": "1",
}
# The engine's KV cache unless engine_kwargs or VLLM_CPU_KVCACHE_SPACE (whole GiB,
# which vLLM's CPU backend takes over the argument) says otherwise: the requests
# sent here are a few short sequences (64 MiB holds 4,096 tokens of the bench's
# 0.58 GiB Llama in float32). On CPU only: a GPU engine sizes its own from
# gpu_memory_utilization. vLLM's CPU backend wants a size; the 1 GiB that the
# variable's smallest value gives took 5-7 s of an engine's start to allocate on a
# 2-core machine short of free memory (0.04 s for this).
KV_CACHE_BYTES = 64 << 20


def share_cores_among_workers(tp: int) -> None:
    """Before vLLM starts `tp` CPU workers unbound (VLLM_CPU_OMP_THREADS_BIND=nobind):
    give each an equal share of this process's cores as its OpenMP threads, unless
    the user set OMP_NUM_THREADS. Unbound, every worker runs as many threads as
    there are cores, and tensor-parallel workers spin on each other's: a 16-token
    greedy request of a tiny Qwen3 at TP 2 on 2 cores took 1.2-2.4 s instead of
    0.1-0.17 s. Per engine: engines side by side on one host still share its cores."""
    if tp > 1 and os.environ.get("VLLM_CPU_OMP_THREADS_BIND") == "nobind":
        os.environ.setdefault("OMP_NUM_THREADS", str(max(1, len(os.sched_getaffinity(0)) // tp)))


class EngineError(RuntimeError):
    """An exception raised in the engine's process; its traceback is the message."""


def _greedy(llm, prompts: list[list[int]], max_tokens: int) -> list[tuple[list[int], list[float]]]:
    """Greedy tokens and their log-probs for token-id prompts."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=0, detokenize=False, ignore_eos=True)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    completions = [o.outputs[0] for o in outs]
    return [(list(c.token_ids), [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)]) for c in completions]


def _ddma_update(llm, version: int, timeout_s: float | None) -> tuple[float, float]:
    """One version through llamarl_ddma; returns the seconds generation was paused
    and, of those, the seconds the workers spent committing it (the slowest worker)."""
    start = time.monotonic()
    llm.start_weight_update()
    llm.update_weights({"update_info": {"version": version, "timeout_s": timeout_s}})
    llm.finish_weight_update(weight_version=str(version))
    # KV the prefix cache computed under the last version must not serve the next
    # request: the engine forgets it (vLLM's update path does not).
    if not llm.reset_prefix_cache():
        raise RuntimeError(f"vLLM did not reset its prefix cache after version {version}")
    paused = time.monotonic() - start
    return paused, max(llm.collective_rpc(lambda worker: worker.weight_transfer_engine.commit_seconds))


def _random_weights(shapes: dict, seed: int) -> list:
    """Random tensors of the given checkpoint names and shapes, made in this process."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    return [(name, torch.randn(shape, generator=gen) * 0.02) for name, shape in shapes.items()]


def _reload_weights(llm, weights) -> float:
    """vLLM's own path: `reload_weights` with Hugging Face-named tensors (a layer-by-layer
    reload that re-fuses, re-shards and re-processes, re-packing on CPU)."""
    start = time.monotonic()
    llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights, "is_checkpoint_format": True})
    return time.monotonic() - start


def _load_weights(llm, weights) -> float:
    """What verl / TRL / PipelineRL do: `model.load_weights` with Hugging Face-named
    tensors, through the worker."""
    start = time.monotonic()
    llm.apply_model(lambda model: model.load_weights(weights=iter(weights)))
    return time.monotonic() - start


def _serve(conn, model_dir: str, engine_kwargs: dict, temp_dir: str, environ: dict) -> None:
    # The caller's environment when it started the engine (CUDA_VISIBLE_DEVICES, VLLM_*,
    # OMP_NUM_THREADS among it), not the forkserver's from its own start; and Ctrl-C ends
    # the engine as it ends its caller (processes forked from the server ignore SIGINT).
    os.environ.clear()
    os.environ.update(environ)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    # What this process and its workers print goes to stderr: vLLM logs to stdout
    # (VLLM_LOGGING_STREAM's default, ext://sys.stdout, resolves to the fd below), and
    # the driving process's stdout carries its own output alone (`--json`).
    sys.stdout.flush()
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    # The temporary files of this process and its workers (vLLM's file:// rendezvous
    # among them, which its exit below does not remove) go where EngineProcess.close
    # removes them.
    os.environ["TMPDIR"] = tempfile.tempdir = temp_dir
    for key, value in ENGINE_ENV.items():  # a user's own setting wins
        os.environ.setdefault(key, value)
    import torch

    if not torch.cuda.is_available() and not os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
        engine_kwargs = {"kv_cache_memory_bytes": KV_CACHE_BYTES, **engine_kwargs}
    if engine_kwargs.get("tensor_parallel_size", 1) > 1:
        # vLLM's CPU workers bind their threads to a NUMA node each by default, and
        # refuse to start with fewer nodes than workers; unbound unless told.
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        share_cores_among_workers(engine_kwargs["tensor_parallel_size"])
    try:
        from vllm import LLM
        from vllm.config import WeightTransferConfig

        llm = LLM(model=model_dir, load_format="dummy", skip_tokenizer_init=True, enforce_eager=True,
                  weight_transfer_config=WeightTransferConfig(backend="llamarl_ddma"), **engine_kwargs)
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        return
    conn.send(("ok", None))
    held = {}  # tensors made in this process, by key (the native paths' inputs)
    handlers = {
        "init": lambda info: llm.init_weight_transfer_engine({"init_info": info}),
        "shutdown_transfer": llm.shutdown_weight_transfer_engine,
        "ddma_update": lambda version, timeout_s=None: _ddma_update(llm, version, timeout_s),
        "greedy": lambda prompts, max_tokens: _greedy(llm, prompts, max_tokens),
        "weight_version": llm.get_weight_version,
        "pending_version": lambda: ddma_pending_version(llm),
        "make_hf_weights": lambda key, shapes, seed: held.__setitem__(key, _random_weights(shapes, seed)),
        # The bytes each trainer rank sends per version, by the plan every worker holds.
        "planned_bytes_by_src_rank": lambda: llm.collective_rpc(
            lambda worker: worker.weight_transfer_engine.receiver.plan.bytes_sent_by_src_rank())[0],
        "reload_weights": lambda key: _reload_weights(llm, held[key]),
        "load_weights": lambda key: _load_weights(llm, held[key]),
        "drop": lambda key: held.pop(key, None) and None,
        "engine_layout": lambda: llm.collective_rpc(lambda worker: worker.weight_transfer_engine.receiver.layout.to_json())[0],
        "loader_differences": lambda weights: [line for lines in llm.collective_rpc(
            lambda worker: worker.weight_transfer_engine.differences_from_loader(weights)) for line in lines],
    }
    while True:
        try:
            kind, args = conn.recv()
        except EOFError:  # the driving process is gone
            return
        if kind == "stop":
            # Stopped here rather than by the interpreter's exit, which then spends 4 s
            # collecting vLLM's and torch's modules: nothing is left to finalize.
            llm.llm_engine.engine_core.shutdown()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)
        try:
            conn.send(("ok", handlers[kind](*args)))
        except BaseException:
            conn.send(("error", traceback.format_exc()))


class EngineProcess:
    """A vLLM engine for the model config in `model_dir` (weights: dummy until a
    sync), started in a process forked from llamarl_core.forkserver's server
    (torch and transformers imported there once: an engine's start then imports
    vLLM alone), its KV cache KV_CACHE_BYTES unless `engine_kwargs` sets
    kv_cache_memory_bytes or the environment VLLM_CPU_KVCACHE_SPACE (whole GiB,
    which vLLM's CPU backend takes first), on CPU. The engine runs with this
    process's environment as it is at the start; it finds this package as the
    forkserver does (not through a sys.path entry this process added itself).
    `call(kind, *args)` runs one of the
    handlers in `_serve` there and returns its result (EngineError on failure).
    The engine's processes write their temporary files into a folder of their
    own (TMPDIR), which close() removes; a failed start closes at once."""

    def __init__(self, model_dir: str, start_timeout: float = 300.0, **engine_kwargs):
        ctx = forkserver.context()
        self.conn, child = ctx.Pipe()
        self.temp_dir = tempfile.mkdtemp(prefix="llamarl-vllm-")  # the engine's TMPDIR, removed by close()
        # Daemonic unless it starts worker processes of its own (tensor parallelism), which a
        # daemonic process may not; either way it ends when this process's end of the pipe closes.
        daemon = engine_kwargs.get("tensor_parallel_size", 1) == 1
        # A path from here, not from the forkserver's working directory.
        self.proc = ctx.Process(target=_serve, args=(child, os.path.abspath(model_dir), engine_kwargs, self.temp_dir,
                                                     dict(os.environ)), daemon=daemon,
                                name="llamarl-vllm-engine")
        try:
            self.proc.start()
            self._reply(start_timeout, "start")
        except BaseException:
            self.close()
            raise

    def _reply(self, timeout: float, what: str):
        deadline = time.monotonic() + timeout
        while not self.conn.poll(0.5):
            if not self.proc.is_alive():
                raise EngineError(f"the vLLM engine process exited (code {self.proc.exitcode}) during {what}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the vLLM engine did not answer {what} within {timeout} s")
        status, value = self.conn.recv()
        if status == "error":
            raise EngineError(value)
        return value

    def call(self, kind: str, *args, timeout: float = 300.0):
        self.conn.send((kind, args))
        return self._reply(timeout, kind)

    def close(self) -> None:
        try:
            self.conn.send(("stop", ()))
        except (BrokenPipeError, OSError):
            pass
        if self.proc.pid is not None:
            self.proc.join(timeout=30)
            if self.proc.is_alive():
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.join()
        shutil.rmtree(self.temp_dir, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
