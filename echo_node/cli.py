"""`echo-node`: one binary, one role per process.

Arguments are parsed and checked before torch or libp2p is imported, so `echo-node --help`, a
typo and every input the CLI can judge on its own answer at once. Rules:
- No abbreviations: `--peer 3` is not `--peers 3` (a typo must not run a different command). An
  unknown flag is refused with the subcommand's usage and the closest flag it has.
- Paths and addresses are checked first (`check_inputs`): `--model` and `--config` exist, a
  bootstrap address ends in /p2p/<peer id>, HOST:PORT has a port. Each error is one line naming
  the input and the remedy, exit status 2 (argparse's), in well under a second.
- User errors found later (unreachable bootstrap, missing learner) end in one line on stderr
  and a non-zero exit too, never a traceback.
- Output into a closed pipe (`echo-node plan ... | head`) ends quietly with 141 (128 + SIGPIPE),
  as a command killed by SIGPIPE does.

SIGINT and SIGTERM stop every role cleanly: the role is cancelled, its own cleanup runs (the
learner writes its summary and checkpoint), and the process exits with 128 + the signal number
(130, 143), without a traceback. See `run_until_signal` (echo_node/stopping.py).
"""

from __future__ import annotations

import argparse
import difflib
import json
import logging
import math
import os
import select
import signal
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any, Literal, NoReturn

from echo_node.stopping import Stopped, raise_stopped, run_until_signal, signal_name, signals_deferred

DEFAULT_KEY_DIR = Path(os.environ.get("ECHO_NODE_HOME", Path.home() / ".local" / "share" / "echo-node")) / "keys"
EXIT_USER_ERROR = 2
# A bootstrap address as `echo-node bootstrap` prints it; errors quote it as the shape to copy.
BOOTSTRAP_EXAMPLE = "/ip4/203.0.113.10/tcp/4001/p2p/12D3KooW..."

log = logging.getLogger("echo_node.cli")


def _exit_status(signum: int | None) -> int:
    return 0 if signum is None else 128 + signum


def _common(p: argparse.ArgumentParser, *, role: str) -> None:
    p.add_argument("--listen", default=None, help="libp2p listen multiaddr (default /ip4/127.0.0.1/tcp/0)")
    p.add_argument("--advertise-host", default=None, metavar="ADDRESS", help="IP address others dial this node at (published instead of the listen address)")
    p.add_argument("--announce", action="append", default=None, metavar="MULTIADDR", help="publish this multiaddr instead (repeatable; port forwards, DNS names)")
    p.add_argument("--key-file", type=Path, default=None, help=f"identity key file (default {DEFAULT_KEY_DIR}/{role}.key)")
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    if role != "bootstrap":
        p.add_argument("--metrics-port", type=int, default=None, metavar="PORT",
                       help="serve Prometheus metrics at http://127.0.0.1:PORT/metrics (net.metrics_host to bind wider)")


def _run_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--bootstrap", action="append", default=None, metavar="MULTIADDR", help="bootstrap peer (repeatable)")
    p.add_argument("--run-id", default=None, metavar="RUN_ID[@LEARNER_PEER_ID]", help="the run (with @PEER_ID: only that learner)")
    p.add_argument("--learner", default=None, metavar="PEER_ID", help="join only the learner with this peer id (it prints it when ready)")
    p.add_argument("--config", type=Path, default=None, help="run.toml with the config tree")
    p.add_argument("--model", default=None, metavar="PATH", help="local Hugging Face model directory")
    p.add_argument("--task", default=None, metavar="NAME", help="built-in task: addition (default) or math; a dataset task is a [task] table in --config")
    p.add_argument("--dtype", default=None, choices=["auto", "float32", "bfloat16", "float16"],
                   help="rollout dtype: what engines run in and the learner publishes (auto: bfloat16 on CUDA, float32 on CPU)")
    p.add_argument("--device", default=None, metavar="DEVICE", help="auto (default), cpu, cuda or cuda:N")
    p.add_argument("--threads", type=int, default=None, help="torch threads for this process (default 1)")
    p.add_argument("--join-deadline", type=float, default=None, help="seconds to keep trying to join")
    p.add_argument("--data-port", type=int, default=None, help="TCP port of the weight data channel (default: any free port)")
    p.add_argument("--runs-dir", type=Path, default=None, help="where runs/<run-id>/ is written (default ./runs)")


class _Parser(argparse.ArgumentParser):
    """argparse without abbreviations (module rules); `add_subparsers` builds every subcommand's
    parser with this class too."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs["allow_abbrev"] = False
        super().__init__(*args, **kwargs)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("echo-node")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed)"


def _host_port(text: str) -> str:
    """An argparse type: HOST:PORT (an IPv6 host in brackets) or an http(s):// URL of a metrics
    endpoint. A bare host is refused: a port is needed, and urllib would quietly take 80."""
    if text.startswith(("http://", "https://")):
        return text
    host, colon, port = text.rpartition(":")
    if not colon or not host:
        raise argparse.ArgumentTypeError(
            f"{text!r} has no port: give HOST:PORT, e.g. 127.0.0.1:9400 (the node's --metrics-port)"
        )
    if ":" in host and not (host.startswith("[") and host.endswith("]")):
        raise argparse.ArgumentTypeError(f"{text!r}: an IPv6 address goes in brackets, e.g. [::1]:9400")
    if not (port.isascii() and port.isdigit() and 1 <= int(port) <= 65535):
        raise argparse.ArgumentTypeError(f"{text!r}: {port!r} is not a TCP port (1-65535)")
    return text


def _positive(text: str) -> float:
    """An argparse type: a finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {text!r}")
    return value


def _at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type: an integer >= `minimum`."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {text!r}")
        return value

    return parse


def _report_to(p: argparse.ArgumentParser) -> None:
    p.add_argument("--report-to", default=None, choices=["none", "tensorboard", "wandb"],
                   help="also write the train, eval and progress scalars to TensorBoard event files or a W&B run "
                        "(offline unless report.wandb_mode = \"online\"), under runs/<run-id>/tracking/ (default none)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="echo-node", description="Decentralized RL post-training: learner, rollout peers and bootstrap over libp2p.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("bootstrap", help="serve the DHT for others to join through")
    _common(p, role="bootstrap")

    p = sub.add_parser("learn", help="own a run: train on rollouts, publish weight versions")
    _common(p, role="learner")
    _run_options(p)
    p.add_argument("--mode", choices=["pull", "async"], default=None)
    p.add_argument("--staleness", type=int, default=None, help="async staleness bound S")
    p.add_argument("--publish-every", type=_publish_every, default=None, metavar="K|auto",
                   help="async: publish every K-th version (K <= S); auto: the capacity model chooses (S - 1 while broadcasts are faster than updates)")
    p.add_argument("--seconds", type=float, default=None, help="stop after this much training time")
    p.add_argument("--max-versions", type=int, default=None)
    p.add_argument("--fresh", action="store_true",
                   help="start the run over even if --runs-dir holds it (default: resume it; the old state is moved aside)")
    p.add_argument("--allow-peers", type=Path, default=None, metavar="FILE",
                   help="a private swarm: only these peer ids may join (one per line, # comments)")
    _report_to(p)

    p = sub.add_parser("join", help="contribute rollouts to a run as a volunteer peer")
    _common(p, role="peer")
    _run_options(p)
    p.add_argument("--engine", default=None, choices=["torch", "vllm"], help="rollout engine (vllm: CUDA, pip install 'echo-node[vllm]')")
    p.add_argument("--price-per-hour", type=float, default=None, metavar="PRICE",
                   help="what the operator pays for this peer per hour (default 0: a volunteer); the learner activates the cheapest peers first")
    p.add_argument("--insecure-first-learner", action="store_const", const=True, default=None,
                   help="without a pin, join the first learner that answers (a demo on one machine: every bootstrap on loopback)")

    p = sub.add_parser("demo", help="bootstrap + learner + rollout peers on loopback, with live progress")
    p.add_argument("--mode", choices=["pull", "async"], default="async")
    p.add_argument("--peers", type=_at_least(1), default=2)
    p.add_argument("--staleness", type=_at_least(0), default=4)
    p.add_argument("--seconds", type=_positive, default=150.0, help="training time after warm-up")
    p.add_argument("--run-id", default=None)
    p.add_argument("--runs-dir", type=Path, default=Path("runs"))
    p.add_argument("--no-progress", action="store_true", help="plain log lines instead of a live display")
    p.add_argument("--model", default=None, metavar="DIR", help="train this local Hugging Face model instead of the embedded one (e.g. one `echo-node tiny-model` built)")
    p.add_argument("--dtype", default=None, choices=["auto", "float32", "bfloat16", "float16"], help="rollout dtype of the run")
    p.add_argument("--task", default=None, metavar="ENV",
                   help="a multi-turn environment (built-in 'calc' or module:Class) for the embedded model: the peers "
                        "play episodes, the learner re-runs every one before training on it")
    _report_to(p)

    p = sub.add_parser("status", help="read a learner's or peer's metrics endpoint (--metrics-port) and print them")
    p.add_argument("--learner", required=True, type=_host_port, metavar="HOST:PORT", help="its metrics endpoint, e.g. 127.0.0.1:9400")
    p.add_argument("--json", action="store_true", help="one JSON object instead of a table")

    p = sub.add_parser("plan", help="ECHO-2's capacity model: how many and which workers keep the learner busy, at what cost")
    p.add_argument("--learner", default=None, type=_host_port, metavar="HOST:PORT", help="online: from a running learner's measurements (its --metrics-port)")
    p.add_argument("--candidates", type=Path, default=None, metavar="CSV", help="offline: candidate workers (peer_id, mu, price, bandwidth_mbit[, up_mbit])")
    p.add_argument("--model", type=Path, default=None, metavar="DIR", help="offline: the model directory (its safetensors bytes are one version)")
    p.add_argument("--model-bytes", type=_positive, default=None,
                   help="offline: bytes of the stored weights (instead of --model); times --dtype-factor, one published version")
    p.add_argument("--dtype-factor", type=_positive, default=1.0,
                   help="publication bytes per stored byte, for --model and --model-bytes (0.5: bf16 publications of fp32 files)")
    p.add_argument("--learner-up", type=_positive, default=None, metavar="MBIT", help="offline: the learner's uplink, Mbit/s")
    p.add_argument("--t-train", type=_positive, default=None, metavar="S", help="offline: seconds per learner update")
    p.add_argument("--rollouts-per-update", type=_positive, default=64.0, metavar="R")
    p.add_argument("--staleness", type=_at_least(0), default=4, metavar="S")
    p.add_argument("--mode", choices=["async", "pull"], default=None,
                   help="the run's sync mode (default: async offline, the learner's default; with --learner, its own); "
                        "pull publishes every version (κ = 1)")
    p.add_argument("--kappa", type=_publish_every, default=None, metavar="K|auto",
                   help="updates per publication: a number or auto (S - 1 when broadcasts are fast enough); "
                        "default: the learner's own with --learner, else auto")
    p.add_argument("--json", action="store_true", help="one JSON object instead of a table")

    p = sub.add_parser("tiny-model", help="build a tiny Qwen2/Llama model and tokenizer locally (tests, demos; no download)")
    p.add_argument("out_dir", type=Path, metavar="DIR")
    p.add_argument("--family", choices=["qwen2", "llama"], default="qwen2")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup-steps", type=int, default=None, help="supervised warm-up on addition, so RL has a signal to start from")

    p = sub.add_parser("import-gguf", help="convert a GGUF file (llama.cpp) into a local Hugging Face model directory for --model")
    p.add_argument("gguf_file", type=Path, metavar="FILE")
    p.add_argument("out_dir", type=Path, metavar="DIR", help="a new or empty directory")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="dtype of the saved weights (default float32: GGUF tensors are dequantised)")
    return parser


# -- checks before the heavy imports ---------------------------------------------------------


def parse_args(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """`parser.parse_args`, except that an unknown flag is refused by the subcommand's parser
    (its usage, not the top level's) with the closest flag it has."""
    args, extra = parser.parse_known_args(argv)
    if extra:
        command = _subparser(parser, args.command)
        command.error(_unrecognized(command, extra))
    return args


def _subparser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    for action in parser._actions:  # argparse keeps subparsers only here
        if isinstance(action, argparse._SubParsersAction):
            found: argparse.ArgumentParser = action.choices[name]
            return found
    return parser


def _unrecognized(parser: argparse.ArgumentParser, extra: list[str]) -> str:
    """argparse's "unrecognized arguments" line, with "did you mean" for each unknown flag."""
    flags = [flag for action in parser._actions for flag in action.option_strings]
    hints: list[tuple[str, str]] = []  # (unknown flag, closest known one)
    for arg in extra:
        flag = arg.split("=", 1)[0]
        close = difflib.get_close_matches(flag, flags, n=1, cutoff=0.6) if flag.startswith("-") else []
        if close:
            hints.append((flag, close[0]))
    line = f"unrecognized arguments: {' '.join(extra)}"
    if len(hints) == 1:
        return f"{line}; did you mean {hints[0][1]}?"
    if hints:
        return f"{line}; did you mean {', '.join(f'{known} for {flag}' for flag, known in hints)}?"
    return line


def check_inputs(args: argparse.Namespace) -> None:
    """Every input that can be judged without torch, libp2p or the network, judged before any of
    them is imported (module rules); ValueError: one line naming the input and the remedy.
    learn and join keep the config tree built here as `args.run_config`, bootstrap its net
    settings as `args.net_config`."""
    role = args.command
    if role in ("learn", "join"):
        _check_file(args.config, "--config")
        cfg = _config(args)
        in_config = f"in {args.config}"
        _check_model_dir(cfg.model.path, "--model" if args.model is not None else f"model.path {in_config}")
        _check_bootstrap(cfg.net.bootstrap, "--bootstrap" if args.bootstrap else f"net.bootstrap {in_config}", required=role == "join")
        if role == "join" and cfg.net.insecure_first_learner and cfg.net.learner is None:
            from echo_node.net.discovery import check_first_learner_allowed

            check_first_learner_allowed(cfg.net.bootstrap)
        if role == "learn":
            from echo_node.learner.tracking import check_available

            check_available(cfg.report.report_to)
        args.run_config = cfg
    elif role == "bootstrap":
        from echo_node.config import NetConfig, validate_net

        net = NetConfig(listen=args.listen or NetConfig().listen, advertise_host=args.advertise_host, announce=args.announce or [])
        validate_net(net)
        args.net_config = net
    elif role == "demo":
        _check_model_dir(args.model, "--model")
        if args.report_to is not None:
            from echo_node.learner.tracking import check_available

            check_available(args.report_to)
    elif role == "plan":
        _check_file(args.candidates, "--candidates")
        if args.model is not None and not args.model.is_dir():
            raise ValueError(f"--model {args.model}: no such directory (give the model directory, or --model-bytes N)")
    elif role == "import-gguf":
        # The texts echo_node/ml/gguf_import.py uses: that module imports torch.
        _check_file(args.gguf_file, "GGUF file")
        if args.out_dir.exists() and not args.out_dir.is_dir():
            raise ValueError(f"{args.out_dir} exists and is not a directory")
        if args.out_dir.is_dir() and any(args.out_dir.iterdir()):
            raise ValueError(f"{args.out_dir} is not empty: import into a new or empty directory")


def _check_file(path: Path | None, what: str) -> None:
    """A file the command will read: there, a file, readable."""
    if path is None:
        return
    if not path.exists():
        raise ValueError(f"{what} {path}: no such file")
    if not path.is_file():
        raise ValueError(f"{what} {path} is a directory, not a file")
    if not os.access(path, os.R_OK):
        raise ValueError(f"{what} {path}: not readable (check its permissions)")


def _check_model_dir(path: str | Path | None, what: str) -> None:
    """A local Hugging Face model directory, as `load_pretrained` (echo_node/ml/model.py) needs
    it: a directory with a config.json (None: the embedded model)."""
    if path is None:
        return
    where = Path(path)
    make = "a local Hugging Face model directory (config.json, weights, tokenizer), e.g. one `echo-node tiny-model DIR` built"
    if not where.exists():
        raise ValueError(f"{what} {path}: no such directory; give {make}")
    if not where.is_dir():
        raise ValueError(f"{what} {path} is a file; give {make} (a GGUF file: `echo-node import-gguf FILE DIR` first)")
    if not (where / "config.json").is_file():
        raise ValueError(f"{what} {path}: not a local Hugging Face model directory (no config.json there); give {make}")


def _check_bootstrap(addrs: list[str], what: str, *, required: bool) -> None:
    """Each bootstrap address is a TCP multiaddr ending in /p2p/<peer id>: the id is how a node
    knows it reached the bootstrap it meant (the Noise handshake checks it)."""
    from protocol.addresses import AddressError, parse_tcp_multiaddr
    from protocol.identity import is_valid_peer_id

    shape = f"the address `echo-node bootstrap` printed, e.g. {BOOTSTRAP_EXAMPLE}"
    if required and not addrs:
        raise ValueError(f"a bootstrap address is needed: --bootstrap MULTIADDR, {shape}")
    for text in addrs:
        try:
            addr = parse_tcp_multiaddr(text)
        except AddressError as exc:
            raise ValueError(f"{what}: {exc}; give {shape}") from None
        if addr.peer_id is None:
            raise ValueError(
                f"{what} {text}: a bootstrap address must end in /p2p/<peer id> (the bootstrap node's id);"
                f" give {shape}"
            )
        if not is_valid_peer_id(addr.peer_id):
            raise ValueError(f"{what} {text}: {addr.peer_id!r} is not a libp2p Ed25519 peer id (12D3KooW...); give {shape}")


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
        net__metrics_port=getattr(args, "metrics_port", None),
        net__bootstrap=args.bootstrap,
        net__join_deadline_s=args.join_deadline,
        net__learner=getattr(args, "learner", None),
        net__insecure_first_learner=getattr(args, "insecure_first_learner", None),
        net__allow_peers=_read_peer_list(args.allow_peers) if getattr(args, "allow_peers", None) else None,
        model__path=args.model,
        model__dtype=getattr(args, "dtype", None),
        model__device=getattr(args, "device", None),
        task=getattr(args, "task", None),
        rollout__engine=getattr(args, "engine", None),
        rl__mode=getattr(args, "mode", None),
        rl__staleness=getattr(args, "staleness", None),
        rl__publish_every=getattr(args, "publish_every", None) if getattr(args, "publish_every", None) != "auto" else None,
        rl__publish_auto=True if getattr(args, "publish_every", None) == "auto" else None,
        rollout__price_per_hour=getattr(args, "price_per_hour", None),
        report__report_to=getattr(args, "report_to", None),
    )


def _cmd_bootstrap(args: argparse.Namespace) -> int:
    from bootstrap.node import run_bootstrap

    from echo_node.net.p2p import p2p_settings

    net = args.net_config  # built and checked by check_inputs
    _, signum = run_until_signal(
        partial(run_bootstrap, _identity(args, "bootstrap"), p2p_settings(net, dht_server=True)),
        on_ready=lambda addrs: _say(addrs[0]),
    )
    return _exit_status(signum)


def _publish_every(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of versions or auto, got {text!r}") from None


def _read_peer_list(path: Path) -> list[str]:
    """Peer ids, one per line; blank lines and # comments ignored (config validates the ids)."""
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise ValueError(f"cannot read the peer list {path}: {exc.strerror or exc}") from None
    return [line.split("#", 1)[0].strip() for line in lines if line.split("#", 1)[0].strip()]


def _cmd_learn(args: argparse.Namespace) -> int:
    cfg = args.run_config  # built and checked by check_inputs
    from echo_node.learner.heap import limit_heap_growth

    heap = limit_heap_growth()  # before the model's first allocations (echo_node/learner/heap.py)
    with signals_deferred():
        import torch
    from echo_node.ml.sharded import init_from_env
    from echo_node.policy import set_threads

    set_threads(cfg.threads)
    log.info("%s", heap)
    _log_device_choice(cfg.model.device, cfg.model.dtype)
    # Under torchrun (WORLD_SIZE > 1) the update is sharded over the job's ranks: rank 0 is the
    # learner the swarm sees, the other ranks only take their part of each update.
    dist = init_from_env()
    if dist is not None:
        # Rank 0's own copy of the weights (publications, checkpoints) lives in host memory;
        # the shards live on each rank's device. Followers get rank 0's weights at the start,
        # so they skip the warm-up.
        cfg.model.device = "cpu"
        if dist.rank > 0:
            cfg.warmup.enabled = False
            _exit_without_finalizing(_follow_learner(cfg, dist))
    try:
        status = _lead_learner(args, cfg, dist)
    finally:
        if dist is not None:
            torch.distributed.destroy_process_group()
    if dist is not None:
        _exit_without_finalizing(status)
    return status


def _exit_without_finalizing(status: int) -> NoReturn:
    """End a torchrun rank whose work is done and durable. Interpreter finalization after a gloo
    process group sometimes aborts the process (SIGABRT, "terminate called without an active
    exception": gloo's worker threads release tensors whose release needs the GIL of an
    interpreter being torn down), and torchrun then reports a clean stop as a crash. Metrics
    lines are flushed as written and checkpoints and the journal are synced, so skipping
    finalization loses nothing; logs and stdout are flushed here."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(status)


def _log_device_choice(device: str, dtype: str | None) -> None:
    """What `auto` chose and why, once at start (echo_node/ml/device.py); a device that cannot be
    used is the role's own one-line error a moment later, not this line's."""
    from echo_node.ml.device import describe_choice

    try:
        log.info("%s", describe_choice(device, dtype))
    except ValueError:
        pass


def _follow_learner(cfg: Any, dist: Any) -> int:
    import torch

    from echo_node.learner.trainer import sharded_learner
    from echo_node.policy import learner_policy

    # A follower stops when rank 0 says so (after its last checkpoint, which gathers from every
    # rank), not on the SIGINT/SIGTERM torchrun forwards to all ranks; a rank 0 that died is
    # torchrun's to clean up (it kills the job's other ranks).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    policy = learner_policy(cfg)
    log.info("rank %d of %d: following rank 0's updates on %s", dist.rank, dist.world, dist.device)
    try:
        sharded_learner(cfg, policy, dist, policy.model).follow()
    finally:
        torch.distributed.destroy_process_group()
    return 0


def _lead_learner(args: argparse.Namespace, cfg: Any, dist: Any) -> int:
    from echo_node.learner.learner import Learner
    from echo_node.policy import learner_policy

    identity = _identity(args, "learner")
    policy = learner_policy(cfg)
    summary_path = cfg.run_dir / "summary.json"
    earlier = _mtime(summary_path)  # a summary an earlier run under this id left
    learner = Learner(cfg, identity, policy, fresh=args.fresh, dist=dist)
    try:
        summary, signum = run_until_signal(learner.run, doing="writing the summary", on_ready=lambda ready: _say(json.dumps(ready)))
    finally:
        learner.trainer.close()  # releases the other ranks (sharded), also on an error
    if summary is not None:
        log.info("run %s finished: %d versions, %s", summary["run_id"], summary["versions"], _reward_change(summary))
    else:
        _log_stopped(summary_path, cfg.run_id, signum, stale=earlier)
    return _exit_status(signum)


def _say(line: str) -> None:
    """A line for the program that started this one (the bootstrap's address, the learner's
    ready record): stdout, flushed at once."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def _mtime(path: Path) -> float | None:
    try:
        return path.stat().st_mtime
    except OSError:
        return None


def _reward_change(summary: dict[str, Any]) -> str:
    """The summary's first and last update rewards for a log line (None: no update was trained)."""
    first, last = summary["reward_first"], summary["reward_last"]
    if first is None or last is None:
        return "no update trained"
    return f"reward {float(first):.3f} -> {float(last):.3f}"


def _log_stopped(path: Path, run_id: str, signum: int | None, *, stale: float | None) -> None:
    """The learner's last line when a signal stopped it: what summary.json says, if this run wrote
    it (a file still at modification time `stale` is an earlier run's under the same id)."""
    how = f"stopped on {signal_name(signum)}" if signum is not None else "stopped"
    if _mtime(path) in (None, stale):
        log.warning("run %s %s without writing %s", run_id, how, path)
        return
    try:
        s = json.loads(path.read_text())
        totals = f"{s['versions']:d} versions, {_reward_change(s)}"
    except (OSError, ValueError, KeyError, TypeError):  # only the log line's numbers are lost
        totals = "its totals unreadable"
    log.info("run %s %s: %s; summary in %s", run_id, how, totals, path)


def _cmd_join(args: argparse.Namespace) -> int:
    cfg = args.run_config  # built and checked by check_inputs
    with signals_deferred():
        import torch  # noqa: F401
    from echo_node.peer.rollout_peer import RolloutPeer
    from echo_node.policy import set_threads

    set_threads(cfg.threads)
    if cfg.rollout.engine == "torch":
        _log_device_choice(cfg.model.device, None)
    if cfg.rollout.engine == "vllm":
        from echo_node.ml.vllm_engine import check_vllm_available

        try:
            check_vllm_available()
        except RuntimeError as exc:
            raise ValueError(str(exc)) from None
    peer = RolloutPeer(cfg, _identity(args, "peer"))
    _, signum = run_until_signal(peer.run, doing="leaving the run")
    return _exit_status(signum)


def _cmd_demo(args: argparse.Namespace) -> int:
    if args.task is not None and args.model is not None:
        raise ValueError("demo --task runs the embedded model only (its environments speak its alphabet); drop --model")
    from echo_node.demo import run_demo

    return run_demo(args)


def _cmd_status(args: argparse.Namespace) -> int:
    from echo_node.metrics import json_safe
    from echo_node.status import format_status, scrape

    values = scrape(args.learner)
    # Strict JSON: a gauge that is NaN or infinite (Prometheus allows both) is null.
    print(json.dumps(json_safe(values), sort_keys=True, allow_nan=False) if args.json else format_status(values))
    return 0


def _cmd_plan(args: argparse.Namespace) -> int:
    from echo_node.plan import (
        format_table,
        load_candidates,
        plan_from_inputs,
        plan_from_status,
        publication_bytes,
        safetensors_bytes,
    )

    kappa: int | Literal["auto"] | None = args.kappa
    if args.mode == "pull":
        if kappa not in (None, 1, "auto"):
            raise ValueError(f"--mode pull publishes every version: --kappa must be 1, got {kappa}")
        kappa = 1  # on-policy: every version is published and waited for
    if args.learner is not None:
        from echo_node.status import scrape

        m = scrape(args.learner)
        need = ("echo_t_train_seconds", "echo_t_bcast_seconds", "echo_rollouts_per_update", "echo_staleness_bound", "echo_kappa")
        if any(k not in m for k in need) or not m.get("workers"):
            raise ValueError(f"the learner at {args.learner} has not measured its peers and times yet: ask again in a minute")
        plan = plan_from_status({
            "t_train": m["echo_t_train_seconds"], "t_bcast": m["echo_t_bcast_seconds"],
            "rollouts_per_update": m["echo_rollouts_per_update"], "staleness": int(m["echo_staleness_bound"]),
            "kappa": int(m["echo_kappa"]) if kappa is None else kappa,
            "pipelined": args.mode != "pull" if args.mode else bool(m.get("echo_pipelined", 0.0)),
            "workers": {p: {"mu": w.get("mu", 0.0), "price": w.get("price", 0.0)} for p, w in m["workers"].items()},
        })
    else:
        missing = [flag for flag, v in (("--candidates", args.candidates), ("--learner-up", args.learner_up), ("--t-train", args.t_train)) if v is None]
        if args.model is None and args.model_bytes is None:
            missing.append("--model or --model-bytes")
        if missing:
            raise ValueError(f"offline planning needs {', '.join(missing)} (or --learner HOST:PORT for a running learner)")
        # --dtype-factor applies to either source of the size: both are stored bytes.
        if args.model_bytes is not None:
            size = publication_bytes(args.model_bytes, args.dtype_factor)
        else:
            size = safetensors_bytes(args.model, dtype_factor=args.dtype_factor)
        plan = plan_from_inputs(
            model_bytes=size, learner_up_mbit=args.learner_up, t_train=args.t_train, rollouts_per_update=args.rollouts_per_update,
            staleness=args.staleness, kappa="auto" if kappa is None else kappa, workers=load_candidates(args.candidates),
            pipelined=args.mode != "pull",
        )
    print(json.dumps(plan, allow_nan=False) if args.json else format_table(plan))
    return 0


def _cmd_tiny_model(args: argparse.Namespace) -> int:
    from echo_node.ml import tiny_hf

    argv = [str(args.out_dir), "--family", args.family, "--seed", str(args.seed)]
    if args.warmup_steps is not None:
        argv += ["--warmup-steps", str(args.warmup_steps)]
    return tiny_hf.main(argv)


def _cmd_import_gguf(args: argparse.Namespace) -> int:
    with signals_deferred():
        import torch  # noqa: F401
    from echo_node.ml.device import DTYPES
    from echo_node.ml.gguf_import import import_gguf

    result = import_gguf(args.gguf_file, args.out_dir, dtype=DTYPES[args.dtype])
    print(json.dumps({"event": "imported", "model": str(result.out_dir), "architecture": result.architecture,
                      "parameters": result.parameters, "dtype": result.dtype, "chat_template": result.chat_template}))
    return 0


COMMANDS = {"bootstrap": _cmd_bootstrap, "learn": _cmd_learn, "join": _cmd_join, "demo": _cmd_demo, "tiny-model": _cmd_tiny_model,
            "status": _cmd_status, "plan": _cmd_plan, "import-gguf": _cmd_import_gguf}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(build_parser(), argv)
    role = args.command
    # SIGTERM unwinds like SIGINT wherever `run_until_signal` is not handling it (stop-signal
    # rules in echo_node/stopping.py); the demo's cleanup then stops its children as it does on Ctrl-C.
    previous_sigterm = signal.getsignal(signal.SIGTERM)
    if previous_sigterm is not signal.SIG_IGN:
        signal.signal(signal.SIGTERM, raise_stopped)
    try:
        check_inputs(args)  # first: before logging, the file limit and every heavy import
        if role not in ("demo", "tiny-model", "status", "plan", "import-gguf"):
            _setup_logging(args.log_level, role)
        if role in ("learn", "join", "bootstrap"):
            from echo_node.net.budget import raise_open_file_limit

            # Before any listener sizes its connection budget from the limit (echo_node/net/budget.py).
            raise_open_file_limit()
        status = COMMANDS[role](args)
        sys.stdout.flush()  # here, where a closed pipe is handled, not at interpreter exit
        return status
    except KeyboardInterrupt:
        return 130
    except Stopped as exc:
        return 128 + exc.signum
    except BaseException as exc:
        if _is_interrupt(exc):  # Ctrl-C inside trio arrives wrapped in exception groups
            return 130
        if isinstance(exc, BrokenPipeError) and _stdout_closed():  # not a socket's: stdout's reader left
            return _stdout_gone()
        user_error = _find_user_error(exc)
        if user_error is None or getattr(args, "log_level", "") == "DEBUG":
            raise
        return _user_error(role, user_error)
    finally:
        signal.signal(signal.SIGTERM, previous_sigterm)  # main() may be called in-process


def _user_error(role: str, error: BaseException) -> int:
    print(f"echo-node {role}: error: {error}", file=sys.stderr)
    return EXIT_USER_ERROR


def _stdout_closed() -> bool:
    """Whether nobody reads stdout any more: a pipe without readers polls as an error."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # replaced by an object without a descriptor
        return False
    poller = select.poll()
    poller.register(fd, select.POLLOUT)
    return any(events & (select.POLLERR | select.POLLHUP) for _, events in poller.poll(0))


def _stdout_gone() -> int:
    """Whoever read stdout is gone (`echo-node plan | head`): end as a command killed by SIGPIPE
    would, quietly and with 128 + SIGPIPE, the standard way for a Python CLI (the Python docs'
    "Note on SIGPIPE"): what is left in stdout's buffer goes to /dev/null, or the interpreter's
    own flush at exit would raise again. SIGPIPE itself stays ignored, as Python sets it: a
    node's sockets must get EPIPE, not kill the process."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass
    return 128 + signal.SIGPIPE


def _is_interrupt(exc: BaseException) -> bool:
    if isinstance(exc, BaseExceptionGroup):
        return all(_is_interrupt(inner) for inner in exc.exceptions)
    return isinstance(exc, KeyboardInterrupt)


def _find_user_error(exc: BaseException) -> BaseException | None:
    """The user-facing error inside `exc`, looking through trio's exception groups."""
    # Only classes already imported can have raised: importing their modules here (trio, the
    # journal) would make every early error wait for them.
    user_errors: tuple[type[BaseException], ...] = (ValueError, FileNotFoundError, PermissionError)
    for module, name in (("echo_node.learner.journal", "StorageFailed"), ("echo_node.net.discovery", "JoinError")):
        if module in sys.modules:
            user_errors += (getattr(sys.modules[module], name),)
    return _user_error_in(exc, user_errors)


def _user_error_in(exc: BaseException, user_errors: tuple[type[BaseException], ...]) -> BaseException | None:
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            found = _user_error_in(inner, user_errors)
            if found is not None:
                return found
        return None
    return exc if isinstance(exc, user_errors) else None


if __name__ == "__main__":
    sys.exit(main())
