"""The offline half of `echo-node plan`: which workers to rent, at what κ, for what cost.

Two sources of inputs, one answer (the dict `plan_from_inputs` documents):

- `plan_from_inputs`: before a run, from what an operator knows: the size of one published
  version, the learner's uplink, T_train, R, S, κ (or "auto") and a CSV of candidate workers
  (`load_candidates`). T_bcast is not known yet, so it is the broadcast lower bound
  (`protocol.capacity.broadcast_bound`, Kumar & Ross) for the chosen workers' links: the plan
  is optimistic about T_bcast, a real broadcast runs some percent above the bound.
- `plan_from_status`: during a run, from the learner's measured T_train, T_bcast and worker
  rates, so nothing is estimated.

Rules, and why:

- T_bcast depends on the chosen set (its links) and the set on T_bcast (through μ_min), so the
  plan iterates: start from the bound for every candidate, choose the cheapest set for the
  target that gives (`cheapest_set`: exact for small pools, greedy within a stated bound
  otherwise), take the bound for that set, and repeat until the set the bound was taken
  for is the set chosen (a fixed point: the reported T_bcast is the chosen set's own bound). A
  smaller set can have a larger bound (fewer uplinks share the N copies), so a fixed point is
  not guaranteed; after `MAX_ROUNDS` the last set is reported, evaluated with its own bound,
  and a note says it did not settle.
- Feasible means the chosen rate reaches the target γ·μ_min (γ = `protocol.capacity.GAMMA`,
  headroom for noisy rates); when even the whole pool falls short every candidate is chosen
  (each still shortens the learner's wait) and `reason` says by how much. An infeasible plan's
  `reason` names the input that makes it so (the learner uplink, a worker's downlink, the pool,
  R, T_train, κ) and what it would have to be.
- `--model-bytes` and `--model` are stored bytes; times `dtype_factor` they are one published
  version (`publication_bytes`).
- A peer's uplink defaults to its downlink / 5 (`DEFAULT_UP_RATIO`: asymmetric consumer and
  cloud links) when the CSV has no `up_mbit`; a note says for how many.
- Rates in a CSV are Mbit/s (10^6 bit/s, as tc and benchmarks/wan/bound.py); the capacity
  model takes bytes/s.
- The dict is strict JSON: an infinite μ_min or target (κ·T_train <= T_bcast: no pool is enough)
  is None, and `feasible` is False with the reason.
- A candidates file comes from anywhere (a spreadsheet, a provider's listing): every value is
  checked, and each error is one ValueError line naming the file, the line and the column.
"""

from __future__ import annotations

import bisect
import csv
import itertools
import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TextIO

from protocol.capacity import (
    GAMMA,
    Choice,
    Worker,
    cheapest_set,
    broadcast_bound,
    choose_kappa,
    delta_max,
    mu_min,
    predicted_idle,
)

__all__ = [
    "DEFAULT_UP_RATIO",
    "MAX_CANDIDATES",
    "MAX_ROUNDS",
    "Candidate",
    "Choice",
    "cheapest_set",
    "format_table",
    "load_candidates",
    "plan_from_inputs",
    "plan_from_status",
    "publication_bytes",
    "safetensors_bytes",
]

MBIT = 1e6 / 8  # bytes/s in one Mbit/s
DEFAULT_UP_RATIO = 0.2  # uplink = downlink / 5 when a candidate states none
MAX_ROUNDS = 10  # of the T_bcast <-> chosen-set iteration; real pools settle in two or three
MAX_CANDIDATES = 100_000  # rows in a candidates file: far above any pool, far below a memory problem
MAX_PEER_ID_CHARS = 256

Kappa = int | Literal["auto"]


@dataclass(frozen=True, slots=True)
class Candidate(Worker):
    """A worker with its uplink, as a candidates file states it: `capacity.Worker` has no
    uplink (the scheduler needs none), the broadcast bound does."""

    up: float | None = None  # bytes/s; None: not stated, DEFAULT_UP_RATIO of the downlink

    def __post_init__(self) -> None:
        # Explicit base call: zero-argument super() fails in a slots dataclass (Python < 3.14).
        Worker.__post_init__(self)
        up = self.up
        if up is not None and (isinstance(up, bool) or not isinstance(up, numbers.Real) or not 0 <= up < math.inf):
            raise ValueError(f"up (worker {self.peer_id!r}) must be a finite number >= 0, got {self.up!r}")


# --- Inputs ---------------------------------------------------------------------------------


def publication_bytes(stored_bytes: float, dtype_factor: float = 1.0) -> int:
    """Bytes of one published version from the bytes of the stored weights: `dtype_factor` is
    the published bytes per stored byte (0.5 to publish bf16 from fp32 files, 2 for fp32 from
    bf16; 1 when the learner publishes the stored dtype)."""
    if not (math.isfinite(dtype_factor) and dtype_factor > 0):
        raise ValueError(f"dtype_factor must be a finite number > 0, got {dtype_factor!r}")
    if not (math.isfinite(stored_bytes) and stored_bytes > 0):
        raise ValueError(f"model bytes must be a finite number > 0, got {stored_bytes!r}")
    return round(stored_bytes * dtype_factor)


def safetensors_bytes(directory: Path, *, dtype_factor: float = 1.0) -> int:
    """Bytes of one published version: the total size of `directory`'s `*.safetensors` files
    (not recursive: a Hugging Face model's shards sit side by side) times `dtype_factor`, the
    published bytes per stored byte (0.5 to publish bf16 from fp32 files, 2 for fp32 from bf16;
    1 when the learner publishes the stored dtype). Headers count as weights: they are a
    fraction of a percent."""
    publication_bytes(1, dtype_factor)  # checks the factor before the directory is read
    try:
        files = sorted(directory.glob("*.safetensors"))
        total = sum(f.stat().st_size for f in files)
    except OSError as e:
        raise ValueError(f"{directory}: cannot read: {e.strerror or e}") from None
    if not files:
        raise ValueError(f"{directory}: no *.safetensors files")
    return publication_bytes(total, dtype_factor)


_REQUIRED = ("mu", "price", "bandwidth_mbit")
_OPTIONAL = ("up_mbit",)
_ID_COLUMNS = ("peer_id", "name")  # either one names the worker


def load_candidates(path: Path) -> list[Candidate]:
    """The candidate workers in a CSV file with a header row.

    Columns: `peer_id` (or `name`), `mu` (rollouts/s, >= 0), `price` (per hour, >= 0),
    `bandwidth_mbit` (downlink, > 0), optionally `up_mbit` (uplink, >= 0; empty or absent:
    DEFAULT_UP_RATIO of the downlink). Blank lines are skipped. Unknown or repeated columns, a
    repeated peer id, a missing, non-numeric, NaN, infinite or negative value, or a row with the
    wrong number of fields is a ValueError "FILE:LINE: column N (NAME): what is wrong"."""
    try:
        with path.open(encoding="utf-8-sig", newline="") as fh:  # -sig: spreadsheets write a BOM
            return _parse_candidates(path, fh)
    except UnicodeDecodeError:
        raise ValueError(f"{path}: not UTF-8 text") from None
    except OSError as e:
        raise ValueError(f"{path}: cannot read: {e.strerror or e}") from None


def _parse_candidates(path: Path, fh: TextIO) -> list[Candidate]:
    reader = csv.reader(fh)

    def fail(line: int, message: str) -> ValueError:
        return ValueError(f"{path}:{line}: {message}")

    try:
        header = next(reader, None)
        if header is None:
            raise fail(1, "empty file: expected a header row")
        columns = [name.strip() for name in header]
        index = _header_index(columns, lambda message: fail(reader.line_num, message))
        out: list[Candidate] = []
        seen: dict[str, int] = {}
        for row in reader:
            line = reader.line_num
            if not any(cell.strip() for cell in row):
                continue
            if len(row) != len(columns):
                raise fail(line, f"{len(row)} fields, the header has {len(columns)}")
            if len(out) >= MAX_CANDIDATES:
                raise fail(line, f"more than {MAX_CANDIDATES} candidates")
            def at(col: int, message: str, line: int = line) -> ValueError:
                return fail(line, f"column {col + 1} ({columns[col]}): {message}")

            candidate = _candidate(row, index, at)
            if candidate.peer_id in seen:
                raise at(index["peer_id"], f"{candidate.peer_id!r} already on line {seen[candidate.peer_id]}")
            seen[candidate.peer_id] = line
            out.append(candidate)
    except csv.Error as e:  # a field over csv's size limit (128 KiB): the one bound csv keeps
        raise fail(reader.line_num, f"not CSV: {e}") from None
    if not out:
        raise fail(reader.line_num, "no candidates after the header")
    return out


def _header_index(columns: list[str], fail: Callable[[str], ValueError]) -> dict[str, int]:
    """Column name -> index, with `name` filed as `peer_id`."""
    index: dict[str, int] = {}
    for col, name in enumerate(columns):
        if name not in (*_ID_COLUMNS, *_REQUIRED, *_OPTIONAL):
            known = ", ".join((*_ID_COLUMNS, *_REQUIRED, *_OPTIONAL))
            raise fail(f"column {col + 1}: unknown column {name!r} (known: {known})")
        key = "peer_id" if name in _ID_COLUMNS else name
        if key in index:
            raise fail(f"column {col + 1}: {name!r} repeats column {index[key] + 1}")
        index[key] = col
    missing = [name for name in ("peer_id", *_REQUIRED) if name not in index]
    if missing:
        raise fail(f"missing column(s): {', '.join('peer_id (or name)' if m == 'peer_id' else m for m in missing)}")
    return index


def _peer_id_problem(peer_id: str) -> str | None:
    """What is wrong with a peer id for the plan, or None. Ids are printed in the plan's table:
    no terminal escapes, no screenful of one name."""
    if not peer_id:
        return "missing"
    if len(peer_id) > MAX_PEER_ID_CHARS or not peer_id.isprintable():
        return f"must be printable and at most {MAX_PEER_ID_CHARS} characters"
    return None


def _candidate(row: list[str], index: dict[str, int], fail: Callable[[int, str], ValueError]) -> Candidate:
    peer_id = row[index["peer_id"]].strip()
    problem = _peer_id_problem(peer_id)
    if problem is not None:
        raise fail(index["peer_id"], problem)

    def number(name: str, *, positive: bool = False) -> float | None:
        col = index.get(name)
        text = row[col].strip() if col is not None else ""
        if not text:
            if name in _OPTIONAL:
                return None
            raise fail(index[name], "missing")
        assert col is not None  # text comes only from a column
        try:
            value = float(text)
        except ValueError:
            raise fail(col, f"not a number: {text[:40]!r}") from None
        if not math.isfinite(value) or value < 0 or (positive and value == 0):
            raise fail(col, f"must be a finite number {'> 0' if positive else '>= 0'}, got {text[:40]!r}")
        return value

    mu, price = number("mu"), number("price")
    down, up = number("bandwidth_mbit", positive=True), number("up_mbit")
    assert mu is not None and price is not None and down is not None  # required: `number` raised otherwise
    return Candidate(peer_id, mu, price, bandwidth=down * MBIT, up=None if up is None else up * MBIT)


# --- Choosing the set ---------------------------------------------------------------------
#
# `protocol.capacity.cheapest_set`: the same solver the learner's live scheduler uses.


# --- Planning -------------------------------------------------------------------------------


def _links(workers: Sequence[Worker]) -> tuple[list[float], list[float], int]:
    """(downlinks, uplinks, how many uplinks were defaulted), bytes/s, for the broadcast bound."""
    downs: list[float] = []
    ups: list[float] = []
    defaulted = 0
    for w in workers:
        if w.bandwidth is None or w.bandwidth <= 0:
            raise ValueError(f"worker {w.peer_id!r}: a downlink bandwidth > 0 is needed for the broadcast bound")
        up = w.up if isinstance(w, Candidate) else None
        if up is None:
            up, defaulted = w.bandwidth * DEFAULT_UP_RATIO, defaulted + 1
        downs.append(w.bandwidth)
        ups.append(up)
    return downs, ups, defaulted


def _bottleneck(size: float, learner_up: float, chosen: Sequence[Worker], *, below: float | None = None) -> str:
    """Which term of the broadcast bound is the largest, in words naming the input that sets it:
    what to upgrade (or whom to drop) for a faster broadcast. With `below` (seconds), also what
    that input must become for the bound to fall under it; the bound is linear in the size, so
    a smaller publication always serves too."""
    downs, ups, _ = _links(chosen)
    slowest = min(range(len(chosen)), key=downs.__getitem__)
    slow_id = chosen[slowest].peer_id
    up_total = learner_up + math.fsum(ups)
    terms = {
        "learner": size / learner_up,
        "down": size / downs[slowest],
        "up": len(chosen) * size / (learner_up + math.fsum(ups)),
    }
    term = max(terms, key=terms.__getitem__)
    what = {
        "learner": f"the learner uplink (--learner-up {learner_up / MBIT:g} Mbit/s)",
        "down": f"the downlink of {slow_id} ({downs[slowest] / MBIT:g} Mbit/s in --candidates)",
        "up": f"the chosen workers' total uplink ({(up_total - learner_up) / MBIT:g} Mbit/s with the learner's)",
    }[term]
    if below is None:
        return what
    fix = {
        "learner": f"--learner-up above {size / below / MBIT:.4g} Mbit/s",
        "down": f"a downlink above {size / below / MBIT:.4g} Mbit/s for {slow_id} (or {slow_id} left out)",
        "up": f"{(len(chosen) * size / below - up_total) / MBIT:.4g} Mbit/s more uplink (up_mbit in --candidates)",
    }[term]
    smaller = size * below / terms[term]
    return f"{what}: it needs {fix}, or versions under {smaller:.4g} bytes (--model-bytes or --model, times --dtype-factor)"


def _kappa(kappa: Kappa, staleness: int, t_train: float, t_bcast: float) -> tuple[int, str | None]:
    """κ and its warning: `choose_kappa` for "auto"; for a given κ, the same warnings (a Δ_max
    beyond S, a κ·T_train no pool can fill)."""
    if isinstance(staleness, bool) or not isinstance(staleness, int) or staleness < 0:
        raise ValueError(f"staleness must be an integer >= 0, got {staleness!r}")
    if kappa == "auto":
        choice = choose_kappa(staleness, t_train, t_bcast)
        return choice.kappa, choice.warning
    if isinstance(kappa, bool) or not isinstance(kappa, int) or kappa < 1:
        raise ValueError(f"kappa must be an integer >= 1 or 'auto', got {kappa!r}")
    warnings = []
    worst = delta_max(kappa, t_train, t_bcast)  # first: it checks t_train and t_bcast
    if worst > staleness:
        warnings.append(f"κ = {kappa} gives Δ_max = {worst} > S = {staleness}")
    if kappa * t_train <= t_bcast:
        warnings.append(
            f"κ·T_train = {kappa * t_train:g} s <= T_bcast = {t_bcast:g} s: no pool avoids training bubbles"
        )
    return kappa, "; ".join(warnings) or None


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None


def _evaluate(
    workers: Sequence[Worker],
    *,
    t_bcast: float,
    t_train: float,
    rollouts_per_update: float,
    staleness: int,
    kappa: Kappa,
    fixed: Sequence[Worker] | None = None,
    broadcast: Callable[[float], str],
    pool_name: str,
    pipelined: bool = False,
) -> dict[str, Any]:
    """The plan for a known T_bcast: κ, μ_min, the cheapest set of `workers` for γ·μ_min
    (`cheapest_set`; or the `fixed` set, when given) and its outcome. An infeasible plan's
    reason names the input that makes it so: `broadcast(seconds)` says what sets T_bcast and
    what it must become to fall below `seconds`; `pool_name` names where the workers came from."""
    k, warning = _kappa(kappa, staleness, t_train, t_bcast)
    floor = mu_min(k, rollouts_per_update, t_train, t_bcast, pipelined=pipelined)
    target = GAMMA * floor
    method: Literal["exact", "greedy", "all", "fixed"]
    if fixed is None:
        choice = cheapest_set(workers, target)
        chosen, method = choice.workers, choice.method
    else:
        chosen, method = list(fixed), "fixed"
    mu_active = math.fsum(w.mu for w in chosen)
    feasible = math.isfinite(target) and mu_active >= target
    if math.isinf(target):
        # κ·T_train <= T_bcast: any of T_bcast, T_train, κ can change it.
        reason = (
            f"infeasible: T_bcast = {t_bcast:.4g} s >= κ·T_train = {k} × {t_train:g} s, no pool avoids training bubbles;"
            f" T_bcast is set by {broadcast(k * t_train)}; or T_train above {t_bcast / k:.4g} s (--t-train),"
            f" or κ >= {math.floor(t_bcast / t_train) + 1} (--kappa; auto takes S - 1: --staleness)"
        )
    elif not feasible:
        who = "the whole pool gives" if len(chosen) == len(workers) else f"the chosen {len(chosen)} give"
        reason = (
            f"infeasible: {who} {mu_active:.4g}/s < target {target:.4g}/s; {target - mu_active:.4g} rollouts/s more are"
            f" needed from {pool_name}, or a lower target: "
            + (f"μ_min = R/T_train = {rollouts_per_update:g}/{t_train:g}" if pipelined else
               f"μ_min = κ·R/(κ·T_train − T_bcast) = {k}·{rollouts_per_update:g}/({k}·{t_train:g} − {t_bcast:.4g})")
            + " (R: --rollouts-per-update)"
        )
    else:
        how = {
            "exact": "the cheapest set (exact search)",
            "greedy": "a greedy set (at most the cheapest set's cost plus its dearest worker's price)",
            "fixed": "the last set of the T_bcast iteration",
            "all": "every worker",
        }[method]
        reason = (
            f"{how}: {len(chosen)} of {len(workers)} give {mu_active:.4g}/s"
            f" >= target {target:.4g}/s (γ = {GAMMA:g} × μ_min)"
        )
    return {
        "kappa": k,
        "kappa_warning": warning,
        "mu_min": _finite(floor),
        "target": _finite(target),
        "t_bcast_bound_s": t_bcast,
        "chosen": [w.peer_id for w in chosen],
        "choice": method,
        "cost_per_hour": math.fsum(w.price for w in chosen),
        "mu_active": mu_active,
        "delta_max_predicted": delta_max(k, t_train, t_bcast),
        "idle_predicted": predicted_idle(k, rollouts_per_update, t_train, t_bcast, mu_active, pipelined=pipelined),
        "feasible": feasible,
        "reason": reason,
    }


def plan_from_inputs(
    *,
    model_bytes: float,
    learner_up_mbit: float,
    t_train: float,
    rollouts_per_update: float,
    staleness: int,
    kappa: Kappa = "auto",
    workers: Sequence[Worker],
    pipelined: bool = True,
) -> dict[str, Any]:
    """The plan before a run (see the module docstring for the T_bcast iteration).

    `model_bytes`: one published version (`safetensors_bytes` for a model directory);
    `learner_up_mbit`: the learner's uplink; `workers`: the candidates, each with a downlink
    (`Worker.bandwidth`, bytes/s; `load_candidates` sets it), and an uplink if a `Candidate`;
    `pipelined`: the peers generate on the weights they have while a version downloads (this
    implementation's async mode; `mu_min`), so the broadcast costs staleness, not rollouts;
    False: they wait for each version (ECHO-2's model; pull mode, with κ = 1).

    Returns a JSON-ready dict:
      kappa, kappa_warning (str | None): κ used and why it is not the S − 1 asked for, if not;
      mu_min, target (rollouts/s; None: no pool is enough): μ_min and γ·μ_min;
      t_bcast_bound_s: the broadcast bound for the chosen workers (seconds);
      t_bcast_source: "bound" here, "measured" from `plan_from_status`;
      chosen (peer ids, cheapest first), cost_per_hour, mu_active: the set and what it gives;
      choice: how the set was chosen: "exact" (the cheapest), "greedy" (at most the cheapest
        set's cost plus its dearest worker's price), "all" (the pool falls short) or "fixed"
        (the T_bcast iteration did not settle);
      delta_max_predicted (versions), idle_predicted (share of wall time, 0..1);
      feasible, reason: whether the chosen rate reaches the target, one line why;
      rounds: iteration rounds (0 when T_bcast was measured); notes: assumptions made;
      inputs: the inputs, for the table and for whoever reads the JSON later.
    ValueError (one line) for an invalid input."""
    pool = list(workers)
    if not pool:
        raise ValueError("no candidate workers")
    up_ok = not isinstance(learner_up_mbit, bool) and isinstance(learner_up_mbit, numbers.Real)
    if not (up_ok and math.isfinite(learner_up_mbit) and learner_up_mbit > 0):
        raise ValueError(f"learner uplink must be a finite number > 0 Mbit/s, got {learner_up_mbit!r}")
    by_id = {w.peer_id: w for w in pool}
    if len(by_id) != len(pool):
        raise ValueError("candidate workers: a peer id appears twice")

    def bound(chosen: Sequence[Worker]) -> float:
        downs, ups, _ = _links(chosen)
        return broadcast_bound(model_bytes, learner_up_mbit * MBIT, downs, ups)

    def evaluate(t_bcast_of: Sequence[Worker], fixed: Sequence[Worker] | None = None) -> dict[str, Any]:
        return _evaluate(
            pool, t_bcast=bound(t_bcast_of), t_train=t_train, rollouts_per_update=rollouts_per_update,
            staleness=staleness, kappa=kappa, fixed=fixed, pool_name="--candidates (more or faster workers)",
            pipelined=pipelined,
            broadcast=lambda below: _bottleneck(model_bytes, learner_up_mbit * MBIT, t_bcast_of, below=below),
        )

    _, _, defaulted = _links(pool)  # validates every downlink before the loop
    current = pool
    settled = False
    rounds = 0
    while rounds < MAX_ROUNDS:
        rounds += 1
        plan = evaluate(current)
        chosen = [by_id[i] for i in plan["chosen"]]
        if {w.peer_id for w in chosen} == {w.peer_id for w in current}:
            settled = True
            break
        current = chosen
    notes = []
    if not settled:
        # Report the last set chosen as it is, evaluated with its own bound, so the numbers agree.
        plan = evaluate(current, fixed=current)
        notes.append(f"the chosen set did not settle in {MAX_ROUNDS} rounds: the last one is shown")
    notes.append(f"T_bcast bound set by {_bottleneck(model_bytes, learner_up_mbit * MBIT, current)}")
    if defaulted:
        notes.append(
            f"uplink of {defaulted} of {len(pool)} candidates not given: taken as downlink / {1 / DEFAULT_UP_RATIO:g}"
        )
    notes.append("T_bcast is the broadcast lower bound for a full version: a real broadcast takes somewhat longer")
    return {
        **plan,
        "t_bcast_source": "bound",
        "rounds": rounds,
        "notes": notes,
        "inputs": {
            "model_bytes": model_bytes,
            "learner_up_mbit": learner_up_mbit,
            "t_train": t_train,
            "rollouts_per_update": rollouts_per_update,
            "staleness": staleness,
            "kappa": kappa,
            "pipelined": pipelined,
            "candidates": len(pool),
        },
    }


_STATUS_KEYS = ("t_train", "t_bcast", "rollouts_per_update", "staleness", "kappa", "workers")


def plan_from_status(status: Mapping[str, Any]) -> dict[str, Any]:
    """The plan from a learner's measurements (`echo-node plan --learner ADDR`): `status` holds
    t_train, t_bcast (seconds, measured), rollouts_per_update, staleness, kappa (int or "auto")
    and workers: a list of {peer_id, mu, price}, or a mapping peer_id -> {mu, price} (the form
    of the learner's `capacity` record); optionally pipelined (the learner's peers generate while
    a version downloads: its async mode), so that the plan's figures are the learner's own. Same dict as `plan_from_inputs`, with
    `t_bcast_bound_s` the measured T_bcast and `t_bcast_source` "measured". The status comes
    over the network: every field is checked, ValueError names the first bad one."""
    missing = [key for key in _STATUS_KEYS if key not in status]
    if missing:
        raise ValueError(f"learner status lacks {', '.join(missing)}")
    entries = status["workers"]
    if isinstance(entries, Mapping):
        entries = [{**v, "peer_id": k} if isinstance(v, Mapping) else v for k, v in entries.items()]
    if not isinstance(entries, Sequence) or isinstance(entries, (str, bytes)):
        raise ValueError(f"learner status: workers must be a list or a mapping, got {type(entries).__name__}")
    if not entries:
        raise ValueError("learner status: no workers")
    if len(entries) > MAX_CANDIDATES:
        raise ValueError(f"learner status: more than {MAX_CANDIDATES} workers")
    workers = []
    for i, entry in enumerate(entries):
        if not isinstance(entry, Mapping) or not {"peer_id", "mu", "price"} <= entry.keys():
            raise ValueError(f"learner status: workers[{i}] must be a mapping with peer_id, mu and price")
        try:
            worker = Worker(entry["peer_id"], entry["mu"], entry["price"])
        except ValueError as e:
            raise ValueError(f"learner status: workers[{i}]: {e}") from None
        problem = _peer_id_problem(worker.peer_id)
        if problem is not None:
            raise ValueError(f"learner status: workers[{i}]: peer_id {problem}")
        workers.append(worker)
    if len({w.peer_id for w in workers}) != len(workers):
        raise ValueError("learner status: a peer id appears twice in workers")
    t_bcast = status["t_bcast"]
    plan = _evaluate(
        workers, t_bcast=t_bcast, t_train=status["t_train"], rollouts_per_update=status["rollouts_per_update"],
        staleness=status["staleness"], kappa=status["kappa"], pool_name="the swarm (more or faster peers)",
        pipelined=bool(status.get("pipelined", False)),
        broadcast=lambda below: (
            f"the learner's measurement: a faster broadcast is needed, under {below:.4g} s"
            " (learner uplink; smaller publications: --dtype bfloat16)"
        ),
    )
    return {
        **plan,
        "t_bcast_source": "measured",
        "rounds": 0,
        "notes": ["T_train, T_bcast and worker rates as the learner measured them"],
        "inputs": {
            "t_train": status["t_train"],
            "t_bcast": t_bcast,
            "rollouts_per_update": status["rollouts_per_update"],
            "staleness": status["staleness"],
            "kappa": status["kappa"],
            "candidates": len(workers),
        },
    }


# --- Output ---------------------------------------------------------------------------------


def format_table(plan: Mapping[str, Any]) -> str:
    """The plan as aligned plain-text lines for a terminal (no colour: it goes to logs too)."""
    inputs = plan["inputs"]
    rows: list[tuple[str, str]] = []
    given = [f"T_train {inputs['t_train']:g} s", f"R {inputs['rollouts_per_update']:g}", f"S {inputs['staleness']}"]
    if "model_bytes" in inputs:  # a plan from inputs, not from a learner's measurements
        given[:0] = [
            f"model {inputs['model_bytes'] / 1e9:.3g} GB",
            f"learner uplink {inputs['learner_up_mbit']:g} Mbit/s",
        ]
    rows.append(("inputs", ", ".join(given)))
    kappa = f"{plan['kappa']} (asked: {inputs['kappa']})"
    if plan["kappa_warning"]:
        kappa += f"; warning: {plan['kappa_warning']}"
    rows.append(("κ", kappa))
    what = "broadcast bound for the chosen workers" if plan["t_bcast_source"] == "bound" else "measured"
    rows.append(("T_bcast", f"{plan['t_bcast_bound_s']:.3g} s ({what})"))
    if plan["target"] is None:
        rows.append(("μ_min", "unbounded: no pool is enough"))
    else:
        target = f"target {plan['target']:.4g} rollouts/s (γ = {GAMMA:g})"
        rows.append(("μ_min", f"{plan['mu_min']:.4g} rollouts/s; {target}"))
    rows.append(("chosen", f"{len(plan['chosen'])} of {inputs['candidates']}: {', '.join(plan['chosen'])}"))
    rows.append(("μ active", f"{plan['mu_active']:.4g} rollouts/s"))
    rows.append(("cost", f"{plan['cost_per_hour']:.2f} per hour"))
    rows.append(("Δ_max", f"{plan['delta_max_predicted']} versions (S = {inputs['staleness']})"))
    rows.append(("idle", f"{plan['idle_predicted']:.1%} predicted"))
    rows.append(("feasible", f"{'yes' if plan['feasible'] else 'NO'}: {plan['reason']}"))
    rows.extend(("note", note) for note in plan["notes"])
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name:<{width}}  {text}" for name, text in rows) + "\n"
