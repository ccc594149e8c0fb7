"""CharTokenizer round trips and errors; addition task format and exact-match reward."""

import json
import random

import pytest

from echo_node.ml.tasks import AdditionTask, addition_answer, exact_match_reward, get_task
from echo_node.ml.tokenizer import CharTokenizer, load_tokenizer


def test_char_round_trip_and_specials() -> None:
    tok = CharTokenizer()
    assert (tok.pad_id, tok.bos_id, tok.eos_id, tok.vocab_size) == (0, 1, 2, 16)
    ids = tok.encode("37+05=042")
    assert all(i >= 3 for i in ids)
    assert tok.decode(ids) == "37+05=042"
    assert tok.encode_prompt("1+") == [tok.bos_id, *tok.encode("1+")]


def test_decode_stops_at_eos_and_skips_pad_bos() -> None:
    tok = CharTokenizer()
    ids = [tok.pad_id, tok.bos_id, *tok.encode("04"), tok.pad_id, *tok.encode("2"), tok.eos_id, *tok.encode("9")]
    assert tok.decode(ids) == "042"


def test_unknown_character_and_id_raise() -> None:
    tok = CharTokenizer()
    with pytest.raises(ValueError, match="'x'"):
        tok.encode("1x")
    with pytest.raises(ValueError):
        tok.decode([tok.vocab_size])
    with pytest.raises(ValueError):
        CharTokenizer("aa")


def test_dict_round_trip_is_json() -> None:
    tok = CharTokenizer("ab ")
    d = json.loads(json.dumps(tok.to_dict()))
    assert d == {"kind": "char", "alphabet": "ab "}
    again = CharTokenizer.from_dict(d)
    assert again == tok and again.encode("ba") == tok.encode("ba")
    assert load_tokenizer(d, None) == tok
    with pytest.raises(ValueError):
        load_tokenizer({"kind": "nope"}, None)


def test_addition_format_is_fixed_width() -> None:
    task = AdditionTask()
    prompts = task.sample_prompts(200, random.Random(0))
    assert all(len(p) == 6 and p[2] == "+" and p[5] == "=" for p in prompts)
    assert addition_answer("37+05=") == "042"
    assert addition_answer("99+99=") == "198"
    assert addition_answer("00+00=") == "000"
    assert task.max_new_tokens == 4
    pairs = task.supervised_pairs(5, random.Random(1))
    assert all(len(a) == 3 and addition_answer(p) == a for p, a in pairs)
    # Everything the task produces is in the default alphabet.
    CharTokenizer().encode("".join(p + a for p, a in pairs))


def test_exact_match_reward_cases() -> None:
    prompts = ["37+05="] * 6
    completions = ["042", " 042 ", "42", "0420", "043", ""]
    assert exact_match_reward(prompts, completions) == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0]
    task = get_task("addition")
    assert task.reward(["10+20="], ["030"]) == [1.0]
    with pytest.raises(ValueError):
        exact_match_reward(["1+1="], ["2"])
    with pytest.raises(ValueError):
        exact_match_reward(["37+05="], [])
    with pytest.raises(ValueError, match="known tasks"):
        get_task("chess")
