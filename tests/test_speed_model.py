"""The speed model (measure/speed_model.py) and the bandwidth it reads (measure/bandwidth.py): pure, on the
seed preset's real parameter shapes. The rows are a measured row's fields; the model's arithmetic is
checked against the bytes the communication model predicts (itself checked to the byte at 2 ranks in
test_zoo.py) and nccl-tests' bus factors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ray_zero.config import ConfigError
from ray_zero.measure.bandwidth import FILE_KIND, bus_factor, given, read_bandwidth
from ray_zero.measure.comm_model import predict_comm
from ray_zero.measure.partitions import held
from ray_zero.measure.speed_model import predict_speed
from ray_zero.models.describe import describe_model


@pytest.fixture(scope="module")
def seed():
    return describe_model("seed", {}, None)


def row(backend="deepspeed", stage=1, workers=1, exposed=0.0, **times):
    split = {"forward_s": 0.010, "backward_s": 0.020, "optimizer_s": 0.006, **times}
    step = sum(split.values()) + exposed
    return {
        "backend": backend,
        "stage": stage,
        "num_workers": workers,
        "precision": "fp32",
        "micro_batch_size": 64,
        "status": "ok",
        **split,
        "exposed_comm_s": exposed,
        "step_s": step,
        "samples_per_s": workers * 64 / (step * 1.02),  # a step does a little beyond its split
    }


def test_bus_factors_are_nccl_tests():
    assert bus_factor("all_reduce", 2) == 1.0 and bus_factor("all_reduce", 8) == 2 * 7 / 8
    assert bus_factor("all_gather", 4) == 0.75 and bus_factor("reduce_scatter", 4) == 0.75
    assert bus_factor("broadcast", 4) == 1.0 and bus_factor("all_reduce", 1) == 0.0


def test_a_bandwidth_file_reads_back_and_interpolates(tmp_path):
    results = [
        {"collective": "all_reduce", "bytes": 2**20, "time_s": 1e-3, "algbw_gbps": 1.05, "busbw_gbps": 1.0},
        {"collective": "all_reduce", "bytes": 2**22, "time_s": 2e-3, "algbw_gbps": 2.1, "busbw_gbps": 3.0},
        {"collective": "all_gather", "bytes": 2**20, "time_s": 1e-3, "algbw_gbps": 1.0, "busbw_gbps": 0.5},
    ]
    path = tmp_path / "bw.json"
    path.write_text(json.dumps({"kind": FILE_KIND, "workers": 2, "backend": "gloo", "results": results}))
    bandwidth = read_bandwidth(path)
    assert bandwidth.busbw("all_reduce", 2**20) == 1.0 and bandwidth.busbw("all_reduce", 2**22) == 3.0
    assert bandwidth.busbw("all_reduce", 2**21) == pytest.approx(2.0)  # halfway on a log scale
    assert bandwidth.busbw("all_reduce", 2**30) == 3.0 and bandwidth.busbw("all_reduce", 1) == 1.0
    assert bandwidth.busbw("broadcast", 2**20) == 0.5  # read at the all-gather's figure
    with pytest.raises(ConfigError, match="no reduce_scatter figures"):
        bandwidth.busbw("reduce_scatter", 2**20)
    path.write_text(json.dumps({"kind": "something else"}))
    with pytest.raises(ConfigError, match="not a file of `python -m ray_zero bandwidth`"):
        read_bandwidth(path)
    with pytest.raises(ConfigError, match="above 0"):
        given(0)


def test_at_its_own_worker_count_a_one_rank_row_predicts_itself(seed):
    measured = row()
    speed = predict_speed(seed, measured, 1, given(10.0), 5e7)
    assert speed.comm_s == 0 and speed.step_s == pytest.approx(measured["step_s"])
    assert speed.samples_per_s == pytest.approx(measured["samples_per_s"])
    assert speed.samples_per_s_low == speed.samples_per_s == speed.samples_per_s_high


@pytest.mark.parametrize(
    "backend, stage, optimizer_scales",
    [
        ("deepspeed", 0, False),
        ("deepspeed", 1, True),
        ("deepspeed", 3, True),
        ("torch_zero", 0, False),
        ("torch_zero", 1, True),
        ("fsdp", 3, True),
    ],
)
def test_two_ranks_add_the_predicted_bytes_and_split_the_optimizer(seed, backend, stage, optimizer_scales):
    measured = row(backend, stage)
    busbw = 2.0
    speed = predict_speed(seed, measured, 2, given(busbw), 5e7)
    sent = predict_comm(seed.trainable_param_shapes, seed.frozen_param_shapes, backend, stage, 2, "fp32")
    expected = sum(nbytes * bus_factor(kind, 2) / (busbw * 1e9) for kind, nbytes in sent.items())
    assert speed.comm_bytes == sent and speed.comm_s == pytest.approx(expected) and expected > 0
    states = [
        held(seed.trainable_param_shapes, seed.frozen_param_shapes, backend, stage, n).states for n in (1, 2)
    ]
    assert speed.optimizer_s == pytest.approx(0.006 * states[1] / states[0])
    assert (speed.optimizer_s < 0.0035) is optimizer_scales
    # a one-rank row shows no overlap: the point is the no-overlap end, the band reaches full overlap
    assert speed.step_s == pytest.approx(0.030 + speed.optimizer_s + expected)
    assert speed.step_fastest_s == pytest.approx(max(0.030, expected) + speed.optimizer_s)
    assert speed.samples_per_s_low <= speed.samples_per_s <= speed.samples_per_s_high
    per_sample = measured["samples_per_s"] * measured["step_s"]  # samples a rank's step makes, as measured
    assert speed.samples_per_s == pytest.approx(2 * per_sample / speed.step_s)


def test_a_two_rank_row_carries_its_hidden_share_of_communication(seed):
    bandwidth = given(2.0)
    alone = predict_speed(seed, row("torch_zero", 0), 2, bandwidth, 5e7)
    exposed = alone.comm_s / 4  # three quarters hidden behind the backward
    measured = row("torch_zero", 0, workers=2, exposed=exposed)
    speed = predict_speed(seed, measured, 4, bandwidth, 5e7)
    assert speed.hidden_fraction == pytest.approx(0.75)
    assert speed.step_s == pytest.approx(
        max(speed.step_fastest_s, speed.step_slowest_s - 0.75 * speed.comm_s)
    )


def test_a_row_without_a_split_is_not_predicted(seed):
    assert predict_speed(seed, {**row(), "forward_s": None}, 2, given(1.0), 5e7) is None


def test_estimates_speed_options_are_one_line_each(tmp_path):
    from ray_zero.report.speed_estimate import speed_source

    assert speed_source(None, None, None) is None
    with pytest.raises(ConfigError, match="go with --measured DIR"):
        speed_source(None, None, 3.0)
    with pytest.raises(ConfigError, match="no trials.jsonl there"):
        speed_source(tmp_path, None, 3.0)
    (tmp_path / "trials.jsonl").write_text("")
    with pytest.raises(ConfigError, match="give one of --bandwidth FILE"):
        speed_source(tmp_path, tmp_path / "bw.json", 3.0)
    assert speed_source(tmp_path, None, 3.0).busbw("all_reduce", 2**20) == 3.0
    # with a profile: the step's communication at the bandwidth given, or none counted
    assert speed_source(None, None, None, profile="h100.json") is None
    assert speed_source(None, None, 3.0, profile="h100.json").busbw("all_gather", 2**20) == 3.0
    with pytest.raises(ConfigError, match="--profile: give one of"):
        speed_source(None, tmp_path / "bw.json", 3.0, profile="h100.json")


def test_estimate_puts_the_predicted_samples_per_s_beside_each_points_memory():
    import ray_zero

    folder = Path(__file__).resolve().parents[1] / "bench" / "results" / "speed-cpu-2core" / "sweep"
    found = ray_zero.estimate("", measured=folder, busbw=5.0, workers=[1, 2])
    assert "samples_per_s" in found.table and found.speed is not None and len(found.speed)
    for line in found.table.to_dict("records"):
        match = found.speed[
            (found.speed["backend"] == line["backend"])
            & (found.speed["stage"] == line["stage"])
            & (found.speed["micro_batch"] == line["micro_batch"])
            & (found.speed["workers"] == line["workers"])
        ]
        assert line["samples_per_s"] == pytest.approx(match["samples_per_s"].iloc[0]) if len(match) else True
    assert found.table["samples_per_s"].notna().any()
