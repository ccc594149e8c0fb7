"""`python -m tests.integration.slow_peer JOIN_ARGS...`: the real `echo-node join`, whose decoding
steps are slow (SLOW_STEP_S each, eos never sampled, so a batch runs its full max_new_tokens):
a batch takes as long as one of a real model on a busy CPU, while each step stays short. For the
test that SIGTERM stops a peer mid-batch (test_peer_stop.py)."""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

from echo_node import cli
from echo_node.ml.rollout import ScoredGroup
from echo_node.peer.rollout_peer import Generator, RolloutPeer

SLOW_STEP_S = 0.5
log = logging.getLogger("slow_peer")


class SlowGenerator(Generator):
    def _generate(self, prompts: list[str], seed: int) -> list[ScoredGroup]:
        stepper: Any = self.engine._stepper  # type: ignore[attr-defined]
        forward, eos = stepper.forward, self.engine.eos_id  # type: ignore[attr-defined]
        steps = 0

        def slow(input_ids: Any, rows: Any = None) -> Any:
            nonlocal steps
            logits = forward(input_ids, rows)
            logits[:, eos] = float("-inf")
            if input_ids.shape[1] == 1:  # a decoding step (the prefill is longer)
                steps += 1
                log.info("slow decoding step %d", steps)
                time.sleep(SLOW_STEP_S)
            return logits

        stepper.forward = slow
        try:
            return super()._generate(prompts, seed)
        finally:
            del stepper.forward


if __name__ == "__main__":
    RolloutPeer.generator_class = SlowGenerator
    sys.exit(cli.main(["join", *sys.argv[1:]]))
