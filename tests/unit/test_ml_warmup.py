"""Warm-up: deterministic, cached by a key over all inputs, cache written atomically."""

import dataclasses

import torch

from echo_node.ml.defaults import WarmupConfig
from echo_node.ml.model import build_model, state_to_bytes, tiny_llama_config
from echo_node.ml.tasks import AdditionTask
from echo_node.ml.tokenizer import CharTokenizer
from echo_node.ml.warmup import cache_key, supervised_batch, warmup

torch.set_num_threads(1)

ARCH = {**tiny_llama_config(16), "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 2, "num_key_value_heads": 2}
CFG = WarmupConfig(steps=3, batch_size=8, lr=1e-3, ramp_steps=1, seed=0)


def test_supervised_batch_labels_only_answer_and_eos() -> None:
    tok = CharTokenizer()
    ids, labels = supervised_batch(tok, [("37+05=", "042")])
    assert ids[0].tolist() == tok.encode_prompt("37+05=") + tok.encode("042") + [tok.eos_id]
    assert labels[0].tolist() == [-100] * 7 + tok.encode("042") + [tok.eos_id]


def test_warmup_deterministic_and_cached(tmp_path) -> None:
    tok, task = CharTokenizer(), AdditionTask()
    a, b = build_model(ARCH, seed=0), build_model(ARCH, seed=0)
    first = warmup(a, tok, task, config=CFG, cache_dir=tmp_path)
    assert not first.cache_hit and first.cache_path.exists()
    assert [p.name for p in tmp_path.iterdir()] == [first.cache_path.name]  # no temp file left
    again = warmup(b, tok, task, config=CFG, cache_dir=tmp_path)
    assert again.cache_hit and state_to_bytes(a) == state_to_bytes(b)
    assert again.final_loss == first.final_loss
    c = build_model(ARCH, seed=0)
    warmup(c, tok, task, config=CFG, cache_dir=None)
    assert state_to_bytes(c) == state_to_bytes(a)


def test_cache_key_covers_inputs() -> None:
    tok, task = CharTokenizer(), AdditionTask()
    model = build_model(ARCH, seed=0)
    base = cache_key(model, tok, task, CFG)
    assert cache_key(model, tok, task, CFG) == base
    assert cache_key(model, tok, task, dataclasses.replace(CFG, seed=1)) != base
    assert cache_key(model, CharTokenizer("0123456789+= x"), task, CFG) != base
    assert cache_key(build_model(ARCH, seed=1), tok, task, CFG) != base
