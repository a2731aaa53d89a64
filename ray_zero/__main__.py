"""ray_zero command line.

python -m ray_zero sweep experiments/quick.yaml                 # private Ray, CPU or GPU
python -m ray_zero sweep experiments/quick.yaml --set grid.num_workers=[1,3] --set steps=8
python -m ray_zero sweep experiments/quick.yaml --address auto  # join a running cluster
python -m ray_zero sweep --resume runs/quick-20261129-120000     # finish an interrupted sweep
python -m ray_zero fit experiments/gpt2_tiny_fit.yaml --budget-gib 3   # largest micro-batch that fits
python -m ray_zero report runs/quick-20261129-120000             # tables, plots, report.html again
python -m ray_zero estimate --model hf:gpt2 --workers 1,2,4,8    # the memory model alone
python -m ray_zero keys                                          # every experiment key
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import sys
from pathlib import Path

from ray_zero.config import ConfigError
from ray_zero.experiment_file import field_help, load_experiment, validate_experiment

EXIT_BAD_INPUT = 2


class _OneLineParser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse prints usage + message; we print one line
        print(
            f"ray_zero: error: {message} (see python -m ray_zero {self.prog.split()[-1]} --help)",
            file=sys.stderr,
        )
        sys.exit(EXIT_BAD_INPUT)


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a comma-separated list of integers, e.g. 1,2,4"
        ) from None
    if not values or min(values) < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: give integers, e.g. 1,2,4")
    return values


def _add_run_options(command: argparse.ArgumentParser) -> None:
    command.add_argument("experiment", nargs="?", help="experiment YAML file, e.g. experiments/quick.yaml")
    command.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a key of the experiment; dotted keys, YAML values "
        "(e.g. --set steps=8 --set grid.num_workers=[1,3]); repeatable",
    )
    command.add_argument(
        "--output", type=Path, metavar="DIR", help="folder for the results (default runs/NAME-DATE)"
    )
    command.add_argument(
        "--address",
        metavar="ADDR",
        help="join this Ray cluster ('auto' for the local one started with `ray start`); "
        "default: RAY_ADDRESS if set, else a private Ray that stops with the sweep",
    )
    command.add_argument("--resume", type=Path, metavar="DIR", help="finish the interrupted run in DIR")
    command.add_argument(
        "--diagnostics",
        action="store_true",
        help="also write diagnostics.csv: host threads, scheduler counts, pids, time marks",
    )
    command.add_argument(
        "--verbose",
        action="store_true",
        help="show Ray's and every rank's own output on the terminal (kept in Ray's logs otherwise)",
    )


def _parser() -> argparse.ArgumentParser:
    parser = _OneLineParser(
        prog="python -m ray_zero",
        description=__doc__.split("\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__,
    )
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_OneLineParser)
    _add_run_options(commands.add_parser("sweep", help="run an experiment's grid as Ray Tune trials"))
    fit = commands.add_parser(
        "fit", help="find the largest micro-batch that fits, per stage and worker count"
    )
    _add_run_options(fit)
    fit.add_argument(
        "--budget-gib",
        type=float,
        metavar="G",
        help="memory per rank to stay within (default on GPU: the device's memory less --margin-gib; "
        "required on CPU, where it bounds each worker's peak resident set)",
    )
    fit.add_argument(
        "--margin-gib", type=float, default=2.0, help="GPU: memory left free below the device's (default 2)"
    )
    fit.add_argument(
        "--granularity",
        type=int,
        metavar="K",
        help="search to a multiple of K samples (default 8, or 1 below 64)",
    )
    fit.add_argument(
        "--max-micro-batch", type=int, default=65536, metavar="B", help="largest micro-batch tried"
    )

    report = commands.add_parser(
        "report", help="re-render a finished sweep's tables, plots and report page (no Ray)"
    )
    report.add_argument("directory", type=Path, help="the sweep's output folder")

    estimate = commands.add_parser("estimate", help="print the memory model's prediction, no training")
    estimate.add_argument("experiment", nargs="?", help="an experiment YAML to start from (optional)")
    estimate.add_argument(
        "--model", help="model source: seed|base|large, hf:TYPE, timm:NAME, module:function"
    )
    estimate.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a key, e.g. --set model_config.hidden_size=2048 --set seq_len=512",
    )
    estimate.add_argument(
        "--workers", type=_int_list, default=[1, 2, 4, 8], help="comma-separated ranks, e.g. 1,2,4,8"
    )
    estimate.add_argument(
        "--stages", type=_int_list, default=None, help="comma-separated ZeRO stages (default 0,1,2,3)"
    )
    estimate.add_argument("--backend", default="deepspeed", choices=["deepspeed", "torch_zero", "fsdp"])
    estimate.add_argument(
        "--precision", default="fp16", choices=["fp16", "bf16", "fp32"], help="training precision"
    )
    estimate.add_argument(
        "--micro-batch-size", type=int, default=64, help="samples per rank per step (for activations)"
    )
    estimate.add_argument(
        "--gpu-gib",
        type=float,
        metavar="G",
        help="mark the rows whose predicted peak (or model states, without activations) exceeds G GiB",
    )
    estimate.add_argument(
        "--calibration",
        type=Path,
        metavar="DIR",
        help="a sweep's folder whose calibration.json gives the model's activations per sample",
    )
    commands.add_parser("keys", help="list every experiment key with its meaning and default")
    return parser


def _use_cluster_token(address: str | None) -> None:
    """`ray start --head` turns token authentication on where a token exists (~/.ray/auth_token); a client
    joining it must say so, before Ray is imported (Ray reads RAY_AUTH_MODE once)."""
    joining = address or os.environ.get("RAY_ADDRESS")
    has_token = os.environ.get("RAY_AUTH_TOKEN") or (Path.home() / ".ray" / "auth_token").is_file()
    if joining and has_token and "RAY_AUTH_MODE" not in os.environ:
        os.environ["RAY_AUTH_MODE"] = "token"


def _describe(experiment, address: str | None = None, check_machine: bool = True):
    """The model's facts, before Ray starts; a bad model is one line (ConfigError). On this machine's own
    Ray, a model whose states cannot fit is refused as soon as its parameters are counted (not for
    `estimate`, which plans for the cluster the user will have)."""
    from ray_zero.models.describe import describe_model
    from ray_zero.models.source import ModelError

    def check(params: int) -> None:
        if check_machine and not (address or os.environ.get("RAY_ADDRESS")):
            from ray_zero.run.plan import check_model_fits, local_cluster, plan_sweep

            cluster = local_cluster()
            check_model_fits(experiment, params, cluster, plan_sweep(experiment, cluster))

    try:
        return describe_model(
            experiment.model,
            experiment.model_options,
            experiment.seq_len,
            experiment.input_shape,
            experiment.num_classes,
            check_params=check,
        )
    except ModelError as error:
        raise ConfigError(f"model {experiment.model}: {error}") from None


def _experiment_and_output(args):
    from ray_zero.store import EXPERIMENT_FILE, read_experiment_file

    if args.resume is not None:
        if args.experiment or args.overrides:
            raise ConfigError("--resume DIR takes no experiment file or --set: it reuses DIR's experiment")
        saved = args.resume / EXPERIMENT_FILE
        if not saved.is_file():
            raise ConfigError(
                f"--resume {args.resume}: no {EXPERIMENT_FILE} there (give a sweep's output folder)"
            )
        return validate_experiment(
            read_experiment_file(args.resume)["experiment"], source=str(saved)
        ), args.resume
    if not args.experiment:
        raise ConfigError(
            f"{args.command} needs an experiment file, e.g. python -m ray_zero {args.command} "
            "experiments/quick.yaml"
        )
    experiment = load_experiment(args.experiment, args.overrides)
    return experiment, args.output or Path("runs") / f"{experiment.name}-{dt.datetime.now():%Y%m%d-%H%M%S}"


def _run(args) -> int:
    experiment, output = _experiment_and_output(args)
    model = _describe(experiment, args.address)
    _use_cluster_token(args.address)
    from ray_zero.report.tables import console_table  # imports Ray only after the input is checked
    from ray_zero.run.sweep import SweepIncomplete, run_sweep
    from ray_zero.store import read_provenance

    # A resumed sweep keeps what its first run collected: its unfinished trials run with the same
    # --diagnostics.
    diagnostics = args.diagnostics or bool(args.resume and (read_provenance(output) or {}).get("diagnostics"))
    options = dict(
        address=args.address, resume=args.resume is not None, diagnostics=diagnostics, verbose=args.verbose
    )
    try:
        if args.command == "fit":
            from ray_zero.run.fit import FitSettings, run_fit

            settings = FitSettings.from_args(args, experiment)
            frame = run_fit(experiment, output, model, settings, **options)
        else:
            frame = run_sweep(experiment, output, model, **options)
    except (KeyboardInterrupt, SweepIncomplete) as stop:
        done = f" ({stop})" if isinstance(stop, SweepIncomplete) else ""
        print(
            f"ray_zero: interrupted{done}; finished trials are in {output}/results.csv. "
            f"Finish the rest with: python -m ray_zero {args.command} --resume {output}",
            file=sys.stderr,
        )
        return 130
    print(console_table(frame))
    print(f"ray_zero: results in {output}/ (results.csv, results.md, per_rank.csv, report.html)")
    return 0 if frame["status"].isin(["ok", "oom", "skipped"]).all() else 1


def _report(args) -> int:
    from ray_zero.report.tables import console_table, rerender

    try:
        frame = rerender(args.directory)
    except FileNotFoundError as error:
        raise ConfigError(str(error)) from None
    print(console_table(frame))
    return 0


def _estimate(args) -> int:
    from ray_zero.report.estimate import estimate_table

    if args.experiment:
        experiment = load_experiment(
            args.experiment, args.overrides + ([f"model={args.model}"] if args.model else [])
        )
    else:
        model = f"model={args.model or 'large'}"
        experiment = validate_experiment(
            {"steps": 1, "warmup_steps": 0}, [model, *args.overrides], source="estimate"
        )
    print(estimate_table(experiment, _describe(experiment, check_machine=False), args))
    return 0


def _keys(_args) -> int:
    for key, text, default in field_help():
        print(f"{key:36} {text}  [default: {default!r}]")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    handler = {"sweep": _run, "fit": _run, "report": _report, "estimate": _estimate, "keys": _keys}[
        args.command
    ]
    try:
        return handler(args)
    except ConfigError as error:
        print(f"ray_zero: error: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT


if __name__ == "__main__":
    sys.exit(main())
