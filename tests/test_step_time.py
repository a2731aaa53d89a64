"""The speed of a grid point before running (issue 67): the profile command's micro-benchmarks on the CPU,
the roofline step-time model (measure/step_time.py) on hand numbers, the profile file it reads
(measure/gpu_profile.py), and estimate's columns from a traced tiny GPT-2."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest
import torch

import ray_zero
from ray_zero.__main__ import main
from ray_zero.config import ConfigError
from ray_zero.measure.gpu_profile import FILE_KIND, profile_from, profile_notes, read_profile
from ray_zero.measure.step_time import OpCost, op_seconds, predict_step
from ray_zero.train import profile_bench, profile_cases
from ray_zero.train.profile_bench import REPEATS, repeats_summary, seconds_per_call

OLD_PROFILE = Path(__file__).parent.parent / "bench/results/speed-accuracy-cpu-2core/cpu_profile_a.json"
"""A profile of one mean a point (2026-12-06, before repeats): it must still load."""

TINY_GPT2 = ["model_config.n_layer=2", "model_config.n_embd=64", "model_config.n_head=4", "seq_len=128"]


def _row(kind, dtype, size, seconds, **extra):
    """One timed call of `size` (FLOPs, bytes or parameters, by kind) in `seconds`."""
    key = {"adamw_foreach": "params", "elementwise": "bytes", "reduction": "bytes", "random": "bytes"}.get(
        kind, "flops"
    )
    return {"kind": kind, "dtype": dtype, "shape": [], "flops": 0, "bytes": 0, key: size, "seconds": seconds}


def _content(launch_s=10e-6, rows=None) -> dict:
    rows = rows or [
        _row("matmul", "bf16", 1e9, 1e9 / 100e12),  # 100 TFLOP/s at 1 GFLOP a call
        _row("matmul", "bf16", 1e12, 1e12 / 400e12),  # 400 TFLOP/s at 1 TFLOP a call
        _row("elementwise", "bf16", 1e6, 1e6 / 1e12),  # 1 TB/s at 1 MB
        _row("elementwise", "bf16", 1e9, 1e9 / 2e12),  # 2 TB/s at 1 GB
        _row("adamw_foreach", "fp32", 1e6, 1e6 / 1e9),
        _row("adamw_foreach", "fp32", 1e8, 1e8 / 1e10),
    ]
    gpu = {"hardware": {"name": "a GPU"}, "date": "today"}
    return {"kind": FILE_KIND, **gpu, "launch_s": launch_s, "results": rows}


def test_the_profiles_rates_are_read_log_linearly_and_stand_in_for_kinds_not_measured():
    profile = profile_from(_content(), "hand")
    assert profile.rate("matmul", "bf16", 1e9) == pytest.approx(100e12)
    assert profile.rate("matmul", "bf16", 10**10.5) == pytest.approx(250e12)  # halfway in log size
    assert profile.rate("matmul", "bf16", 1e15) == pytest.approx(400e12)  # beyond: the nearest end
    assert profile.rate("conv", "bf16", 1e12) == pytest.approx(400e12)  # no conv measured: matmul's
    assert profile.rate("attention", "fp16", 1e9) == pytest.approx(100e12)  # nor fp16: bf16's
    assert profile.rate("reduction", "fp32", 1e9) == pytest.approx(2e12)  # elementwise's bandwidth
    assert profile.rate("random", "bf16", 1e6) == pytest.approx(1e12)  # no random fill measured: likewise
    with pytest.raises(ConfigError, match="no adamw_fused figures"):
        profile.rate("adamw_fused", "fp32", 1e6)


def test_each_kernel_takes_the_larger_of_its_flops_and_its_bytes_term():
    profile = profile_from(_content(), "hand")
    big = OpCost("matmul", "bf16", count=2, flops=2e12, bytes=2e9)  # 5 ms of FLOPs, 1 ms of bytes
    assert op_seconds(big, profile) == pytest.approx((5e-3, 0.0))
    skinny = OpCost("matmul", "bf16", count=1, flops=1e9, bytes=1e9)  # 10 us of FLOPs, 0.5 ms of bytes
    assert op_seconds(skinny, profile) == pytest.approx((0.0, 0.5e-3))
    adds = OpCost("elementwise", "bf16", count=10, flops=0, bytes=1e7)  # 1 MB a call at 1 TB/s
    assert op_seconds(adds, profile) == pytest.approx((0.0, 10e-6))

    step = predict_step([big, skinny, adds], profile, stepped_params=1e8, accumulation=2)
    assert (step.compute_s, step.memory_s) == pytest.approx((5e-3, 0.51e-3))
    assert step.launches == 13 and step.host_s == pytest.approx(130e-6)
    assert step.optimizer_s == pytest.approx(10e-3)  # 1e8 parameters at 1e10 a second
    assert step.step_s == pytest.approx(2 * 5.51e-3 + 10e-3) and step.bound == "compute"
    assert step.samples_per_s(micro_batch=4, workers=2) == pytest.approx(2 * 4 * 2 / 21.02e-3)
    assert predict_step([skinny], profile).bound == "memory"


def test_dropouts_random_mask_is_costed_at_the_profiles_random_fill_rate():
    # On the 2-core CPU bernoulli_ filled 0.5 GB/s where a multiply moved 80 GB/s: a fifth of the seed
    # model's step (torch.profiler), which elementwise's rate made free.
    import torch

    from ray_zero.train.op_costs import kind_of

    aten = torch.ops.aten
    assert kind_of(aten.bernoulli_.float) == kind_of(aten.native_dropout.default) == "random"
    assert kind_of(aten.mul.Tensor) == "pointwise"
    mask = OpCost("random", "bf16", count=4, flops=0, bytes=4e6)
    slow = _content(rows=[*_content()["results"], _row("random", "bf16", 1e6, 1e6 / 1e9)])  # 1 GB/s
    assert op_seconds(mask, profile_from(slow, "hand")) == pytest.approx((0.0, 4e-3))
    assert op_seconds(mask, profile_from(_content(), "hand")) == pytest.approx((0.0, 4e-6))  # elementwise's


def test_a_step_of_many_tiny_kernels_takes_the_hosts_time():
    profile = profile_from(_content(launch_s=10e-6), "hand")
    tiny = OpCost("elementwise", "bf16", count=1000, flops=0, bytes=1e6)  # 1 us on the device in all
    step = predict_step([tiny], profile)
    assert step.device_s == pytest.approx(1e-6) and step.host_s == pytest.approx(10e-3)
    assert step.step_s == pytest.approx(10e-3) and step.bound == "host"


def test_the_profile_command_measures_every_kernel_class_on_the_cpu_within_its_budget(
    tmp_path, capsys, monkeypatch
):
    output = tmp_path / "cpu.json"
    args = ["profile", "--device", "cpu", "--budget-s", "5", "--output", str(output)]
    monkeypatch.setattr(sys, "argv", ["ray_zero", *args])  # the command the file records
    # The budget is a behaviour, not a timing (a loaded vCPU stretches any case): it left cases out, below.
    assert main(args) == 0
    content = json.loads(output.read_text())
    assert content["kind"] == FILE_KIND and content["device"] == "cpu" and content["seconds"] > 0
    assert content["hardware"]["name"] and content["versions"]["torch"] and content["date"]
    assert content["command"].startswith("python -m ray_zero profile --device cpu")
    assert content["budget_s"] == 5
    assert 1e-8 < content["launch_s"] < 1e-3  # an eager add costs microseconds of the host
    assert 1e-9 <= content["hook_s"] < 1e-4  # a no-op module hook: a Python call, about a microsecond
    rows = [r for r in content["results"] if "seconds" in r]
    kinds = {r["kind"] for r in rows}
    assert kinds >= {"matmul", "attention", "conv", "elementwise", "reduction", "random", "adamw_foreach"}
    assert all(r["seconds"] > 0 for r in rows)
    # every point, the launch and the hook figure: the fastest of REPEATS repeats, and their spread
    for figure in [*rows, content["launch"], content["hook"]]:  # a second pass while the budget lasts
        assert figure["repeats"] == REPEATS * len(figure["calls"]) and min(figure["calls"]) >= 1
        assert figure["iqr_over_median"] >= 0 and figure["max_over_min"] >= 1
    assert content["launch"]["repeats"] == content["hook"]["repeats"] == 2 * REPEATS
    assert all(r["seconds"] <= r["median_s"] for r in rows)
    assert all(content[f"{name}_s"] == content[name]["seconds"] for name in ("launch", "hook"))
    # 5 s leave the larger cases out, and the file says which
    assert content["left_out"] and all(x["cases"] >= 1 and x["after"] for x in content["left_out"])
    profile = read_profile(output)
    assert profile.hook_s == content["hook_s"] and profile.hardware == content["hardware"]["name"]
    # Units, not speed: a 2-core CPU does GFLOP/s and GB/s (a stalled vCPU reads up to ~1,000x slower)
    assert 1e6 < profile.rate("matmul", "fp32", 1e9) < 1e13
    assert 1e6 < profile.rate("elementwise", "fp32", 1e6) < 1e12
    printed = capsys.readouterr().out
    assert f"written to {output}" in printed and "left out for the budget: matmul fp32" in printed
    assert f"of {len(rows)} points spread over" in printed


def test_a_point_keeps_its_fastest_repeat_and_the_repeats_spread():
    summary = repeats_summary([([3.0, 1.0, 2.0, 10.0, 2.0], 4)])
    assert summary == {"seconds": 1.0, "median_s": 2.0, "iqr_over_median": 0.5, "max_over_min": 10.0} | {
        "repeats": 5, "calls": [4]
    }  # fmt: skip
    two = repeats_summary([([4.0] * 5, 1), ([1.0, 1.0, 1.0, 1.0, 1.0], 8)])  # a stall over the whole first
    assert two["seconds"] == 1.0 and two["pass_ratio"] == 0.25 and two["max_over_min"] == 4.0
    assert two["repeats"] == 10 and two["calls"] == [1, 8]
    calls = []

    def sleeps():  # 2 ms a call; the warm-up is call 0, the repeats (one call each) 1-5: call 3 disturbed
        calls.append(None)
        time.sleep(0.02 if len(calls) == 4 else 0.002)

    timed = seconds_per_call(sleeps, torch.device("cpu"), target_s=REPEATS * 0.002)
    assert len(calls) == 1 + REPEATS and timed["calls"] == [1]
    assert 0.002 <= timed["seconds"] < 0.006 and timed["max_over_min"] > 3  # a mean would read 5.6 ms
    assert timed["seconds"] <= timed["median_s"] < 0.01


def test_the_profile_times_every_point_again_in_a_second_pass_while_the_budget_lasts(monkeypatch):
    # the real two passes, over fewer cases: 16 K and 64 K elements, 1 M parameters
    monkeypatch.setattr(profile_bench, "CASES", {"elementwise": profile_bench.CASES["elementwise"]})
    monkeypatch.setattr(profile_cases, "VECTOR_EXPONENTS", range(14, 17, 2))
    monkeypatch.setattr(profile_cases, "ADAMW_MILLIONS", (1,))
    started = time.perf_counter()
    figures = profile_bench.measure(torch.device("cpu"), budget_s=20)
    assert time.perf_counter() - started < 5
    rows = figures["results"]
    assert [(r["kind"], r["dtype"], r["shape"]) for r in rows] == [
        ("elementwise", "fp32", [2**14]), ("elementwise", "fp32", [2**16]),
        ("elementwise", "bf16", [2**14]), ("elementwise", "bf16", [2**16]),
        ("adamw_foreach", "fp32", [1, 2**20]), ("adamw_fused", "fp32", [1, 2**20]),
    ]  # fmt: skip
    for row in rows:
        assert row["repeats"] == 2 * REPEATS and len(row["calls"]) == 2 and row["pass_ratio"] > 0
        assert row["seconds"] <= row["median_s"] and row["max_over_min"] >= 1
    assert figures["left_out"] == []


def test_a_profile_of_one_mean_a_point_still_loads():
    content = json.loads(OLD_PROFILE.read_text())
    assert "iqr_over_median" not in content["results"][0] and "launch" not in content
    profile = read_profile(OLD_PROFILE)
    assert profile.launch_s == content["launch_s"] and profile.hook_s == content["hook_s"]
    assert 1e8 < profile.rate("matmul", "fp32", 1e9) < 1e13
    assert profile_notes(content) == []  # nothing to say of spreads it never kept


def _profile_file(tmp_path, launch_s: float, **more):
    """One rate for every kind (no size dependence): the step's time is its sums over the rates; `more`:
    other fields of the file (hook_s, hardware)."""
    rows = [_row(kind, dtype, 1e9, 1e9 / 1e12) for kind in ("matmul", "attention", "elementwise")
            for dtype in ("bf16", "fp32")]  # fmt: skip
    rows.append(_row("adamw_foreach", "fp32", 1e8, 1e8 / 1e10))
    path = tmp_path / f"profile-{launch_s}.json"
    path.write_text(json.dumps(_content(launch_s, rows) | more))
    return path


def test_estimate_with_a_profile_predicts_each_points_step_and_what_bounds_it(tmp_path, capsys):
    grid = dict(overrides=TINY_GPT2, stages=[0], workers=[1, 2], micro_batch_size=[2, 4], precision="bf16")
    slow_host = ray_zero.estimate("hf:gpt2", profile=_profile_file(tmp_path, 1e-3), **grid).table
    # 1 ms a launch: the host sets every step, the same launches at either micro-batch
    assert set(slow_host["bound"]) == {"host"}
    steps = slow_host.set_index(["micro_batch", "workers"])["step_ms"]
    assert steps[(2, 1)] == pytest.approx(steps[(4, 1)]) and steps[(2, 1)] > 100  # over 100 kernels
    h100 = {"hardware": {"name": "NVIDIA H100 80GB HBM3"}}  # its dense bf16 peak: 989 TFLOP/s
    estimated = ray_zero.estimate("hf:gpt2", profile=_profile_file(tmp_path, 1e-9, **h100), **grid)
    fast_host = estimated.table
    assert set(fast_host["bound"]) <= {"compute", "memory"}
    by = fast_host.set_index(["micro_batch", "workers"])
    # twice the samples: about twice the kernels' FLOPs and activations' bytes (the weights' bytes stay)
    assert 1.3 < by.loc[(4, 1), "step_ms"] / by.loc[(2, 1), "step_ms"] < 2.05
    rate = by["predicted_samples_per_s"]
    assert rate[(2, 2)] == pytest.approx(2 * rate[(2, 1)])  # stage 0: each rank steps every parameter
    assert rate[(2, 1)] == pytest.approx(2 / (by.loc[(2, 1), "step_ms"] / 1e3))

    comm = by["comm_ms"]  # 1 worker sends nothing; 2 do, at no bandwidth given: not counted
    assert comm[(2, 1)] == 0 and comm[(4, 1)] == 0 and comm[(2, 2)] != comm[(2, 2)]
    assert by["hooks_ms"].isna().all()  # the profile has no seconds per hook
    flops = estimated.rows[0]["flops_per_sample"]
    assert by.loc[(2, 1), "mfu"] == pytest.approx(flops * rate[(2, 1)] / 989e12)

    # at 1 MB/s the 2 workers' gradient all-reduce (stage 0: nothing hidden) sets their step
    args = ["estimate", "--model", "hf:gpt2", *(x for s in TINY_GPT2 for x in ("--set", s)), "--stages", "0"]
    profile = str(_profile_file(tmp_path, 1e-3, hook_s=2e-6))
    assert main([*args, "--workers", "1,2", "--profile", profile, "--busbw", "0.001"]) == 0
    printed = capsys.readouterr().out
    assert "step_ms" in printed and "predicted_samples_per_s" in printed and "comm_ms" in printed
    assert " host" in printed and " communication" in printed and "busbw 0.001 GB/s" in printed
    assert "hooks at 2.00 us each" in printed and "mfu" in printed


def test_a_cpu_sweep_row_stores_its_step_predicted_on_a_cpu_profile_beside_the_measured(ranks, tmp_path):
    # runtime.profile's path through a row (point_speed.speed_fields): the profile the driver read travels
    # in the spec with the traced step; the row made from 2 real ranks (DDP on gloo) carries the prediction,
    # its terms and bound, and measured over predicted; results.md shows them beside the measured samples/s.
    import dataclasses

    from rank_group import experiment_of, trial_spec

    from ray_zero.config import Point
    from ray_zero.report.tables import write_results
    from ray_zero.rows import trial_row
    from ray_zero.store import append_trial, load_trials
    from ray_zero.train.grid_trace import trace_grid, trace_key

    profile = read_profile(ray_zero.profile(tmp_path / "cpu.json", device="cpu", budget_s=0.3))
    experiment = experiment_of("experiments/quick.yaml", "steps=6", "warmup_steps=1")
    point = Point("torch_zero", 0, 16, 2)
    bare = trial_spec(experiment, point)  # no profile: blank, with why
    assert trial_row(bare)["speed_note"] == "no profile given (runtime.profile)"
    assert "predicted_step_ms" not in trial_row(bare)
    traced = trace_grid(experiment.model_source(), [point], bare.precision)
    activations = traced[trace_key(point.backend, bare.precision, point.activation_checkpointing)]
    spec = dataclasses.replace(bare, activations=activations, profile=profile)
    untraced = trial_row(dataclasses.replace(spec, activations="no meta kernel for aten::x"))
    assert untraced["speed_note"] == "step not traced: no meta kernel for aten::x"
    assert "predicted_step_ms" not in untraced and untraced["speed_profile"] == profile.source

    row = ranks(2).row(spec)
    assert row["status"] == "ok" and row["memory_kind"] == "cpu_rss", row.get("error")
    assert row["predicted_step_ms"] > 0
    assert row["predicted_speed_bound"] in {"compute", "memory", "host"}  # comm: no bandwidth given
    assert row["predicted_comm_ms"] is None and "communication (no bandwidth given)" in row["speed_note"]
    assert row["predicted_compute_ms"] + row["predicted_memory_ms"] > 0 and row["predicted_optimizer_ms"] > 0
    # both ranks' samples, as samples_per_s sums them
    assert row["predicted_samples_per_s"] == pytest.approx(2 * 16 / (row["predicted_step_ms"] / 1e3))
    assert row["samples_per_s"] > 0
    ratio = row["samples_per_s"] / row["predicted_samples_per_s"]
    assert row["measured_over_predicted_speed"] == pytest.approx(ratio)
    assert profile.hardware in row["speed_profile"]  # the device the profile measured
    # estimate, at the row's precision, predicts the same step for the same point
    overrides = ["grid.backend=[torch_zero]", "grid.stage=[0]", "grid.micro_batch_size=[16]", "steps=6"]
    found = ray_zero.estimate(
        "experiments/quick.yaml", workers=[2], precision=spec.precision, profile=tmp_path / "cpu.json",
        overrides=overrides,
    ).table  # fmt: skip
    assert found["step_ms"].tolist() == [pytest.approx(row["predicted_step_ms"], rel=1e-12)]
    samples = row["predicted_samples_per_s"]
    assert found["predicted_samples_per_s"].tolist() == [pytest.approx(samples, rel=1e-12)]

    append_trial(tmp_path, row)  # every column registered (a key the registry lacks is refused)
    write_results(tmp_path, load_trials(tmp_path), None)
    markdown = (tmp_path / "results.md").read_text()
    speed = "samples_per_s | predicted_samples_per_s | measured_over_predicted_speed | predicted_speed_bound"
    assert f"| {speed} |" in markdown
    assert f"Speed predicted on:\n\n- {profile.source}: every row" in markdown
