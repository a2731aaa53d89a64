"""bench/first_conv.py in fresh Ray worker processes (one task each, max_calls=1), with what the worker's
environment has that this process's has not: to tell whether a Ray worker finds a cache that a plain
process finds.

    python bench/first_conv_in_ray.py N     # N tasks one after another; JSON lines
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import ray

ROOT = Path(__file__).resolve().parents[1]


@ray.remote(num_gpus=1, max_calls=1)
def first_conv_in_worker() -> dict:
    import contextlib
    import io
    import runpy

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        runpy.run_path(str(ROOT / "bench" / "first_conv.py"), run_name="__main__")
    return {"result": json.loads(out.getvalue()), "env": dict(os.environ)}


def main(tasks: int) -> None:
    ray.init(num_gpus=1, num_cpus=2, configure_logging=False)  # workers inherit PYTHONPATH
    for _ in range(tasks):
        got = ray.get(first_conv_in_worker.remote())
        env = got["env"]
        differs = {k: v for k, v in env.items() if os.environ.get(k) != v and not k.startswith("RAY_")}
        print(json.dumps({**got["result"], "env_differs": differs,
                          "env_missing": sorted(k for k in os.environ if k not in env)}))
    ray.shutdown()


if __name__ == "__main__":
    main(int(sys.argv[1]))
