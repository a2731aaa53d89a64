"""The command line's options: one parser with a subcommand each (sweep, fit, report, estimate, bandwidth,
profile, keys, columns), whose errors are one line (exit 2) before anything runs."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

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


def parser(usage: str) -> argparse.ArgumentParser:
    """The command line's parser; `usage` (the CLI's docstring) is its description and epilog."""
    top = _OneLineParser(
        prog="python -m ray_zero",
        description=usage.split("\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=usage,
    )
    commands = top.add_subparsers(dest="command", required=True, parser_class=_OneLineParser)
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
    return top
