"""The asynchronous RL pipeline: a single controller and generator / trainer /
reward executors (see controller.py), partial rollouts (rollout.py), tasks with
rule-based rewards (task.py) and the `llamarl train` command (train_cli.py).

From Python: `Controller(TrainConfig(...), out_dir, on_step=fn).run()` returns
the summary; the plug-in points (a Generator class, an advantage estimator, a
loss, a step hook, a reward function) are TrainConfig fields (in its sections:
RunConfig, GeneratorConfig, TrainerConfig, LossConfig, SyncConfig), typed here
(Generator, AdvantageFn, LossFn, StepHook). A trainer of one's own builds on
`train_step` (one policy-gradient step over samples) and `Scheduler` (which
samples a step may train on, under bounded staleness).
"""

from .advantages import ADVANTAGES, AdvantageFn
from .config import GeneratorConfig, LossConfig, RunConfig, SyncConfig, TrainConfig, TrainerConfig
from .controller import Controller, PipelineError
from .generators import Generator, GeneratorContext
from .learner import Batch, LossFn, StepContext, StepHook, StepStats, train_step
from .rollout import RolloutEngine, Sample
from .run_folder import RunFolderError
from .scheduler import Scheduler
from .task import CharTokenizer, Task, load_task, reverse_task

__all__ = ["ADVANTAGES", "AdvantageFn", "Batch", "CharTokenizer", "Controller", "Generator", "GeneratorConfig",
           "GeneratorContext", "LossConfig", "LossFn", "PipelineError", "RolloutEngine", "RunConfig", "RunFolderError",
           "Sample", "Scheduler", "StepContext", "StepHook", "StepStats", "SyncConfig", "Task", "TrainConfig",
           "TrainerConfig", "load_task", "reverse_task", "train_step"]
