"""Weight sync's rules, sans-I/O: what a version is on the wire and how a swarm moves it.

- `manifest`: a version's signed description — pieces, leaf-tree digests, `verify_piece`.
- `delta`: the lossless delta codec between two versions.
- `datachannel`: the data channel's typed frames, the signed hello, the learner's session.
- `pieces`: `PieceSwarm`, which piece to ask of whom (repair, endgame, bans).
- `relay`: `SourcePull`, a receiver's rules for the source (pull, relay, when to repair).
- `source`: `SourcePlan`, the learner's rules for which piece leaves its uplink towards whom.
- `overlay`: `Overlay`, the learner's bounded-degree choice of who links to whom.

The drivers that own sockets and clocks are in `echo_node/weights/`.
"""
