"""A script that runs a sweep through ray_zero's Python API, as a user submits one to a Ray cluster.

    python examples/sweep_script.py                      # a private Ray on this machine, the quick grid
    python examples/sweep_script.py --set 'grid.num_workers=[1]' --set steps=8
    RAY_AUTH_MODE=token ray job submit --address http://127.0.0.1:8265 --working-dir . -- \\
        python examples/sweep_script.py --address auto   # a job on a running cluster (docs/clusters.md)

It prints ray_zero's console lines, then one line per trial from the returned tables, and exits 1 if a
trial failed. README.md shows this code as it is here (tests/test_api.py checks that they agree).
"""

import argparse
import sys
from pathlib import Path

try:
    import ray_zero
except ModuleNotFoundError:  # a checkout, not installed: the package beside examples/
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import ray_zero


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--experiment", default="experiments/quick.yaml")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--output")
    parser.add_argument("--address")  # "auto" inside a Ray job
    args = parser.parse_args(argv)

    ray_zero.log_to_console()  # the CLI's `ray_zero: ...` lines
    results = ray_zero.sweep(
        args.experiment, overrides=args.overrides, output=args.output, address=args.address
    )
    for row in results.table.itertuples():  # results.csv as a DataFrame; results.per_rank too
        print(f"{row.trial}: {row.status}, peak {row.peak_allocated_gib_max:.3f} GiB per rank")
    print(f"report: {results.files['report.html']}")
    return 0 if results.table["status"].isin(["ok", "skipped"]).all() else 1


if __name__ == "__main__":
    sys.exit(main())
