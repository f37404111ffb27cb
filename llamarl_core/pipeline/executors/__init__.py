"""The executors: generator, trainer and reward, each a process (or a group of
processes) with its own torch.distributed process group, driven by the
controller through queues in the run's Store (control/queues.py). They exchange
rollouts (token ids, floats) with the controller as the messages of messages.py;
model weights go from trainer to generator through the DDMA engine only
(WeightSender -> WeightReceiver), never through the controller.

An executor runs in a process the controller forked (one host, `llamarl train`) or
in a torchrun rank that the controller's rank assigns it to (`llamarl_core.launch`);
either way `run_executor` runs it, on a Store the controller's side also reaches.

One module per role (generator.py, trainer.py, reward.py); link.py is an
executor's end of the queues and the run's names in the Store; resources.py its
threads, cores, GPU and process group; run.py its life in its process. Every
report carries the spans (name, start, end on the host's monotonic clock) that
the run's trace shows.
"""

from .link import CONTROLLER_BEAT, EVENTS, GENERATOR, REWARD, TRAINER, Link, has_inbox, inbox_name, sync_name_of
from .run import executor_main, run_executor

__all__ = ["CONTROLLER_BEAT", "EVENTS", "GENERATOR", "REWARD", "TRAINER", "Link", "executor_main", "has_inbox",
           "inbox_name", "run_executor", "sync_name_of"]
