"""The weight plane's section of the config tree: the overlay degree has an allowed range."""

from __future__ import annotations

from pathlib import Path

import pytest

from echo_node.config import load_config
from protocol.weights.overlay import DEFAULT_DEGREE, DEGREE_RANGE


def test_the_default_degree_is_in_range_and_loads_from_toml(tmp_path: Path) -> None:
    assert DEGREE_RANGE[0] <= load_config().weights.degree == DEFAULT_DEGREE <= DEGREE_RANGE[1]
    f = tmp_path / "run.toml"
    f.write_text("[weights]\ndegree = 12\nsource_degree = 8\n")
    cfg = load_config(f)
    assert (cfg.weights.degree, cfg.weights.source_degree) == (12, 8)


@pytest.mark.parametrize(
    "overrides",
    [{"weights__degree": DEGREE_RANGE[0] - 1}, {"weights__degree": DEGREE_RANGE[1] + 1}, {"weights__source_degree": 0},
     {"weights__source_rotate": 99}, {"weights__settle_s": -1.0}, {"weights__rotate_share": 2.0}],
)
def test_out_of_range_values_are_refused_with_the_range(overrides: dict[str, object]) -> None:
    with pytest.raises(ValueError, match="weights needs"):
        load_config(None, **overrides)
