"""The `llamarl` command explains itself: --version, and --help on every command
lists each option with its help and its default."""

import os
import re

import pytest

from llamarl_core import __version__
from llamarl_core.cli import BENCHES, main


def help_text(capsys, *argv: str) -> str:
    with pytest.raises(SystemExit) as stopped:
        main([*argv, "--help"])
    assert stopped.value.code == 0
    return capsys.readouterr().out


def option_entries(text: str) -> dict[str, str]:
    """'--option METAVAR' (or '--flag') -> its help, from argparse's options section."""
    entries, current = {}, None
    for line in text.split("options:\n", 1)[1].splitlines():
        match = re.match(r"  (-\S+(?: \S+)*?)(?:  +(.*))?$", line)
        if match and not line.startswith("   "):
            current = match.group(1)
            entries[current] = match.group(2) or ""
        elif current is not None:
            entries[current] += " " + line.strip()
    return entries


def test_version(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out == f"llamarl {__version__}\n"


# Options whose absence means "none": there is no default to state.
NO_DEFAULT = {"--dataset", "--reward-model", "--into", "--record", "--model", "--json-out", "--json"}


@pytest.mark.parametrize("command", [["train"], ["export"], ["dataset", "arithmetic"], ["check", "gpu"],
                                     *(["bench", name] for name in BENCHES)])
def test_every_option_has_help_and_its_default(capsys, command):
    entries = option_entries(help_text(capsys, *command))
    assert "-h, --help" in entries, entries
    for option, text in entries.items():
        if option.startswith("-h"):
            continue
        takes_value = " " in option.split(", ")[-1]  # '--steps STEPS'; a flag ('--quiet') has no metavar
        assert text.strip(), f"{command}: {option} has no help"
        if takes_value and option.split()[0] not in NO_DEFAULT:
            assert "default" in text, f"{command}: {option} does not say its default: {text!r}"



def test_train_help_states_the_config_defaults(capsys):
    from llamarl_core.ops.objectives import DEFAULTS
    from llamarl_core.pipeline import TrainConfig

    entries = option_entries(help_text(capsys, "train"))
    defaults = TrainConfig().flat()
    for option, value in (("--steps STEPS", defaults["steps"]), ("--max-staleness MAX_STALENESS", defaults["max_staleness"]),
                          ("--segment-tokens SEGMENT_TOKENS", defaults["segment_tokens"]),
                          ("--lr LR", defaults["lr"]), ("--num-heads NUM_HEADS", defaults["num_heads"]),
                          ("--num-kv-heads NUM_KV_HEADS", defaults["num_kv_heads"]),
                          ("--warmup-batch WARMUP_BATCH", defaults["warmup_batch"]),
                          ("--entropy-coef ENTROPY_COEF", defaults["entropy_coef"])):
        assert f"(default: {value:g})" in entries[option], (option, entries[option])
    # A loss parameter's default is the loss's own (ops.objectives.DEFAULTS), each named.
    assert defaults["rho"] is None and "(default: the loss's own: aipo 4, ppo_tis 4, seq_tis 2, geo_mask 2;" in \
        entries["--rho RHO"]
    for option, name in (("--eps-low EPS_LOW", "eps_low"), ("--eps-high EPS_HIGH", "eps_high"),
                         ("--mask-low MASK_LOW", "mask_low"), ("--mask-high MASK_HIGH", "mask_high")):
        assert all(f"{loss} {reads[name]:g}" in entries[option] for loss, reads in DEFAULTS.items() if name in reads)
    assert all(loss in entries["--loss LOSS"] for loss in DEFAULTS)



def test_train_starts_the_executor_forkserver_before_importing_the_pipeline():
    """`llamarl train` launches the executors' forkserver first thing, so that its
    imports and the controller's run side by side: importing the CLI and
    llamarl_core.forkserver imports no torch, start() comes before the pipeline is
    imported, and a process started in the server's context begins with
    torch.distributed, transformers' Llama and this package's executors imported
    (its working directory, /, holds no other llamarl_core), SIGINT ignored and
    OpenMP's spin bounded (GOMP_SPINCOUNT, in the server's environment alone)."""
    import subprocess
    import sys

    preloaded = " and ".join(f"{name!r} in sys.modules" for name in ("torch.distributed",
                                                                   "transformers.models.llama.modeling_llama",
                                                                   "llamarl_core.pipeline.executors.run"))
    child = (f"import os, signal, sys; sys.exit(0 if {preloaded} and signal.getsignal(signal.SIGINT) == signal.SIG_IGN "
             "and os.environ.get('GOMP_SPINCOUNT') == '10000' else 3)")
    script = "\n".join([
        "import sys",
        "from llamarl_core import cli, forkserver",
        "assert 'torch' not in sys.modules, 'importing the CLI imported torch'",
        "real_start = forkserver.start",
        "def start():",
        "    assert 'llamarl_core.pipeline' not in sys.modules, 'the pipeline was imported before the forkserver started'",
        "    real_start()",
        "    assert 'GOMP_SPINCOUNT' not in __import__('os').environ, 'the caller kept the server environment'",
        f"    child = forkserver.context().Process(target=exec, args=({child!r},))",
        "    child.start()",
        "    child.join(120)",
        "    sys.exit(5 if child.exitcode is None else child.exitcode)",
        "forkserver.start = start",
        "cli.main(['train', '--steps', '1'])",
        "sys.exit(4)  # start() was never called",
    ])
    # A caller's own OpenMP setting is left alone (the next test), the tests' own (conftest) among them.
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=180, cwd="/", env=env)
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])


def test_a_callers_own_openmp_wait_setting_is_left_to_the_executors():
    """With OMP_WAIT_POLICY (or GOMP_SPINCOUNT) set by the caller, the forkserver
    adds no spin count of its own: its processes get the caller's environment."""
    import subprocess
    import sys

    script = ("import os\nfrom llamarl_core import forkserver\n"
              "child = forkserver.context().Process(target=exec, args=(\"import os, sys; sys.exit(0 if "
              "'GOMP_SPINCOUNT' not in os.environ and os.environ['OMP_WAIT_POLICY'] == 'PASSIVE' else 3)\",))\n"
              "child.start(); child.join(120); raise SystemExit(child.exitcode)")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=180, cwd="/",
                          env={**os.environ, "OMP_WAIT_POLICY": "PASSIVE"})
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])


def test_the_suites_forkserver_preloads_its_helpers_and_the_pipeline(tmp_path):
    """start(preload=...), as conftest starts the session's server (from tests/): a
    process forked from it begins with those modules imported, this package the one
    the tests import (the installed one, not a source tree's). A preload that is
    not a sequence of dotted module names is refused before anything starts."""
    import llamarl_core
    from llamarl_core import forkserver

    check = ("import sys; sys.exit(0 if all(m in sys.modules for m in ('helpers', 'llamarl_core.pipeline')) "
             f"and sys.modules['llamarl_core'].__file__ == {llamarl_core.__file__!r} else 3)")
    child = forkserver.context().Process(target=exec, args=(check,))
    child.start()
    child.join(120)
    assert child.exitcode == 0
    # The server imported llamarl_core.control.hosts: each forked process still draws its own
    # token (process_identity), as a container's process with an equal pid must not pass for it.
    tokens = tmp_path / "tokens"
    write = (f"from llamarl_core.control.hosts import process_identity; "
             f"open({str(tokens)!r}, 'a').write(process_identity().split('/')[1] + '\\n')")
    for _ in range(2):
        child = forkserver.context().Process(target=exec, args=(write,))
        child.start()
        child.join(120)
        assert child.exitcode == 0
    assert len(set(tokens.read_text().split())) == 2
    for bad in ("helpers", b"helpers", 3, ["helpers", ""], [3], ["a..b"], ["sync workers"]):
        with pytest.raises(ValueError, match="preload must be a sequence of dotted module names"):
            forkserver.start(preload=bad)


def test_the_executors_are_preloaded_only_where_the_server_finds_this_package(tmp_path, monkeypatch):
    """The forkserver preloads this package's executors only where a fresh
    interpreter in the working directory finds the package this process imported:
    not from a folder holding another llamarl_core (a source checkout beside an
    installed package), which Python 3.11's server would import instead."""
    from llamarl_core import forkserver

    monkeypatch.chdir(tmp_path)
    assert forkserver._finds_this_package()
    (tmp_path / "llamarl_core").mkdir()
    (tmp_path / "llamarl_core" / "__init__.py").write_text("")
    assert not forkserver._finds_this_package()


def _processes_with(marker: str) -> list[int]:
    """The pids of live processes whose environment holds `marker`."""
    from pathlib import Path

    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes()
            state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
        except OSError:  # gone, or not ours to read
            continue
        if marker.encode() in environ and state != "Z":
            found.append(int(pid))
    return found


def test_a_command_ends_with_its_forkserver_and_its_exit_status(tmp_path):
    """`llamarl train` ends through cli.run_command: the executors' forkserver it
    launched first thing, which writes to the same stdout and stderr, is stopped
    with it rather than left to tear its modules down afterwards (once the command
    has exited no process of it is left), and its status and one-line error are
    those sys.exit gives. (A run that completes: every test of test_pipeline.py.)"""
    import subprocess
    import sys
    import uuid

    marker = uuid.uuid4().hex
    env = {**{k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}, "LLAMARL_TEST_RUN": marker}
    with open(tmp_path / "err.log", "w+") as err:
        proc = subprocess.Popen([sys.executable, "-m", "llamarl_core.cli", "train", "--steps", "0"],
                                stdout=subprocess.DEVNULL, stderr=err, cwd="/", env=env)
        assert proc.wait(timeout=120) == 1
        assert _processes_with(f"LLAMARL_TEST_RUN={marker}") == []
        err.seek(0)
        message = err.read()
    assert message.startswith("llamarl train: --steps must be >= 1, got 0") and message.count("\n") == 1, message
