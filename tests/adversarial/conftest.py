from tests.node.conftest import learner  # noqa: F401  (the same real learner, host not started)
