"""A run across hosts, launched by torchrun: every rank runs this module.

    torchrun --nnodes 2 --nproc-per-node 3 --rdzv-backend c10d --rdzv-endpoint HOST:PORT \\
        -m llamarl_core.launch train --placement controller:0,reward:1,trainer:2,generator:3-5 [train options]

The options after `train` are `llamarl train`'s. Each rank takes its role from
--placement (the syntax: llamarl_core.pipeline.placement; default: controller 0,
reward 1, the trainer's ranks, then the generator's). The controller's rank runs
`llamarl train` itself, with the other ranks as its executors: it assigns each rank
its executor through the rendezvous's Store, and every controller <-> executor
message goes through that Store; model weights go from trainer to generator ranks
by the DDMA engine (shared memory within a host, point-to-point across hosts).

What the ranks share: the run folder (--out) is written by the controller and read
and written by trainer rank 0 (its checkpoint): put it on a filesystem both see, or
place them on one host. --model, --dataset and --task must resolve on every host.
With more than one network interface, set GLOO_SOCKET_IFNAME to the one the hosts
reach each other through.

The run's secret: every rank needs the same one, from its environment, set for
torchrun on every host: LLAMARL_SECRET (hex, at least 32 digits) or
LLAMARL_SECRET_FILE (a file holding it, mode 0600). Make one per job, e.g.

    export LLAMARL_SECRET=$(python -c 'import secrets; print(secrets.token_hex(32))')

and hand it to the other hosts the way their shells get secrets (never through the
Store: anyone who reaches torchrun's Store port can read it). Every message the
ranks exchange through the Store is authenticated with it; one that is not is
dropped and counted (auth.py).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import sys

from .control.auth import SECRET_ENV, SECRET_FILE_ENV, secret_from_env
from .spelling import use_flags

USAGE = ("usage: torchrun [torchrun options] -m llamarl_core.launch train [--placement SPEC] [llamarl train options]\n"
         "(on one host without torchrun: llamarl train)")
# The controller's rank beats from the rendezvous on; a rank waiting for an assignment
# gives up after this long without a beat. Generous: the controller's checks (loading
# a model's config and tokenizer, every dataset line) come before its first assignment,
# and a dead controller rank normally ends the job through torchrun's agent first.
LAUNCH_BEAT, LAUNCH_GRACE_S = "llamarl/launch/controller-beat", 300.0
# torchrun starts the workers once the agents have met, its Store already up: a worker
# that cannot reach it within this long has been given an address that does not lead there.
STORE_CONNECT_TIMEOUT_S = 60.0
ASSIGNMENT_POLL_S = 1.0


def _split_placement(argv: list[str]) -> tuple[str | None, list[str]]:
    """(--placement's value, the other arguments)."""
    rest, spec = [], None
    args = iter(argv)
    for arg in args:
        if arg == "--placement":
            spec = next(args, None)
            if spec is None:
                raise SystemExit("llamarl_core.launch: --placement needs a value, e.g. controller:0,reward:1,"
                                 "trainer:2,generator:3")
        elif arg.startswith("--placement="):
            spec = arg.split("=", 1)[1]
        else:
            rest.append(arg)
    return spec, rest


def controller_rank(spec: str | None) -> int:
    """The rank named `controller:N` in `spec` (0 without a placement), read the same
    way on every rank before anything else is known."""
    if spec is None:
        return 0
    entries = [e.strip() for e in spec.split(",") if e.strip().startswith("controller:")]
    if len(entries) != 1 or not entries[0].split(":", 1)[1].isdigit():
        raise SystemExit(f"llamarl_core.launch: --placement {spec!r} must name exactly one controller rank "
                         "(controller:N)")
    return int(entries[0].split(":", 1)[1])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] != ["train"]:
        raise SystemExit(USAGE)
    if "TORCHELASTIC_RUN_ID" not in os.environ or "RANK" not in os.environ:
        raise SystemExit("llamarl_core.launch runs under torchrun (no RANK / TORCHELASTIC_RUN_ID in the environment)\n"
                         + USAGE)
    use_flags()  # every rank's messages name `llamarl train` flags
    spec, train_argv = _split_placement(argv[1:])
    controller = controller_rank(spec)
    try:
        secret = secret_from_env()
    except (OSError, ValueError) as exc:
        raise SystemExit(f"llamarl_core.launch: {exc}") from None
    if secret is None:
        raise SystemExit(f"llamarl_core.launch: set {SECRET_ENV} (or {SECRET_FILE_ENV}, a file of mode 0600) to the "
                         f"same secret for every rank on every host, e.g. export {SECRET_ENV}=$(python -c 'import "
                         f"secrets; print(secrets.token_hex(32))'): the messages through torchrun's Store are "
                         f"authenticated with it")
    if os.getcwd() not in sys.path:  # --task / --reward modules from the working folder, as `llamarl` does
        sys.path.append(os.getcwd())

    import torch.distributed as dist

    try:
        store, rank, world = next(dist.rendezvous("env://", timeout=datetime.timedelta(seconds=STORE_CONNECT_TIMEOUT_S)))
    except dist.DistError as exc:
        raise SystemExit(f"llamarl_core.launch: cannot reach torchrun's Store at {os.environ.get('MASTER_ADDR')}:"
                         f"{os.environ.get('MASTER_PORT')} ({exc}); where host names do not resolve to the hosts' "
                         "addresses, give torchrun --local-addr ADDRESS on each node") from None
    if controller >= world:
        raise SystemExit(f"llamarl_core.launch: --placement: controller:{controller} is outside the job's {world} "
                         f"ranks (0-{world - 1})")
    if rank == controller:
        return _control(store, world, controller, spec, train_argv, secret)
    return _serve(store, rank, controller, secret)


def _control(store, world: int, controller: int, spec: str | None, train_argv: list[str], secret: bytes) -> int:
    """The controller's rank: `llamarl train` with the job's other ranks as executors."""
    import torch.distributed as dist

    from .control import Heartbeat, StoreQueue
    from .pipeline.placement import Placement
    from .pipeline.processes import LaunchedExecutors, assignment_queue, assignment_secret
    from .pipeline.train_cli import main as train_main

    def executors_for(config) -> LaunchedExecutors:
        if config.generator.backend == "vllm":
            raise ValueError("--generator vllm runs on one host (llamarl train), not under torchrun")
        counts = {"trainer": config.trainer.world, "generator": config.generator.tp * config.generator.replicas}
        placement = Placement.parse(spec, world, counts) if spec else Placement.default(world, counts)
        return LaunchedExecutors(store, placement, assignments, secret)

    beat = Heartbeat(store, LAUNCH_BEAT)
    assignments_secret = assignment_secret(secret)
    assignments = {rank: StoreQueue(store, assignment_queue(rank), assignments_secret) for rank in range(world)
                   if rank != controller}
    code = 1
    try:
        code = train_main(train_argv, executors_for=executors_for)
        return code
    finally:
        # Every other rank waits for an assignment: tell each to return, with this rank's outcome
        # (also when the run was refused before any assignment). A Store already gone (torchrun's
        # agent ended) must not hide the run's own error.
        for queue in assignments.values():
            with contextlib.suppress(dist.DistError):
                queue.put(("exit", {"code": code}))
        beat.stop()


def _serve(store, rank: int, controller: int, secret: bytes) -> int:
    """Any other rank: run the executors the controller assigns, one after another,
    until it says exit (its exit code is this rank's)."""
    import torch.distributed as dist

    from .pipeline.executors import run_executor
    from .control import Heartbeat, HeartbeatWatch, QueueClosed, StoreQueue
    from .pipeline.processes import assignment_queue, assignment_secret, rank_beat, run_secret

    assignments = StoreQueue(store, assignment_queue(rank), assignment_secret(secret))
    controller_alive = HeartbeatWatch(store, LAUNCH_BEAT, grace_s=LAUNCH_GRACE_S)
    # The controller's sign that this rank (and its host) is there; a connection of its own,
    # as an executor's weight-sync waits hold the rank's main one.
    beat = Heartbeat(store.clone(), rank_beat(rank))
    try:
        while True:
            try:
                assignment = assignments.get(ASSIGNMENT_POLL_S)
            except QueueClosed:
                raise SystemExit(f"llamarl_core.launch rank {rank}: the job's Store is gone") from None
            if assignment is None:
                if not controller_alive.alive():
                    raise SystemExit(f"llamarl_core.launch rank {rank}: no heartbeat from the controller (rank "
                                     f"{controller}) for {LAUNCH_GRACE_S:.0f} s")
                continue
            kind, payload = assignment
            if kind == "exit":
                return payload["code"]
            run_executor(payload["role"], payload["rank"], payload["config"],
                         dist.PrefixStore(payload["prefix"], store), payload["extra"],
                         run_secret(secret, payload["prefix"]))
    finally:
        beat.stop()


if __name__ == "__main__":
    from .cli import run_command

    run_command(main)
