"""Weight sync: one version's path from the learner's optimizer to a rollout peer's engine.

- `publisher.WeightPublisher` (learner): weights bytes -> signed manifest -> a broadcast source
  on the data channel, full and, when it pays, as a delta; which versions stay served.
- `echo_node.weights.broadcast` (both roles): the data channel's drivers — the listener, the source's
  shared piece queue, a receiver's links, relaying and repair — over the sans-I/O rules in
  `protocol.weights.datachannel` (frames, hello, session), `protocol.weights.pieces` (which piece from whom),
  `protocol.weights.manifest` (hash checks) and `protocol.weights.delta` (the codec).
- `follower.WeightFollower` (rollout peer): learns of new versions (announcements, status),
  fetches and verifies them (delta first when it can), and hands them to the engine.
"""
