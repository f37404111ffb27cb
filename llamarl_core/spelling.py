"""How a message names an option: `--max-new-tokens 48` to a user of `llamarl
train`, `max_new_tokens=48` to a caller of the Python API (TrainConfig,
Controller). The command line says which for its own process: use_flags() in a
command's own process (every rank of llamarl_core.launch), flag_spelling()
around `llamarl train`'s main (it may run in a process of the user's). The
controller hands its spelling to each executor it starts (names_flags, then
set_spelling in the executor's process)."""

from __future__ import annotations

import os
from contextlib import contextmanager

FLAGS_ENV = "LLAMARL_OPTION_SPELLING"
_UNSET = object()


def use_flags() -> None:
    """This process (a command's own), and those it starts from now on, name flags."""
    os.environ[FLAGS_ENV] = "flags"


def names_flags() -> bool:
    """Whether this process's messages name flags."""
    return os.environ.get(FLAGS_ENV) == "flags"


def set_spelling(*, flags: bool) -> None:
    """An executor's process: its messages name flags, or Python arguments, as its
    controller's do."""
    if flags:
        use_flags()
    else:
        os.environ.pop(FLAGS_ENV, None)


@contextmanager
def flag_spelling():
    """Within it, messages of this process, and of the processes it starts, name
    command-line flags."""
    before = os.environ.get(FLAGS_ENV)
    use_flags()
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(FLAGS_ENV, None)
        else:
            os.environ[FLAGS_ENV] = before


def option(name: str, value=_UNSET) -> str:
    """The option `name` (a TrainConfig field), with `value` when given, as the
    user spelled it: "--reward-model" / "--reward-model DIR" under the CLI,
    "reward_model" / "reward_model='DIR'" from Python."""
    if names_flags():
        flag = "--" + name.replace("_", "-")
        return flag if value is _UNSET else f"{flag} {value}"
    return name if value is _UNSET else f"{name}={value!r}"
