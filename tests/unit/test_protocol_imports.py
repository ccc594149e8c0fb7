"""protocol/ is sans-I/O: importing it must not load trio, libp2p or torch."""

from __future__ import annotations

import subprocess
import sys


def test_import_protocol_loads_no_io_or_ml_stacks() -> None:
    code = (
        "import sys, protocol, protocol.envelope, protocol.sequence, protocol.staleness\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in {'trio', 'libp2p', 'torch'})\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "", f"protocol imported: {out.stdout.strip()}"
