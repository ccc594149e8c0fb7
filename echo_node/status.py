"""`echo-node status`: a node's Prometheus endpoint, read once and printed for a person.

The endpoint is the one source (`echo_node/prom.py`): `status` shows exactly what a dashboard
would, and needs no request type of its own on the node (nothing new to bound or rate-limit).
The answer is a remote's bytes: read with a size cap and a timeout, parsed by prometheus_client's
own parser, and any failure is one line.
"""

from __future__ import annotations

import math
import urllib.error
import urllib.request
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

MAX_SCRAPE_BYTES = 4 << 20
SCRAPE_TIMEOUT_S = 10.0

# What a person reads first, in this order: (metric, label).
ROWS: tuple[tuple[str, str], ...] = (
    ("echo_version", "version"),
    ("echo_installed_version", "installed version"),
    ("echo_steps_per_second", "updates/s"),
    ("echo_learner_idle_ratio", "learner idle"),
    ("echo_learner_idle_predicted_ratio", "learner idle predicted"),
    ("echo_staleness_mean", "staleness (mean)"),
    ("echo_kappa", "kappa (updates per publication)"),
    ("echo_delta_max_predicted", "worst staleness predicted"),
    ("echo_mu_pool", "rollouts/s, whole pool"),
    ("echo_mu_active", "rollouts/s, active peers"),
    ("echo_mu_min", "rollouts/s needed (mu_min)"),
    ("echo_mu_target", "rollouts/s target"),
    ("echo_active_peers", "active peers"),
    ("echo_standby_peers", "standby peers"),
    ("echo_cost_per_hour", "cost per hour"),
    ("echo_active", "active (1) or standby (0)"),
    ("echo_price_per_hour", "price per hour"),
    ("echo_rollouts_published_total", "rollouts published"),
    ("echo_rollouts_received_total", "rollouts received"),
    ("echo_rollouts_accepted_total", "rollouts accepted"),
    ("echo_banned_peers", "banned peers"),
    ("echo_bytes_up_total", "bytes up"),
    ("echo_bytes_down_total", "bytes down"),
)


def scrape(address: str) -> dict[str, Any]:
    """HOST:PORT (or a URL) of a metrics endpoint -> {sample name: value}, `drops` by reason."""
    url = address if "://" in address else f"http://{address}/metrics"
    try:
        with urllib.request.urlopen(url, timeout=SCRAPE_TIMEOUT_S) as answer:  # noqa: S310 (an operator's own address)
            body = answer.read(MAX_SCRAPE_BYTES + 1)
    except (OSError, urllib.error.URLError, ValueError) as exc:
        raise ValueError(f"cannot read metrics at {url}: {exc}") from None
    if len(body) > MAX_SCRAPE_BYTES:
        raise ValueError(f"{url} answered more than {MAX_SCRAPE_BYTES} bytes: not an echo-node metrics endpoint")
    out: dict[str, Any] = {"drops": {}, "workers": {}}
    try:
        for family in text_string_to_metric_families(body.decode("utf-8", "replace")):
            for sample in family.samples:
                if sample.name == "echo_rollouts_dropped_total":
                    out["drops"][sample.labels.get("reason", "?")] = sample.value
                elif sample.name.startswith("echo_worker_"):
                    field = sample.name.removeprefix("echo_worker_")
                    out.setdefault("workers", {}).setdefault(sample.labels.get("peer", "?"), {})[field] = sample.value
                elif sample.name.startswith("echo_"):
                    out[sample.name] = sample.value
                    out.setdefault("role", sample.labels.get("role"))
                    out.setdefault("run_id", sample.labels.get("run_id"))
    except ValueError as exc:
        raise ValueError(f"{url} did not answer Prometheus text: {exc}") from None
    return out


def format_status(values: dict[str, Any]) -> str:
    lines = [f"{values.get('role') or 'node'} of run {values.get('run_id') or '?'}"]
    for metric, label in ROWS:
        if metric in values:
            lines.append(f"  {label:<34} {_show(values[metric])}")
    workers = values.get("workers") or {}
    if workers:
        lines.append("  rollouts/s per peer (measured by the learner):")
        for peer, w in sorted(workers.items()):
            state = "active" if w.get("active", 1.0) else "standby"
            lines.append(f"    {peer[-12:]:<14} {_show(w.get('mu', 0.0)):>10}  {state}, {_show(w.get('price', 0.0))}/h")
    drops = values.get("drops") or {}
    if drops:
        lines.append("  rollouts dropped, by reason:")
        lines += [f"    {reason:<32} {_show(count)}" for reason, count in sorted(drops.items())]
    return "\n".join(lines)


def _show(value: float) -> str:
    if math.isinf(value):
        return "unreachable (no pool keeps up)"
    return f"{value:,.0f}" if float(value).is_integer() else f"{value:,.3f}"
