"""The rollout peer's wing: joining a run, following its weights, generating and publishing.

`RolloutPeer` (rollout_peer.py) joins a run and runs its generator and rollout publisher;
`WeightFollower` (weight_follower.py) keeps the engine on recent versions from the data channel.
Nothing outside this package but the CLI, tests and benchmarks imports it
(tests/unit/test_import_graph.py).
"""
