"""Messages: round trips for every kind, every bound at and one past the limit, strict decoding."""

from __future__ import annotations

import math
from dataclasses import fields, replace
from typing import Any

import msgpack
import pytest

from protocol.episodes import Episode, EpisodeBatch, EpisodeGroup, Turn
from protocol import (
    MESSAGE_TYPES,
    SCHEMA_VERSION,
    ErrorResponse,
    Identity,
    JoinRequest,
    JoinResponse,
    LocalProtocolError,
    RemoteProtocolError,
    RepairRequest,
    RepairResponse,
    RolloutBatch,
    RolloutGroup,
    RunEnded,
    RunSpec,
    Sample,
    SamplingParams,
    StatusRequest,
    StatusResponse,
    VersionAnnounce,
    WireMessage,
    decode_message,
    encode_message,
    kind_of,
    pack_groups,
    pack_repair_response,
    seal,
)
from protocol.limits import (
    MAX_ABS_REWARD,
    MAX_BATCH_GROUPS,
    MAX_CONFIG_ITEMS,
    MAX_CONFIG_KEYS,
    MAX_CONFIG_LIST,
    MAX_DEMAND_GROUPS,
    MAX_FRAME_BYTES,
    MAX_GROUP_SIZE,
    MAX_NAME_LEN,
    MAX_PROMPT_TOKENS,
    MAX_REPAIR_SEQS,
    MAX_SEQ,
    MAX_STALENESS,
    MAX_STR,
    MAX_TEMPERATURE,
    MAX_TOKENS_PER_SEQUENCE,
    MAX_VERSION,
    MAX_VOCAB,
    MAX_WEIGHTS_BYTES,
)
from protocol.weights.manifest import build_manifest

PEER = Identity.from_seed(b"\x02" * 32).peer_id
LEARNER = Identity.from_seed(b"\x03" * 32).peer_id
SHA = bytes(range(32))


def sampling(**kw: Any) -> SamplingParams:
    return SamplingParams(**{"temperature": 1.0, "top_p": 0.95, "max_new_tokens": 64, **kw})


def spec(**overrides: Any) -> RunSpec:
    kw = {
        "run_id": "add-2digit.v1",
        "model": {"hidden_size": 64, "rope_scaling": {"type": "linear", "factor": 2.0},
                  "layers": [1, 2, 3], "tie": True, "eps": 1e-6, "name": None},
        "tokenizer": {"kind": "char", "vocab": list("0123456789+=")},
        "task": "two-digit addition",
        "sampling": sampling(),
        "sync_mode": "async",
        "staleness": 2,
        "group_size": 8,
        "current_version": 0,
        "learner_peer_id": LEARNER,
        "epoch": 3,
    }
    kw.update(overrides)
    return RunSpec(**kw)


def sample(n: int = 4, version: int = 3, **overrides: Any) -> Sample:
    kw = {
        "completion_ids": tuple(range(n)),
        "behaviour_logprobs": tuple(-0.5 for _ in range(n)),
        "token_versions": (version,) * n,
        "reward": 1.0,
    }
    kw.update(overrides)
    return Sample(**kw)


def group(**overrides: Any) -> RolloutGroup:
    kw = {
        "group_id": "g-7",
        "prompt_ids": (1, 2, 3),
        "samples": (sample(), sample(2, 4)),
    }
    kw.update(overrides)
    return RolloutGroup(**kw)


def batch(**overrides: Any) -> RolloutBatch:
    kw = {
        "run_id": "add-2digit.v1",
        "peer_id": PEER,
        "seq": 7,
        "groups": (group(), group(group_id="g-8", samples=(sample(3, 5), sample(1, 6)))),
    }
    kw.update(overrides)
    return RolloutBatch(**kw)


ALL_MESSAGES: list[WireMessage] = [
    spec(),
    batch(),
    build_manifest(run_id="r", version=3, payload=b"x" * 40000, piece_size=16384),
    JoinRequest(run_id="r", peer_id=PEER, data_host="10.0.0.2", data_port=7001),
    JoinResponse(spec=spec(), data_host="10.0.0.1", data_port=7000),
    JoinResponse(spec=spec(), data_host="10.0.0.1", data_port=7000, seq_from=1_796_687_941_373),
    StatusRequest(run_id="r"),
    StatusResponse(run_id="r", version=3, weights_size=123, weights_sha256=SHA, demand_groups=8, epoch=1),
    VersionAnnounce(run_id="r", version=MAX_VERSION, size=MAX_WEIGHTS_BYTES, sha256=SHA, demand_groups=MAX_DEMAND_GROUPS, epoch=MAX_VERSION),
    RunEnded(run_id="r", epoch=MAX_VERSION, version=MAX_VERSION, reason="stopped"),
    RepairRequest(run_id="r", peer_id=PEER, seqs=(1, 5, 9)),
    RepairResponse(envelopes=(b"frame-1", b"frame-2"), unavailable=(3,)),
    RepairResponse(envelopes=()),
    ErrorResponse(code="unknown_run", message="no such run"),
    EpisodeBatch(run_id="r", peer_id=PEER, seq=4, groups=(EpisodeGroup(group_id="g", prompt_ids=(1, 2), episodes=(
        Episode(turns=(Turn(from_env=False, token_ids=(5, 2), logprobs=(-0.5, -0.25), versions=(3, 3)),), reward=1.0),)),)),
]


def remote(msg: WireMessage) -> WireMessage:
    """What a receiver gets: through msgpack and back."""
    return type(msg).from_wire(msgpack.unpackb(msgpack.packb(msg.to_wire(), use_bin_type=True)))


@pytest.mark.parametrize("msg", ALL_MESSAGES, ids=lambda m: type(m).__name__)
def test_round_trip(msg: WireMessage) -> None:
    assert remote(msg) == msg
    assert decode_message(encode_message(msg)) == msg  # type: ignore[arg-type]
    assert decode_message(encode_message(msg), type(msg)) == msg  # type: ignore[arg-type]


def test_every_kind_has_a_round_trip_case() -> None:
    assert {kind_of(m) for m in ALL_MESSAGES} == set(MESSAGE_TYPES)


def test_nested_only_types_are_not_top_level() -> None:
    for msg in (sampling(), sample(), group()):
        with pytest.raises(LocalProtocolError, match="not a top-level"):
            kind_of(msg)
        with pytest.raises(LocalProtocolError):
            encode_message(msg)  # type: ignore[arg-type]


def test_lists_normalized_to_tuples() -> None:
    s = Sample(completion_ids=[1, 2], behaviour_logprobs=[-1.0, -2.0], token_versions=[0, 1], reward=0.0)  # type: ignore[arg-type]
    assert s.completion_ids == (1, 2) and isinstance(s.behaviour_logprobs, tuple)


def test_min_and_max_version_ignore_empty_samples() -> None:
    g = group(samples=(sample(0), sample(3, version=5), sample(2, token_versions=(2, 9))))
    assert g.min_version == 2 and g.max_version == 9 and g.num_tokens == 5


def test_batch_max_version_and_samples() -> None:
    b = batch()
    assert b.max_version == 6 and b.num_samples == 4


def test_all_empty_group_rejected() -> None:
    with pytest.raises(LocalProtocolError, match="no sample has any completion token"):
        group(samples=(sample(0), sample(0)))


# --- bounds: (constructor, at-limit kwargs, over-limit kwargs) --------------------------------


def _seq_of(n: int, v: Any) -> tuple[Any, ...]:
    return (v,) * n


BOUNDS: list[tuple[str, Any, dict[str, Any], dict[str, Any]]] = [
    ("temperature", sampling, {"temperature": MAX_TEMPERATURE}, {"temperature": MAX_TEMPERATURE * 1.01}),
    ("temperature_low", sampling, {"temperature": 0.0}, {"temperature": -0.001}),
    ("top_p", sampling, {"top_p": 1.0}, {"top_p": 1.0001}),
    ("top_p_zero", sampling, {"top_p": 1e-9}, {"top_p": 0.0}),
    ("max_new_tokens", sampling, {"max_new_tokens": MAX_TOKENS_PER_SEQUENCE}, {"max_new_tokens": MAX_TOKENS_PER_SEQUENCE + 1}),
    ("max_new_tokens_low", sampling, {"max_new_tokens": 1}, {"max_new_tokens": 0}),
    ("run_id_len", spec, {"run_id": "a" * 64}, {"run_id": "a" * 65}),
    ("run_id_charset", spec, {"run_id": "A.b_c-9"}, {"run_id": ".hidden"}),
    ("run_id_slash", spec, {"run_id": "a"}, {"run_id": "a/b"}),
    ("run_id_newline", spec, {"run_id": "ab"}, {"run_id": "ab\n"}),
    ("task_len", spec, {"task": "t" * MAX_STR}, {"task": "t" * (MAX_STR + 1)}),
    ("staleness", spec, {"staleness": MAX_STALENESS}, {"staleness": MAX_STALENESS + 1}),
    ("staleness_low", spec, {"staleness": 0}, {"staleness": -1}),
    ("group_size", spec, {"group_size": MAX_GROUP_SIZE}, {"group_size": MAX_GROUP_SIZE + 1}),
    ("group_size_low", spec, {"group_size": 2}, {"group_size": 1}),
    ("current_version", spec, {"current_version": MAX_VERSION}, {"current_version": MAX_VERSION + 1}),
    ("current_version_low", spec, {"current_version": 0}, {"current_version": -1}),
    ("epoch_low", spec, {"epoch": 0}, {"epoch": -1}),
    ("epoch_type", spec, {"epoch": MAX_VERSION}, {"epoch": "1"}),
    ("sync_mode", spec, {"sync_mode": "pull"}, {"sync_mode": "sync"}),
    ("config_keys", spec, {"model": {f"k{i}": i for i in range(MAX_CONFIG_KEYS)}},
     {"model": {f"k{i}": i for i in range(MAX_CONFIG_KEYS + 1)}}),
    ("config_list", spec, {"tokenizer": {"v": ["x"] * MAX_CONFIG_LIST}}, {"tokenizer": {"v": ["x"] * (MAX_CONFIG_LIST + 1)}}),
    ("config_items", spec, {"model": {f"k{i}": [0] * 15 for i in range(MAX_CONFIG_ITEMS // 16)}},
     {"model": {f"k{i}": [0] * 15 for i in range(MAX_CONFIG_ITEMS // 16)} | {"one_more": 0}}),
    ("config_key_len", spec, {"model": {"k" * MAX_NAME_LEN: 1}}, {"model": {"k" * (MAX_NAME_LEN + 1): 1}}),
    ("config_str", spec, {"model": {"s": "x" * MAX_STR}}, {"model": {"s": "x" * (MAX_STR + 1)}}),
    ("config_depth", spec, {"model": {"a": {"b": 1}}}, {"model": {"a": {"b": {"c": 1}}}}),
    ("config_nested_list", spec, {"model": {"a": [1, 2]}}, {"model": {"a": [[1, 2]]}}),
    ("config_int", spec, {"model": {"a": 2**63 - 1}}, {"model": {"a": 2**63}}),
    ("config_float", spec, {"model": {"a": 1e308}}, {"model": {"a": math.inf}}),
    ("config_bytes", spec, {"model": {"a": "x"}}, {"model": {"a": b"x"}}),
    ("completion_len", sample, {"n": MAX_TOKENS_PER_SEQUENCE}, {"n": MAX_TOKENS_PER_SEQUENCE + 1}),
    ("token_id", sample, {"completion_ids": (MAX_VOCAB - 1,) * 4}, {"completion_ids": (MAX_VOCAB,) * 4}),
    ("token_id_low", sample, {"completion_ids": (0,) * 4}, {"completion_ids": (-1,) * 4}),
    ("logprob", sample, {"behaviour_logprobs": (0.0, -0.0, -1e300, -1.0)}, {"behaviour_logprobs": (0.0, 1e-12, -1.0, -1.0)}),
    ("token_version", sample, {"token_versions": (MAX_VERSION,) * 4}, {"token_versions": (MAX_VERSION + 1,) * 4}),
    ("token_version_low", sample, {"token_versions": (0,) * 4}, {"token_versions": (-1,) * 4}),
    ("token_version_order", sample, {"token_versions": (1, 1, 2, 3)}, {"token_versions": (1, 2, 1, 3)}),
    ("reward", sample, {"reward": MAX_ABS_REWARD}, {"reward": MAX_ABS_REWARD * 1.01}),
    ("reward_low", sample, {"reward": -MAX_ABS_REWARD}, {"reward": -MAX_ABS_REWARD * 1.01}),
    ("prompt_len", group, {"prompt_ids": (1,) * MAX_PROMPT_TOKENS}, {"prompt_ids": (1,) * (MAX_PROMPT_TOKENS + 1)}),
    ("prompt_empty", group, {"prompt_ids": (1,)}, {"prompt_ids": ()}),
    ("prompt_token", group, {"prompt_ids": (MAX_VOCAB - 1,)}, {"prompt_ids": (MAX_VOCAB,)}),
    ("samples", group, {"samples": (sample(1),) * MAX_GROUP_SIZE}, {"samples": (sample(1),) * (MAX_GROUP_SIZE + 1)}),
    ("samples_empty", group, {"samples": (sample(1),)}, {"samples": ()}),
    ("seq", batch, {"seq": MAX_SEQ}, {"seq": MAX_SEQ + 1}),
    ("seq_low", batch, {"seq": 0}, {"seq": -1}),
    ("group_id", group, {"group_id": "g" * MAX_NAME_LEN}, {"group_id": "g" * (MAX_NAME_LEN + 1)}),
    ("group_id_empty", group, {"group_id": "g"}, {"group_id": ""}),
    ("peer_id", batch, {"peer_id": PEER}, {"peer_id": PEER[:-1]}),
    ("batch_run_id", batch, {"run_id": "a" * 64}, {"run_id": "a/b"}),
    ("batch_groups", batch, {"groups": (group(),) * MAX_BATCH_GROUPS}, {"groups": (group(),) * (MAX_BATCH_GROUPS + 1)}),
    ("batch_groups_empty", batch, {"groups": (group(),)}, {"groups": ()}),
]


def _build(factory: Any, kwargs: dict[str, Any]) -> WireMessage:
    if factory is sample and "n" in kwargs:
        return sample(kwargs["n"])
    return factory(**kwargs)  # type: ignore[no-any-return]


@pytest.mark.parametrize(("name", "factory", "at", "over"), BOUNDS, ids=[b[0] for b in BOUNDS])
def test_bound_at_limit_accepted_over_rejected(name: str, factory: Any, at: dict[str, Any], over: dict[str, Any]) -> None:
    ok = _build(factory, at)
    assert remote(ok) == ok
    with pytest.raises(LocalProtocolError):
        _build(factory, over)
    # The same out-of-bound value arriving from a peer is a RemoteProtocolError.
    wire = ok.to_wire()
    field = next(iter(over))
    if field == "n":
        bad_wire = sample(1).to_wire()
        bad_wire[0] = list(range(MAX_TOKENS_PER_SEQUENCE + 1))
    else:
        names = [f.name for f in fields(type(ok))]  # type: ignore[arg-type]
        bad_wire = list(wire)
        value = over[field]
        bad_wire[names.index(field)] = [v.to_wire() for v in value] if field == "samples" else value
    with pytest.raises(RemoteProtocolError):
        type(ok).from_wire(bad_wire)


@pytest.mark.parametrize(
    ("factory", "kwargs"),
    [
        (lambda **k: JoinResponse(**{"spec": spec(), "data_host": "192.0.2.1", "data_port": 1, **k}),
         [{"data_port": 0}, {"data_port": 65536}, {"data_port": 2**63},
          {"data_host": ""}, {"data_host": "h" * 300}, {"data_host": "a b"}, {"data_host": "a..b"},
          {"data_host": "learner.example"}, {"data_host": "0.0.0.0"}, {"data_host": "::"}, {"data_host": "224.0.0.1"},
          {"data_host": "255.255.255.255"}, {"data_host": 7}, {"spec": sampling()},
          {"seq_from": -1}, {"seq_from": 2**63}, {"seq_from": True}, {"seq_from": 1.0}, {"seq_from": None}]),
        (lambda **k: JoinRequest(**{"run_id": "r", "peer_id": PEER, "data_host": "2001:db8::1", "data_port": 4002, **k}),
         [{"data_port": 0}, {"data_port": -1}, {"data_port": 65536}, {"data_port": True}, {"data_host": "0.0.0.0"},
          {"data_host": "10.0.0.256"}, {"data_host": "\u0661.1.1.1"}, {"data_host": "fe80::1"}, {"data_host": b"10.0.0.1"}]),
        (lambda **k: StatusResponse(**{"run_id": "r", "version": 0, "weights_size": 0, "weights_sha256": SHA, "demand_groups": 1, "epoch": 0, **k}),
         [{"weights_size": MAX_WEIGHTS_BYTES + 1}, {"weights_size": -1}, {"weights_sha256": SHA[:31]},
          {"weights_sha256": SHA + b"\x00"}, {"version": -1}, {"epoch": -1}, {"demand_groups": 0},
          {"demand_groups": MAX_DEMAND_GROUPS + 1}, {"active": 1}, {"active": "yes"}]),
        # The heartbeat's claims (schema 8): bounded, finite, typed.
        (lambda **k: StatusRequest(**{"run_id": "r", "installed_version": 3, "price_per_hour": 1.5, "engine": "vllm", "device": "cuda:0", **k}),
         [{"installed_version": -2}, {"installed_version": 2**63}, {"price_per_hour": -0.01}, {"price_per_hour": float("nan")},
          {"price_per_hour": float("inf")}, {"price_per_hour": 1e7}, {"price_per_hour": 1}, {"engine": "e" * 129},
          {"device": 7}, {"engine": None}]),
        (lambda **k: RepairRequest(**{"run_id": "r", "peer_id": PEER, "seqs": (1,), **k}),
         [{"seqs": ()}, {"seqs": (1, 1)}, {"seqs": tuple(range(MAX_REPAIR_SEQS + 1))}, {"seqs": (-1,)}]),
        (lambda **k: RepairResponse(**{"envelopes": (), **k}),
         [{"envelopes": (b"x",) * (MAX_REPAIR_SEQS + 1)}, {"envelopes": (b"x" * (MAX_FRAME_BYTES + 1),)},
          {"envelopes": ("str",)}, {"unavailable": (-1,)}]),
        (lambda **k: ErrorResponse(**{"code": "x", "message": "", **k}),
         [{"code": "Bad"}, {"code": ""}, {"code": "a" * 65}, {"message": "m" * (MAX_STR + 1)}]),
    ],
)
def test_other_bounds(factory: Any, kwargs: list[dict[str, Any]]) -> None:
    factory()  # the base case is valid
    for kw in kwargs:
        with pytest.raises(LocalProtocolError):
            factory(**kw)


def test_other_bounds_at_limit() -> None:
    RepairRequest(run_id="r", peer_id=PEER, seqs=tuple(range(MAX_REPAIR_SEQS)))
    RepairResponse(envelopes=(b"x" * MAX_FRAME_BYTES,) * 2, unavailable=tuple(range(MAX_REPAIR_SEQS)))
    JoinResponse(spec=spec(), data_host="127.0.0.1", data_port=65535, seq_from=MAX_SEQ)
    ErrorResponse(code="a" * 64, message="m" * MAX_STR)


# --- strict decoding -------------------------------------------------------------------------


def test_missing_and_extra_fields_rejected_naming_the_fields() -> None:
    wire = StatusRequest(run_id="r").to_wire()
    with pytest.raises(RemoteProtocolError, match=r"StatusRequest: expected 5 fields \(run_id, installed_version, price_per_hour, engine, device\), got 0"):
        StatusRequest.from_wire([])
    with pytest.raises(RemoteProtocolError, match="got 1"):
        StatusRequest.from_wire(wire[:1])
    with pytest.raises(RemoteProtocolError, match="got 6"):
        StatusRequest.from_wire(wire + ["extra"])
    with pytest.raises(RemoteProtocolError, match="expected an array"):
        StatusRequest.from_wire({"run_id": "r"})


@pytest.mark.parametrize(
    ("index", "value", "field"),
    [
        (2, True, "RolloutBatch.seq"),  # bool is not an int
        (2, 7.0, "RolloutBatch.seq"),
        (2, "7", "RolloutBatch.seq"),
        (0, b"add-2digit.v1", "RolloutBatch.run_id"),
        (3, "groups", "RolloutBatch.groups"),
        (3, [["g", [1], "x"]], r"RolloutBatch.groups\[0\]: RolloutGroup.samples"),
    ],
)
def test_wrong_types_rejected_naming_the_field(index: int, value: Any, field: str) -> None:
    wire = batch().to_wire()
    wire[index] = value
    with pytest.raises(RemoteProtocolError, match=field):
        RolloutBatch.from_wire(wire)


@pytest.mark.parametrize(
    ("index", "value", "field"),
    [
        (1, [1, 2.0], r"RolloutGroup.prompt_ids\[1\]"),
        (1, "abc", "RolloutGroup.prompt_ids"),
        (2, "samples", "RolloutGroup.samples"),
        (2, [[[1], [-1.0], [0]]], r"RolloutGroup.samples\[0\]: Sample: expected 4 fields"),
    ],
)
def test_wrong_group_types_rejected_naming_the_field(index: int, value: Any, field: str) -> None:
    wire = group().to_wire()
    wire[index] = value
    with pytest.raises(RemoteProtocolError, match=field):
        RolloutGroup.from_wire(wire)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_floats_rejected(bad: float) -> None:
    wire = group().to_wire()
    wire[2][0][3] = bad  # reward
    with pytest.raises(RemoteProtocolError, match=r"samples\[0\]: Sample.reward: must be finite"):
        RolloutGroup.from_wire(wire)
    wire = group().to_wire()
    wire[2][1][1] = [bad, -1.0]  # logprobs
    with pytest.raises(RemoteProtocolError, match=r"Sample.behaviour_logprobs\[0\]"):
        RolloutGroup.from_wire(wire)
    with pytest.raises(RemoteProtocolError, match="temperature"):
        SamplingParams.from_wire([bad, 1.0, 4])


def test_int_for_float_field_rejected() -> None:
    with pytest.raises(RemoteProtocolError, match="SamplingParams.temperature: expected float"):
        SamplingParams.from_wire([1, 1.0, 4])
    wire = group().to_wire()
    wire[2][0][3] = 1  # reward as int
    with pytest.raises(RemoteProtocolError, match="Sample.reward: expected float"):
        RolloutGroup.from_wire(wire)


def test_length_mismatch_rejected() -> None:
    with pytest.raises(LocalProtocolError, match="behaviour_logprobs"):
        sample(3, behaviour_logprobs=(-1.0, -1.0))
    with pytest.raises(LocalProtocolError, match="token_versions"):
        sample(3, token_versions=(0, 0))


def test_config_values_must_be_str_keyed() -> None:
    with pytest.raises(LocalProtocolError, match="key"):
        spec(model={1: "x"})


def test_config_canonical_key_order() -> None:
    a = spec(model={"b": 1, "a": {"y": 1, "x": 2}})
    b = spec(model={"a": {"x": 2, "y": 1}, "b": 1})
    assert encode_message(a) == encode_message(b)
    assert list(a.model) == ["a", "b"]


def test_decode_message_rejects_bad_frames() -> None:
    good = encode_message(StatusRequest(run_id="r"))
    newer = SCHEMA_VERSION + 1
    with pytest.raises(RemoteProtocolError, match=f"unsupported schema version {newer} \\(this node speaks {SCHEMA_VERSION}\\)"):
        decode_message(msgpack.packb([newer, "status_request", ["r"]]))
    with pytest.raises(RemoteProtocolError, match="unknown message kind"):
        decode_message(msgpack.packb([SCHEMA_VERSION, "nope", ["r"]]))
    with pytest.raises(RemoteProtocolError, match="expected a 'join_request'"):
        decode_message(good, JoinRequest)
    with pytest.raises(RemoteProtocolError):
        decode_message(good + b"\x00")
    with pytest.raises(RemoteProtocolError):
        decode_message(good[:-1])
    with pytest.raises(RemoteProtocolError):
        decode_message(b"\xc1")
    with pytest.raises(RemoteProtocolError, match="exceeds"):
        decode_message(good, max_size=len(good) - 1)
    with pytest.raises(RemoteProtocolError, match="schema"):
        decode_message(msgpack.packb(["1", "status_request", ["r"]]))
    with pytest.raises(RemoteProtocolError, match="3 fields"):
        decode_message(msgpack.packb([SCHEMA_VERSION, "status_request"]))
    with pytest.raises(LocalProtocolError):
        decode_message(good, "no_such_kind")


def test_ext_types_and_non_str_keys_rejected() -> None:
    ext = msgpack.packb([SCHEMA_VERSION, "status_request", [msgpack.ExtType(5, b"x")]])
    with pytest.raises(RemoteProtocolError):
        decode_message(ext)
    bad_key = msgpack.packb([SCHEMA_VERSION, "run_spec", [{1: 2}]])
    with pytest.raises(RemoteProtocolError):
        decode_message(bad_key)


def test_encode_message_size_cap() -> None:
    msg = RepairResponse(envelopes=(b"x" * 100,) * 3)
    with pytest.raises(LocalProtocolError):
        encode_message(msg, max_size=200)


def test_pack_repair_response_fits_budget() -> None:
    frames = [b"f" * 1000] * 10
    resp = pack_repair_response(frames, unavailable=[4, 5], max_bytes=5000)
    assert 0 < len(resp.envelopes) < 10 and resp.unavailable == (4, 5)
    assert len(encode_message(resp)) <= 5000
    full = pack_repair_response([b"f" * (MAX_FRAME_BYTES - 64)] * MAX_REPAIR_SEQS)
    assert len(encode_message(full)) <= 4 * 1024 * 1024


def test_pack_groups_keeps_order_within_the_frame_budget() -> None:
    groups = [group(group_id=f"g{i:02d}", samples=(sample(200), sample(200))) for i in range(40)]
    one = len(msgpack.packb(groups[0].to_wire(), use_bin_type=True))
    chunks = pack_groups(groups, max_bytes=5 * one)
    assert [len(c) for c in chunks] == [5] * 8
    assert [g for c in chunks for g in c] == groups
    # Every default-budget batch of real-sized groups seals into one gossip frame.
    big = [group(group_id=f"g{i}", samples=(sample(MAX_TOKENS_PER_SEQUENCE),) * 2) for i in range(12)]
    batches = [RolloutBatch(run_id="r", peer_id=PEER, seq=i, groups=c) for i, c in enumerate(pack_groups(big))]
    sealed = [seal(b, Identity.from_seed(b"\x02" * 32)) for b in batches]
    assert len(sealed) > 1 and all(len(f) <= MAX_FRAME_BYTES for f in sealed)
    assert len(pack_groups(groups, max_groups=3)) == 14
    with pytest.raises(LocalProtocolError):
        pack_groups(groups, max_groups=0)


def test_replace_revalidates() -> None:
    with pytest.raises(LocalProtocolError):
        replace(batch(), seq=-1)


def test_hostile_bytes_only_raise_remote_protocol_error() -> None:
    import random

    rnd = random.Random(1234)
    corpus = [encode_message(m) for m in ALL_MESSAGES]  # type: ignore[arg-type]
    for _ in range(400):
        data = bytearray(rnd.choice(corpus))
        for _ in range(rnd.randint(1, 4)):
            data[rnd.randrange(len(data))] = rnd.randrange(256)
        try:
            decode_message(bytes(data))
        except RemoteProtocolError:
            pass


def test_a_string_that_can_be_built_can_be_received() -> None:
    """Lengths count characters, decoders bound UTF-8 bytes: a long non-ASCII string is refused
    when built, not by every receiver."""
    with pytest.raises(LocalProtocolError, match="bytes of UTF-8"):
        ErrorResponse(code="x", message="é" * 3000)
    ok = ErrorResponse(code="x", message="é" * 2048)
    assert decode_message(encode_message(ok)) == ok
