"""ray_zero command line.

python -m ray_zero sweep experiments/quick.yaml                 # private Ray, CPU or GPU
python -m ray_zero sweep experiments/quick.yaml --set grid.num_workers=[1,3] --set steps=8
python -m ray_zero sweep experiments/quick.yaml --address auto  # join a running cluster
python -m ray_zero sweep --resume runs/quick-20261129-120000     # finish an interrupted sweep
python -m ray_zero fit experiments/gpt2_tiny_fit.yaml --budget-gib 3   # largest micro-batch that fits
python -m ray_zero fit experiments/gpt2_tiny_fit.yaml --budget-gib 3 --target seq_len   # longest sequence
python -m ray_zero report runs/quick-20261129-120000             # tables, plots, report.html again
python -m ray_zero estimate experiments/llama_1b.yaml           # every grid point predicted
python -m ray_zero bandwidth --workers 2                         # busbw between workers, for estimate
python -m ray_zero estimate --measured runs/X --bandwidth bandwidth.json   # samples/s at 1-8 workers
python -m ray_zero profile --output h100.json                    # this GPU's kernel rates, <= 3 minutes
python -m ray_zero estimate experiments/llama_1b.yaml --profile h100.json   # + step ms and samples/s
python -m ray_zero estimate experiments/llama_1b.yaml --profile h100.json --busbw 360   # + communication
python -m ray_zero sweep experiments/gpt2_zero.yaml --profile h100.json   # rows: predicted speed too
python -m ray_zero keys                                          # every experiment key
python -m ray_zero columns                                       # every column of the tables

A thin layer over the Python API (ray_zero/api.py: ray_zero.sweep, ray_zero.fit, ray_zero.estimate).
"""

from __future__ import annotations

import gc
import json
import logging
import shlex
import sys
from pathlib import Path

from ray_zero import api
from ray_zero.cli_options import EXIT_BAD_INPUT, parser
from ray_zero.config import ConfigError
from ray_zero.console import log_to_console
from ray_zero.experiment_file import field_help


def _run(args) -> int:
    from ray_zero.run.sweep import SweepIncomplete  # Ray: imported once the input is known to be good

    common = _options(args, "overrides", "output", "address", "resume", "verbose", "profile")
    common["command"] = _command()
    if args.resume is None and not args.experiment:
        raise ConfigError(
            f"{args.command} needs an experiment file, e.g. python -m ray_zero {args.command} "
            "experiments/quick.yaml"
        )
    try:
        if args.command == "fit":
            search = _options(
                args, "budget_gib", "margin_gib", "granularity", "max_micro_batch", "target", "max_seq_len"
            )
            results = api.fit(args.experiment, **search, **common)
            print(results.fit.to_string(index=False, float_format=lambda v: f"{v:.4g}", na_rep="-"))
        else:
            results = api.sweep(args.experiment, diagnostics=args.diagnostics, **common)
    except (KeyboardInterrupt, SweepIncomplete) as stop:
        output = args.resume or args.output or "the output folder"
        done = f" ({stop})" if isinstance(stop, SweepIncomplete) else ""
        print(
            f"ray_zero: interrupted{done}; finished trials are in {output}/results.csv. "
            f"Finish the rest with: python -m ray_zero {args.command} --resume {output}",
            file=sys.stderr,
        )
        return 130
    from ray_zero.report.tables import console_table  # loaded while Ray started (run/session.py)

    print(console_table(results.table))
    print(f"ray_zero: results in {results.output}/ (results.csv, results.md, per_rank.csv, report.html)")
    return 0 if results.table["status"].isin(["ok", "oom", "skipped"]).all() else 1


def _command() -> str:
    return " ".join(shlex.quote(a) for a in ["python", "-m", "ray_zero", *sys.argv[1:]])


def _options(args, *names: str) -> dict:
    """The parsed options of these names: the API's keyword arguments of the same names."""
    return {name: getattr(args, name) for name in names}


def _report(args) -> int:
    from ray_zero.report.tables import console_table, rerender

    try:
        frame = rerender(args.directory, predict=args.predict)
    except FileNotFoundError as error:
        raise ConfigError(str(error)) from None
    print(console_table(frame))
    return 0


def _estimate(args) -> int:
    model_set = [f"model={args.model}"] if args.model else []
    model = args.experiment or args.model or ("" if args.measured else "large")
    grid = _options(
        args, "workers", "stages", "backend", "precision", "micro_batch_size", "seq_len", "calibration"
    )
    speed = _options(args, "gpu_gib", "gpu", "measured", "bandwidth", "busbw", "profile")
    overrides = [*args.overrides, *(model_set if args.experiment else [])]
    print(api.estimate(model, **grid, **speed, overrides=overrides))
    return 0


def _bandwidth(args) -> int:
    from ray_zero.run.bandwidth import BandwidthFailed, bandwidth_table

    try:
        sizes = _options(args, "workers", "device", "min_mib", "max_mib", "iterations")
        written = api.bandwidth(**sizes, **_options(args, "output", "address"), command=_command())
    except BandwidthFailed as error:
        print(f"ray_zero: error: {error}", file=sys.stderr)
        return 1
    if written is not None:
        print(bandwidth_table(written))
        print(f"ray_zero: written to {written} (for estimate --measured DIR --bandwidth {written})")
    return 0


def _profile(args) -> int:
    written = api.profile(**_options(args, "output", "device", "budget_s"), command=_command())
    from ray_zero.measure.gpu_profile import profile_notes

    for note in profile_notes(json.loads(Path(written).read_text())):
        print(f"ray_zero: {note}")
    print(f"ray_zero: written to {written} (for estimate --profile {written})")
    return 0


def _keys(_args) -> int:
    for key, text, default in field_help():
        print(f"{key:36} {text}  [default: {default!r}]")
    return 0


def _columns(_args) -> int:
    from ray_zero.schema.docs import columns_markdown

    print(columns_markdown())
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parser(__doc__).parse_args(argv)
    verbose, quiet = getattr(args, "verbose", False), getattr(args, "quiet", False)
    log_to_console(logging.DEBUG if verbose else logging.WARNING if quiet else logging.INFO)
    handlers = {"sweep": _run, "fit": _run, "report": _report, "estimate": _estimate, "keys": _keys}
    handler = {**handlers, "bandwidth": _bandwidth, "columns": _columns, "profile": _profile}[args.command]
    try:
        return handler(args)
    except ConfigError as error:
        print(f"ray_zero: error: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT


if __name__ == "__main__":
    code = main()
    # The process ends here: its exit need not search the objects that torch, Ray and pandas made for
    # cycles (the cost: bench/sweep_bench.md). Files are closed, Ray is shut down, atexit handlers run.
    gc.freeze()
    sys.exit(code)
