from tests.node.conftest import learner

__all__ = ["learner"]  # the same real learner fixture (host built, not started)
