"""End to end on CPU, as a user runs it: `python -m ray_zero sweep experiments/quick.yaml` (real Ray,
real DeepSpeed, real MNIST digits), killed with SIGKILL mid-trial, resumed and stopped with Ctrl-C, left
with a half-written row, and finished with `--resume`: its console, its three tiers of tables, each trial
recorded exactly once. The other engines and stage 3, at rank
level: tests/test_worker_engines.py; a trial started early: tests/test_faults.py."""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pandas as pd
import psutil
import pytest
from conftest import ROOT

from ray_zero.__main__ import main
from ray_zero.rows import results_columns
from ray_zero.train.worker import jit_ops_dir

REQUIRED = [
    "stage",
    "micro_batch_size",
    "num_workers",
    "precision",
    "model",
    "params",
    "dataset",
    "steps",
    "status",
    "loss_first",
    "loss_last",
    "samples_per_s",
    "samples_per_s_per_worker",
    "peak_allocated_gib_max",
    "peak_reserved_gib_max",
    "wall_s",
]


PRIVATE_RAY: dict = {}
"""What the quick grid's CLI process started: its dashboard's listening addresses and HTTP answers."""


def _look_at_private_ray(pid: int) -> None:
    """The dashboard of the Ray that process `pid` started (its child): every address it listens on, and
    what its HTTP port answers a request without a token."""
    for child in psutil.Process(pid).children(recursive=True):
        try:
            if not any(a.endswith("dashboard/dashboard.py") for a in child.cmdline()):
                continue
            listening = {
                (c.laddr.ip, c.laddr.port) for c in child.net_connections("inet") if c.status == "LISTEN"
            }
        except psutil.NoSuchProcess:
            continue
        answers = []
        for _, port in sorted(listening):
            try:
                answers.append(
                    urllib.request.urlopen(f"http://127.0.0.1:{port}/api/version", timeout=3).status
                )
            except urllib.error.HTTPError as error:
                answers.append(error.code)
            except (OSError, ValueError):
                pass  # not an HTTP port (gRPC, metrics agent)
        PRIVATE_RAY.update(listening=listening, answers=answers)


def _cli_until(args: list[str], record: Path, rows: int, stop: signal.Signals, look: bool = False):
    """`python -m ray_zero ARGS` as a user runs it (no Ray address, no auth mode chosen), sent `stop` once
    trials.jsonl holds `rows` rows; (exit status, stdout, stderr)."""
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_MODE")}
    env["PYTHONUNBUFFERED"] = "1"  # a terminal's lines: what the killed run printed is not lost
    cli = subprocess.Popen(
        [sys.executable, "-m", "ray_zero", *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.time() + 300
    while time.time() < deadline and cli.poll() is None and _rows(record) < rows:
        time.sleep(0.2)
    if look and not PRIVATE_RAY:  # a trial is recorded: its Ray is up
        _look_at_private_ray(cli.pid)
    cli.send_signal(stop)
    out, err = cli.communicate(timeout=180)
    return cli.returncode, out, err


def _rows(record: Path) -> int:
    return record.read_text().count("\n") if record.is_file() else 0


@pytest.fixture(scope="module")
def quick(tmp_path_factory, ray_instance):
    """The quick grid through the CLI, with --diagnostics, killed (SIGKILL, as an OOM killer or a lost SSH
    session would) once a trial is recorded and the next trains; resumed through the CLI and stopped with
    Ctrl-C once a third is recorded; then, as if killed while writing a row, a half-written fourth; and
    finished with `--resume`: (output folder, the runs' stdout, the rows before the last resume). The last
    resume runs the CLI's `main` in this process, on the session's Ray: a third fresh process with its own
    private Ray would cost about 15 s more."""
    output = tmp_path_factory.mktemp("quick") / "out"
    record = output / "trials.jsonl"
    args = [
        "sweep",
        "experiments/quick.yaml",
        "--set",
        "steps=6",
        "--set",
        "warmup_steps=2",
        "--set",
        f"data_dir={output.parent / 'mnist'}",
        "--output",
        str(output),
        "--diagnostics",
    ]
    status, first_out, _ = _cli_until(args, record, 1, signal.SIGKILL, look=True)
    assert status == -signal.SIGKILL and _rows(record) == 1
    status, second_out, second_err = _cli_until(["sweep", "--resume", str(output)], record, 3, signal.SIGINT)
    assert status == 130, second_out[-3000:] + second_err[-3000:]  # Ctrl-C
    assert f"sweep --resume {output}" in second_err
    interrupted = [json.loads(line) for line in record.read_text().splitlines()]
    missing = {"stage0_mb64_w1", "stage0_mb64_w2", "stage1_mb64_w1", "stage1_mb64_w2"} - {
        r["trial"] for r in interrupted
    }
    with open(record, "a") as torn:  # half a row of a trial not recorded, cut where a kill would cut it
        torn.write(json.dumps({**interrupted[0], "trial": sorted(missing)[0]})[:200])
    resumed = io.StringIO()
    with contextlib.redirect_stdout(resumed):
        status = main(["sweep", "--resume", str(output)])
    assert status == 0, resumed.getvalue()[-3000:]
    return output, first_out + second_out + resumed.getvalue(), interrupted


def test_the_clis_private_ray_listens_on_loopback_only_and_asks_for_a_token(quick):
    # A private Ray (no --address): its dashboard binds 127.0.0.1 only, as ray_zero asks (nothing of it is
    # reachable from the network), and token authentication stays on: a request without the token is refused.
    assert PRIVATE_RAY.get("listening"), "no dashboard process of the CLI's Ray was found"
    assert {ip for ip, _ in PRIVATE_RAY["listening"]} == {"127.0.0.1"}, PRIVATE_RAY
    assert 401 in PRIVATE_RAY["answers"] and 200 not in PRIVATE_RAY["answers"], PRIVATE_RAY


def test_a_sweep_killed_stopped_and_cut_mid_row_resumes_running_only_unfinished_trials(quick):
    output, _, interrupted = quick
    assert 2 <= len(interrupted) < 4, [r["trial"] for r in interrupted]
    lines = [json.loads(line) for line in (output / "trials.jsonl").read_text().splitlines()]
    assert sorted(r["trial"] for r in lines) == [
        "stage0_mb64_w1",
        "stage0_mb64_w2",
        "stage1_mb64_w1",
        "stage1_mb64_w2",
    ]
    assert (
        lines[: len(interrupted)] == interrupted
    )  # every trial exactly once: the finished ones were not run again
    assert "resumed" in (output / "experiment.yaml").read_text()


def test_the_console_is_one_line_per_trial_a_progress_line_and_a_table(quick):
    _, stdout, _ = quick
    lines = stdout.splitlines()
    assert len(lines) <= 40, stdout  # three runs: each says where Ray and the results are
    trial_lines = [line for line in lines if re.match(r"ray_zero: stage\d_mb64_w\d: ok; loss", line)]
    # The killed run was killed as it recorded its trial, before it said so: the others' three lines.
    assert len(trial_lines) in (3, 4)
    # On CPU: the resident set for what it is, beside the model states counted and predicted.
    assert all("peak RSS" in line and "model states" in line and "predicted" in line for line in trial_lines)
    assert sum("trials finished" in line for line in lines) == len(trial_lines)
    assert all(len(line) <= 120 for line in lines if not line.startswith("ray_zero:"))
    assert "Reporting training result" not in stdout and "TBXLogger" not in stdout


def test_quick_grid_gives_four_ok_rows_in_at_most_30_columns(quick):
    output, _, _ = quick
    table = pd.read_csv(output / "results.csv")
    assert len(table.columns) <= 30 and set(REQUIRED) <= set(table.columns)
    assert list(table.columns) == results_columns()
    assert len(table) == 4 and set(table["status"]) == {"ok"} and (table["attempts"] == 1).all()
    assert sorted(zip(table["stage"], table["num_workers"])) == [(0, 1), (0, 2), (1, 1), (1, 2)]
    assert table["loss_first"].map(math.isfinite).all() and table["loss_last"].map(math.isfinite).all()
    assert (table["precision"] == "fp32").all() and (table["params"] == 274_698).all()
    assert (table["samples_per_s"] > 0).all() and (table["memory_kind"] == "cpu_rss").all()
    # fp32 on CPU: the model states predicted are the tensors counted (params, grads, master, Adam): within
    # 1% at stage 0; at stage 1 on 2 ranks one rank held 0.43 bytes per parameter more gradient than its
    # partition here (DeepSpeed's flat gradient buffers of this small model), within 5%.
    ratio = (table["measured_model_state_gib"] / table["predicted_model_state_gib"]).set_axis(table["trial"])
    assert ratio[["stage0_mb64_w1", "stage0_mb64_w2", "stage1_mb64_w1"]].between(0.99, 1.01).all(), ratio
    assert 1.0 <= ratio["stage1_mb64_w2"] < 1.05, ratio
    assert table["predicted_peak_gib"].isna().all() and table["measured_over_predicted"].isna().all()


def test_zero1_halves_optimizer_state_per_rank_at_two_workers(quick):
    output, _, _ = quick
    state = {
        (r["stage"], r["num_workers"]): r["optimizer_state_bytes_per_rank_max"]
        for r in map(json.loads, (output / "trials.jsonl").read_text().splitlines())
    }
    assert abs(state[(1, 2)] / state[(0, 2)] - 0.5) < 0.01
    assert abs(state[(1, 1)] / state[(0, 1)] - 1.0) < 0.01
    assert state[(0, 2)] == state[(0, 1)]  # stage 0 replicates: flat in N
    assert 2 * 4 * 274_698 <= state[(0, 1)] < 2 * 4 * 274_698 * 1.01  # two fp32 Adam states


def test_per_rank_file_has_every_rank_and_memory_is_max_over_ranks(quick):
    output, _, _ = quick
    table, ranks = pd.read_csv(output / "results.csv"), pd.read_csv(output / "per_rank.csv")
    assert len(ranks) == 1 + 2 + 1 + 2
    for row in table.itertuples():
        mine = ranks[ranks["trial"] == row.trial]
        assert sorted(mine["rank"]) == list(range(row.num_workers))
        assert row.peak_allocated_gib_max == pytest.approx(mine["peak_allocated_gib"].max())
        assert row.samples_per_s == pytest.approx(mine["samples_per_s"].sum())
    phases = [
        "memory_after_model_gib",
        "memory_after_data_gib",
        "memory_after_initialize_gib",
        "memory_after_first_backward_gib",
        "memory_after_first_step_gib",
    ]
    assert ranks[phases].notna().all().all() and (ranks["saved_for_backward_bytes"] > 0).all()
    assert (ranks["attempt"] == 1).all() and ranks["data_source"].str.contains("MNIST").all()
    assert not any(c.startswith("timed_thread") or c == "pid" for c in ranks.columns)  # those are diagnostics


def test_diagnostics_file_holds_the_host_figures_when_asked(quick):
    output, _, _ = quick
    diagnostics = pd.read_csv(output / "diagnostics.csv")
    assert len(diagnostics) == 6
    assert (
        (diagnostics["model_build_at"] < diagnostics["warmed_up_at"])
        & (diagnostics["warmed_up_at"] < diagnostics["finished_at"])
    ).all()
    assert (diagnostics["timed_thread_cpu_s"] > 0).all() and diagnostics["pid"].nunique() == 6
    assert set(diagnostics["working_dir"]) == {str(Path(__file__).resolve().parents[1])}  # Ray's folder kept


@pytest.mark.skipif("TORCH_EXTENSIONS_DIR" in os.environ, reason="the user chose the JIT build folder")
def test_ranks_point_deepspeeds_jit_builds_at_this_environments_own_folder(quick):
    # On CPU no op is built any more (tests/test_engines.py); on a GPU DeepSpeed may JIT-build its ops, and
    # two venvs sharing torch's default folder rebuilt them in turn.
    from torch.utils.cpp_extension import get_default_build_root

    output, _, _ = quick
    assert set(pd.read_csv(output / "diagnostics.csv")["jit_ops_dir"]) == {jit_ops_dir()}
    assert jit_ops_dir() != get_default_build_root()


def test_results_markdown_provenance_and_plots(quick):
    output, _, _ = quick
    markdown = (output / "results.md").read_text()
    header = next(line for line in markdown.splitlines() if line.startswith("| trial"))
    assert header.count("|") - 1 <= 12 and markdown.count("| ok |") == 4
    assert "resident set" in markdown
    saved = (output / "experiment.yaml").read_text()
    for key in (
        "question:",
        "python:",
        "torch:",
        "deepspeed: 0.19.8",
        "ray: 2.60.0",
        "cpu:",
        "date:",
        "command:",
        "scheduling: up to 1 at once on CPU",
    ):
        assert key in saved
    assert (output / "memory.png").stat().st_size > 1000 and (output / "throughput.png").stat().st_size > 1000


def test_report_rerenders_without_ray(quick, capsys):
    import ray

    output, _, _ = quick
    (output / "results.md").unlink()
    (output / "memory.png").unlink()
    before = pd.read_csv(output / "results.csv")
    ray_before = ray.is_initialized()
    assert main(["report", str(output)]) == 0  # `python -m ray_zero report DIR`, in this process
    assert ray.is_initialized() == ray_before
    assert (
        "stage1_mb64_w2" in capsys.readouterr().out
        and (output / "results.md").is_file()
        and (output / "memory.png").is_file()
    )
    pd.testing.assert_frame_equal(pd.read_csv(output / "results.csv"), before)


def test_the_sweeps_log_hands_each_engines_largest_miss_to_the_trials_after_it(ray_instance):
    # Issue 65 item 4 through Ray: trial drivers post a miss (run/trial.py) and read the corrections back
    # from the sweep's log actor as they start.
    from ray_zero.measure.correction import Correction
    from ray_zero.run.trial_log import trial_log

    log = trial_log("ray_zero_log_corrections_test")
    try:
        for trial, excess in (("stage1_mb8_w1", 1.3), ("stage1_mb16_w1", 1.6), ("stage3_mb16_w1", 1.1)):
            ray_instance.get(log.missed.remote(Correction(trial, ("deepspeed", False), 1.1, excess, "")))
        ray_instance.get(log.missed.remote(Correction("fsdp_stage3_mb8_w1", ("fsdp", False), 1.2, 2.0, "")))
        found = ray_instance.get(log.corrections.remote())
        assert found.for_row({"backend": "deepspeed"}).trial == "stage1_mb16_w1"
        assert found.for_row({"backend": "fsdp"}).excess_gib == 2.0
        assert found.for_row({"backend": "deepspeed", "activation_checkpointing": True}) is None
    finally:
        ray_instance.kill(log)
