"""The learner's wing: one run's trainer and everything only the learner uses.

`Learner` (learner.py) runs a run; around it: joins, status answers and dial-backs (door.py),
who may publish and what is admitted (intake.py, banlog.py), the rollout ledger (replay.py), the
spot checker and its log-prob envelopes (spot_check.py, calibration.py), the optimizer step
(trainer.py), the capacity controller (capacity_controller.py), durability (journal.py,
checkpoint.py, recovery.py), version publication (publication.py, weight_publisher.py) and what a run reports
(summary.py, report.py, progress.py, profile.py, evaluation.py, tracking.py). Nothing outside
this package but the CLI, tests and benchmarks imports it (tests/unit/test_import_graph.py).

This file imports nothing: importing one module of the wing (the CLI sets the heap's policy
from heap.py before torch allocates anything) must not import the whole learner.
"""
