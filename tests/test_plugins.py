"""The pipeline opened to code of yours: plug-ins by object or module:attribute
(a Generator class, an advantage estimator, a loss, a step hook, a reward),
checked before any executor starts, and a transformers-generate generator
(tests/pipeline_tasks.py, not ours) running under the controller."""

import json
import runpy
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from pipeline_tasks import HFGenerateGenerator
from test_pipeline import FAST, TASKS_ENV, llamarl, read_metrics

from llamarl_core.pipeline import Controller, Generator, TrainConfig


def module_level_function(rewards, group_ids):
    return rewards


def test_plugins_are_kept_by_their_importable_names():
    config = TrainConfig(generator=HFGenerateGenerator, advantage=module_level_function)
    assert config.generator.backend == "pipeline_tasks:HFGenerateGenerator"
    assert config.loss.advantage == "test_plugins:module_level_function"
    assert TrainConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config  # config.json round trip

    def local(rewards, group_ids):
        return rewards

    for bad, match in ((lambda r, g: r, "lambda or defined inside a function"),
                       (local, "lambda or defined inside a function"), (object(), "object instance")):
        with pytest.raises(ValueError, match=match):
            TrainConfig(advantage=bad)
    with pytest.raises(ValueError, match=r"generator must be one of \('llama', 'vllm'\) or module:Class"):
        TrainConfig(generator="sglang")
    with pytest.raises(ValueError, match="is one replica"):
        TrainConfig(generator=HFGenerateGenerator, generator_replicas=2)


class NotAGenerator:
    pass


class HalfAGenerator(Generator):
    def submit(self, samples):
        pass


@pytest.mark.parametrize("fields, match", [
    (dict(reward="pipeline_tasks:two_argument_reward"),
     r"^reward term 'pipeline_tasks:two_argument_reward': pipeline_tasks:two_argument_reward\(prompts, "
     r"completions\) cannot be called with 3 arguments"),
    (dict(reward="pipeline_tasks:text_reward"), r"returned 'good' \(str\) among its scores"),
    (dict(reward="pipeline_tasks:no_such_reward"), "cannot load it"),
    (dict(task="pipeline_tasks:nan_task", reward="pipeline_tasks:length_reward", advantage="rloo", loss="ppo"),
     None),  # fine: nothing refused
    (dict(advantage="pipeline_tasks:two_argument_reward"),
     "advantage 'pipeline_tasks:two_argument_reward' returned a list, not a tensor of 4 advantages"),
    (dict(loss="pipeline_tasks:leave_one_out", step_hook="pipeline_tasks:text_reward"),
     r"step_hook: pipeline_tasks:text_reward\(prompts, completions, answers\) cannot be called with 2 arguments"),
    (dict(loss="ppo_clip"), "not one of"),
    (dict(generator="test_plugins:NotAGenerator"), "is not a subclass of llamarl_core.pipeline.Generator"),
    (dict(generator="test_plugins:HalfAGenerator"), "does not implement busy, run_segment, update_weights"),
    (dict(generator=HFGenerateGenerator, eval_every=5), "does not implement evaluate"),
])
def test_bad_plugins_are_refused_before_any_executor_starts(tmp_path, fields, match):
    start = time.monotonic()
    if match is None:
        Controller(TrainConfig(**fields), tmp_path / "run")
    else:
        with pytest.raises(ValueError, match=match):
            Controller(TrainConfig(**fields), tmp_path / "run")
    assert time.monotonic() - start < 5
    assert not (tmp_path / "run").exists()


def test_a_reward_with_the_wrong_signature_stops_the_cli_at_once(tmp_path):
    start = time.monotonic()
    proc = llamarl("--reward", "pipeline_tasks:two_argument_reward", "--out", str(tmp_path / "run"))
    assert proc.returncode != 0  # the message names the flag (from Python: reward term ..., the test above)
    assert ("--reward term 'pipeline_tasks:two_argument_reward': pipeline_tasks:two_argument_reward(prompts, "
            "completions) cannot be called") in proc.stderr
    assert time.monotonic() - start < 15  # the interpreter's start-up and imports included
    assert not (tmp_path / "run" / "executors.json").exists()  # no executor was started


def _my_run(tmp_path: Path, body: str) -> Path:
    """A user's script `body`, written to tmp_path/my_run.py."""
    script = tmp_path / "my_run.py"
    script.write_text(textwrap.dedent(body))
    return script


def _script(tmp_path: Path, body: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(_my_run(tmp_path, body))], capture_output=True, text=True, timeout=120,
                          cwd=tmp_path, env=TASKS_ENV)  # tests/ on the path


def _run_as_main(tmp_path: Path, monkeypatch, body: str) -> None:
    """The script `body` run in this process as `python my_run.py` runs it (runpy:
    its module is __main__ while it runs), from tmp_path."""
    script = _my_run(tmp_path, body)
    monkeypatch.chdir(tmp_path)
    runpy.run_path(str(script), run_name="__main__")


def test_a_run_started_without_the_main_guard_is_refused_naming_the_line(tmp_path, monkeypatch):
    with pytest.raises(ValueError) as refused:
        _run_as_main(tmp_path, monkeypatch, """\
            from llamarl_core.pipeline import Controller, TrainConfig

            controller = Controller(TrainConfig(steps=2), "out")
            controller.run()
            """)
    assert f"{tmp_path / 'my_run.py'}:4 starts the run from the script's top level" in str(refused.value)
    assert 'if __name__ == "__main__":' in str(refused.value) and not (tmp_path / "out").exists()


def test_a_plugin_defined_under_the_main_guard_is_refused(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="my_advantage is defined under `if __name"):
        _run_as_main(tmp_path, monkeypatch, """\
            from llamarl_core.pipeline import TrainConfig

            if __name__ == "__main__":
                def my_advantage(rewards, group_ids):
                    return rewards

                TrainConfig(advantage=my_advantage)
            """)


def _rollouts(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "rollouts.jsonl").read_text().splitlines()]


def test_a_transformers_generate_generator_learns_under_the_controller(tmp_path):
    """Given as a class through TrainConfig, from Python: the default task's
    first 60 steps learn, from scratch (no warm-up: a warmed-up model first dips
    under RL at this rate), the mean reward of the last 10 steps above the first
    10's (seeds 0, 1, 2: 0.087 / 0.083 / 0.079 -> 0.114 / 0.146 / 0.137; seed 1
    runs here). Sync mode, whose samples do not depend on timing: the same seed
    gives the same rewards on a busy machine (asynchronous, the rise at seed 0
    fell under the bound beside another pytest-xdist worker's tests, 0.076 ->
    0.095). Every token carries the version its step trains. The per-step
    callback sees every step. Then 12 asynchronous steps (max_staleness 2) of the
    same generator, whose partial rollouts go on under newer weights: every token
    carries the version that sampled it, and staleness stays within the bound as
    with ours. Run as a script of its own, as a user's."""
    out, async_out = tmp_path / "run", tmp_path / "async"
    proc = _script(tmp_path, f"""\
        import json
        from pipeline_tasks import HFGenerateGenerator
        from llamarl_core.pipeline import Controller, TrainConfig

        if __name__ == "__main__":
            seen = []
            config = TrainConfig(generator=HFGenerateGenerator, mode="sync", seed=1, steps=60, warmup_steps=0,
                                 lr_schedule="constant", log_rollouts=True, checkpoint_every=60)
            summary = Controller(config, {str(out)!r}, on_step=lambda m: seen.append(m["step"])).run()
            config = TrainConfig(generator=HFGenerateGenerator, steps=12, max_staleness=2, warmup_steps=0,
                                 log_rollouts=True, checkpoint_every=12)
            Controller(config, {str(async_out)!r}).run()
            print(json.dumps({{"seen": seen, "steps": summary["steps"]}}))
        """)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.splitlines()[-1])
    seen, summary = result["seen"], result
    metrics = read_metrics(out)
    assert seen == [m["step"] for m in metrics] == list(range(60)) and summary["steps"] == 60
    rewards = [m["reward"] for m in metrics]
    assert sum(rewards[-10:]) > sum(rewards[:10]) + 0.2, rewards  # 10 steps of 64 samples: a mean 0.02 higher
    assert all(m["staleness"] == {"0": 64} for m in metrics), [m["staleness"] for m in metrics]
    rollouts = _rollouts(out)
    assert len(rollouts) == 60 * 64 and all(r["versions"] == [r["step"], r["step"]] for r in rollouts)
    assert json.loads((out / "config.json").read_text())["generator"]["backend"] == "pipeline_tasks:HFGenerateGenerator"
    metrics = read_metrics(async_out)
    assert [m["step"] for m in metrics] == list(range(12))
    for m in metrics:
        assert all(0 <= int(k) <= 2 for k in m["staleness"]), m["staleness"]
    for r in _rollouts(async_out):  # the oldest and newest version of its tokens (the controller checked each has one)
        oldest, newest = r["versions"]
        assert 0 <= r["step"] - oldest <= 2 and oldest <= newest <= r["step"]


def test_plugins_by_name_on_the_command_line(tmp_path):
    """--generator module:Class with a user's advantage, loss and step hook, sync
    mode: every token was sampled with the weights the trainer holds, so the
    generator's log-probs equal the trainer's (the sync landed every version whole
    in its transformers model); the hook's numbers are in metrics.jsonl."""
    out = tmp_path / "run"
    proc = llamarl("--mode", "sync", "--out", str(out), *FAST, "--generator", "pipeline_tasks:HFGenerateGenerator",
                   "--advantage", "pipeline_tasks:leave_one_out", "--loss", "pipeline_tasks:aipo_by_hand",
                   "--step-hook", "pipeline_tasks:count_tokens_hook")
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = read_metrics(out)
    assert [m["step"] for m in metrics] == list(range(12))
    for m in metrics:
        assert m["staleness"] == {"0": 16}
        assert abs(m["mismatch_kl"]) < 1e-5 and abs(m["mean_ratio"] - 1) < 1e-4, m
        assert m["hook"]["hook_step"] == m["step"] and m["hook"]["hook_tokens"] == m["completion_tokens"]


@pytest.mark.parametrize("test, guarded", [('__name__ == "__main__"', True), ("'__main__' == __name__", True),
                                           ('__name__ == "__main__" and "--dry" not in sys.argv', True),
                                           ('__name__ != "__main__"', False), ("True", False),
                                           ('__name__ == "__main__" or True', False)])
def test_main_guard_forms(test, guarded):
    import ast

    from llamarl_core.pipeline.plugins import _is_main_guard

    assert _is_main_guard(ast.parse(f"if {test}:\n    run()\n").body[0]) == guarded


def test_a_folder_holding_a_run_is_resumed_only_when_asked(tmp_path):
    from llamarl_core.pipeline import RunFolderError

    TrainConfig(steps=3).save(tmp_path / "config.json")
    with pytest.raises(RunFolderError, match="already holds a run .* resume=True"):
        Controller(TrainConfig(steps=3), tmp_path).run()
    with pytest.raises(RunFolderError, match="different configuration"):
        Controller(TrainConfig(steps=3, seed=1), tmp_path, resume=True).run()
    assert not (tmp_path / "executors.json").exists()  # refused before any executor started
