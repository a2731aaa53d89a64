"""The package as a user installs it, not the checkout: `pip wheel .` builds a wheel with every module
and the report page's template, it installs into a fresh virtual environment (its dependencies seen
through a .pth file: no network), and `python -m ray_zero report` run from another folder writes a
committed result folder's report.html with it."""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
import venv
import zipfile

from conftest import ROOT


def test_the_wheel_installs_and_renders_a_report_away_from_the_checkout(tmp_path):
    # From a copy: setuptools builds in the source folder (build/, *.egg-info).
    source = tmp_path / "source"
    shutil.copytree(
        ROOT,
        source,
        ignore=shutil.ignore_patterns(
            ".*", "results", "runs", "data", "bench", "tests", "__pycache__", "build", "*.egg-info"
        ),
    )
    built = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            str(source),
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(tmp_path / "dist"),
            "-q",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert built.returncode == 0, built.stderr[-2000:]
    wheel = next((tmp_path / "dist").glob("ray_zero-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert "ray_zero/report/templates/report.html.j2" in names and "ray_zero/run/sweep.py" in names
    assert "ray_zero/measure/error_bands.json" in names  # the error bands estimate and fit read
    assert not [n for n in names if n.startswith(("tests/", "bench/", "results/"))]

    env = tmp_path / "env"
    venv.create(env, with_pip=False)
    python = env / "bin" / "python"
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    # torch, pandas, Jinja2 ... as this environment has them (CI's has them from requirements.txt).
    (tmp_path / "env" / site.split(str(env) + "/", 1)[1] / "deps.pth").write_text(
        sysconfig.get_paths()["purelib"]
    )
    installed = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(python),
            "install",
            "--no-deps",
            "--no-index",
            "-q",
            str(wheel),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert installed.returncode == 0, installed.stderr[-2000:]

    folder = tmp_path / "results"
    shutil.copytree(ROOT / "results" / "zero1_mnist-h200", folder)  # kept: no report.html
    away = tmp_path / "elsewhere"
    away.mkdir()
    done = subprocess.run(
        [str(python), "-c", "import ray_zero, sys; print(ray_zero.__file__)"],
        cwd=away,
        capture_output=True,
        text=True,
        check=True,
    )
    assert done.stdout.startswith(str(env))  # the installed package, not the checkout
    report = subprocess.run(
        [str(python), "-m", "ray_zero", "report", str(folder)],
        cwd=away,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert report.returncode == 0, report.stderr[-2000:]
    assert (folder / "report.html").stat().st_size > 10_000 and "stage1_mb64_w1" in report.stdout
