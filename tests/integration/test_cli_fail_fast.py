"""The CLI refuses what it can judge on its own at once: through the real `echo-node` process, each
case ends in one precise line (or argparse's usage and line) with exit status 2 well under a
second on an idle machine, because the checks run before torch and libp2p are imported (issue
29 measured 10.7-12.6 s for a missing model path or a malformed bootstrap address).

WALL_LIMIT_S is generous for a loaded machine; that the heavy imports did not happen is asserted
directly in `test_no_check_imports_torch_or_libp2p`.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from importlib.metadata import version
from pathlib import Path

import pytest

from echo_node.cli import build_parser

WALL_LIMIT_S = 3.0
PEER = "12D3KooWD3eckifWpRn9wQpMG9R9hX3sD158z7EqHWmweQAJU5SA"
BOOT = f"/ip4/127.0.0.1/tcp/9/p2p/{PEER}"


def echo_node(*args: str, stdout: int | None = subprocess.PIPE) -> tuple[int, str, str, float]:
    """(exit status, stdout, stderr, wall seconds) of `python -m echo_node.cli ARGS`."""
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "echo_node.cli", *args], stdout=stdout, stderr=subprocess.PIPE,
                          text=True, timeout=60, check=False)
    return proc.returncode, proc.stdout or "", proc.stderr, time.monotonic() - started


def one_line_error(tmp_path: Path, role: str, *args: str) -> str:
    """The one error line `echo-node ROLE ARGS` ends in, asserting status 2 and the wall time."""
    code, _, err, wall = echo_node(role, *args, "--key-file", str(tmp_path / "k.key")) if role in ("learn", "join") \
        else echo_node(role, *args)
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"echo-node {role}: error: "), err
    assert wall < WALL_LIMIT_S, f"{wall:.2f} s: {err}"
    return lines[0]


def test_a_missing_model_directory_is_refused_at_once(tmp_path: Path) -> None:
    for role, extra in (("learn", ()), ("join", ("--bootstrap", BOOT))):
        line = one_line_error(tmp_path, role, "--run-id", "r", "--model", str(tmp_path / "nope"), *extra)
        assert f"--model {tmp_path / 'nope'}: no such directory; give a local Hugging Face model directory" in line
        assert "echo-node tiny-model DIR" in line  # the remedy
    (tmp_path / "empty").mkdir()
    line = one_line_error(tmp_path, "join", "--run-id", "r", "--bootstrap", BOOT, "--model", str(tmp_path / "empty"))
    assert "not a local Hugging Face model directory (no config.json there)" in line
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    line = one_line_error(tmp_path, "learn", "--run-id", "r", "--model", str(gguf))
    assert "is a file" in line and "echo-node import-gguf FILE DIR" in line
    line = one_line_error(tmp_path, "demo", "--model", str(tmp_path / "nope"))
    assert "--model" in line and "no such directory" in line


def test_a_model_path_from_the_config_file_is_checked_too(tmp_path: Path) -> None:
    config = tmp_path / "run.toml"
    config.write_text(f'[model]\npath = "{tmp_path / "gone"}"\n')
    line = one_line_error(tmp_path, "learn", "--run-id", "r", "--config", str(config))
    assert f"model.path in {config} {tmp_path / 'gone'}: no such directory" in line


def test_config_files_must_be_readable_files(tmp_path: Path) -> None:
    line = one_line_error(tmp_path, "learn", "--run-id", "r", "--config", str(tmp_path / "run.toml"))
    assert line.endswith(f"--config {tmp_path / 'run.toml'}: no such file")
    line = one_line_error(tmp_path, "join", "--run-id", "r", "--bootstrap", BOOT, "--config", str(tmp_path))
    assert line.endswith(f"--config {tmp_path} is a directory, not a file")
    bad = tmp_path / "bad.toml"
    bad.write_text("[model\n")
    assert "is not valid TOML" in one_line_error(tmp_path, "learn", "--run-id", "r", "--config", str(bad))


@pytest.mark.parametrize(
    ("address", "expected"),
    [
        ("/ip4/127.0.0.1/tcp/4001", "--bootstrap /ip4/127.0.0.1/tcp/4001: a bootstrap address must end in /p2p/<peer id>"),
        ("/ip4/127.0.0.1/tcp/4001/p2p/xyz", "'xyz' is not a libp2p Ed25519 peer id"),
        ("/ip4/127.0.0.1", "is not a TCP multiaddr like /ip4/HOST/tcp/PORT[/p2p/ID]"),
        ("127.0.0.1:4001", "is not a TCP multiaddr"),
        (f"/ip4/1.2.3.400/tcp/4001/p2p/{PEER}", "'1.2.3.400' is not an ip4 address"),
    ],
    ids=["no-p2p", "bad-peer-id", "no-port", "host-port", "bad-ip"],
)
def test_a_malformed_bootstrap_address_is_refused_plainly(tmp_path: Path, address: str, expected: str) -> None:
    for role in ("join", "learn"):
        line = one_line_error(tmp_path, role, "--run-id", "r", "--bootstrap", address)
        assert expected in line
        assert "give the address `echo-node bootstrap` printed, e.g. /ip4/203.0.113.10/tcp/4001/p2p/12D3KooW" in line
        assert "P_P2P" not in line  # no libp2p-internal wording


def test_join_without_any_bootstrap_says_what_to_pass(tmp_path: Path) -> None:
    line = one_line_error(tmp_path, "join", "--run-id", "r")
    assert "a bootstrap address is needed: --bootstrap MULTIADDR" in line


def test_bootstrap_refuses_a_bad_listen_address_at_once() -> None:
    assert "is not a TCP multiaddr" in one_line_error(Path(), "bootstrap", "--listen", "/ip4/1.2.3.4")


def test_import_gguf_refuses_a_missing_file_before_torch(tmp_path: Path) -> None:
    line = one_line_error(tmp_path, "import-gguf", str(tmp_path / "x.gguf"), str(tmp_path / "out"))
    assert line.endswith(f"GGUF file {tmp_path / 'x.gguf'}: no such file")


def usage_error(*args: str) -> tuple[str, str]:
    """(usage lines, error line) of an argparse refusal, asserting status 2 and the wall time."""
    code, _, err, wall = echo_node(*args)
    assert code == 2, err
    assert wall < WALL_LIMIT_S, f"{wall:.2f} s: {err}"
    *usage, error = err.strip().splitlines()
    return "\n".join(usage), error


def test_abbreviations_are_refused_with_the_subcommands_usage_and_a_suggestion() -> None:
    """Issue 29: `demo --peer 3 --no-progres` ran a whole demo that trained 0 versions."""
    usage, error = usage_error("demo", "--peer", "3", "--no-progres")
    assert usage.startswith("usage: echo-node demo ")
    assert error == (
        "echo-node demo: error: unrecognized arguments: --peer 3 --no-progres;"
        " did you mean --peers for --peer, --no-progress for --no-progres?"
    )
    usage, error = usage_error("plan", "--candidate", "x.csv")
    assert usage.startswith("usage: echo-node plan ")
    assert error.endswith("unrecognized arguments: --candidate x.csv; did you mean --candidates?")
    _, error = usage_error("join", "--bootstrap=/ip4/1.2.3.4/tcp/1", "--modle=/m")
    assert error.endswith("did you mean --model?")


def test_every_parser_refuses_abbreviations() -> None:
    parser = build_parser()
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert parser.allow_abbrev is False
    assert all(p.allow_abbrev is False for p in subparsers.choices.values())


def test_version() -> None:
    code, out, _, wall = echo_node("--version")
    assert code == 0 and out == f"echo-node {version('echo-node')}\n"
    assert wall < WALL_LIMIT_S


@pytest.mark.parametrize("role", ["status", "plan"])
def test_a_metrics_address_needs_a_port(role: str) -> None:
    """Issue 29: `status --learner localhost` silently used port 80."""
    usage, error = usage_error(role, "--learner", "localhost")
    assert usage.startswith(f"usage: echo-node {role} ")
    assert error == (
        f"echo-node {role}: error: argument --learner: 'localhost' has no port:"
        " give HOST:PORT, e.g. 127.0.0.1:9400 (the node's --metrics-port)"
    )
    assert "brackets" in usage_error(role, "--learner", "::1:9400")[1]
    assert "'99999' is not a TCP port" in usage_error(role, "--learner", "127.0.0.1:99999")[1]


def test_plan_numbers_are_checked_by_the_parser() -> None:
    assert "argument --kappa: expected a number of versions or auto, got 'x'" in usage_error("plan", "--kappa", "x")[1]
    assert "argument --dtype-factor: expected a finite number > 0, got 'nan'" in usage_error("plan", "--dtype-factor", "nan")[1]
    assert "argument --peers: expected an integer >= 1, got '0'" in usage_error("demo", "--peers", "0")[1]


def test_plan_into_a_closed_pipe_ends_quietly(tmp_path: Path) -> None:
    """`echo-node plan ... | head`: no BrokenPipe traceback, status 141 as for a SIGPIPE kill."""
    csv = tmp_path / "pool.csv"
    csv.write_text("peer_id,mu,price,bandwidth_mbit\na,50,0.5,500\n")
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before the plan is written
    try:
        code, _, err, _ = echo_node("plan", "--candidates", str(csv), "--model-bytes", "1e7", "--learner-up", "1000",
                                    "--t-train", "2", stdout=write_end)
    finally:
        os.close(write_end)
    assert err == ""
    assert code == 141


def test_no_check_imports_torch_or_libp2p(tmp_path: Path) -> None:
    """The refusals above, in one process: none of them imported torch, transformers or libp2p."""
    cases = [
        ["learn", "--run-id", "r", "--model", str(tmp_path / "nope")],
        ["join", "--run-id", "r", "--bootstrap", "/ip4/127.0.0.1/tcp/4001"],
        ["join", "--run-id", "r", "--bootstrap", BOOT, "--model", str(tmp_path / "nope")],
        ["learn", "--run-id", "r", "--config", str(tmp_path / "nope.toml")],
        ["bootstrap", "--listen", "/ip4/1.2.3.4"],
        ["import-gguf", str(tmp_path / "x.gguf"), str(tmp_path / "out")],
        ["demo", "--model", str(tmp_path / "nope")],
    ]
    script = (
        "import sys\n"
        "from echo_node.cli import main\n"
        f"for argv in {cases!r}:\n"
        "    assert main(argv + (['--key-file', sys.argv[1]] if argv[0] in ('learn', 'join') else [])) == 2, argv\n"
        "heavy = sorted(m for m in ('torch', 'transformers', 'libp2p', 'trio') if m in sys.modules)\n"
        "print(','.join(heavy))\n"
    )
    proc = subprocess.run([sys.executable, "-c", script, str(tmp_path / "k.key")], capture_output=True, text=True,
                          timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "", f"imported: {proc.stdout.strip()}"
    assert len(proc.stderr.strip().splitlines()) == len(cases)  # one line each


def test_a_broken_pipe_that_is_not_stdouts_is_not_swallowed(monkeypatch: pytest.MonkeyPatch) -> None:
    """A socket's EPIPE inside a role is an error, not a reader that left."""
    from echo_node import cli

    def broken(args: argparse.Namespace) -> int:
        raise BrokenPipeError("a peer's socket")

    monkeypatch.setitem(cli.COMMANDS, "status", broken)
    with pytest.raises(BrokenPipeError, match="a peer's socket"):
        cli.main(["status", "--learner", "127.0.0.1:9400"])
