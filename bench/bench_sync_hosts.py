"""`llamarl bench sync --hosts`: the weight sync between hosts, over links shaped to
a fixed rate.

The hosts are network namespaces on this machine (llamarl_core.bench.netns; needs
root and iproute2): the trainer ranks on host 0, generator replica r on host 1 + r,
every host's link shaped to --link-rate by a token bucket (tc tbf), so the figure
depends on the rate asked for and not on this machine's loopback speed. The
engine picks its transports by host identity as in a real run: gloo
point-to-point across hosts (shared memory between ranks of one host). Beside
it, in the same run and on the same bytes:
  line rate        the bytes the busiest link carries / --link-rate (the
                   limit): the model once at R <= 2, twice from R = 3 (replica
                   0 feeds two replicas down the binary relay tree)
  R x single       R x the one-replica sync time (a trainer sending to each
                   replica in turn)
  gloo broadcast   trainer rank 0 broadcasts each full tensor to the R x tp
                   generator ranks over the hosts' links
The driver runs inside host 0 (the hosts reach each other, not the root
namespace), holds the Store and starts a zygote in every host through `ip netns
exec`, which forks that host's ranks.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist

from llamarl_core.bench.bench_sync import (
    DTYPES,
    _broadcast_rank,
    _engine_rank,
    _engine_ranks,
    _run_methods,
    _sender_threads,
    _WAIT,
    model_bytes,
    model_config,
)
from llamarl_core.bench.harness import emit, record, share_secret, summarize, table
from llamarl_core.bench.netns import NetnsHosts, NetnsUnavailable, parse_rate_bits
from llamarl_core.bench.versions import check_version_folders
from llamarl_core.sync import plan_transfer
from llamarl_core.sync.presets import hf_llama_fsdp, vllm_llama_tp
from llamarl_core.sync.plan import relay_tree

# The whole measurement, start-up included, may take this long.
DRIVE_TIMEOUT_S = 3600
# What a round of every method may take at most, of the ranks' wait for their next
# round (_WAIT): the others' rounds run meanwhile.
ROUND_SHARE_OF_WAIT = 0.8
# What the ranks' tensors may take of the memory available (the processes take more).
MEMORY_SHARE = 0.6
# What the driver and the ranks run (`python -m`; this file is __main__ in them).
MODULE = "llamarl_core.bench.bench_sync_hosts"
# prctl(PR_SET_PDEATHSIG, signal): the signal a process gets when its parent dies (Linux, as the hosts are).
_PRCTL = ctypes.CDLL(None, use_errno=True).prctl
_PR_SET_PDEATHSIG = 1


class _Zygote:
    """The driver's end of a zygote (`_zygote_main`): a process in one namespace
    host that has imported this module (torch, the sync) and forks each rank of
    that host on request, so that a host's ranks share one start-up (2.3 CPU-s
    each, 14 ranks in the tests' run) instead of importing torch each. A thread
    reads its reports: each rank's pid as it starts, its exit code as it ends."""

    START_TIMEOUT_S = 120.0  # the zygote's imports included

    def __init__(self, host: dict):
        # gloo binds the interface the hosts share (its default would be the hostname's address).
        # From /: the installed package is imported, never the sources of the current folder;
        # stdout a pipe for its reports, stderr (the ranks' stdout too) the driver's.
        argv = ["ip", "netns", "exec", host["name"], sys.executable, "-m", MODULE, "zygote"]
        self.proc = subprocess.Popen(argv, env={**os.environ, "GLOO_SOCKET_IFNAME": host["ifname"]},
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd="/", text=True)
        self.name = host["name"]
        self.changed = threading.Condition()
        self.started: list[int] = []
        self.exited: dict[int, int] = {}
        self.gone = False  # its reports ended: every rank it did not report as exited is lost with it
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        try:
            for line in self.proc.stdout:
                match line.split():
                    case ["started", pid] if pid.isdigit():
                        with self.changed:
                            self.exited.pop(int(pid), None)  # a pid the system gave again
                            self.started.append(int(pid))
                            self.changed.notify_all()
                    case ["exited", pid, code] if pid.isdigit():
                        with self.changed:
                            self.exited[int(pid)] = int(code)
                            self.changed.notify_all()
                    case _:
                        print(f"host {self.name}'s zygote: {line.rstrip()}", file=sys.stderr)
        finally:
            with self.changed:
                self.gone = True
                self.changed.notify_all()

    def fork(self, call: dict) -> int:
        """Start a rank running `call`; its pid."""
        with self.changed:
            count = len(self.started)
            try:
                self.proc.stdin.write(json.dumps(call) + "\n")
                self.proc.stdin.flush()
            except OSError:  # its end of the pipe is closed: it is gone
                self.changed.wait_for(lambda: self.gone, self.START_TIMEOUT_S)
            if not self.changed.wait_for(lambda: len(self.started) > count or self.gone, self.START_TIMEOUT_S):
                raise RuntimeError(f"host {self.name}'s zygote started no rank within {self.START_TIMEOUT_S:.0f} s")
            if len(self.started) == count:
                raise RuntimeError(f"host {self.name}'s zygote exited (code {self.proc.poll()})")
            return self.started[count]

    def exitcode(self, pid: int) -> int | None:
        with self.changed:
            return self.exited.get(pid, -signal.SIGKILL if self.gone else None)

    def join(self, pid: int, timeout: float | None) -> None:
        with self.changed:
            self.changed.wait_for(lambda: pid in self.exited or self.gone, timeout)

    @staticmethod
    def kill(pid: int) -> None:
        """SIGKILL a rank it started (the hosts share the pid namespace); nothing if it is gone."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)

    def kill_ranks(self) -> None:
        """SIGKILL every rank it started that has not exited."""
        with self.changed:
            running = [pid for pid in self.started if pid not in self.exited]
        for pid in running:
            self.kill(pid)


def _close_zygotes(zygotes: list[_Zygote], kill: bool) -> None:
    """No more ranks: each zygote exits once the ranks it started have (with `kill`,
    they are killed first: the driver failed, and they would wait out their rounds).
    Past the ranks' wait, a zygote is killed, and its ranks with it (PR_SET_PDEATHSIG)."""
    for zygote in zygotes:
        if kill:
            zygote.kill_ranks()
        with contextlib.suppress(OSError):  # one already gone
            zygote.proc.stdin.close()
    deadline = time.monotonic() + _WAIT.total_seconds()
    for zygote in zygotes:
        try:
            zygote.proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            zygote.proc.kill()
            zygote.proc.wait()
        zygote.reader.join()


def _zygote_main() -> None:
    """The `zygote` command: fork a rank for each call read from stdin (a JSON line),
    report "started PID" and "exited PID CODE" on stdout; end when stdin closes and
    every rank has exited. Single-threaded, and no torch op runs here before a fork
    (what makes forking safe; llamarl_core.forkserver's rule)."""
    reports = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # the ranks' prints go to the driver's stderr
    pending, reading, running = b"", True, set()
    while reading or running:
        if reading and select.select([0], [], [], 0.05)[0]:
            chunk = os.read(0, 65536)
            reading = bool(chunk)
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                pid = os.fork()
                if pid == 0:
                    reports.close()
                    _PRCTL(_PR_SET_PDEATHSIG, signal.SIGKILL)  # a zygote that dies takes its ranks with it
                    devnull = os.open(os.devnull, os.O_RDONLY)
                    os.dup2(devnull, 0)
                    os.close(devnull)
                    code = 1
                    try:
                        _rank_main(json.loads(line))
                        code = 0
                    except SystemExit as stop:  # as a process's exit status reads it
                        code = stop.code if isinstance(stop.code, int) else int(stop.code is not None)
                    except BaseException:
                        traceback.print_exc()
                    finally:
                        sys.stdout.flush()
                        sys.stderr.flush()
                        os._exit(code)
                running.add(pid)
                reports.write(f"started {pid}\n")
                reports.flush()
        elif not reading:
            time.sleep(0.05)
        while running:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            running.discard(pid)
            reports.write(f"exited {pid} {os.waitstatus_to_exitcode(status)}\n")
            reports.flush()


class _HostRank:
    """A rank run in a namespace host, forked by that host's zygote, with the handle
    _run_methods expects of a multiprocessing.Process (start, exitcode, join,
    is_alive, kill)."""

    def __init__(self, zygote: _Zygote, call: dict):
        self.zygote, self.call, self.pid = zygote, call, None

    def start(self) -> None:
        self.pid = self.zygote.fork(self.call)

    @property
    def exitcode(self):
        return None if self.pid is None else self.zygote.exitcode(self.pid)

    def join(self, timeout=None) -> None:
        if self.pid is not None:  # never started: nothing to wait for
            self.zygote.join(self.pid, timeout)

    def is_alive(self) -> bool:
        return self.pid is not None and self.exitcode is None

    def kill(self) -> None:
        self.zygote.kill(self.pid)


def _rank_main(call: dict) -> None:
    """One rank (the `rank` command): an engine rank or a broadcast rank."""
    spec = SimpleNamespace(**call["spec"])
    if call["kind"] == "engine":
        _engine_rank(call["store_at"], call["role"], call["rank"], spec, "auto", call["rounds"], call["threads"],
                     replica=call["replica"], num_replicas=call["num_replicas"], method=call["method"],
                     delta_fraction=call.get("delta_fraction"), delta_versions=call.get("delta_versions"))
    else:
        _broadcast_rank(call["store_at"], call["rank"], spec, call["rounds"], receivers=call["receivers"],
                        method=call["method"])


def _drive(spec: SimpleNamespace, hosts: list[dict]) -> dict:
    """Inside host 0: time every method, rounds interleaved (the `drive` command)."""
    zygotes = [_Zygote(host) for host in hosts]  # importing while the rest is set up
    done = False
    try:
        result = _drive_ranks(spec, hosts[0]["addr"], zygotes)
        done = True
        return result
    finally:
        _close_zygotes(zygotes, kill=not done)


def _drive_ranks(spec: SimpleNamespace, addr: str, hosts: list[_Zygote]) -> dict:
    """_drive with each host's zygote: every method's ranks forked there."""
    store = dist.TCPStore(addr, 0, is_master=True, timeout=_WAIT)
    store_at = f"{addr}:{store.port}"
    rounds = spec.warmup + spec.repeats
    threads = _sender_threads(spec)
    common = {"store_at": store_at, "spec": vars(spec), "rounds": rounds}
    methods = {}
    for r in spec.counts:
        method = f"engine{r}"
        methods[method] = _engine_ranks(spec, r, lambda role, rank, replica: _HostRank(
            hosts[0] if role == "src" else hosts[1 + replica],
            {**common, "kind": "engine", "method": method, "role": role, "rank": rank, "threads": threads,
             "replica": replica, "num_replicas": r}))
        method = f"bcast{r}"
        receivers = r * spec.tp
        ranks = [_HostRank(hosts[0 if rank == 0 else 1 + (rank - 1) // spec.tp],
                           {**common, "kind": "bcast", "method": method, "rank": rank, "receivers": receivers})
                 for rank in range(1 + receivers)]
        methods[method] = (ranks, [f"rank{rank}" for rank in range(1 + receivers)])
    for fraction in spec.delta or []:
        method = f"delta{fraction}"
        methods[method] = _engine_ranks(spec, 1, lambda role, rank, replica: _HostRank(
            hosts[0] if role == "src" else hosts[1],
            {**common, "kind": "engine", "method": method, "role": role, "rank": rank, "threads": threads,
             "replica": 0, "num_replicas": 1, "delta_fraction": fraction}))
    for index, folder in enumerate(spec.delta_versions or []):
        method = f"versions{index}"
        methods[method] = _engine_ranks(spec, 1, lambda role, rank, replica: _HostRank(
            hosts[0] if role == "src" else hosts[1],
            {**common, "kind": "engine", "method": method, "role": role, "rank": rank, "threads": threads,
             "replica": 0, "num_replicas": 1, "delta_versions": folder}))
    times = _run_methods(store, methods, rounds, spec.warmup)
    # What each delta method's trainer ranks put on the wire in every round, beside a full sync's bytes.
    keys = ("wire_bytes", "full_bytes", "changed", "elements", "dense_buckets", "delta_buckets")
    sent = {}
    for method in [f"delta{f}" for f in spec.delta or []] + [f"versions{i}" for i in range(len(spec.delta_versions or []))]:
        ranks = [json.loads(store.get(f"{method}/stats/{rank}")) for rank in range(spec.fsdp)]
        sent[method] = [{key: sum(r[i][key] for r in ranks) for key in keys} for i in range(rounds)]
    return {"times": times, "sent": sent}


def _busiest_link(replicas: int) -> int:
    """How many copies of the model the busiest link carries per sync: the trainer
    host's one, or a replica's feeding its children down the relay tree."""
    return max(1, *(len(children) for children in relay_tree(replicas).values()))


def _relay_depth(replicas: int) -> int:
    """Links in a row from the trainer host to the deepest replica."""
    depth = {0: 1}
    for parent, children in sorted(relay_tree(replicas).items()):
        depth.update({child: depth[parent] + 1 for child in children})
    return max(depth.values())


def _check_fits(spec, counts: list[int], nbytes: int, rate_bits: int) -> None:
    """Refuse, before any host is made, a run whose rounds would outlast the ranks'
    waits or whose tensors would not fit in memory, naming the figures."""
    line_s = nbytes * 8 / rate_bits
    # Per round: each R's engine sync (a version goes down the tree whole, link after link) and
    # its broadcast (the full model to each of the R x tp ranks from one link).
    # A delta sync: up to about 4 line-times here (its computation, at half the elements changed).
    deltas = len(spec.delta or []) + len(spec.delta_versions or [])
    round_s = sum(_relay_depth(r) * line_s + r * spec.tp * line_s for r in counts) + 4 * deltas * line_s
    if round_s > ROUND_SHARE_OF_WAIT * _WAIT.total_seconds():
        raise SystemExit(f"--hosts: one round of every method would take about {round_s:.0f} s at {spec.link_rate} "
                         f"({nbytes / 2**20:.0f} MiB model, R = {counts}), past the ranks' "
                         f"{_WAIT.total_seconds():.0f} s wait: a smaller model, fewer --replicas or a higher "
                         "--link-rate")
    # Trainer shards, each replica's tensors, the broadcast's full copies on every rank.
    src_bytes = nbytes * DTYPES[spec.src_dtype].itemsize // torch.bfloat16.itemsize
    needed = sum(src_bytes + r * nbytes + (1 + r * spec.tp) * nbytes for r in counts)
    needed += deltas * (src_bytes + 2 * nbytes)  # shards, the senders' bases, the replica
    with open("/proc/meminfo") as f:
        available = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    if needed > MEMORY_SHARE * available:
        raise SystemExit(f"--hosts: the ranks' tensors would take {needed / 2**30:.1f} GiB, "
                         f"{available / 2**30:.1f} GiB is available: a smaller model or fewer --replicas")


def run_hosts(spec) -> dict:
    """Make 1 + max(R) namespace hosts, shape their links, drive the methods from
    host 0 and return the figures (SystemExit when namespaces cannot be made or
    the measurement fails)."""
    share_secret()
    config = model_config(spec)
    nbytes = model_bytes(config, torch.bfloat16)
    counts = sorted({1, *spec.replicas})
    src_layout = hf_llama_fsdp(config, spec.fsdp, DTYPES[spec.src_dtype])
    dst_layout = vllm_llama_tp(config, spec.tp, torch.bfloat16)
    sent = {r: plan_transfer(src_layout, dst_layout, num_replicas=r).bytes_sent_by_src_rank() for r in counts}
    rate_bits = parse_rate_bits(spec.link_rate)
    _check_fits(spec, counts, nbytes, rate_bits)
    drive = {key: value for key, value in vars(spec).items() if key in (
        "hidden", "intermediate", "layers", "heads", "kv_heads", "vocab", "fsdp", "tp", "src_dtype", "threads",
        "warmup", "repeats", "delta", "delta_versions")}
    drive.update(counts=counts, device="cpu", fp8=None)  # --fp8 is refused with --hosts
    try:
        hosts = NetnsHosts(1 + max(counts)).start()
    except NetnsUnavailable as error:
        raise SystemExit(f"--hosts: network namespace hosts cannot be made here: {error}") from None
    with hosts:
        try:
            for host in hosts:
                host.shape(spec.link_rate)
        except subprocess.CalledProcessError as error:
            raise SystemExit(f"--hosts: the links cannot be shaped (tc's tbf): {error.stderr.strip()}") from None
        described = [{"name": h.name, "addr": h.addr, "ifname": h.ifname} for h in hosts]
        try:
            done = hosts[0].run([sys.executable, "-m", MODULE, "drive", json.dumps(drive), json.dumps(described)],
                                timeout=DRIVE_TIMEOUT_S, check=False, cwd="/")
        except subprocess.TimeoutExpired as error:
            raise SystemExit(f"--hosts: the measurement took over {DRIVE_TIMEOUT_S} s:\n"
                             f"{(error.stderr or '')[-4000:]}") from None
    if done.returncode != 0:
        raise SystemExit(f"--hosts: the measurement failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
    measured = json.loads(done.stdout)
    times = measured["times"]
    single = summarize(times["engine1"])["median"]
    rows = []
    for r in counts:
        line_rate_s = _busiest_link(r) * nbytes * 8 / rate_bits
        engine, bcast = summarize(times[f"engine{r}"]), summarize(times[f"bcast{r}"])
        rows.append({"replicas": r, "seconds": engine, "naive_seconds": r * single,
                     "broadcast_seconds": bcast, "line_rate_seconds": line_rate_s,
                     "fraction_of_line_rate": line_rate_s / engine["median"],
                     "speedup_vs_broadcast": bcast["median"] / engine["median"]})
    deltas = []
    for fraction in spec.delta or []:
        delta, wire = summarize(times[f"delta{fraction}"]), measured["sent"][f"delta{fraction}"][-1]
        deltas.append({"fraction": fraction, "seconds": delta, "full_seconds": single,
                       "time_vs_full": delta["median"] / single, "wire_vs_full": wire["wire_bytes"] / wire["full_bytes"],
                       "changed_fraction": wire["changed"] / max(1, wire["elements"]), **wire})
    versions = []
    for index, folder in enumerate(spec.delta_versions or []):
        timed = measured["sent"][f"versions{index}"][spec.warmup:]  # the timed rounds, versions warmup ..
        delta = summarize(times[f"versions{index}"])
        versions.append({
            "folder": folder, "versions": [spec.warmup, spec.warmup + len(timed) - 1], "seconds": delta,
            "full_seconds": single, "time_vs_full": delta["median"] / single,
            "wire_vs_full": sum(r["wire_bytes"] for r in timed) / sum(r["full_bytes"] for r in timed),
            "changed_fraction": [r["changed"] / max(1, r["elements"]) for r in timed],
            "dense_buckets": sum(r["dense_buckets"] for r in timed),
            "buckets": sum(r["dense_buckets"] + r["delta_buckets"] for r in timed)})
    return {"model_bytes": nbytes, "config": dict(vars(config)), "fsdp": spec.fsdp, "tp": spec.tp,
            "src_dtype": spec.src_dtype, "link_rate": spec.link_rate, "link_rate_bits": rate_bits,
            "repeats": spec.repeats, "bytes_sent_by_src_rank": {str(r): b for r, b in sent.items()}, "rows": rows,
            "deltas": deltas, "versions": versions}


def report_hosts(result: dict) -> str:
    rows = [["R", "sync median s", "min s", "max s", "R x single s", "gloo broadcast s", "line rate s (limit)",
             "limit / sync", "broadcast / sync"]]
    for row in result["rows"]:
        s, b = row["seconds"], row["broadcast_seconds"]
        rows.append([str(row["replicas"]), f"{s['median']:.3f}", f"{s['min']:.3f}", f"{s['max']:.3f}",
                     f"{row['naive_seconds']:.3f}", f"{b['median']:.3f}", f"{row['line_rate_seconds']:.3f}",
                     f"{row['fraction_of_line_rate']:.2f}", f"{row['speedup_vs_broadcast']:.2f}x"])
    sent = result["bytes_sent_by_src_rank"]
    per_rank = ", ".join(f"rank {k}: {v}" for k, v in sent["1"].items())
    head = (f"Model {result['model_bytes'] / 2**20:.1f} MiB bf16 ({result['config']['num_hidden_layers']} layers, "
            f"hidden {result['config']['hidden_size']}), FSDP {result['fsdp']} ({result['src_dtype']}) on host 0 -> "
            f"replica r (TP {result['tp']}, bf16) on host 1 + r; network-namespace hosts, every link shaped to "
            f"{result['link_rate']} (tc tbf); {result['repeats']} timed syncs each, methods interleaved. The line "
            f"rate is the bytes of the busiest link (the model once, twice from R = 3: replica 0 feeds two "
            f"replicas) at the link's rate; the gloo broadcast sends every full tensor from trainer rank 0 to "
            f"each generator rank.")
    return (f"{head}\n\n{table(rows)}\n\nBytes sent per trainer rank per sync: {per_rank}, the same for R = "
            f"{', '.join(sent)}.\n")


def report_deltas(result: dict) -> str:
    """The --delta table (empty without --delta)."""
    text = ""
    if result.get("deltas"):
        rows = [["elements changed", "changed, last sync", "delta sync median s", "min s", "max s",
                 "full sync s (same run)", "delta / full", "wire bytes / full", "buckets whole"]]
        for row in result["deltas"]:
            s = row["seconds"]
            rows.append([f"{row['fraction']:g}", f"{row['changed_fraction']:.4f}", f"{s['median']:.3f}",
                         f"{s['min']:.3f}", f"{s['max']:.3f}",
                         f"{row['full_seconds']:.3f}", f"{row['time_vs_full']:.3f}", f"{row['wire_vs_full']:.4f}",
                         f"{row['dense_buckets']} of {row['dense_buckets'] + row['delta_buckets']}"])
        text = (f"Model {result['model_bytes'] / 2**20:.1f} MiB bf16, FSDP {result['fsdp']} ({result['src_dtype']}) on "
                f"host 0 -> one replica (TP {result['tp']}, bf16) on host 1, links shaped to {result['link_rate']}; "
                f"deltas (WeightSender delta=True): before every sync after the first, each trainer rank changes "
                f"that fraction of its elements (drawn at random, each at most once); {result['repeats']} timed syncs "
                f"each, interleaved with the full sync's; wire bytes and buckets sent whole are the last sync's "
                f"(WeightSender.last_send).\n\n{table(rows)}\n")
    return text


def report_versions(result: dict) -> str:
    """The --delta-versions table (empty without it)."""
    if not result.get("versions"):
        return ""
    rows = [["run (folder)", "versions", "delta sync median s", "min s", "max s", "full sync s (same run)",
             "delta / full", "wire bytes / full", "elements changed per version", "buckets whole"]]
    for row in result["versions"]:
        s, changed = row["seconds"], row["changed_fraction"]
        rows.append([os.path.basename(row["folder"].rstrip("/")), f"{row['versions'][0]}-{row['versions'][1]}",
                     f"{s['median']:.3f}", f"{s['min']:.3f}", f"{s['max']:.3f}", f"{row['full_seconds']:.3f}",
                     f"{row['time_vs_full']:.3f}", f"{row['wire_vs_full']:.4f}",
                     f"{100 * min(changed):.2f}-{100 * max(changed):.2f}%",
                     f"{row['dense_buckets']} of {row['buckets']}"])
    return (f"Model {result['model_bytes'] / 2**20:.1f} MiB bf16, FSDP {result['fsdp']} ({result['src_dtype']}) on "
            f"host 0 -> one replica (TP {result['tp']}, bf16) on host 1, links shaped to {result['link_rate']}; "
            "deltas (WeightSender delta=True) of a real run's consecutive versions (saved by "
            "llamarl_core.bench.versions:save_versions, bf16): round i sends version i, the first rounds untimed; "
            "beside the full sync of the same model in the same run; wire bytes summed over the timed rounds "
            "(WeightSender.last_send).\n\n" + table(rows) + "\n")


def _check_versions(spec) -> None:
    """--delta-versions' folders: readable, one model, enough versions for the
    rounds, a plan at --fsdp / --tp."""
    if not spec.hosts:
        raise SystemExit("--delta-versions measures deltas across hosts: it needs --hosts")
    if spec.warmup < 1:
        raise SystemExit(f"--delta-versions needs --warmup 1 or more (a delta sender's first sync is whole), "
                         f"got {spec.warmup}")
    try:
        check_version_folders(spec.delta_versions, spec.warmup + spec.repeats)
        plan_transfer(hf_llama_fsdp(model_config(spec), spec.fsdp, DTYPES[spec.src_dtype]),
                      vllm_llama_tp(model_config(spec), spec.tp, torch.bfloat16))
    except ValueError as error:
        raise SystemExit(f"--delta-versions: {error}") from None


def main_hosts(spec) -> int:
    """`llamarl bench sync --hosts` (and --delta, --delta-versions): measure, record, print."""
    if spec.delta_versions:
        _check_versions(spec)
    if spec.device != "cpu" or spec.transports:
        raise SystemExit("--hosts times host tensors with the transports a run picks: no --device cuda, no --transports")
    spec.replicas = spec.replicas or [1]
    try:
        parse_rate_bits(spec.link_rate)
    except ValueError as error:
        raise SystemExit(f"--link-rate: {error}") from None
    result = run_hosts(spec)
    section = (f"Weight sync across hosts: {result['model_bytes'] / 2**20:.0f} MiB, FSDP {spec.fsdp} {spec.src_dtype} "
               f"-> R x TP {spec.tp} bf16, links at {spec.link_rate} (`llamarl bench sync --hosts`)")
    params = {"fsdp": spec.fsdp, "tp": spec.tp, "bytes": result["model_bytes"], "src_dtype": spec.src_dtype,
              "link_rate": spec.link_rate}
    mib, flow = result["model_bytes"] / 2**20, f"FSDP {spec.fsdp} {spec.src_dtype} -> TP {spec.tp} bf16"
    tables = []  # (bench, its section, its rows, the row's own parameter, the table)
    if spec.delta_versions:
        tables.append(("sync_delta_versions", f"Delta weight sync across hosts, a real run's versions: {mib:.0f} MiB, "
                       f"{flow}, links at {spec.link_rate} (`llamarl bench sync --hosts --delta-versions`)",
                       [(row, {"versions": Path(row["folder"]).name}) for row in result["versions"]],
                       report_versions(result)))
    if spec.delta:  # a section of its own: the replicas' section keeps its counts
        tables.append(("sync_delta_hosts", f"Delta weight sync across hosts: {mib:.0f} MiB, {flow}, links at "
                       f"{spec.link_rate} (`llamarl bench sync --hosts --delta`)",
                       [(row, {"fraction": row["fraction"]}) for row in result["deltas"]], report_deltas(result)))
    for bench, delta_section, rows, text in tables:
        for row, own in rows:
            record(spec.record, bench, {"seconds": row["seconds"]["median"], "time_vs_full": row["time_vs_full"],
                                        "wire_vs_full": row["wire_vs_full"]}, params | own, delta_section, text)
    if not (spec.delta or spec.delta_versions):
        for row in result["rows"]:
            record(spec.record, "sync_hosts", {"seconds": row["seconds"]["median"],
                                               "fraction_of_line_rate": row["fraction_of_line_rate"],
                                               "speedup_vs_broadcast": row["speedup_vs_broadcast"]},
                   params | {"replicas": row["replicas"]}, section, report_hosts(result))
    emit(spec, result, report_hosts(result) + ("\n" + report_deltas(result) if spec.delta else "")
         + ("\n" + report_versions(result) if spec.delta_versions else ""))
    return 0


if __name__ == "__main__":
    command, *arguments = sys.argv[1:]
    if command == "zygote":
        _zygote_main()
    elif command == "drive":
        print(json.dumps(_drive(SimpleNamespace(**json.loads(arguments[0])), json.loads(arguments[1]))), flush=True)
    else:
        raise SystemExit(f"unknown command {command!r} (zygote, drive: run by `llamarl bench sync --hosts`)")
