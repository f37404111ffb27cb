"""One GPU shared by the trainer and generator through MPS (pipeline/gpu_share.py):
the option's parsing and refusals here; the daemon itself, marked gpu, where
nvidia-cuda-mps-control and a GPU are."""

import os
import shutil
import socket
import subprocess
import sys
import time

import pytest
from helpers import llamarl_here

from llamarl_core.pipeline import TrainConfig
from llamarl_core.pipeline.gpu_share import CONTROL, MpsDaemon, generator_percent, role_percent
from llamarl_core.spelling import flag_spelling


def test_gpu_share_gives_the_generator_p_percent_and_the_trainer_the_rest():
    assert generator_percent("none") is None
    for p in (1, 37, 50, 99):
        assert generator_percent(f"mps:{p}") == p
        assert (role_percent(f"mps:{p}", "generator"), role_percent(f"mps:{p}", "trainer")) == (p, 100 - p)
        assert role_percent(f"mps:{p}", "reward") is None  # touches no GPU: not a client
    assert role_percent("none", "generator") is None


@pytest.mark.parametrize("bad", ["mps", "mps:0", "mps:100", "mps:-5", "mps:50.5", "green:50", "MPS:50", "", "mps:"])
def test_gpu_share_refuses_what_it_does_not_describe(bad):
    with pytest.raises(ValueError, match=r"gpu_share=.*must be 'none' or 'mps:P'"):
        generator_percent(bad)
    with pytest.raises(ValueError, match="must be 'none' or 'mps:P'"):
        TrainConfig(device="cuda", gpu_share=bad)


def test_gpu_share_needs_our_generator_on_a_gpu_in_async_mode():
    with pytest.raises(ValueError, match=r"gpu_share='mps:50' shares one GPU .* needs device='cuda'"):
        TrainConfig(gpu_share="mps:50")
    with pytest.raises(ValueError, match=r"generator='llama'"):
        TrainConfig(device="cuda", generator="vllm", gpu_share="mps:50")
    with pytest.raises(ValueError, match=r"mode='sync' runs them one after the other"):
        TrainConfig(device="cuda", mode="sync", gpu_share="mps:50")
    assert TrainConfig(device="cuda", gpu_share="mps:50").generator.gpu_share == "mps:50"


def test_the_cli_names_the_flag(tmp_path):
    proc = llamarl_here("train", "--out", str(tmp_path / "run"), "--gpu-share", "mps:120")
    assert proc.returncode != 0 and "--gpu-share mps:120: must be 'none' or 'mps:P'" in proc.stderr, proc.stderr
    assert not (tmp_path / "run").exists()


def test_a_missing_control_program_is_said_before_anything_starts(monkeypatch):
    if shutil.which(CONTROL):
        pytest.skip(f"{CONTROL} is installed here")
    before = set(os.listdir("/tmp"))
    with pytest.raises(RuntimeError, match=f"gpu_share mps: {CONTROL} is not on PATH"):
        MpsDaemon.start()
    assert not [name for name in set(os.listdir("/tmp")) - before if name.startswith("llamarl-mps-")]


def test_the_daemon_counts_alive_while_its_socket_answers_not_while_its_file_stays(tmp_path):
    """stop() waits for the daemon by its control socket, not by the socket's file,
    which a daemon that quit leaves behind (on an H200 the old check waited out its
    30 s after a quit the daemon's log put at 22 ms): a listener answers; a file
    nobody listens on, or none, does not, and stop() then removes the folder at once."""
    daemon = MpsDaemon(CONTROL, tmp_path / "mps", tmp_path / "mps" / "log")
    daemon.pipe.mkdir(parents=True)
    assert not daemon.answers()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(daemon.pipe / "control"))
    listener.listen()
    try:
        assert daemon.answers() and daemon.answers()  # each probe accepted into the queue, or taken
    finally:
        listener.close()
    assert (daemon.pipe / "control").exists() and not daemon.answers()
    started = time.monotonic()
    assert daemon.stop() and not daemon.folder.exists() and time.monotonic() - started < 1
    # A socket it cannot reach (its path past AF_UNIX's 108 bytes): an error, not "alive"; stop() keeps the folder.
    far = MpsDaemon(CONTROL, tmp_path / ("x" * 120), tmp_path / "log")
    far.pipe.mkdir(parents=True)
    with pytest.raises(OSError):
        far.answers()
    assert not far.stop() and far.folder.exists()


@pytest.mark.gpu(seconds=36)
def test_the_daemon_serves_a_capped_client_and_quits():
    """A process given client_env(25) initialises CUDA through the run's daemon (whose
    server starts at a client's first connection: get_server_list names it) and
    computes there; after stop() the daemon's pipe and folder are gone. (What the cap
    does to speed is a bench figure: bench pipeline --gpu-share.)"""
    if shutil.which(CONTROL) is None:
        pytest.skip(f"{CONTROL} is not on PATH")
    client = ("import torch; a = torch.randn(1024, 1024, device='cuda'); "
              "print(torch.cuda.get_device_properties(0).multi_processor_count, float((a @ a).sum()))")
    daemon = MpsDaemon.start()
    try:
        env = {**os.environ, **daemon.client_env(25)}
        ran = subprocess.run([sys.executable, "-c", client], env=env, capture_output=True, text=True, timeout=120)
        servers = subprocess.run([shutil.which(CONTROL)], input="get_server_list\n", env=env, capture_output=True,
                                 text=True, timeout=30)
    finally:
        quit_in_time = daemon.stop()
    print("client at 25%: SMs seen, sum:", ran.stdout.strip(), "; MPS servers:", servers.stdout.strip())
    assert ran.returncode == 0, ran.stderr[-2000:]
    assert servers.returncode == 0 and servers.stdout.split(), servers.stdout + servers.stderr
    assert quit_in_time and not (daemon.pipe / "control").exists() and not daemon.folder.exists()


@pytest.mark.gpu
def test_the_controller_refuses_a_share_it_cannot_start_before_anything_is_written(tmp_path):
    """(Its GPU count is checked first: without a GPU that check answers.)"""
    from llamarl_core.pipeline import Controller

    if shutil.which(CONTROL):
        pytest.skip(f"{CONTROL} is installed here")
    with pytest.raises(ValueError, match=f"gpu_share='mps:50': {CONTROL} is not on PATH"):
        Controller(TrainConfig(device="cuda", gpu_share="mps:50"), tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_compare_gives_the_share_to_its_async_run_alone():
    """--compare runs sync then async from one set of flags: the sync run's phases
    take turns, each with the whole GPU, so --gpu-share is the async run's."""
    from llamarl_core.pipeline.train_cli import _config, parse_args

    args = parse_args(["--compare", "--device", "cuda", "--gpu-share", "mps:40"])
    assert (_config(args, "sync").generator.gpu_share, _config(args, "async").generator.gpu_share) == ("none", "mps:40")
    with flag_spelling(), pytest.raises(SystemExit, match="--mode sync runs them one after the other"):
        _config(parse_args(["--mode", "sync", "--device", "cuda", "--gpu-share", "mps:40"]), "sync")
