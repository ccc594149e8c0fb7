"""`echo-node`: one binary, one role per process.

Arguments are parsed before torch or libp2p is imported, so `echo-node --help` (and a typo)
answers at once. User errors (bad config, unreachable bootstrap, missing learner) end in one
line on stderr and a non-zero exit, never a traceback.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import Any

DEFAULT_KEY_DIR = Path(os.environ.get("ECHO_NODE_HOME", Path.home() / ".local" / "share" / "echo-node")) / "keys"
EXIT_USER_ERROR = 2


def _common(p: argparse.ArgumentParser, *, role: str) -> None:
    p.add_argument("--listen", default=None, help="libp2p listen multiaddr (default /ip4/127.0.0.1/tcp/0)")
    p.add_argument("--advertise-host", default=None, metavar="ADDRESS", help="IP address others dial this node at (published instead of the listen address)")
    p.add_argument("--announce", action="append", default=None, metavar="MULTIADDR", help="publish this multiaddr instead (repeatable; port forwards, DNS names)")
    p.add_argument("--key-file", type=Path, default=None, help=f"identity key file (default {DEFAULT_KEY_DIR}/{role}.key)")
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])


def _run_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--bootstrap", action="append", default=None, metavar="MULTIADDR", help="bootstrap peer (repeatable)")
    p.add_argument("--run-id", default=None, metavar="RUN_ID[@LEARNER_PEER_ID]", help="the run (with @PEER_ID: only that learner)")
    p.add_argument("--learner", default=None, metavar="PEER_ID", help="join only the learner with this peer id (it prints it when ready)")
    p.add_argument("--config", type=Path, default=None, help="run.toml with the config tree")
    p.add_argument("--model", default=None, metavar="PATH", help="local Hugging Face model directory")
    p.add_argument("--threads", type=int, default=None, help="torch threads for this process (default 1)")
    p.add_argument("--join-deadline", type=float, default=None, help="seconds to keep trying to join")
    p.add_argument("--data-port", type=int, default=None, help="TCP port of the weight data channel (default: any free port)")
    p.add_argument("--runs-dir", type=Path, default=None, help="where runs/<run-id>/ is written (default ./runs)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="echo-node", description="Decentralized RL post-training: learner, rollout peers and bootstrap over libp2p.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("bootstrap", help="serve the DHT for others to join through")
    _common(p, role="bootstrap")

    p = sub.add_parser("learn", help="own a run: train on rollouts, publish weight versions")
    _common(p, role="learner")
    _run_options(p)
    p.add_argument("--mode", choices=["pull", "async"], default=None)
    p.add_argument("--staleness", type=int, default=None, help="async staleness bound S")
    p.add_argument("--publish-every", type=int, default=None, metavar="K", help="async: publish every K-th version (K <= S)")
    p.add_argument("--seconds", type=float, default=None, help="stop after this much training time")
    p.add_argument("--max-versions", type=int, default=None)
    p.add_argument("--allow-peers", type=Path, default=None, metavar="FILE",
                   help="a private swarm: only these peer ids may join (one per line, # comments)")

    p = sub.add_parser("join", help="contribute rollouts to a run as a volunteer peer")
    _common(p, role="peer")
    _run_options(p)

    p = sub.add_parser("demo", help="bootstrap + learner + rollout peers on loopback, with live progress")
    p.add_argument("--mode", choices=["pull", "async"], default="async")
    p.add_argument("--peers", type=int, default=2)
    p.add_argument("--staleness", type=int, default=4)
    p.add_argument("--seconds", type=float, default=150.0, help="training time after warm-up")
    p.add_argument("--run-id", default=None)
    p.add_argument("--runs-dir", type=Path, default=Path("runs"))
    p.add_argument("--no-progress", action="store_true", help="plain log lines instead of a live display")
    return parser


def _setup_logging(level: str, role: str) -> None:
    logging.basicConfig(level=level, stream=sys.stderr, format=f"%(asctime)s {role} %(levelname)s %(name)s: %(message)s")
    # libp2p's own log level is set where it is imported (echo_node/net/p2p.py).
    logging.getLogger("multiaddr").setLevel(logging.DEBUG if level == "DEBUG" else logging.ERROR)


def _identity(args: argparse.Namespace, role: str) -> Any:
    from protocol.identity import load_or_create_key_file

    return load_or_create_key_file(args.key_file or DEFAULT_KEY_DIR / f"{role}.key")


def _config(args: argparse.Namespace) -> Any:
    from echo_node.config import load_config

    return load_config(
        args.config,
        run_id=args.run_id,
        threads=args.threads,
        seconds=getattr(args, "seconds", None),
        max_versions=getattr(args, "max_versions", None),
        runs_dir=str(args.runs_dir) if getattr(args, "runs_dir", None) else None,
        net__listen=args.listen,
        net__advertise_host=args.advertise_host,
        net__announce=args.announce,
        net__data_port=args.data_port,
        net__bootstrap=args.bootstrap,
        net__join_deadline_s=args.join_deadline,
        net__learner=getattr(args, "learner", None),
        net__allow_peers=_read_peer_list(args.allow_peers) if getattr(args, "allow_peers", None) else None,
        model__path=args.model,
        rl__mode=getattr(args, "mode", None),
        rl__staleness=getattr(args, "staleness", None),
        rl__publish_every=getattr(args, "publish_every", None),
    )


def _cmd_bootstrap(args: argparse.Namespace) -> int:
    import trio

    from bootstrap.node import run_bootstrap

    from echo_node.config import NetConfig, validate_net
    from echo_node.net.p2p import p2p_settings

    net = NetConfig(listen=args.listen or NetConfig().listen, advertise_host=args.advertise_host, announce=args.announce or [])
    validate_net(net)
    trio.run(run_bootstrap, _identity(args, "bootstrap"), p2p_settings(net, dht_server=True))
    return 0


def _read_peer_list(path: Path) -> list[str]:
    """Peer ids, one per line; blank lines and # comments ignored (config validates the ids)."""
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise ValueError(f"cannot read the peer list {path}: {exc.strerror or exc}") from None
    return [line.split("#", 1)[0].strip() for line in lines if line.split("#", 1)[0].strip()]


def _cmd_learn(args: argparse.Namespace) -> int:
    cfg = _config(args)
    import trio

    from echo_node.learner import Learner
    from echo_node.policy import learner_policy, set_threads

    set_threads(cfg.threads)
    identity = _identity(args, "learner")
    policy = learner_policy(cfg)
    summary = trio.run(Learner(cfg, identity, policy).run)
    logging.getLogger("echo_node").info(
        "run %s finished: %d versions, reward %.3f -> %.3f", summary["run_id"], summary["versions"], summary["reward_first"], summary["reward_last"]
    )
    return 0


def _cmd_join(args: argparse.Namespace) -> int:
    cfg = _config(args)
    import trio

    from echo_node.policy import set_threads
    from echo_node.rollout_peer import RolloutPeer

    set_threads(cfg.threads)
    peer = RolloutPeer(cfg, _identity(args, "peer"), model_path=cfg.model.path)
    trio.run(peer.run)
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from echo_node.demo import run_demo

    return run_demo(args)


COMMANDS = {"bootstrap": _cmd_bootstrap, "learn": _cmd_learn, "join": _cmd_join, "demo": _cmd_demo}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    role = args.command
    if role != "demo":
        _setup_logging(args.log_level, role)
    try:
        return COMMANDS[role](args)
    except KeyboardInterrupt:
        return 130
    except BaseException as exc:
        if _is_interrupt(exc):  # Ctrl-C inside trio arrives wrapped in exception groups
            return 130
        user_error = _find_user_error(exc)
        if user_error is None or getattr(args, "log_level", "") == "DEBUG":
            raise
        print(f"echo-node {role}: error: {user_error}", file=sys.stderr)
        return EXIT_USER_ERROR


def _is_interrupt(exc: BaseException) -> bool:
    if isinstance(exc, BaseExceptionGroup):
        return all(_is_interrupt(inner) for inner in exc.exceptions)
    return isinstance(exc, KeyboardInterrupt)


def _find_user_error(exc: BaseException) -> BaseException | None:
    """The user-facing error inside `exc`, looking through trio's exception groups."""
    from echo_node.net.discovery import JoinError

    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            found = _find_user_error(inner)
            if found is not None:
                return found
        return None
    if isinstance(exc, (JoinError, ValueError, FileNotFoundError, PermissionError)):
        return exc
    return None


if __name__ == "__main__":
    sys.exit(main())
