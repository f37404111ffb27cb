"""The asynchronous RL pipeline: a single controller and generator / trainer /
reward executors (see controller.py), partial rollouts (rollout.py), tasks with
rule-based rewards (task.py) and the `llamarl train` command (train_cli.py).

From Python: `Controller(TrainConfig(...), out_dir, on_step=fn).run()` returns
the summary; the plug-in points (a Generator class, an advantage estimator, a
loss, a step hook, a reward function) are TrainConfig fields.
"""

from .advantages import ADVANTAGES
from .config import TrainConfig
from .controller import Controller, PipelineError
from .generators import Generator, GeneratorContext
from .learner import Batch, StepContext, StepStats
from .rollout import RolloutEngine, Sample
from .task import CharTokenizer, Task, load_task, reverse_task

__all__ = ["ADVANTAGES", "Batch", "CharTokenizer", "Controller", "Generator", "GeneratorContext", "PipelineError",
           "RolloutEngine", "Sample", "StepContext", "StepStats", "Task", "TrainConfig", "load_task",
           "reverse_task"]
