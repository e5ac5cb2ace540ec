"""`make bench`: every benchmark, start to finish, then all tables and targets together.

    python -m bench.run_all [--quick] [--repeat N]

Each benchmark starts its own redis-server on a free port and stops it; results are
written to bench/out/ (JSON per benchmark, model.png, summary.md). The machine this
runs on is likely shared: ratios are taken within one run, and --repeat N keeps each
contender's best of N interleaved runs.
"""

from __future__ import annotations

import argparse
import time

from bench import (cluster_scale, common, contention, fair_share, generate, model, prefix,
                   priorities, queue_cost, redis_floor, start_order)

BENCHMARKS = (("Real model", model), ("Defaults and start order", start_order),
              ("Sharing the cores", contention),
              ("Queue cost", queue_cost), ("Redis time per request", redis_floor),
              ("Past one node", cluster_scale),
              ("Priorities", priorities), ("Fair share", fair_share), ("Generation", generate),
              ("Shared prefix", prefix))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="fewer requests: a smoke run")
    p.add_argument("--repeat", type=int, help="runs per contender, the best kept (default 2; "
                   "--quick: 1)")
    args = p.parse_args()
    repeat = args.repeat or (1 if args.quick else 2)
    passed = (["--quick"] if args.quick else []) + ["--repeat", str(repeat)]
    started = time.perf_counter()
    sections = []
    for title, bench in BENCHMARKS:
        common.log(f"=== {title} ===")
        out = bench.main(passed)
        sections.append(f"## {title}\n\n{out['table']}\n\n" + "\n".join(out["targets"]))
    summary = (f"# batchery benchmarks ({common.machine()})\n\n"
               f"`python -m bench.run_all {' '.join(passed)}`, "
               f"{(time.perf_counter() - started) / 60:.0f} min\n\n" + "\n\n".join(sections) + "\n")
    common.OUT.mkdir(parents=True, exist_ok=True)
    (common.OUT / "summary.md").write_text(summary)
    print("\n" + summary)


if __name__ == "__main__":
    main()
