"""The reward executor: scores the completions the controller sends, a bunch at a time."""

from __future__ import annotations

import time

from ..config import TrainConfig
from ..data import RunData
from ..messages import Score, Scored
from ..rewards import check_rewards, make_scorer
from .link import REWARD, Link, dispatch
from .resources import process_group


def run_reward(link: Link, config: TrainConfig, store, rank: int) -> None:
    """Scores each bunch of completions the controller sends (each a prompt group,
    whether it is held out, and the completion's tokens) in one call: a rule reward
    over the whole bunch, a reward model in batches of reward_batch. The rewards go
    back, in order; an error or a non-finite reward names the completion."""
    data = RunData(config)
    score, what = make_scorer(config, data)
    process_group(store, REWARD, rank, 1, config, link.secret)

    def scored(command: Score) -> None:
        start = time.monotonic()
        problems = [data.eval_problem(group) if held_out else data.problem(group)
                    for group, held_out in zip(command.groups, command.eval)]
        completions = [data.tokenizer.decode(tokens) for tokens in command.tokens]
        rewards = score(problems, completions)
        check_rewards(problems, completions, rewards, what)
        link.span("score", start, time.monotonic(), samples=len(completions))
        link.send(Scored(bunch=command.bunch, rewards=list(rewards)))

    link.ready()
    for command in link.commands():
        dispatch({Score: scored}, command, REWARD)
