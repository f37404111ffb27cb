"""llamarl_core: primitives for asynchronous, distributed RL of large language models.

- `llamarl_core.sync`: DDMA weight sync (layouts, planner, sender / receiver).
"""

__version__ = "0.1.0"
