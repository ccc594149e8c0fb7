"""tests/conftest.py's split of the suite over xdist workers names real files."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import HEAVY, PROCESSES, unit_of

ROOT = Path(__file__).resolve().parents[2]


def test_every_heavy_module_exists_so_a_rename_cannot_move_it_to_the_other_unit_unseen() -> None:
    missing = sorted(m for m in HEAVY if not (ROOT / m).is_file())
    assert not missing, missing


def test_process_tests_form_two_units_and_every_other_module_is_its_own() -> None:
    heavy = next(iter(sorted(HEAVY)))
    assert unit_of(f"{heavy}::test_x") == "processes-heavy"
    assert unit_of(f"{PROCESSES}test_swarm.py::test_y[async]") == "processes"
    assert unit_of("tests/unit/test_offload.py::test_z") == "tests/unit/test_offload.py"
