"""Why a worker that gives torch every core trails the in-process loop (a) on a small CPU.

The queue's own work (redis-server, the client, result encoding: tens of microseconds of
CPU per request) runs on the same cores as the model. A model using every core with
OpenMP threads waits at each operation for its slowest thread, so a neighbour busy a
little of the time slows it by more than that. This measures (a) alone, then beside a
process busy 5% and 10% of the time in 1 ms slices, interleaved.

``python -m bench.contention [--quick] [--repeat R]``: a table, bench/out/contention.json.
"""

from __future__ import annotations

import subprocess
import sys
import time
from typing import Any

from bench import common
from bench.corpus import paragraphs
from bench.model import SWEEP, load_model, sorted_loop

BUSY = (0.0, 0.05, 0.10)  # share of the time the neighbour spins
SLICE_S = 0.001


def neighbour(busy: float) -> subprocess.Popen | None:
    if not busy:
        return None
    idle = SLICE_S * (1 - busy) / busy
    code = ("import time\nwhile True:\n    t = time.perf_counter()\n"
            f"    while time.perf_counter() - t < {SLICE_S}: pass\n    time.sleep({idle})")
    return subprocess.Popen([sys.executable, "-c", code])


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = common.parser(__doc__.splitlines()[0]).parse_args(argv)
    texts = paragraphs(600 if args.quick else 3000)
    runner = load_model(common.CORES)
    common.freeze()
    size = max(SWEEP[:3])  # a batch size near (a)'s best on this machine
    sorted_loop(runner, texts, size)  # warm every batch shape
    rates: dict[float, list[float]] = {b: [] for b in BUSY}
    for _ in range(args.repeat):
        for busy in BUSY:
            proc = neighbour(busy)
            try:
                started = time.perf_counter()
                sorted_loop(runner, texts, size)
                rates[busy].append(len(texts) / (time.perf_counter() - started))
            finally:
                if proc:
                    proc.kill()
                    proc.wait()
    quiet = max(rates[0.0])
    rows = [{"neighbour": f"busy {b:.0%} of the time" if b else "none",
             "rps": max(r), "ratio": max(r) / quiet} for b, r in rates.items()]
    text = common.table(rows, [("neighbour", "neighbour process", ""),
                               ("rps", "(a) requests/s", ".1f"), ("ratio", "x alone", ".2f")])
    print(f"\n## (a), batch {size}, {common.CORES} torch threads, beside a busy neighbour "
          f"({common.machine()})\n\n{text}\n")
    common.save("contention", {"machine": common.machine(), "batch": size, "rows": rows})
    return {"table": text, "targets": []}


if __name__ == "__main__":
    main()
