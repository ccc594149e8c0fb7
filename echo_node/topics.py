"""GossipSub topic names, one pair per run (versioned so a wire change gets new topics)."""


def rollouts_topic(run_id: str) -> str:
    return f"/echo-node/1/{run_id}/rollouts"


def versions_topic(run_id: str) -> str:
    return f"/echo-node/1/{run_id}/versions"
