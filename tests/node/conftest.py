"""Shared node-test fixtures: real node objects, no network started."""

from __future__ import annotations

from pathlib import Path

import pytest

from echo_node.config import RunConfig, VerifyConfig
from echo_node.learner.learner import Learner
from echo_node.ml.model import build_model, tiny_llama_config
from echo_node.ml.tasks import get_task
from echo_node.ml.tokenizer import CharTokenizer
from echo_node.policy import Policy
from protocol import Identity


@pytest.fixture
def learner(tmp_path: Path) -> Learner:
    """A learner for run "run-1": libp2p host built but not started, tiny model, no warm-up.
    No log-prob spot checks: the factories' log-probs are not a model's (tests of the spot
    checks sample theirs from the model)."""
    cfg = RunConfig(run_id="run-1", runs_dir=tmp_path, verify=VerifyConfig(logprobs=False))
    tok = CharTokenizer()
    arch = tiny_llama_config(tok.vocab_size)
    policy = Policy(build_model(arch), tok, get_task("addition"), {"kind": "embedded", **arch}, tok.to_dict())
    return Learner(cfg, Identity.from_seed(b"\x01" * 32), policy)
