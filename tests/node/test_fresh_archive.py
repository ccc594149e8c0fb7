"""`--fresh` moves the previous run aside whole, its plots included (previous/<time>/)."""

from __future__ import annotations

from echo_node.learner.learner import Learner
from echo_node.metrics import plot_run
from tests.unit.test_operator_view import train_records


def test_fresh_keeps_the_previous_plots(learner: Learner) -> None:
    run_dir = learner.cfg.run_dir
    plot_run(train_records(), run_dir, title="old run")
    (run_dir / "metrics.jsonl").write_text("{}\n")
    before = sorted(p.name for p in run_dir.glob("*.png"))
    assert "idle.png" in before
    learner._archive(run_dir)
    (previous,) = (run_dir / "previous").iterdir()
    assert sorted(p.name for p in previous.glob("*.png")) == before
    assert not list(run_dir.glob("*.png"))
