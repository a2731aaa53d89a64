"""The error bands ray_zero ships (ray_zero/measure/error_bands.json), from issue 65's GPU population: per
class, measured/predicted − 1 of the tuning families' rows as predicted again by this version
(population_predict.py's predicted.jsonl), never the held-out third's, which the bands are judged on.

Per class (ray_zero.measure.error_band.CLASSES): `upper` is the largest under-prediction (at least 0),
`lower` the LOWER_QUANTILE of the residuals (at most 0); a class with fewer than MIN_ROWS rows takes the
band of all classes together ("any model"). The file says the GPUs, their compute capability, the torch
releases (the GPU's and the tracer's) and the command.

    python bench/population_band.py DIR [DIR ...]            # print the bands
    python bench/population_band.py DIR [DIR ...] --write    # and write ray_zero/measure/error_bands.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from population_table import _rows, load

from ray_zero.measure.error_band import ANY, BANDS_FILE, CLASSES, compute_capability

MIN_ROWS = 10
LOWER_QUANTILE = 0.025


def band(ratios: list[float], name: str) -> dict:
    residuals = sorted(r - 1 for r in ratios)
    low = statistics.quantiles(residuals, n=40, method="inclusive")[0] if len(residuals) > 1 else residuals[0]
    return {"name": name, "lower": round(min(low, 0.0), 4), "upper": round(max(residuals[-1], 0.0), 4),
            "rows": len(residuals)}  # fmt: skip


def bands(folders: list[Path]) -> dict:
    records, _ = load(folders, predicted=True)
    rows = [r for r in _rows(records) if r["set"] == "tuning"]
    if not rows:
        raise SystemExit("no tuning row predicted again: run bench/population_predict.py DIR --set tuning")
    everything = band([r["ratio"] for r in rows], ANY)
    classes = {ANY: everything}
    for name in CLASSES:
        ratios = [r["ratio"] for r in rows if r["cls"] == name]
        classes[name] = band(ratios, name) if len(ratios) >= MIN_ROWS else everything
    tuning = [r for r in records.values() if r["set"] == "tuning"]
    gpus = sorted({(r.get("gpu") or "").split(" x ")[-1] for r in tuning if r.get("gpu")})
    gpu_torch = {(r.get("provenance") or {}).get("torch") for r in tuning} - {None}
    again = {((r.get("provenance") or {}).get("predicted again") or {}).get("torch") for r in tuning} - {None}
    versions = sorted(gpu_torch | again, key=lambda v: tuple(int(x) for x in v.split("+")[0].split(".")[:2]))
    return {
        "about": {
            "gpus": gpus,
            "compute_capabilities": sorted({compute_capability(g) for g in gpus} - {None}),
            "torch_range": [versions[0], versions[-1]],
            "torch_on_the_gpu": sorted(gpu_torch),
            "torch_that_predicted": sorted(again),
            "families": len({r["family"] for r in rows}),
            "rows_from": "the tuning families of bench/population_split.json only",
            "date": time.strftime("%Y-%m-%d", time.gmtime()),
            "command": "python bench/population_band.py " + " ".join(sys.argv[1:]),
        },
        "classes": classes,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("folders", type=Path, nargs="+", help="population run folders (or kept records)")
    parser.add_argument("--write", action="store_true", help=f"write {BANDS_FILE.name}")
    args = parser.parse_args(argv)
    found = bands(args.folders)
    text = json.dumps(found, indent=1) + "\n"
    print(text)
    if args.write:
        BANDS_FILE.write_text(text)
        print(f"population_band: wrote {BANDS_FILE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
