"""The executors: generator, trainer and reward, each a process (or a group of
processes) with its own torch.distributed process group, driven by the
controller through queues in the run's Store (control/queues.py). They exchange
rollouts (token ids, floats) with the controller; model weights go from trainer
to generator through the DDMA engine only (WeightSender -> WeightReceiver), never
through the controller.

An executor runs in a process the controller forked (one host, `llamarl train`) or
in a torchrun rank that the controller's rank assigns it to (`llamarl_core.launch`);
either way `run_executor` runs it, on a Store the controller's side also reaches.

Every message to the controller is (role, rank, kind, payload); payloads carry
the spans (name, start, end on the host's monotonic clock) that the run's trace
shows.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import os
import signal
import threading
import time
import traceback
from collections import deque
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

from ..control.auth import AuthenticatedStore, refused_count
from ..control.hosts import host_identity
from ..models.sharded import NotByName, copy_shards, empty_model, init_random, load_shards
from ..spelling import set_spelling
from ..sync import StaleReceiveError, SyncError, module_sender
from .config import TrainConfig
from .data import RunData
from .checkpoints import TrainerCheckpoints
from .generators import GeneratorContext, LlamaGeneratorBackend, plugin_generator
from .learner import (
    StepContext,
    StepStats,
    check_packed_rows_attend_within_samples,
    learning_rate,
    run_with_hook,
    supervised_warmup,
    train_step,
    trainer_plugins,
)
from ..control import HeartbeatWatch, QueueClosed, StoreQueue
from .rewards import check_rewards, make_scorer
from .rollout import Sample

GENERATOR, TRAINER, REWARD = "generator", "trainer", "reward"
# What the trainer ranks' step reports add to a step's metrics, averaged over the ranks; truncated completions are
# counted by the controller over every rank's samples.
TRAINER_STATS = tuple(f.name for f in dataclasses.fields(StepStats) if f.name != "truncated_samples")
INBOX_POLL_S = 0.2  # how long an idle executor blocks on its inbox before checking on the controller
_ALL_CORES = os.sched_getaffinity(0)  # at import, before any pinning
# The run's queues and the controller's heartbeat, in the run's Store.
EVENTS, CONTROLLER_BEAT = "events", "controller-beat"


def inbox_name(role: str, rank: int, incarnation: int) -> str:
    """The queue of commands to executor rank `rank` of `role` (of generator incarnation
    `incarnation`: a restarted generator never reads its predecessor's commands)."""
    return f"inbox/{role}/{rank}/{incarnation}"


def has_inbox(role: str, rank: int, generator_tp: int) -> bool:
    """Only each replica's generator rank 0 reads commands; it broadcasts them to the
    replica's other ranks (_CommandFeed)."""
    return role != GENERATOR or rank % generator_tp == 0


class Link:
    """An executor's end of the queues, with the spans it has not reported yet. inbox is
    None on generator ranks other than a replica's rank 0, which reads the commands for
    all of them. An idle wait for a command checks that the controller still beats."""

    def __init__(self, store: dist.Store, role: str, rank: int, tags: dict, inbox: str | None, timeout_s: float,
                 secret: bytes):
        self.role, self.rank = role, rank
        self.secret = secret  # the run's: its weight syncs and process groups use it too
        self._refused_before = refused_count()
        # A connection for the messages alone: the executor's weight syncs wait on `store` for
        # up to their timeout, and the heartbeat thread's reports must not queue behind them.
        messages = store.clone()
        self.events = StoreQueue(messages, EVENTS, secret)
        self.inbox = StoreQueue(messages, inbox, secret) if inbox is not None else None
        self.controller = HeartbeatWatch(messages, CONTROLLER_BEAT, grace_s=timeout_s)
        self.tags = tags  # added to every message (the generator's incarnation)
        self.spans: list[tuple[str, float, float, dict]] = []

    def send(self, kind: str, **payload) -> None:
        if kind == "ready":  # where this executor runs (the run's hosts.json)
            payload["host"] = host_identity()
        payload.update(self.tags)
        # The values this executor refused (auth.py), for the run's metrics: counted from its start (a torchrun
        # rank runs the executors of several runs one after another).
        payload["refused"] = refused_count() - self._refused_before
        payload["spans"], self.spans = self.spans, []
        self.events.put((self.role, self.rank, kind, payload))

    def span(self, name: str, start: float, end: float, **args) -> None:
        """A trace event. `name` is fixed per kind of work (Perfetto groups events by name); what varies (the
        step, the version) goes into `args`."""
        self.spans.append((name, start, end, args))

    @contextlib.contextmanager
    def heartbeat(self, every_s: float):
        """While inside, tell the controller every `every_s` seconds that this executor
        is alive (a "working" message, from a thread of its own: no spans taken). The
        controller stops a run after timeout_s of silence; a trainer step of a real
        model can be longer than that (SmolLM2-135M: 20-25 s a step on one busy core
        here; a larger model, or a checkpoint of its AdamW state, takes minutes)."""
        stop = threading.Event()

        def beat():
            while not stop.wait(every_s):
                self.events.put((self.role, self.rank, "working", dict(self.tags)))

        thread = threading.Thread(target=beat, name=f"{self.role}-{self.rank}-heartbeat", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join()

    def get(self, timeout: float):
        """The next command (kind, payload), or None after `timeout` seconds."""
        try:
            command = self.inbox.get(timeout)
        except QueueClosed:
            raise SystemExit(f"{self.role} {self.rank}: the controller is gone (its Store closed)") from None
        if command is None and not self.controller.alive():
            raise SystemExit(f"{self.role} {self.rank}: the controller is gone (no heartbeat for "
                             f"{self.controller.silent_for():.0f} s)")
        return command

    def commands(self):
        """The controller's commands (kind, payload) in order, until 'stop'."""
        while True:
            command = self.get(INBOX_POLL_S)
            if command is None:
                continue
            if command[0] == "stop":
                return
            yield command

    def get_nowait(self):
        return self.inbox.get_nowait()

    def close(self) -> None:
        if self.inbox is not None:
            self.inbox.close()


def _setup_threads(config: TrainConfig, role: str, rank: int, launched: bool) -> None:
    """Async mode: one thread per executor and, with enough cores, the generator
    and trainer ranks pinned to cores of their own (the two phases run at once;
    measured on a 2-core machine: one core each beats sharing both). Sync
    mode: each phase has every core while it runs. Under torchrun, a host's
    cores are shared evenly by its ranks (torchrun's own OMP_NUM_THREADS is 1),
    unpinned: which roles share a host is the placement's choice."""
    cores = sorted(os.sched_getaffinity(0))
    if launched:
        torch.set_num_threads(max(1, len(cores) // int(os.environ["LOCAL_WORLD_SIZE"])))
        return
    if config.mode == "sync":
        torch.set_num_threads(len(cores))
        return
    torch.set_num_threads(1)
    generator_ranks = config.generator_tp * config.generator_replicas
    pinned = generator_ranks + config.trainer_world
    if role != REWARD and pinned <= len(cores):
        index = rank if role == GENERATOR else generator_ranks + rank
        os.sched_setaffinity(0, {cores[index]})


@contextlib.contextmanager
def _every_core(world: int):
    """While nothing else computes (the trainer's warm-up, before the first sync),
    a lone trainer may use every core; its own pinning and threads come back after."""
    pinned, threads = os.sched_getaffinity(0), torch.get_num_threads()
    if world == 1:
        os.sched_setaffinity(0, _ALL_CORES)
        torch.set_num_threads(len(_ALL_CORES))
    try:
        yield
    finally:
        os.sched_setaffinity(0, pinned)
        torch.set_num_threads(threads)


# The Python Stores under this process's groups, alive as long as the process (see _process_group).
_GROUP_STORES: list[AuthenticatedStore] = []


def _process_group(store: dist.Store, name: str, rank: int, world: int, config: TrainConfig, secret: bytes) -> None:
    """This executor's own process group: gloo, and NCCL for CUDA tensors (FSDP2's
    and tensor parallelism's collectives) when the run is on GPUs. Its rendezvous
    values (the ranks' addresses, NCCL's id) are authenticated with the run's secret."""
    backend = "cpu:gloo,cuda:nccl" if config.device == "cuda" else "gloo"
    prefix = f"pg/{name}/"
    group_store = AuthenticatedStore(dist.PrefixStore(prefix, store), secret, label=prefix)
    # The group keeps only the C++ part of a Store written in Python: without this reference its methods are
    # gone once the call returns, and every later use from C++ (NCCL's monitor thread checks a key once a
    # second; new_group) raised "Tried to call pure virtual function" (seen on an H200, 267 warnings a run).
    _GROUP_STORES.append(group_store)
    dist.init_process_group(backend, store=group_store, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=config.timeout_s))


def _select_gpu(config: TrainConfig, role: str, rank: int, launched: bool) -> None:
    """On GPUs, one device per rank: under torchrun GPU LOCAL_RANK (the controller's and
    the reward's ranks hold a local rank, and a GPU, too); else trainer rank r on GPU
    r, generator rank r on GPU trainer_world + r (wrapped around when there are fewer)."""
    if launched:
        local_rank = int(os.environ["LOCAL_RANK"])
        if local_rank >= torch.cuda.device_count():
            raise ValueError(f"{role} rank {rank} is torchrun local rank {local_rank}, and this host has "
                             f"{torch.cuda.device_count()} CUDA devices: one per local rank (--nproc-per-node)")
        torch.cuda.set_device(local_rank)
        return
    index = rank if role == TRAINER else config.trainer_world + rank
    torch.cuda.set_device(index % torch.cuda.device_count())


def run_executor(role: str, rank: int, config_dict: dict, store: dist.Store, extra: dict, secret: bytes) -> bool:
    """Run executor rank `rank` of `role` until the controller says stop; False when
    it failed (the failure, with its traceback, is reported to the controller).
    extra: "inbox", "launched", "flags" (its messages name CLI flags, as the
    controller's), "mps_env" (gpu_share: the MPS client's variables, set before
    CUDA starts here) and the role's own arguments (the incarnation, the run
    folder). secret: the run's (auth.py), which its messages carry; never in `extra`,
    which may travel through the Store."""
    config = TrainConfig.from_dict(config_dict)
    extra = dict(extra)
    inbox = extra.pop("inbox")  # the queue it reads its commands from (None: its replica's rank 0 reads them)
    launched = extra.pop("launched", False)  # a torchrun rank (llamarl_core.launch), not forked by the controller
    set_spelling(flags=extra.pop("flags", False))  # this process is the executor's own
    os.environ.update(extra.pop("mps_env", None) or {})  # CUDA reads them when it starts (_select_gpu)
    tags = {"incarnation": extra["incarnation"]} if role == GENERATOR else {}
    link = Link(store, role, rank, tags, inbox, config.timeout_s, secret)
    try:
        _setup_threads(config, role, rank, launched)
        if config.device == "cuda" and role != REWARD:
            _select_gpu(config, role, rank, launched)
        # Their work may outlast timeout_s with nothing to report (loading, a trainer step or
        # checkpoint, a long generation or evaluation, scoring a batch with a reward model):
        # they beat, and the controller counts a beat only while it waits on that work. Every
        # wait of theirs has a timeout of its own (process groups, weight syncs). A rule
        # reward answers at once; silence there stays an error.
        beats = role != REWARD or config.reward_model is not None
        with link.heartbeat(config.timeout_s / 4) if beats else contextlib.nullcontext():
            {GENERATOR: run_generator, TRAINER: run_trainer, REWARD: run_reward}[role](link, config, store, rank,
                                                                                      **extra)
        return True
    except SystemExit:
        raise
    except BaseException as exc:  # noqa: BLE001 - every failure goes to the controller
        link.send("error", message=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc())
        return False
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        _GROUP_STORES.clear()  # a torchrun rank's serve loop runs executors one after another in one process
        link.close()


def _exit_on_sigterm(signum, frame) -> None:
    raise SystemExit(128 + signum)


def executor_main(role: str, rank: int, config_dict: dict, store_port: int, extra: dict, secret: bytes) -> None:
    """Process entry point (forked by the controller's forkserver on its host; the
    run's secret comes in the arguments, through the forkserver's local socket)."""
    # Ctrl-C in a terminal reaches the whole process group: the controller alone handles
    # it (it tells every executor to stop, then kills what is left). An executor
    # interrupted on its own would touch the Store after the controller closed it, and
    # each such request makes c10d print a stack trace.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # SIGTERM (the controller ending an executor still setting up when the run stops):
    # out through run_executor's clean-up (its process group destroyed, its Store closed).
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    if role == GENERATOR and config_dict["generator"] != "llama":
        os.setsid()  # a process group for an engine's processes too (vLLM's, a user's), which the controller kills as one
    store = dist.TCPStore("127.0.0.1", store_port, is_master=False,
                          timeout=datetime.timedelta(seconds=config_dict["timeout_s"]))
    if not run_executor(role, rank, config_dict, store, extra, secret):
        raise SystemExit(1)


# ----------------------------------------------------------------------------- generator


class _CommandFeed:
    """A replica's generator ranks' shared view of the controller's commands: its
    rank 0 (the leader) reads the inbox and broadcasts what it read over the
    replica's tensor-parallel group, so every rank takes the same decisions at the
    same decode step."""

    def __init__(self, link: Link, tp_size: int, leader: bool):
        self.link, self.tp_size, self.leader = link, tp_size, leader
        self.pending: deque = deque()

    def poll(self, block_s: float = 0.0) -> None:
        new = []
        if self.leader:
            first = self.link.get(block_s) if block_s > 0 else self.link.get_nowait()
            while first is not None:
                new.append(first)
                first = self.link.get_nowait()
        if self.tp_size > 1:
            box = [new]
            dist.broadcast_object_list(box, src=0)
            new = box[0]
        self.pending.extend(new)

    def weights_waiting(self) -> bool:
        """Asked between decode steps: is a new version (or a stop) waiting?"""
        self.poll()
        return any(kind in ("receive", "stop") for kind, _ in self.pending)


def sync_name_of(incarnation: int, replica: int = 0) -> str:
    """The name of the sync that fills generator replica `replica` of this incarnation: the
    trainer's for replica 0, a relay's for the others (each receiver is told its
    children's names, `relay_names`: the run names every sync itself)."""
    return f"weights/{incarnation}/replica{replica}" if replica else f"weights/{incarnation}"


def _make_generator(config: TrainConfig, data: RunData, store, secret: bytes, rank: int, incarnation: int, out_dir: str,
                    replica: int = 0, children: dict[int, int] | None = None):
    """This rank's generator (generators.py): ours, one process per tensor-parallel
    rank, each replica's ranks in a process group of their own, the weights relayed
    from replica to replica; or a vLLM engine, whose tensor-parallel workers vLLM
    starts itself (this executor is its only rank). It starts with no weights
    (zeros, or vLLM's dummy ones): the first sync brings the trainer's. Set-up waits
    for the trainer as long as any executor may take to start (its supervised
    warm-up or checkpoint loading comes first). children: the incarnation of each replica this
    one relays to (their syncs' names)."""
    tp, sync_name, seed = config.generator_tp, sync_name_of(incarnation), config.seed * 1000 + incarnation
    tokenizer = data.tokenizer
    if config.plugin_generator:
        return plugin_generator(config.generator)(GeneratorContext(
            model_config=data.model_config, model_path=config.model, dtype=config.torch_dtype, device=config.device,
            tp=tp, max_batch=config.groups_in_flight * config.samples_per_prompt, max_new_tokens=data.max_new_tokens,
            segment_tokens=config.segment_tokens, temperature=config.temperature,
            eos_token_ids=tuple(tokenizer.stop_token_ids), pad_token_id=tokenizer.pad_token_id, seed=seed,
            store=store, secret=secret, sync_name=sync_name, timeout_s=config.timeout_s))
    if config.generator == "vllm":
        from ..integrations.vllm.generator import VllmGenerator

        pinned = config.mode == "async" and tp + config.trainer_world <= len(_ALL_CORES)
        return VllmGenerator(data.model_config, tp=tp, store_port=store.port, secret=secret, sync_name=sync_name,
                             trainer_world=config.trainer_world, timeout_s=config.timeout_s,
                             max_new_tokens=data.max_new_tokens, temperature=config.temperature,
                             eos_token_id=tokenizer.stop_token_ids, seed=seed,
                             recompute_kv=config.recompute_kv, model_dir=Path(out_dir) / f"vllm-model-{incarnation}",
                             # vLLM's workers bind their threads: to the generator's cores, as ours are pinned.
                             cpus="|".join(str(c) for c in sorted(_ALL_CORES)[:tp]) if pinned else None)
    _process_group(store, f"{GENERATOR}/{incarnation}/{replica}", rank, tp, config, secret)
    return LlamaGeneratorBackend(
        data.model_config, tp=tp, rank=rank, store=store, secret=secret, sync_name=sync_name, timeout_s=config.timeout_s,
        replica=replica, num_replicas=config.generator_replicas,
        relay_names={child: sync_name_of(k, child) for child, k in (children or {}).items()},
        max_batch=config.groups_in_flight * config.samples_per_prompt, max_new_tokens=data.max_new_tokens,
        segment_tokens=config.segment_tokens, temperature=config.temperature, eos_token_id=tokenizer.stop_token_ids,
        pad_token_id=tokenizer.pad_token_id, seed=seed, dtype=config.torch_dtype, device=config.device,
        fp8=config.generator_fp8, fp8_gemm=config.generator_fp8_gemm)


def _update_weights(generator, payload: dict, timeout_s: float, tp: int) -> tuple[int | None, str, bool]:
    """Take the version `payload` announces; returns (version, "", False) or, when it
    did not land on every rank of the replica, (None, why, stale) on all of them
    (stale: no rank's weights were touched, the version asked for will not come): a
    replica whose ranks disagree would sample with torn weights or split its
    collectives."""
    try:
        outcome = (generator.update_weights(payload["version"], timeout_s, relay_to=payload["relay_to"]), "", False)
    except SyncError as exc:
        outcome = (None, f"{type(exc).__name__}: {exc}", isinstance(exc, StaleReceiveError))
    if tp > 1:
        outcomes = [None] * tp
        dist.all_gather_object(outcomes, outcome)
        failed = [(rank, why) for rank, (_, why, _) in enumerate(outcomes) if why]
        if failed:
            stale = all(was_stale for _, why, was_stale in outcomes if why)
            if not stale:
                generator.version = None
            outcome = (None, "; ".join(f"rank {rank}: {why}" for rank, why in failed), stale)
    return outcome


def run_generator(link: Link, config: TrainConfig, store, rank: int, incarnation: int, out_dir: str,
                  children: dict[int, int]) -> None:
    """Generator rank `rank` of all replicas': rank `tp_rank` of replica `replica`."""
    tp = config.generator_processes
    replica, tp_rank = divmod(rank, tp)
    generator = _make_generator(config, RunData(config), store, link.secret, tp_rank, incarnation, out_dir, replica,
                                children)
    leader = tp_rank == 0  # reads the replica's commands and reports for it
    feed = _CommandFeed(link, tp, leader)
    busy = 0.0
    link.send("ready")
    try:
        while True:
            while feed.pending:
                kind, payload = feed.pending.popleft()
                if kind == "stop":
                    return
                if kind == "prompts":
                    generator.submit([Sample(group, ids) for group, ids in payload["groups"]
                                      for _ in range(config.samples_per_prompt)])
                elif kind == "relay":  # the child replica was restarted: feed its new incarnation
                    generator.replace_relay(payload["child"], sync_name_of(payload["incarnation"], payload["child"]))
                elif kind == "receive":
                    start = time.monotonic()
                    version, why, stale = _update_weights(generator, payload, config.sync_timeout_s, tp)
                    if version is None:  # the replica feeding this one died: torn, or (stale) untouched
                        link.span("receive weights failed", start, time.monotonic(), version=payload["version"])
                        if leader:
                            link.send("receive_failed", version=payload["version"], attempt=payload["attempt"],
                                      message=why, stale=stale)
                        continue
                    end = time.monotonic()
                    link.span("receive weights", start, end, version=version)
                    if leader:
                        link.send("received", version=version, busy=busy, seconds=end - start,
                                  relay_failed=generator.relay_failures)
                        busy = 0.0
                    if payload["evaluate"]:  # greedy, to the end, on these weights alone, before anything else
                        start = time.monotonic()
                        done = generator.evaluate([Sample(i, ids, eval=True) for i, ids in payload["evaluate"]])
                        link.span("evaluate", start, time.monotonic(), version=version, prompts=len(done))
                        if leader:
                            link.send("samples", samples=done, busy=0.0)
            if generator.version is None or not generator.busy:
                feed.poll(block_s=INBOX_POLL_S)
                continue
            start = time.monotonic()
            done = generator.run_segment(stop=feed.weights_waiting)
            end = time.monotonic()
            busy += end - start
            link.span("generate", start, end, version=generator.version, **generator.segment_stats())
            if done and leader:
                link.send("samples", samples=done, busy=busy)
                busy = 0.0
    finally:
        generator.close()


# ----------------------------------------------------------------------------- trainer


def _trainer_model(data: RunData, config: TrainConfig, mesh, dtype: torch.dtype = torch.float32):
    """The trainer's model, built on the meta device and sharded over `mesh` (FSDP2;
    None: one rank), its parameters not filled (models/sharded.py), checked first
    for keeping packed samples apart."""
    import transformers

    with torch.device("meta"):
        meta = transformers.AutoModelForCausalLM.from_config(data.model_config)
    check_packed_rows_attend_within_samples(meta)  # before any step trains on packed rows
    return empty_model(data.model_config, dtype=dtype, device=config.device, mesh=mesh)


def _fill_policy(model, data: RunData, seed: int, rank: int) -> None:
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


def run_trainer(link: Link, config: TrainConfig, store, rank: int, incarnation: int, out_dir: str) -> None:
    data = RunData(config)
    world, device = config.trainer_world, config.device
    objective, advantage, step_hook = trainer_plugins(config)
    if not Path(out_dir).is_dir():  # the controller made it: a host of its own sees no such folder
        raise ValueError(f"the run folder {out_dir} is not on trainer rank {rank}'s host ({host_identity()}), and "
                         "every trainer rank writes its checkpoint shards there: under torchrun, give --out a folder "
                         "on a filesystem the controller's and every trainer rank's hosts share")
    _process_group(store, TRAINER, rank, world, config, link.secret)
    mesh = None
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device, (world,))
    model = _trainer_model(data, config, mesh)
    # fused: one kernel over all parameters (0.6 vs 1.2 ms a step for the default model).
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=0.0, fused=True)
    checkpoints = TrainerCheckpoints(out_dir, rank, world)
    step, data_position, reference = 0, 0, None
    if checkpoints.latest() is not None:
        saved = checkpoints.load(model, optimizer)
        step, data_position = saved["step"], saved["data_position"]
    else:
        _fill_policy(model, data, config.seed, rank)
    if config.kl_coef:
        reference = _trainer_model(data, config, mesh, dtype=config.torch_dtype)
        if checkpoints.has_reference():
            checkpoints.load_reference(reference)
        elif step > 0:
            raise ValueError(f"{out_dir} holds a checkpoint at step {step} but no KL reference (checkpoint/reference): "
                             "the weights RL started from are lost; start the run anew")
        reference.eval().requires_grad_(False)

    def connect(generator: int):
        """This rank's sender to generator incarnation `generator` (its own Store namespace);
        set-up waits as long as a generator may take to start, each send sync_timeout_s."""
        return module_sender(store, model, rank, world, name=sync_name_of(generator), timeout=config.timeout_s,
                             num_threads=1, secret=link.secret)

    if step == 0 and data.supervised_warmup:
        start = time.monotonic()
        with _every_core(world):
            loss = supervised_warmup(model, optimizer, data.task, config.warmup_steps, config.warmup_batch, rank,
                                     world)
        link.span("supervised warm-up", start, time.monotonic(), steps=config.warmup_steps, loss=loss)
    if config.kl_coef and not checkpoints.has_reference():  # the weights RL starts from, saved once
        copy_shards(reference, model)
        checkpoints.save_reference(reference)
    autocast = config.torch_dtype if config.torch_dtype != torch.float32 else None
    generator = incarnation  # the generator incarnation the sender serves
    sender = connect(generator)
    transports = {f"trainer {src} -> generator {dst}": t for (src, dst), t in sender.transports.items() if src == rank}
    link.send("ready", step=step, data_position=data_position, transports=transports)

    for kind, payload in link.commands():
        start = time.monotonic()
        if kind == "sync":
            try:
                sender.send(payload["version"], timeout=config.sync_timeout_s)
            except SyncError as exc:  # e.g. the generator died mid-sync: the controller decides
                link.send("sync_failed", version=payload["version"], message=str(exc), generator=generator)
                continue
            end = time.monotonic()
            link.span("send weights", start, end, version=payload["version"])
            link.send("synced", version=payload["version"], seconds=end - start, generator=generator)
        elif kind == "train":
            lr = learning_rate(payload["step"], base_lr=config.lr, warmup_steps=config.lr_warmup_steps,
                               total_steps=config.steps, schedule=config.lr_schedule, min_lr_ratio=config.min_lr_ratio)
            samples = payload["samples"]
            normalizer = len(samples) * data.max_new_tokens if config.loss_normalizer == "dr_grpo" else None
            stats, hook_metrics = run_with_hook(
                step_hook, StepContext(payload["step"], model, optimizer, samples, rank, world, lr),
                lambda: train_step(model, optimizer, samples, pad_token_id=data.tokenizer.pad_token_id,
                                   temperature=config.temperature, lr=lr,
                                   micro_batch_size=config.micro_batch_size or None,
                                   max_grad_norm=config.max_grad_norm or None, mask_truncated=config.mask_truncated,
                                   kl_coef=config.kl_coef, reference_model=reference, autocast_dtype=autocast,
                                   loss=objective, advantage=advantage, normalizer=normalizer,
                                   reduction=config.loss_reduction, entropy_coef=config.entropy_coef,
                                   nonfinite_logprobs=config.nonfinite_logprobs, **config.loss_parameters))
            step = payload["step"] + 1
            end = time.monotonic()
            link.span("train step", start, end, step=payload["step"], samples=len(samples))
            link.send("trained", step=payload["step"], seconds=end - start, hook=hook_metrics,
                      **dataclasses.asdict(stats))
        elif kind == "checkpoint":
            checkpoints.save(model, optimizer, step=step, data_position=payload["data_position"])
            end = time.monotonic()
            link.span("checkpoint", start, end, step=step)
            link.send("checkpointed", step=step)
        elif kind == "reconnect":
            sender.close()
            generator = payload["incarnation"]
            sender = connect(generator)
        else:
            raise ValueError(f"trainer: unknown command {kind!r}")


# ----------------------------------------------------------------------------- reward


def run_reward(link: Link, config: TrainConfig, store, rank: int) -> None:
    """Scores each bunch of completions the controller sends (each a prompt group,
    whether it is held out, and the completion's tokens) in one call: a rule reward
    over the whole bunch, a reward model in batches of reward_batch. The rewards go
    back, in order; an error or a non-finite reward names the completion."""
    data = RunData(config)
    score, what = make_scorer(config, data)
    _process_group(store, REWARD, rank, 1, config, link.secret)
    link.send("ready")
    for kind, payload in link.commands():
        start = time.monotonic()
        problems = [data.eval_problem(group) if held_out else data.problem(group)
                    for group, held_out in zip(payload["groups"], payload["eval"])]
        completions = [data.tokenizer.decode(tokens) for tokens in payload["tokens"]]
        rewards = score(problems, completions)
        check_rewards(problems, completions, rewards, what)
        link.span("score", start, time.monotonic(), samples=len(completions))
        link.send("scored", bunch=payload["bunch"], rewards=list(rewards))
