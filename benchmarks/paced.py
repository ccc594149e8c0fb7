"""`echo-node` with a floor on how long work takes: a slower GPU, played by a CPU process.

    python -m benchmarks.paced --group-s 0.25 join ...    # a peer: >= 0.25 s per group it samples
    python -m benchmarks.paced --train-s 2.0 learn ...    # a learner: each update takes >= 2 s

Everything else is the real `echo-node` (`echo_node.cli.main` with the remaining arguments):
the floor is a sleep after the real work, inside the worker thread that did it, so a paced
process holds its CPU no longer than an unpaced one. Benchmarks use it to build a swarm whose
peers have known, different speeds and a learner whose step is as slow as a large model's,
which on two shared cores cannot be had otherwise (every process here runs the same tiny model
at about the same speed). A rollout peer's floor is per group of the engine call
(`Generator._generate(prompts, seed)`: one group per prompt, in a subclass the peer is given as
its generator), so the peer has a rate, as a GPU does, whatever the batch; a learner's is per
update (`Trainer._optimize` of the subclass the learner is given as `Learner.trainer_class`: the
optimizer step, not the snapshot or publication).
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from collections.abc import Callable
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


def at_least(floor: Callable[..., float], fn: F) -> F:
    """`fn`, taking at least `floor(*args, **kwargs)` seconds of wall time per call (the
    remainder slept)."""

    @functools.wraps(fn)
    def paced(*args: Any, **kwargs: Any) -> Any:
        t0 = time.monotonic()
        try:
            return fn(*args, **kwargs)
        finally:
            left = floor(*args, **kwargs) - (time.monotonic() - t0)
            if left > 0:
                time.sleep(left)

    return paced  # type: ignore[return-value]


def paced_generator(group_s: float) -> type[Any]:
    """A `Generator` that takes at least `group_s` per group of each engine call: injected as the
    peer's `RolloutPeer.generator_class` (the extension point the attack benchmarks use too),
    the real generator otherwise."""
    from echo_node.peer.rollout_peer import Generator

    class PacedGenerator(Generator):
        def _generate(self, prompts: list[str], seed: int) -> Any:
            return at_least(lambda *_: group_s * len(prompts), super()._generate)(prompts, seed)

    return PacedGenerator


def paced_trainer(train_s: float) -> type[Any]:
    """A `Trainer` whose optimizer step takes at least `train_s`: injected as the learner's
    `Learner.trainer_class`, the real trainer otherwise."""
    from echo_node.learner.trainer import Trainer
    from echo_node.ml.grpo import TrainGroup

    class PacedTrainer(Trainer):
        def _optimize(self, batch: list[TrainGroup]) -> dict[str, float]:
            return at_least(lambda *_: train_s, super()._optimize)(batch)

    return PacedTrainer


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], add_help=False)
    p.add_argument("--group-s", type=float, default=0.0, help="a rollout peer takes at least this long per group")
    p.add_argument("--train-s", type=float, default=0.0, help="a learner's update takes at least this long")
    args, rest = p.parse_known_args(argv)
    if not (args.group_s >= 0 and args.train_s >= 0):
        p.error("--group-s and --train-s must be >= 0")
    from echo_node import cli
    from echo_node.learner.learner import Learner
    from echo_node.peer.rollout_peer import RolloutPeer

    if args.group_s:
        RolloutPeer.generator_class = paced_generator(args.group_s)
    if args.train_s:
        Learner.trainer_class = paced_trainer(args.train_s)
    return cli.main(rest)


if __name__ == "__main__":
    sys.exit(main())
