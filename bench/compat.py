"""Does ray_zero install beside, and run on, an older stack than requirements.txt pins?

Builds a second virtual environment (away from the checkout) with an older torch, Ray, DeepSpeed,
Transformers and timm from the registry, installs this checkout into it with a plain `pip install .`
(which must keep every one of those versions: pyproject.toml gives ranges, requirements.txt the tested
pins), then runs a representative subset of the rank-level tests and one CPU sweep (experiments/quick.yaml)
with it, and writes a table (hardware, versions, date, command) to OUT/compat.md. bench/compat.md is
the story.

    python bench/compat.py --venv /tmp/rz-compat/venv --output bench/results/compat-cpu-2core
    python bench/compat.py --venv /tmp/rz-compat/venv --skip-build ...   # the venv already built

The venv is several GB (torch's CUDA build): build it under /tmp and delete it afterwards.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import ROOT

OLD_STACK = {
    "torch": "2.11.0",  # the lent GPU machines' torch
    "torchvision": "0.26.0",  # torch 2.11's
    "ray": "2.56.1",  # the oldest with ray.train.LoggingConfig (2.54.1, 2.55.1 lack it)
    "deepspeed": "0.19.0",  # 0.18.9: ZeRO-1/2 fail at 2 ranks on gloo (bench/compat.md)
    "transformers": "5.17.0",  # the GPU machines' Transformers
    "timm": "1.0.29",  # the GPU machines' timm
}
EXTRAS = {"ray": "ray[default,train,tune]"}
# Rank-level tests (tests/README.md) over every engine, precision and model source, the DeepSpeed compat
# module, config and bad input, and the Ray-level tests of the public Ray API this version leans on; each
# file runs on its own under the old stack.
TESTS = [
    "tests/test_ds_compat.py",
    "tests/test_engines.py",
    "tests/test_worker_engines.py",
    "tests/test_rank_models.py",
    "tests/test_models.py",
    "tests/test_model_data.py",
    "tests/test_timed_window.py",
    "tests/test_config.py",
    "tests/test_bad_input.py",
    "tests/test_user_stack.py",  # Ray: the caller's environment, the loggers, a worker hung at its start
]
WATCHED = [*OLD_STACK, "ray_zero"]


def run(command: list[str], log: Path, env: dict | None = None, cwd: Path = ROOT, timeout: float = 3600):
    """Run a command, its output appended to `log`; (return code, seconds)."""
    started = time.time()
    with open(log, "a") as out:
        out.write(f"\n$ {' '.join(command)}\n")
        out.flush()
        done = subprocess.run(
            command, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, env=env, timeout=timeout
        )
    return done.returncode, time.time() - started


def versions(python: Path) -> dict[str, str]:
    script = (
        "import importlib.metadata as m, json; d = {}\n"
        f"for n in {WATCHED!r}:\n"
        "    try: d[n] = m.version(n)\n"
        "    except m.PackageNotFoundError: d[n] = None\n"
        "print(json.dumps(d))"
    )
    return json.loads(subprocess.run([str(python), "-c", script], capture_output=True, text=True).stdout)


def build(venv: Path, log: Path) -> None:
    """The old stack from the registry; DeepSpeed (a source package) built against its torch."""
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q"]
    pins = [f"{EXTRAS.get(name, name)}=={version}" for name, version in OLD_STACK.items()]
    first = [p for p in pins if not p.startswith("deepspeed")]
    code, _ = run([*pip, *first, "setuptools<82", "wheel"], log)
    if code:
        raise SystemExit(f"compat: installing {first} failed (see {log})")
    deepspeed = next(p for p in pins if p.startswith("deepspeed"))
    code, _ = run([*pip, "--no-build-isolation", deepspeed], log, env={**os.environ, "DS_BUILD_OPS": "0"})
    if code:
        raise SystemExit(f"compat: installing {deepspeed} failed (see {log})")


def snapshot(into: Path) -> Path:
    """The checkout as it is now (tests, experiments, data too): what is installed, tested and swept."""
    shutil.copytree(
        ROOT,
        into,
        ignore=shutil.ignore_patterns(".*", "results", "runs", "bench", "build", "*.egg-info", "__pycache__"),
    )
    return into


def install_checkout(venv: Path, source: Path, log: Path) -> int:
    """A plain `pip install .`, as a user installs ray_zero into an environment that has its own stack."""
    return run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "."], log, cwd=source)[0]


def install_test_tools(venv: Path, log: Path) -> int:
    """pytest with the plugins pyproject.toml's options name, and MLflow for the loggers' test (the pin
    requirements.txt tests with)."""
    pins = (ROOT / "requirements.txt").read_text().splitlines()
    mlflow = next(line for line in pins if line.startswith("mlflow"))
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q"]
    return run([*pip, "pytest", "pytest-timeout", "pytest-xdist", mlflow.strip()], log)[0]


def pytest_counts(log_text: str) -> str:
    """pytest's closing line's counts ("12 passed, 1 skipped"), or what it said instead."""
    lines = [line for line in log_text.splitlines() if re.search(r"\d+ (passed|failed|error)", line)]
    return re.sub(r"=+|\s+in [\d.]+s.*", "", lines[-1]).strip() if lines else "no pytest summary"


def sweep(venv: Path, source: Path, out: Path, log: Path) -> dict:
    """experiments/quick.yaml through the CLI of the old stack: each row's status, peak and samples/s."""
    import csv

    folder = out / "quick"
    shutil.rmtree(folder, ignore_errors=True)
    command = [str(venv / "bin" / "python"), "-m", "ray_zero", "sweep", "experiments/quick.yaml", "--output"]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    code, seconds = run([*command, str(folder)], log, env=env, cwd=source, timeout=1800)
    rows = []
    if (folder / "results.csv").is_file():
        with open(folder / "results.csv") as table:
            rows = list(csv.DictReader(table))
    return {"code": code, "seconds": seconds, "rows": rows}


def refused(venv: Path, source: Path, log: Path) -> str:
    """What the old stack refuses before Ray: a ZeRO-3 sweep (ray_zero/run/stack.py), its one line."""
    command = [str(venv / "bin" / "python"), "-m", "ray_zero", "sweep", "experiments/quick.yaml"]
    command += ["--set", "grid.stage=[3]", "--output", str(source / "refused")]
    done = subprocess.run(command, cwd=source, capture_output=True, text=True, timeout=600)
    with open(log, "a") as out:
        out.write(f"\n$ {' '.join(command)}\n{done.stdout}{done.stderr}")
    lines = [line for line in done.stderr.splitlines() if line.startswith("ray_zero: error:")]
    return f"exit {done.returncode}: {lines[-1] if lines else 'no error line'}"


def hardware() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as info:
            cpu = next(line.split(":", 1)[1].strip() for line in info if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{cpu}, {os.cpu_count()} logical CPUs, no GPU" if not shutil.which("nvidia-smi") else cpu


def table(before, after, tests, swept, refusal, command) -> str:
    kept = all(before[n] == after[n] for n in OLD_STACK)
    lines = [
        "# ray_zero on an older stack",
        "",
        f"Hardware: {hardware()}. Date: {dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M UTC}. "
        f"Python {platform.python_version()}. Command: `{command}`.",
        "",
        "| package | before `pip install .` | after | requirements.txt pins |",
        "|---|---|---|---|",
    ]
    pins = pinned()
    for name in WATCHED:
        lines.append(f"| {name} | {before.get(name)} | {after.get(name)} | {pins.get(name, '')} |")
    lines += ["", f"`pip install .` kept every package of the old stack: **{'yes' if kept else 'NO'}**.", ""]
    lines += ["| run on the old stack | result | seconds |", "|---|---|---|"]
    for name, (counts, seconds) in tests.items():
        lines.append(f"| `pytest {name}` | {counts} | {seconds:.0f} |")
    rows = swept["rows"]
    ok = sum(r.get("status") == "ok" for r in rows)
    lines.append(
        f"| `python -m ray_zero sweep experiments/quick.yaml` | exit {swept['code']}, {ok} of {len(rows)} "
        f"rows ok | {swept['seconds']:.0f} |"
    )
    lines.append(f"| `... sweep experiments/quick.yaml --set 'grid.stage=[3]'` | {refusal} | |")
    if rows:
        lines += ["", "| trial | status | peak GiB | samples/s | error |", "|---|---|---|---|---|"]
        for r in rows:
            error = (r.get("error") or "")[:120].replace("|", "/")
            lines.append(
                f"| {r.get('trial')} | {r.get('status')} | {r.get('peak_allocated_gib_max', '')} | "
                f"{r.get('samples_per_s', '')} | {error} |"
            )
    return "\n".join(lines) + "\n"


def pinned() -> dict[str, str]:
    pins = {}
    for line in (ROOT / "requirements.txt").read_text().splitlines():
        match = re.match(r"([A-Za-z0-9_.-]+)(\[[^]]*\])?==([^\s#]+)", line.strip())
        if match:
            pins[match.group(1)] = match.group(3)
    return pins


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--venv", type=Path, required=True, help="where to build the old stack's venv")
    parser.add_argument("--output", type=Path, required=True, help="folder for compat.md and the logs")
    parser.add_argument("--skip-build", action="store_true", help="the venv already holds the old stack")
    parser.add_argument("--tests", nargs="*", default=TESTS, help="test files to run on the old stack")
    args = parser.parse_args()
    out = args.output.resolve()
    out.mkdir(parents=True, exist_ok=True)
    log = out / "compat.log"
    log.write_text("")
    python = args.venv / "bin" / "python"
    if not args.skip_build:
        build(args.venv, log)
    before = versions(python)
    work = Path(tempfile.mkdtemp(prefix="rz-compat-"))
    try:
        source = snapshot(work / "checkout")
        if install_checkout(args.venv, source, log):
            raise SystemExit(f"compat: pip install . failed (see {log})")
        after = versions(python)
        if install_test_tools(args.venv, log):
            raise SystemExit(f"compat: installing pytest and MLflow failed (see {log})")
        tests = {}
        for test in args.tests:
            mark = log.stat().st_size
            command = [str(python), "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider", test]
            code, seconds = run(command, log, cwd=source)
            tests[test] = (pytest_counts(log.read_text()[mark:]), seconds)
            print(f"compat: {test}: {tests[test][0]} ({seconds:.0f} s)", flush=True)
        swept = sweep(args.venv, source, out, log)
        print(f"compat: quick sweep exit {swept['code']} ({swept['seconds']:.0f} s)", flush=True)
        refusal = refused(args.venv, source, log)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    command = "python bench/compat.py " + " ".join(sys.argv[1:])
    (out / "compat.md").write_text(table(before, after, tests, swept, refusal, command))
    (out / "versions.json").write_text(json.dumps({"before": before, "after": after}, indent=1) + "\n")
    print((out / "compat.md").read_text())


if __name__ == "__main__":
    main()
