"""Fuzzing every decoder that takes a peer's bytes: a short, deterministic run of each target.

Each target of tests/fuzz/targets.py gets INPUTS inputs from seed SEED (byte havoc, msgpack-aware
and re-signed mutations of valid seeds); none may crash (let anything but its documented protocol
error escape, or fail an oracle) or hang (one input > 1 s). A failure prints, per distinct crash,
the target, the (minimized) input as hex and the traceback; `input_for(all_targets()[name], SEED,
index)` rebuilds any input. The long run, >= 1M inputs over all cores, is benchmarks/fuzz.py.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from protocol.errors import RemoteProtocolError
from tests.fuzz.targets import Target, all_targets, fuzz, input_for, minimize, quiet_logs, run_one

SEED = 0
INPUTS = 2000

# Real crashes the fuzzer found in the code under test (not in the harness), pending a fix:
# target name -> what crashes. The target's test is then an xfail, strict: once the code is fixed
# it XPASSes and fails, so the entry must go. Empty: the one crash found so far is fixed.
KNOWN_CRASH: dict[str, str] = {}

# Minimal inputs of every crash found so far, kept as regression tests: (target, input, what).
REPRODUCERS: list[tuple[str, bytes, str]] = [
    # parse_tcp_multiaddr raised ValueError, not AddressError: str.isdigit() accepts Unicode digits
    # int() refuses, and dial_plan, which catches only AddressError, let it out too.
    ("addresses", "/dns/m/tcp/\u00b2".encode(), "a superscript two as the port"),
    ("addresses", "/ip4/1.2.3.4/tcp/\u00b9".encode(), "a superscript one as the port"),
    # int() takes these Unicode digits: the port parsed as 3 from text that is not a port.
    ("addresses", "/ip4/1.2.3.4/tcp/\u0663".encode(), "an Arabic-Indic three as the port"),
]


@pytest.fixture(scope="module", autouse=True)
def _project_logs_formatted_not_printed() -> Iterator[None]:
    with quiet_logs():
        yield


@pytest.mark.parametrize("name", list(all_targets()))
def test_no_crash_or_hang(name: str, request: pytest.FixtureRequest) -> None:
    if name in KNOWN_CRASH:
        request.applymarker(pytest.mark.xfail(reason=f"KNOWN_CRASH: {KNOWN_CRASH[name]}", strict=True))
    stats = fuzz(all_targets()[name], inputs=INPUTS, seed=SEED)
    report = "\n\n".join(f.report() for f in stats.findings)
    if report:
        print(report)  # pytest shows it with the failure
    assert stats.inputs == INPUTS
    assert (stats.crashes, stats.hangs) == (0, 0), (
        f"{name}: {stats.crashes} crashes, {stats.hangs} hangs in {INPUTS} inputs (seed {SEED}); distinct:\n{report}"
    )


@pytest.mark.parametrize(("name", "data", "what"), REPRODUCERS, ids=[f"{n}:{w}" for n, _, w in REPRODUCERS])
def test_reproducer_runs_clean(name: str, data: bytes, what: str, request: pytest.FixtureRequest) -> None:
    if name in KNOWN_CRASH:
        request.applymarker(pytest.mark.xfail(reason=f"KNOWN_CRASH: {KNOWN_CRASH[name]}", strict=True))
    finding = run_one(all_targets()[name], data)
    assert finding is None, finding.report()


def test_every_decoder_has_a_target() -> None:
    names = set(all_targets())
    from protocol.messages import MESSAGE_TYPES

    assert {f"messages.decode_message[{kind}]" for kind in MESSAGE_TYPES} <= names
    assert {
        "envelope.open_envelope", "framing.decode_frame", "framing.LengthPrefixedReader", "manifest.open_manifest",
        "delta.decode_delta", "identity.peer_id", "identity.verify", "addresses", "datachannel.HelloChecker.check",
        "datachannel._peer_entry", "datachannel.decode_frame", "datachannel.decode_probe_answer",
        "broadcast.Receiver._on_frame", "broadcast.Source.serve", "rpc.serve_one", "rpc.call", "learner.intake.validate",
        "learner.intake.repair",
    } <= names


def test_inputs_are_deterministic() -> None:
    for target in all_targets().values():
        assert [input_for(target, SEED, i) for i in range(20)] == [input_for(target, SEED, i) for i in range(20)], target.name


# --- the harness itself: it must see a crash, a hang, and let documented errors pass --------------


def _fragile(data: bytes) -> None:
    if data.startswith(b"\x01"):
        raise RemoteProtocolError("documented")
    if b"\xfe" in data and len(data) > 3:
        raise TypeError("a decoder bug")


def test_harness_reports_and_minimizes_a_crash() -> None:
    target = Target("fragile", _fragile, [b"\x00\x00\x00\x00\x00\x00", b"\x01\x02"])
    assert run_one(target, b"\x01\xfe\xfe\xfe") is None  # the documented error is not a crash
    found = run_one(target, b"\x00abc\xfe\x00xyz")
    assert found is not None and found.kind == "crash" and "TypeError: a decoder bug" in found.error
    small = minimize(target, found)
    assert len(small.data) == 4 and b"\xfe" in small.data and small.original_len == 9
    assert "input hex:" in small.report() and small.data.hex() in small.report()
    stats = fuzz(target, inputs=300, seed=1)
    assert stats.crashes > 0 and len(stats.findings) == 1


def test_harness_reports_a_hang() -> None:
    def slow(data: bytes) -> None:
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            pass

    found = run_one(Target("slow", slow, [b""]), b"", hang_s=0.05)
    assert found is not None and found.kind == "hang"
