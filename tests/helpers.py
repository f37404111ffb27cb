"""Shared test helpers: real Hugging Face models with random weights, poisoned
destinations, mismatch reports, and real processes with a deadline."""

from __future__ import annotations

import contextlib
import datetime
import io
import multiprocessing as mp
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from queue import Empty
from typing import Callable, Mapping

import pytest
import torch
import torch.distributed as dist
import transformers

from llamarl_core import cli, forkserver
from llamarl_core.sync import Layout, Replicate, Shard


def small_config(kind: str):
    """Odd-sized Llama-family configs covering GQA, bias and tied embeddings."""
    common = dict(hidden_size=96, intermediate_size=344, num_hidden_layers=2, num_attention_heads=8, vocab_size=1001)
    if kind == "llama_gqa_bias":  # kv heads < tp 4: replicated KV heads; q/k/v/o bias
        return transformers.LlamaConfig(**common, num_key_value_heads=2, attention_bias=True, mlp_bias=True,
                                        tie_word_embeddings=False)
    if kind == "llama_tied":
        return transformers.LlamaConfig(**common, num_key_value_heads=4, tie_word_embeddings=True)
    if kind == "qwen2":  # q/k/v bias, no o bias
        return transformers.Qwen2Config(**common, num_key_value_heads=2, tie_word_embeddings=True)
    if kind == "mistral":
        return transformers.MistralConfig(**common, num_key_value_heads=1, tie_word_embeddings=False)
    if kind == "llama3_rope":  # Llama 3 RoPE scaling; head_dim 12: wavelengths 6 (kept), 29 (blended), 136+ (/ 8)
        rope = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
        return transformers.LlamaConfig(**common, num_key_value_heads=4, tie_word_embeddings=True,
                                        rope_parameters=rope)
    raise ValueError(kind)


CONFIG_KINDS = ("llama_gqa_bias", "llama_tied", "qwen2", "mistral")
MODEL_CLASSES = {
    "llama": transformers.LlamaForCausalLM,
    "qwen2": transformers.Qwen2ForCausalLM,
    "mistral": transformers.MistralForCausalLM,
}


def llama_parameter_count(config: Mapping) -> int:
    """The parameters of transformers' Llama built from a bench's JSON `config` (on the meta device)."""
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            **{k: v for k, v in config.items() if k != "model_type"}))
    return sum(p.numel() for p in model.parameters())


def hf_state_dict(config, seed: int) -> dict[str, torch.Tensor]:
    """named_parameters() of the real Hugging Face model class, every parameter
    (norms and biases too, which init to ones / zeros) redrawn from N(0, 1)."""
    torch.manual_seed(seed)
    model = MODEL_CLASSES[config.model_type](config)
    gen = torch.Generator().manual_seed(seed)
    return {name: torch.randn(p.shape, generator=gen) for name, p in model.named_parameters()}


def chunks(full: torch.Tensor, world: int, dim: int) -> list[torch.Tensor]:
    """torch.chunk pieces, padded with empty ones up to `world`."""
    pieces = list(torch.chunk(full, world, dim))
    while len(pieces) < world:
        shape = list(full.shape)
        shape[dim] = 0
        pieces.append(full.new_empty(shape))
    return [p.contiguous() for p in pieces]


def random_placement(rng, ndim: int):
    """Replicate one time in five, else a split on a random dim."""
    return Replicate() if rng.random() < 0.2 else Shard(rng.randrange(ndim))


def local_tensors(full: torch.Tensor, placement, world: int) -> list[torch.Tensor]:
    """Each rank's local tensor of `full` under `placement` (Replicate or Shard)."""
    if isinstance(placement, Replicate):
        return [full.clone() for _ in range(world)]
    return chunks(full, world, placement.dim)


def deltas_by_size(limit: float = 1.0) -> None:
    """In this process, delta senders choose each bucket's encoding by its bytes
    alone, below a fixed density `limit` (above it: whole, and unscanned the next
    version): their density limits (delta_pair.DensityLimit) stop following the sends'
    times, so that a test of what goes on the wire does not depend on how fast this
    machine is. The limit itself has a test of its own (test_delta_pair)."""
    from llamarl_core.sync.delta_pair import DensityLimit

    init = DensityLimit.__init__

    def fixed(self) -> None:
        init(self)
        self.limit = limit

    DensityLimit.__init__ = fixed
    DensityLimit.observe = lambda self, seconds, full_bytes, densities: None


def random_destination(layout: Layout, rank: int, seed: int) -> dict[str, torch.Tensor]:
    """Every tensor of `rank` filled with random bytes (seeded): a receiver's bytes
    a sync has not written, NaN patterns included."""
    gen = torch.Generator().manual_seed(seed)
    return {name: torch.randint(0, 256, (int(torch.Size(shape).numel()) * torch.empty(0, dtype=dtype).element_size(),),
                                dtype=torch.uint8, generator=gen).view(dtype).view(shape)
            for name, (shape, dtype) in layout.local_tensor_specs(rank).items()}


def unpack_bucket(unpack, data: torch.Tensor, tensors: Mapping[str, torch.Tensor]) -> None:
    """A full send's write of a bucket's bytes `data` (1-D uint8, packed order) into
    `tensors` through its unpack segments (endpoint.packed), by the copy engine."""
    from llamarl_core.sync.engine import run_segment_table, segment_table

    table = segment_table(unpack, lambda seg: data.data_ptr(), lambda seg: tensors[seg.dst_name].data_ptr())
    run_segment_table(table, torch.device("cpu"), 1)


def _child(target: Callable, kwargs: dict, queue, environ: dict, outputs: tuple[str, str] | None) -> None:
    # The test's environment now (a monkeypatched variable included), not the
    # forkserver's when it started; and its output into files the parent copies to
    # its own stdout and stderr (where pytest's capture reads it), as a spawned
    # process's went to the parent's.
    os.environ.clear()
    os.environ.update(environ)
    for fd, path in zip((1, 2), outputs or ()):
        file = os.open(path, os.O_WRONLY | os.O_APPEND)
        os.dup2(file, fd)
        os.close(file)
    try:
        queue.put((os.getpid(), "ok", target(**kwargs)))
    except BaseException:  # report any failure of the child to the parent
        queue.put((os.getpid(), "error", traceback.format_exc()))
    finally:
        sys.stdout.flush()
        sys.stderr.flush()


def rank_context(start_method: str = "forkserver"):
    """The multiprocessing context rank processes start in: forked from the
    executors' forkserver (llamarl_core.forkserver: torch and transformers imported,
    no CUDA, no op run: safe to fork); or "spawn", a fresh interpreter, for a rank
    whose memory is measured against a tight bound (a forked process maps the
    forkserver's pages as it first touches them, and counts them in its resident
    memory then)."""
    return forkserver.context() if start_method == "forkserver" else mp.get_context(start_method)


def start_rank(ctx, queue, fn: Callable, kwargs: dict):
    """One rank process started by hand (for a test that kills and restarts ranks),
    as run_processes starts them: it puts (pid, "ok" | "error", value) on `queue`.
    Its output goes to the forkserver's, not through pytest's capture."""
    proc = ctx.Process(target=_child, args=(fn, kwargs, queue, dict(os.environ), None))
    proc.start()
    return proc


def run_processes(jobs: list[tuple[Callable, dict]], timeout: float, start_method: str = "forkserver") -> list:
    """Run each (function, kwargs) in its own process (rank_context(start_method));
    return their results in order, their output written to this process's stdout
    and stderr. Raises if one fails, or kills them all if they pass the deadline."""
    ctx = rank_context(start_method)
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="llamarl-ranks-") as folder:
        outputs = [(os.path.join(folder, f"{i}.out"), os.path.join(folder, f"{i}.err")) for i in range(len(jobs))]
        for pair in outputs:
            for path in pair:
                open(path, "wb").close()
        procs = [ctx.Process(target=_child, args=(fn, kw, queue, dict(os.environ), out))
                 for (fn, kw), out in zip(jobs, outputs)]
        try:
            by_pid = _collect(procs, queue, timeout)
        finally:
            for out_path, err_path in outputs:
                for fd, path in ((1, out_path), (2, err_path)):
                    with open(path, "rb") as f:
                        os.write(fd, f.read())
    errors = [v for s, v in by_pid.values() if s == "error"]
    if errors:
        raise AssertionError("a rank failed:\n" + "\n".join(errors))
    return [by_pid[p.pid][1] for p in procs]


def _collect(procs, queue, timeout: float) -> dict:
    """Start `procs` and gather (status, value) by pid; every one joined (or killed) after."""
    for p in procs:
        p.start()
    by_pid = {}
    deadline = time.monotonic() + timeout
    try:
        while len(by_pid) < len(procs):
            try:
                pid, status, value = queue.get(timeout=0.5)
                by_pid[pid] = (status, value)
                continue
            except Empty:
                pass
            for p in procs:  # died without a word (killed, os._exit): no result will come
                if p.pid not in by_pid and p.exitcode not in (None, 0):
                    by_pid[p.pid] = ("error", f"process {p.pid} exited with code {p.exitcode} and no result")
            if time.monotonic() > deadline:
                raise TimeoutError(f"processes did not finish within {timeout} s")
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                os.kill(p.pid, signal.SIGKILL)
                p.join()
    return by_pid


def llamarl_here(*args: str) -> subprocess.CompletedProcess:
    """`llamarl ARGS` run by this process as the console script runs it
    (cli.exit_status of cli.main), less the process around it: its exit status and
    what it printed. A `train` run's executors fork from the session's forkserver
    (conftest; Triton's interpreter on, as there), so a run here skips what a fresh
    process spends importing torch and transformers twice (6-7 s of 2 cores a
    run). Run from the root folder as the subprocess runs were, sys.path restored
    after (cli.main appends the working folder). What the executors print goes to
    the forkserver's output, not here: a test of that output, or of the process's
    own end, runs the command. An exception the command raises (a bug, the test's
    timeout) goes on with what the command printed as a note; a Ctrl-C, which the
    command turns into its "interrupted" line, is raised as KeyboardInterrupt."""
    out, err = io.StringIO(), io.StringIO()
    cwd, path = os.getcwd(), list(sys.path)
    os.chdir("/")
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = cli.exit_status(lambda: cli.main(list(args)))
    except BaseException as exc:
        exc.add_note(f"llamarl {' '.join(args)} printed:\n{out.getvalue()[-3000:]}\n{err.getvalue()[-3000:]}")
        raise
    finally:
        os.chdir(cwd)
        sys.path[:] = path
    if code and ": interrupted; " in err.getvalue():
        raise KeyboardInterrupt(err.getvalue().strip().splitlines()[-1])
    return subprocess.CompletedProcess(["llamarl", *args], code, out.getvalue(), err.getvalue())


def in_threads(*calls, timeout: float = 60) -> list:
    """Run each call in a thread of its own; returns their results (or the exceptions they raised)."""
    results = [None] * len(calls)

    def run(i, call):
        try:
            results[i] = call()
        except Exception as exc:  # returned, checked by the caller
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i, call)) for i, call in enumerate(calls)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=timeout)
    assert not any(thread.is_alive() for thread in threads)
    return results


def set_in_store(store: dist.Store, key: str, value) -> None:
    """A raw write that is in the Store before any other client reads: a set is not
    answered, and the server may serve another connection's read first; the check
    after it is answered on the same connection, so only once the set is in."""
    store.set(key, value)
    assert store.check([key])


def store_client(store) -> dist.TCPStore:
    """A client of the TCPStore `store` serves: one per thread, since a client blocks while it waits."""
    return dist.TCPStore("127.0.0.1", store.port, is_master=False, timeout=datetime.timedelta(seconds=30))


def llamarl_shm_entries() -> list[str]:
    return sorted(e for e in os.listdir("/dev/shm") if e.startswith("llamarl"))


def run_with_small_dev_shm(code: str, size: str = "1M") -> subprocess.CompletedProcess:
    """Run `python -c code` (cwd tests/) in a mount namespace of its own with a
    `size` tmpfs over /dev/shm: a small /dev/shm for real (Docker's default is
    64 MiB), the machine's own untouched. Skips where that is not permitted."""
    if os.geteuid() != 0:
        pytest.skip("needs root: mounts a tmpfs over /dev/shm in a mount namespace of its own")
    if shutil.which("unshare") is None:
        pytest.skip("needs unshare (util-linux) for a mount namespace of its own")
    script = f'mount -t tmpfs -o size={size} tmpfs /dev/shm || exit 97; exec "$0" -c "$1"'
    proc = subprocess.run(["unshare", "--mount", "sh", "-c", script, sys.executable, code],
                          cwd=os.path.dirname(os.path.abspath(__file__)), capture_output=True, text=True, timeout=300)
    if proc.returncode == 97 or proc.stderr.startswith("unshare:"):
        pytest.skip(f"cannot mount a small /dev/shm in a mount namespace here: {proc.stderr.strip()}")
    return proc


@contextlib.contextmanager
def killed_process_env(env: Mapping[str, str]):
    """`env` with TMPDIR a folder of its own, removed afterwards: for a command the
    test stops with a signal, whose temporary files (a forkserver's socket folder,
    vLLM's file:// rendezvous) its own exit would have removed, or never does."""
    folder = tempfile.mkdtemp(prefix="killed-")
    try:
        yield {**env, "TMPDIR": folder}
    finally:
        shutil.rmtree(folder, ignore_errors=True)
