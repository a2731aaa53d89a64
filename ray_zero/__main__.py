"""ray_zero command line.

    python -m ray_zero sweep experiments/quick.yaml                 # private Ray, CPU or GPU
    python -m ray_zero sweep experiments/zero1_mnist.yaml --output results/zero1_mnist
    python -m ray_zero sweep experiments/quick.yaml --set grid.num_workers=[1,3] --set steps=8
    python -m ray_zero sweep experiments/quick.yaml --address auto  # join a running cluster
    python -m ray_zero sweep --resume runs/quick-20261129-120000     # finish an interrupted sweep
    python -m ray_zero report runs/quick-20261129-120000             # table and plots again, no Ray
    python -m ray_zero estimate --model large --workers 1,2,4,8      # memory model only
    python -m ray_zero keys                                          # every experiment key
"""
from __future__ import annotations

import argparse
import datetime as dt
import os
import sys
from pathlib import Path

from ray_zero.config import ConfigError, field_help, load_experiment, validate_experiment

EXIT_BAD_INPUT = 2


class _OneLineParser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse prints usage + message; we print one line
        print(f"ray_zero: error: {message} (see python -m ray_zero {self.prog.split()[-1]} --help)",
              file=sys.stderr)
        sys.exit(EXIT_BAD_INPUT)


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers, e.g. 1,2,4") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give integers of at least 1, e.g. 1,2,4")
    return values


def _parser() -> argparse.ArgumentParser:
    parser = _OneLineParser(prog="python -m ray_zero", description=__doc__.split("\n")[0],
                            formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_OneLineParser)

    sweep = commands.add_parser("sweep", help="run an experiment's grid as Ray Tune trials")
    sweep.add_argument("experiment", nargs="?", help="experiment YAML file, e.g. experiments/quick.yaml")
    sweep.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                       help="override a key of the experiment; dotted keys, YAML values "
                            "(e.g. --set steps=8 --set grid.num_workers=[1,3]); repeatable")
    sweep.add_argument("--output", type=Path, metavar="DIR",
                       help="folder for results.csv, results.md, plots (default runs/NAME-DATE)")
    sweep.add_argument("--address", metavar="ADDR",
                       help="join this Ray cluster ('auto' for the local one started with `ray start`); "
                            "default: RAY_ADDRESS if set, else a private Ray that stops with the sweep")
    sweep.add_argument("--resume", type=Path, metavar="DIR",
                       help="finish the interrupted sweep in DIR, running only the trials that did not finish")

    report = commands.add_parser("report", help="re-render a finished sweep's table and plots (no Ray)")
    report.add_argument("directory", type=Path, help="the sweep's output folder")

    estimate = commands.add_parser("estimate", help="print the ZeRO memory model's prediction, no training")
    estimate.add_argument("--model", default="large", help="model preset: seed, base or large (default large)")
    estimate.add_argument("--workers", type=_int_list, default=[1, 2, 4, 8], help="comma-separated ranks, e.g. 1,2,4,8")
    estimate.add_argument("--stages", type=_int_list, default=None, help="comma-separated ZeRO stages (default 0,1,2,3)")
    estimate.add_argument("--precision", default="fp16", choices=["fp16", "bf16", "fp32"], help="training precision")
    estimate.add_argument("--micro-batch-size", type=int, default=64, help="samples per rank per step (for activations)")

    commands.add_parser("keys", help="list every experiment key with its meaning and default")
    return parser


def _use_cluster_token(address: str | None) -> None:
    """`ray start --head` turns token authentication on and keeps the token in ~/.ray/auth_token; a
    client joining it must say so, before Ray is imported (Ray reads RAY_AUTH_MODE once). Unless the
    user chose a mode, use the token when there is one."""
    joining = address or os.environ.get("RAY_ADDRESS")
    has_token = os.environ.get("RAY_AUTH_TOKEN") or (Path.home() / ".ray" / "auth_token").is_file()
    if joining and has_token and "RAY_AUTH_MODE" not in os.environ:
        os.environ["RAY_AUTH_MODE"] = "token"


def _sweep(args) -> int:
    from ray_zero.report import EXPERIMENT_FILE, console_table

    if args.resume is not None:
        if args.experiment or args.overrides:
            raise ConfigError("--resume DIR takes no experiment file or --set: it reuses DIR's experiment")
        saved = args.resume / EXPERIMENT_FILE
        if not saved.is_file():
            raise ConfigError(f"--resume {args.resume}: no {EXPERIMENT_FILE} there (give a sweep's output folder)")
        import yaml

        experiment = validate_experiment(yaml.safe_load(saved.read_text())["experiment"], source=str(saved))
        output = args.resume
    else:
        if not args.experiment:
            raise ConfigError("sweep needs an experiment file, e.g. python -m ray_zero sweep experiments/quick.yaml")
        experiment = load_experiment(args.experiment, args.overrides)
        output = args.output or Path("runs") / f"{experiment.name}-{dt.datetime.now():%Y%m%d-%H%M%S}"

    _use_cluster_token(args.address)
    from ray_zero.sweep import SweepIncomplete, run_sweep  # imports Ray: only after the input is checked

    try:
        frame = run_sweep(experiment, output, address=args.address, resume=args.resume is not None)
    except (KeyboardInterrupt, SweepIncomplete) as stop:
        done = f" ({stop})" if isinstance(stop, SweepIncomplete) else ""
        print(f"ray_zero: interrupted{done}; finished trials are in {output}/results.csv. "
              f"Finish the rest with: python -m ray_zero sweep --resume {output}", file=sys.stderr)
        return 130
    print(console_table(frame))
    print(f"ray_zero: results in {output}/results.csv, results.md, per_rank.csv")
    return 0 if (frame["status"].isin(["ok", "oom", "skipped"])).all() else 1


def _report(args) -> int:
    from ray_zero.report import console_table, rerender

    try:
        frame = rerender(args.directory)
    except FileNotFoundError as error:
        raise ConfigError(str(error)) from None
    print(console_table(frame))
    return 0


def _estimate(args) -> int:
    import pandas as pd

    from ray_zero.memory_model import GIB, deepspeed, paper
    from ray_zero.sizes import PRESETS

    if args.model not in PRESETS:
        raise ConfigError(f"--model {args.model!r}: allowed presets are {', '.join(PRESETS)}")
    preset = PRESETS[args.model]
    params = preset.param_count()
    rows = []
    for stage in args.stages or [0, 1, 2, 3]:
        if stage > 3:
            raise ConfigError(f"--stages: {stage} is not a ZeRO stage; allowed 0, 1, 2, 3")
        for workers in args.workers:
            book = paper(params, stage, workers, args.precision)
            real = deepspeed(params, stage, workers, args.precision, micro_batch_size=args.micro_batch_size,
                             preset=preset)
            rows.append({"stage": stage, "workers": workers,
                         "paper_model_state_gib": book.model_state_bytes / GIB,
                         "ds_params_gib": real.parameter_bytes / GIB, "ds_grads_gib": real.gradient_bytes / GIB,
                         "ds_master_gib": real.master_param_bytes / GIB,
                         "ds_optimizer_states_gib": real.optimizer_state_bytes / GIB,
                         "ds_model_state_gib": real.model_state_bytes / GIB,
                         "ds_predicted_peak_gib": real.peak_bytes / GIB})
    print(f"{args.model}: {params:,} parameters, {args.precision}, micro-batch {args.micro_batch_size}; "
          f"paper = ZeRO paper's model states, ds_* = what DeepSpeed 0.19.8 allocates (ray_zero.memory_model)")
    print(pd.DataFrame(rows).to_string(index=False, float_format=lambda v: f"{v:.3f}"))
    return 0


def _keys(_args) -> int:
    for key, text, default in field_help():
        print(f"{key:32} {text}  [default: {default!r}]")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    handler = {"sweep": _sweep, "report": _report, "estimate": _estimate, "keys": _keys}[args.command]
    try:
        return handler(args)
    except ConfigError as error:
        print(f"ray_zero: error: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT


if __name__ == "__main__":
    sys.exit(main())
