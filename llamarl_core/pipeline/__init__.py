"""The asynchronous RL pipeline: a single controller and generator / trainer /
reward executors (see controller.py), partial rollouts (rollout.py), tasks with
rule-based rewards (task.py) and the `llamarl train` command (train_cli.py)."""

from .config import TrainConfig
from .controller import Controller, PipelineError
from .rollout import RolloutEngine, Sample
from .task import CharTokenizer, Task, load_task, reverse_task

__all__ = ["CharTokenizer", "Controller", "PipelineError", "RolloutEngine", "Sample", "Task", "TrainConfig",
           "load_task", "reverse_task"]
