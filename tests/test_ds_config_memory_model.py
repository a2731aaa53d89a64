"""The DeepSpeed config builder (pure, then parsed by DeepSpeed itself) and the memory model."""

from __future__ import annotations

import pytest

from ray_zero.config import Optimizer
from ray_zero.measure.engine_memory import deepspeed, fsdp, paper, torch_zero
from ray_zero.measure.memory_model import predict_point
from ray_zero.measure.prediction import GIB
from ray_zero.train.ds_config import build_ds_config
from ray_zero.train.settings import EngineSettings


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("precision", ["fp16", "bf16", "fp32"])
def test_config_has_one_optimizer_and_the_batch_arithmetic(stage, precision):
    config = build_ds_config(
        EngineSettings(
            stage=stage,
            micro_batch_size=16,
            gradient_accumulation_steps=4,
            world_size=8,
            precision=precision,
            optimizer=Optimizer(lr=3e-4),
        )
    )
    assert config["train_batch_size"] == 16 * 4 * 8
    assert config["train_micro_batch_size_per_gpu"] == 16 and config["gradient_accumulation_steps"] == 4
    assert config["optimizer"]["type"] == "AdamW" and config["optimizer"]["params"]["lr"] == 3e-4
    assert config["zero_optimization"]["stage"] == stage
    assert ("fp16" in config) == (precision == "fp16") and ("bf16" in config) == (precision == "bf16")
    assert ("allgather_bucket_size" in config["zero_optimization"]) == (stage in (1, 2))


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_deepspeed_accepts_the_config(stage):
    from deepspeed.runtime.config import DeepSpeedConfig

    parsed = DeepSpeedConfig(
        build_ds_config(
            EngineSettings(stage=stage, micro_batch_size=8, gradient_accumulation_steps=2, precision="bf16")
        )
    )
    assert parsed.zero_optimization_stage == stage and parsed.train_batch_size == 16
    assert parsed.optimizer_name == "adamw"


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"stage": 4}, "stage must be 0, 1, 2 or 3"),
        ({"precision": "fp8"}, "precision must be one of"),
        ({"micro_batch_size": 0}, "micro_batch_size must be at least 1"),
    ],
)
def test_config_rejects_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        build_ds_config(EngineSettings(**kwargs))


def test_paper_figure_for_7_5b_parameters_on_64_gpus():
    psi, n = 7.5e9, 64
    got = [paper(int(psi), stage, n).model_state_bytes / 1e9 for stage in range(4)]
    assert [round(g, 1) for g in got] == [120.0, 31.4, 16.6, 1.9]


def _row(**point):
    row = {
        "backend": "deepspeed",
        "params": 805_888_010,
        "model": "large",
        "precision": "fp16",
        "stage": 1,
        "num_workers": 2,
        "micro_batch_size": 64,
        "memory_kind": "cuda",
        "dataset": "synthetic",
    }
    return {**row, **point}


def test_deepspeed_formula_for_the_measured_h200_rows():
    # Measured on H200 (results/memory_scaling): 18.10, 16.60 and 9.12 GiB peak allocated.
    psi = 805_888_010
    assert deepspeed(psi, 0, 1, "fp16").model_state_bytes == 16 * psi
    assert deepspeed(psi, 0, 1, "fp16").step_transient_bytes == 8 * psi  # fp32 gradient copies
    assert deepspeed(psi, 1, 2, "fp16").optimizer_state_bytes == 8 * psi / 2
    assert 18.0 < predict_point(_row(stage=0, num_workers=1)).peak_bytes / GIB < 18.2
    assert 16.6 < predict_point(_row(num_workers=1)).peak_bytes / GIB < 16.8
    assert 8.9 < predict_point(_row()).peak_bytes / GIB < 9.3
    assert deepspeed(psi, 1, 1, "fp16").bucket_bytes == 2 * 50_000_000  # the full bucket, model or not
    assert predict_point(_row()).basis.startswith("checked")


def test_other_engines_offload_and_checkpointing():
    psi = 805_888_010
    # DDP + ZeroRedundancyOptimizer, fp16 autocast over fp32 parameters, 2 GPUs: fp32 params, grads and
    # DDP's bucket copy, half of Adam's states, autocast's fp16 weights; 14.92 GiB was measured on 2 H200s
    # by hand (DESIGN.md) for this model at micro-batch 64, without phases. The prediction peaks in the step
    # (the forward's gradients are freed by zero_grad, as measured per phase at one GPU): 1.10x under it,
    # an open gap at 2 GPUs (no 2-GPU machine lent since).
    assert torch_zero(psi, 1, 2, "fp16").model_state_bytes == (4 + 4 + 4) * psi
    ddp = predict_point(_row(backend="torch_zero")).peak_bytes / GIB
    assert 1.05 < 14.92 / ddp < 1.12 and predict_point(_row(backend="torch_zero")).basis == "unchecked"
    # FSDP2: everything /N; stage 2 keeps the gathered fp16 parameters from forward to backward.
    assert fsdp(psi, 3, 2, "bf16", psi / 16).model_state_bytes == 8 * psi
    assert fsdp(psi, 2, 2, "bf16", psi / 16).compute_bytes > fsdp(psi, 3, 2, "bf16", psi / 16).compute_bytes
    # One H200 (results/h200-2026-12-02/engines_torch_fsdp): DDP's buckets are there at one rank too,
    # 18.08 GiB measured for torch_zero, 15.08 for FSDP2.
    one_gpu = {"backend": "torch_zero", "num_workers": 1}
    assert 18.0 < predict_point(_row(**one_gpu)).peak_bytes / GIB < 18.16
    assert predict_point(_row(**one_gpu)).basis.startswith("checked")
    assert 15.0 < predict_point(_row(backend="fsdp", stage=3, num_workers=1)).peak_bytes / GIB < 15.16
    # bf16 at stage 0 takes DeepSpeed's fp16 optimizer path (bf16 gradients, no fp32 accumulator).
    bf16, fp16 = deepspeed(psi, 0, 1, "bf16"), deepspeed(psi, 0, 1, "fp16")
    assert {**bf16.__dict__, "basis": ""} == {**fp16.__dict__, "basis": ""}
    # Offload: master, Adam's states and the gradient partition leave the device (one H200 measured +0.06
    # GiB over the first backward); checkpointing keeps fewer activations.
    assert deepspeed(psi, 2, 2, "fp16", offload="cpu").model_state_bytes == 2 * psi
    plain, checkpointed = predict_point(_row()), predict_point(_row(activation_checkpointing=True))
    assert checkpointed.activation_bytes < plain.activation_bytes / 4 and checkpointed.basis.startswith(
        "unchecked"
    )
    # Any other model needs its calibration for activations; its model states are predicted anyway.
    other = predict_point(_row(model="hf:gpt2", params=124_439_808))
    assert other.peak_bytes is None and other.model_state_bytes > 0
    calibrated = predict_point(
        _row(model="hf:gpt2", params=124_439_808), {"bytes_per_sample": {"plain": 2**20}}
    )
    assert calibrated.activation_bytes == 64 * 2**20 and "calibrated" in calibrated.basis


def _estimate(capsys, *args: str):
    """`python -m ray_zero estimate ARGS` in this process (no Ray is involved): exit status, stdout."""
    from ray_zero.__main__ import main

    status = main(["estimate", *args])
    return status, capsys.readouterr().out


def _table(out: str) -> list[dict[str, str]]:
    """estimate's printed table, a dict per row (the heading line names the columns)."""
    lines = out.splitlines()
    at = next(i for i, line in enumerate(lines) if line.split()[:2] == ["backend", "stage"])
    names = lines[at].split()
    return [dict(zip(names, line.split())) for line in lines[at + 1 :] if line.strip()]


def test_estimate_command_prints_the_table(capsys):
    status, out = _estimate(capsys, "--model", "large", "--workers", "1,2,4,8", "--stages", "0,1,2,3")
    assert status == 0
    assert "805,888,010 parameters" in out.splitlines()[0]
    rows = _table(out)
    assert len(rows) == 16  # 4 stages x 4 worker counts
    stage1 = {int(r["workers"]): float(r["adam_gib"]) for r in rows if r["stage"] == "1"}
    assert stage1[1] > stage1[2] > stage1[4] > stage1[8]
    assert {r["activations"] for r in rows} == {"traced"}  # the preset's step, traced on meta


def test_estimate_takes_any_model_source_without_network(capsys):
    status, out = _estimate(capsys, "--model", "hf:gpt2", "--workers", "1,2", "--stages", "0,1")
    assert status == 0 and "124,439,808 parameters" in out
    rows = _table(out)
    assert len(rows) == 4 and all(float(r["peak_gib"]) > float(r["activations_gib"]) > 0 for r in rows)


def test_estimate_prints_exactly_the_experiments_grid(tmp_path, capsys):
    # The case: every axis of the experiment honoured, nothing of estimate's own defaults added.
    experiment = tmp_path / "fsdp.yaml"
    experiment.write_text(
        "model: hf:gpt2\nmodel_config: {n_layer: 2}\nseq_len: 128\nsteps: 5\nprecision: bf16\n"
        "grid: {backend: [fsdp], stage: [3], micro_batch_size: [4, 8], num_workers: [2]}\n"
    )
    status, out = _estimate(capsys, str(experiment))
    assert status == 0 and "bf16" in out.splitlines()[0]
    rows = _table(out)
    assert [(r["backend"], r["stage"], r["workers"], r["micro_batch"]) for r in rows] == [
        ("fsdp", "3", "2", "4"),
        ("fsdp", "3", "2", "8"),
    ]
    # Flags narrow or override the experiment's own grid.
    status, out = _estimate(
        capsys, str(experiment), "--micro-batch-size", "8", "--set", "grid.num_workers=[4]"
    )
    assert [(r["workers"], r["micro_batch"]) for r in _table(out)] == [("4", "8")]
    # The activations double with the micro-batch, as a traced step's do.
    first, second = (float(r["activations_gib"]) for r in rows)
    assert 1.8 < second / first < 2.1


TINY = {
    "hf:gpt2": "{n_layer: 2, n_embd: 64, n_head: 4, vocab_size: 1000, n_positions: 512}",
    "hf:bert": "{num_hidden_layers: 2, hidden_size: 64, num_attention_heads: 4, intermediate_size: 128, "
    "vocab_size: 1000, max_position_embeddings: 512}",
}


@pytest.mark.parametrize("model", sorted(TINY))
def test_estimate_predicts_each_seq_len_of_the_axis_from_its_own_step(model, capsys):
    # A tiny model from its config class (no weights, no network): each length's step traced apart, its
    # peak growing with the length, and the column shown because the axis varies.
    args = ["--model", model, "--set", f"model_config={TINY[model]}", "--stages", "1", "--workers", "1"]
    status, out = _estimate(capsys, *args, "--micro-batch-size", "2", "--seq-len", "64,128,256,512")
    assert status == 0 and "seq_len 64, 128, 256, 512" in out.splitlines()[0]
    rows = _table(out)
    assert [r["seq_len"] for r in rows] == ["64", "128", "256", "512"]
    assert {r["activations"] for r in rows} == {"traced"}
    activations = [float(r["activations_gib"]) for r in rows]
    peaks = [float(r["peak_gib"]) for r in rows]
    assert peaks == sorted(set(peaks)) and activations[-1] > 6 * activations[0]  # 8x the tokens
    # One value: no seq_len column (the head says it).
    status, out = _estimate(capsys, *args, "--micro-batch-size", "2", "--seq-len", "128")
    assert "seq_len" not in out.splitlines()[2] and "seq_len 128" in out.splitlines()[0]


def test_estimate_plans_for_the_cluster_the_user_will_have(capsys):
    # 1.9 B parameters: 30 GiB of model states at stage 0 on one rank, more than this 24 GiB machine; estimate
    # still prints the stages and workers it was given (sweep and fit refuse it here), and --gpu-gib marks
    # them.
    status, out = _estimate(
        capsys,
        "--model",
        "hf:llama",
        "--set",
        "model_config.num_hidden_layers=8",
        "--set",
        "seq_len=256",
        "--workers",
        "1,8",
        "--stages",
        "0,3",
        "--micro-batch-size",
        "1",
        "--precision",
        "bf16",
        "--gpu-gib",
        "20",
    )
    assert status == 0
    rows = {(r["stage"], r["workers"]): r for r in _table(out)}
    assert sorted(rows) == [("0", "1"), ("0", "8"), ("3", "1"), ("3", "8")]
    assert rows[("0", "1")]["fits_20_gib"] == "no" and rows[("3", "8")]["fits_20_gib"] == "yes"
    assert float(rows[("3", "8")]["adam_gib"]) < float(rows[("0", "8")]["adam_gib"]) / 7  # ZeRO-3: /8


def test_estimates_peak_is_the_sweep_rows_own_prediction(tmp_path):
    # estimate and a sweep's row of the same point make one prediction, by one function (rows.trial_row).
    import dataclasses

    import ray_zero
    from ray_zero.config import TrialSpec
    from ray_zero.rows import trial_row
    from ray_zero.train.grid_trace import trace_grid, trace_key

    experiment = ray_zero.experiment_of(
        {"model": "hf:gpt2", "model_config": {"n_layer": 2}, "seq_len": 128, "steps": 5, "precision": "bf16",
         "grid": {"backend": ["deepspeed", "fsdp"], "stage": [1, 3], "micro_batch_size": [2],
                  "num_workers": [1]}}
    )  # fmt: skip
    found = ray_zero.estimate(experiment)
    info = ray_zero.api.describe(experiment, check_machine=False)
    traces = trace_grid(experiment.model_source(), experiment.grid.points(), "bf16")
    for row, point in zip(found.rows, experiment.grid.points()):
        key = trace_key(point.backend, "bf16", point.activation_checkpointing)
        spec = TrialSpec(experiment, point, "bf16", True, info, "runs/x", activations=traces[key])
        swept = trial_row(dataclasses.replace(spec, gpu_share=0.5))
        assert swept["predicted_peak_gib"] == row["predicted_peak_gib"] > 0
        assert swept["activation_source"] == "traced"


def test_what_each_engine_leaves_on_its_fullest_rank_tensor_by_tensor():
    from ray_zero.measure.partitions import Held, held

    shapes = [(3,), (14,), (3,)]  # 20 elements: ZeRO-1/2 partitions of 10 at 2 ranks
    # The 14-element tensor overlaps both partitions: each rank's gradient buffer holds it whole.
    assert held(shapes, [], "deepspeed", 1, 2) == Held(params=20, gradients=17, states=10, trainable=20)
    assert held(shapes, [(5, 2)], "deepspeed", 2, 2) == Held(params=30, gradients=17, states=10, trainable=20)
    # ZeRO-3: each tensor split (rounded up), those of at most 1e5 elements also whole on every rank.
    big, small = (200_001,), (7,)
    assert held([big, small], [], "deepspeed", 3, 2) == Held(
        params=100_001 + 4 + 7, gradients=100_005, states=100_005, trainable=200_008, step_group=100_005
    )
    assert (
        held([big, small], [], "deepspeed", 3, 1).params == 200_008
    )  # one rank: its partition is the tensor
    # ZeRO-3 steps its partition in sub-groups of at least 1e9 elements (a group closes on the tensor that
    # reaches it): a 3 B model at one rank in groups of 1.2e9, 1.1e9 and the rest.
    from ray_zero.measure.partitions import zero3_sub_groups

    layers = [(600_000_000,)] * 2 + [(550_000_000,)] * 2 + [(700_000_000,)]
    assert zero3_sub_groups([600_000_000] * 2 + [550_000_000] * 2 + [700_000_000]) == [
        1_200_000_000, 1_100_000_000, 700_000_000
    ]  # fmt: skip
    assert held(layers, [], "deepspeed", 3, 1).step_group == 1_200_000_000
    assert held(layers, [], "deepspeed", 3, 2).step_group == 1_150_000_000  # 300 M + 300 M + 275 M + 275 M
    # ZeroRedundancyOptimizer: whole tensors, largest first, to the least loaded rank.
    assert held([(64_000,), (100,), (100,), (50,)], [], "torch_zero", 1, 2).states == 64_000
    assert held([(64_000,), (100,)], [], "torch_zero", 0, 2).states == 64_100  # DDP: no split
    # FSDP2: dim 0 split, rounded up (a (1, 5) tensor stays on the first rank), a 0-d tensor whole.
    assert held([(3, 4), (1, 5), ()], [(2, 2)], "fsdp", 3, 2) == Held(
        params=16, gradients=14, states=14, trainable=18
    )


def test_frozen_parameters_and_partitions_reach_the_prediction():
    from ray_zero.measure.memory_model import HELD_COLUMNS
    from ray_zero.measure.partitions import held

    # A frozen backbone: held (fp16 under DeepSpeed) with no gradient, master or Adam's states.
    h = held([(1000,)], [(3000,)], "deepspeed", 0, 1)
    assert {
        k: v for k, v in deepspeed(4000, 0, 1, "fp16", held=h).__dict__.items() if k.endswith("_bytes")
    } == dict(
        parameter_bytes=2 * 4000,
        gradient_bytes=2 * 1000,
        master_param_bytes=4 * 1000,
        optimizer_state_bytes=8 * 1000,
        bucket_bytes=0.0,
        step_transient_bytes=8 * 1000,
        compute_bytes=0.0,
        activation_bytes=0.0,
        workspace_bytes=0.0,
        data_bytes=0.0,
    )
    # A row carries them (trial_row); rows of earlier versions predict the even split.
    row = _row(model="hf:gpt2", params=20_000, stage=3, num_workers=2, memory_kind="cpu_rss")
    layout = held([(20_000,)], [], "deepspeed", 3, 2)  # small enough to stay whole on both ranks besides
    with_shapes = predict_point(
        {**row, **dict(zip(HELD_COLUMNS, (layout.params, layout.gradients, layout.states, layout.trainable)))}
    )
    assert (
        with_shapes.parameter_bytes == 2 * (10_000 + 20_000)
        and predict_point(row).parameter_bytes == 2 * 10_000
    )


def test_a_rank_s_synthetic_batches_are_predicted_from_one_samples_bytes():
    """A rank holds SYNTHETIC_BATCHES micro-batches as the model makes them (fp32 images, int64 labels):
    the prediction's data term, before anything runs; the presets' rule and a row of an earlier version
    (no sample_bytes: what the rank measured) as they were."""
    from ray_zero.measure.memory_model import predict_point
    from ray_zero.models.describe import describe_model
    from ray_zero.models.spec import SYNTHETIC_BATCHES

    info = describe_model("timm:resnet18", input_shape=[3, 64, 64])
    assert info.sample_bytes == 3 * 64 * 64 * 4 + 8  # the image in fp32 and its label
    row = {
        "model": "timm:resnet18", "backend": "deepspeed", "stage": 1, "num_workers": 1, "precision": "bf16",
        "params": info.params, "micro_batch_size": 32, "memory_kind": "cuda", "dataset": "synthetic",
        "traced_activation_bytes": 1e8,
    }  # fmt: skip
    with_sample = predict_point({**row, "sample_bytes": info.sample_bytes})
    assert with_sample.data_bytes == SYNTHETIC_BATCHES * 32 * info.sample_bytes
    assert predict_point({**row, "data_bytes_per_rank_max": 12345}).data_bytes == 12345  # earlier rows
    assert predict_point({**row, "sample_bytes": info.sample_bytes, "dataset": "mnist"}).data_bytes == 0
