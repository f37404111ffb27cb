"""Process bodies for tests/test_netns.py, run inside namespace hosts as
`python netns_workers.py COMMAND ...`. Each reports JSON lines on stdout.
torch is imported only by the gloo command: the socket ones start in ~50 ms."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import sys
import time


def report(**fields) -> None:
    print(json.dumps(fields), flush=True)


def serve(bind_addr: str, port: int, num_clients: int, num_bytes: int) -> None:
    """Accept `num_clients` connections one after another; to each send `num_bytes`
    bytes (then close) or, when 0, its own address as the client saw it."""
    with socket.create_server((bind_addr, port)) as server:
        server.settimeout(20)
        report(event="listening")
        for _ in range(num_clients):
            conn, (client_addr, _client_port) = server.accept()
            with conn:
                if num_bytes:
                    conn.sendall(b"x" * num_bytes)
                else:
                    conn.sendall(json.dumps({"server_addr": conn.getsockname()[0]}).encode())
                report(event="served", client_addr=client_addr)


def connect(addr: str, port: int, timeout_s: float) -> None:
    """Connect and read to EOF; report what arrived, or the error."""
    start = time.perf_counter()
    try:
        with socket.create_connection((addr, port), timeout=timeout_s) as conn:
            local_addr = conn.getsockname()[0]
            chunks, first_byte_at = [], None
            while chunk := conn.recv(1 << 20):
                first_byte_at = first_byte_at or time.perf_counter()
                chunks.append(chunk)
    except OSError as error:
        report(ok=False, error=f"{type(error).__name__}: {error}", elapsed_s=time.perf_counter() - start)
        return
    data = b"".join(chunks)
    end = time.perf_counter()
    report(ok=True, local_addr=local_addr, num_bytes=len(data),
           payload=data.decode() if len(data) < 1000 else None,
           transfer_s=end - (first_byte_at or end))


def gloo_all_reduce(rank: int, world_size: int, master_addr: str, master_port: int, timeout_s: float,
                    wait_for_go: bool) -> None:
    """Form a gloo group (TCPStore on `master_addr`, rank 0 serves it) and all_reduce
    rank + 1: the sum is world_size * (world_size + 1) / 2. With `wait_for_go`, then
    report "ready", wait for a line on stdin (the test cuts a link meanwhile) and
    all_reduce again, reporting whether it failed and how long that took."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(master_addr, master_port, world_size, is_master=rank == 0, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timeout)
    value = torch.tensor([float(rank + 1)])
    dist.all_reduce(value)
    report(event="ready" if wait_for_go else "result", sum=value.item(), ifname=os.environ.get("GLOO_SOCKET_IFNAME"))
    if not wait_for_go:
        dist.destroy_process_group()
        return
    sys.stdin.readline()
    start = time.perf_counter()
    try:
        dist.all_reduce(torch.ones(1))
    except RuntimeError as error:  # gloo raises RuntimeError (DistBackendError) on a timeout
        report(event="after_cut", ok=False, error=str(error)[:300], elapsed_s=time.perf_counter() - start)
    else:
        report(event="after_cut", ok=True, elapsed_s=time.perf_counter() - start)
    # The group's connections are broken: skip destroy_process_group and exit
    # handlers, which may wait on the dead peer.
    os._exit(0)


def main() -> None:
    parser = argparse.ArgumentParser()
    commands = parser.add_subparsers(dest="command", required=True)
    serve_cmd = commands.add_parser("serve")
    serve_cmd.add_argument("--bind-addr", required=True)
    serve_cmd.add_argument("--port", type=int, required=True)
    serve_cmd.add_argument("--num-clients", type=int, default=1)
    serve_cmd.add_argument("--num-bytes", type=int, default=0)
    connect_cmd = commands.add_parser("connect")
    connect_cmd.add_argument("--addr", required=True)
    connect_cmd.add_argument("--port", type=int, required=True)
    connect_cmd.add_argument("--timeout-s", type=float, default=5.0)
    gloo_cmd = commands.add_parser("gloo-all-reduce")
    gloo_cmd.add_argument("--rank", type=int, required=True)
    gloo_cmd.add_argument("--world-size", type=int, required=True)
    gloo_cmd.add_argument("--master-addr", required=True)
    gloo_cmd.add_argument("--master-port", type=int, required=True)
    gloo_cmd.add_argument("--timeout-s", type=float, required=True)
    gloo_cmd.add_argument("--wait-for-go", action="store_true")
    args = parser.parse_args()
    if args.command == "serve":
        serve(args.bind_addr, args.port, args.num_clients, args.num_bytes)
    elif args.command == "connect":
        connect(args.addr, args.port, args.timeout_s)
    else:
        gloo_all_reduce(args.rank, args.world_size, args.master_addr, args.master_port, args.timeout_s,
                        args.wait_for_go)


if __name__ == "__main__":
    main()
