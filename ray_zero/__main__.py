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

import argparse
import gc
import json
import logging
import shlex
import sys
from pathlib import Path

from ray_zero import api
from ray_zero.config import ConfigError
from ray_zero.console import log_to_console
from ray_zero.experiment_file import field_help

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


def _names(text: str) -> list[str]:
    return [v.strip() for v in text.split(",") if v.strip()]


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
        "--profile",
        type=Path,
        metavar="FILE",
        help="a file of `python -m ray_zero profile` (sets runtime.profile): each row's step time predicted "
        "on it, term by term, beside the measured samples/s",
    )
    command.add_argument(
        "--diagnostics",
        action="store_true",
        help="also write diagnostics.csv: host threads, scheduler counts, pids, time marks",
    )
    loudness = command.add_mutually_exclusive_group()
    loudness.add_argument(
        "--verbose",
        action="store_true",
        help="show ray_zero's debug lines, and Ray's and every rank's own output (else in Ray's logs)",
    )
    loudness.add_argument("--quiet", action="store_true", help="only warnings and the final table")


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
    fit.add_argument(
        "--target",
        choices=["micro_batch", "seq_len"],
        default="micro_batch",
        help="what to find: the largest micro-batch (default), or the longest sequence at each micro-batch",
    )
    fit.add_argument(
        "--max-seq-len", type=int, metavar="N", help="--target seq_len: longest tried (default: positions)"
    )

    report = commands.add_parser(
        "report", help="re-render a finished sweep's tables, plots and report page (no Ray)"
    )
    report.add_argument("directory", type=Path, help="the sweep's output folder")
    report.add_argument("--predict", action="store_true", help="predict every row again (traced anew)")

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
    # Each narrows or overrides its key of the experiment's grid (the experiment's, or the defaults').
    estimate.add_argument("--workers", type=_int_list, help="grid.num_workers, comma-separated: 1,2,4,8")
    estimate.add_argument("--stages", type=_int_list, help="grid.stage, comma-separated: 0,1,2,3")
    estimate.add_argument("--backend", type=_names, help="grid.backend: deepspeed, torch_zero, fsdp")
    estimate.add_argument("--precision", help="precision: fp16, bf16 or fp32")
    estimate.add_argument("--micro-batch-size", type=_int_list, help="grid.micro_batch_size: 4,8,16")
    estimate.add_argument("--seq-len", type=_int_list, help="grid.seq_len (token models): 512,1024,2048")
    estimate.add_argument(
        "--gpu-gib",
        type=float,
        metavar="G",
        help="mark the rows whose predicted peak exceeds G GiB (default: this machine's GPU, if any)",
    )
    estimate.add_argument(
        "--gpu",
        metavar="NAME",
        help="the GPU's name (h100, h200, A100-SXM4-80GB): the error band is checked against its "
        "architecture (default: this machine's GPU, if any)",
    )
    estimate.add_argument(
        "--measured",
        type=Path,
        metavar="DIR",
        help="a sweep's folder: predict samples/s at --workers from its rows (needs --bandwidth or --busbw)",
    )
    estimate.add_argument(
        "--bandwidth", type=Path, metavar="FILE", help="a file of `python -m ray_zero bandwidth`"
    )
    estimate.add_argument("--busbw", type=float, metavar="GB/s", help="the bus bandwidth, in place of a file")
    estimate.add_argument(
        "--profile",
        type=Path,
        metavar="FILE",
        help="a file of `python -m ray_zero profile`: each point's step ms, samples/s, MFU and what bounds "
        "it (with --bandwidth or --busbw: its exposed communication too)",
    )
    estimate.add_argument(
        "--calibration",
        type=Path,
        metavar="DIR",
        help="a sweep's folder whose calibration.json gives the model's activations per sample",
    )
    bandwidth = commands.add_parser(
        "bandwidth", help="bus bandwidth of all-reduce, reduce-scatter, all-gather between workers"
    )
    bandwidth.add_argument(
        "--workers", type=int, help="workers, 2 or more (default: the cluster's GPUs, else 2 CPU workers)"
    )
    bandwidth.add_argument(
        "--device", default="auto", help="auto (GPUs where the cluster has them), gpu or cpu"
    )
    bandwidth.add_argument(
        "--min-mib", type=int, default=1, help="smallest message, MiB, a power of two (default 1)"
    )
    bandwidth.add_argument(
        "--max-mib",
        type=int,
        default=1024,
        help="largest message, MiB, a power of two (default 1024; on CPU 64 gives the curve in seconds)",
    )
    bandwidth.add_argument(
        "--iterations",
        type=int,
        default=20,
        help="timed calls per message size, fewer where they would take over a second (default 20)",
    )
    bandwidth.add_argument(
        "--output", type=Path, default=Path("bandwidth.json"), metavar="FILE", help="the file to write"
    )
    bandwidth.add_argument(
        "--address",
        metavar="ADDR",
        help="a running Ray cluster to join (default: RAY_ADDRESS, or a private Ray)",
    )
    profile = commands.add_parser(
        "profile", help="this GPU's rates per kernel class from micro-benchmarks, for estimate --profile"
    )
    profile.add_argument(
        "--output", type=Path, default=Path("profile.json"), metavar="FILE", help="the file to write"
    )
    profile.add_argument("--device", help="cuda or cpu (default: the GPU where there is one)")
    profile.add_argument(
        "--budget-s", type=float, default=180.0, metavar="S", help="seconds the benchmarks may take (180)"
    )
    commands.add_parser("keys", help="list every experiment key with its meaning and default")
    commands.add_parser("columns", help="every column of the tables, its unit and meaning (docs/columns.md)")
    return parser


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
    args = _parser().parse_args(argv)
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
