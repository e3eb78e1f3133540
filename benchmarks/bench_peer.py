"""conveyor vs torch.distributed.pipelining, out of the box: the issue's headline configuration.

    python benchmarks/bench_peer.py                 # 1f1b and gpipe, m 8, 3 rounds
    python benchmarks/bench_peer.py --rounds 1 --steps 3 --no-write

The same measurement as bench_schedules.py (benchmarks/ootb.py: each system in fresh processes
of its own, torch's never importing conveyor, alternating rounds, medians, conveyor with
keep_host_memory on and off, plain training for the ideal), restricted to the two schedules
every pipeline library has, and written to the `peer` section of docs/benchmarks.md. For both
systems in the same processes (not out of the box) see bench_same_process.py.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_schedules

if __name__ == "__main__":
    defaults = ["--schedules", "1f1b,gpipe", "--microbatches", "8", "--section", "peer"]
    bench_schedules.main(defaults + sys.argv[1:])
