"""Experiment files, overrides, validation and the sweep's plan (pure: no Ray started)."""

from __future__ import annotations

from pathlib import Path

import pytest

from ray_zero.config import ConfigError, Experiment, Point
from ray_zero.experiment_file import apply_override, load_experiment, validate_experiment

ROOT = Path(__file__).resolve().parents[1]
EXPERIMENTS = sorted((ROOT / "experiments").glob("*.yaml"))


def test_the_four_named_experiments_ship():
    assert {p.stem for p in EXPERIMENTS} >= {"quick", "zero1_mnist", "memory_scaling", "batch_sweep"}


@pytest.mark.parametrize("path", EXPERIMENTS, ids=lambda p: p.stem)
def test_every_experiment_loads_and_says_what_it_answers(path: Path):
    experiment = load_experiment(path)
    assert isinstance(experiment, Experiment) and experiment.name == path.stem
    assert experiment.question.endswith(".") or "?" in experiment.question, (
        f"{path.name} must say what it answers"
    )
    assert experiment.grid.points()


def test_zero1_mnist_is_the_seed_experiment():
    e = load_experiment(ROOT / "experiments" / "zero1_mnist.yaml")
    assert (e.model, e.dataset, e.epochs, e.grid.stage, e.grid.micro_batch_size, e.grid.num_workers) == (
        "seed",
        "mnist",
        3,
        [0, 1],
        [64],
        [1],
    )
    assert e.resolved_precision(use_gpu=True) == "fp16" and e.resolved_precision(use_gpu=False) == "fp32"


def test_overrides_take_dotted_keys_and_yaml_values():
    e = load_experiment(
        ROOT / "experiments" / "quick.yaml",
        ["grid.num_workers=[1,3]", "steps=8", "optimizer.lr=0.01", "grid.stage=2"],
    )
    assert e.grid.num_workers == [1, 3] and e.steps == 8 and e.optimizer.lr == 0.01 and e.grid.stage == [2]
    assert e.model_options == {} and load_experiment(
        ROOT / "experiments" / "quick.yaml", ["model=hf:gpt2", "dataset=auto", "model_config.n_layer=2"]
    ).model_options == {"n_layer": 2}
    assert len(e.grid.points()) == 2


def test_storage_path_accepts_folders_and_uris_without_secrets():
    for path in ("/mnt/nfs/sweeps", "s3://bucket/sweeps?region=us-east-1", "file:///tmp/x"):
        assert (
            validate_experiment({"steps": 4, "runtime": {"storage_path": path}}).runtime.storage_path == path
        )


def test_grid_points_are_the_cartesian_product():
    e = validate_experiment(
        {"steps": 4, "grid": {"stage": [1, 0], "micro_batch_size": [8, 4], "num_workers": [2]}}
    )
    assert e.grid.points() == [Point("deepspeed", s, b, 2) for s in (0, 1) for b in (4, 8)]
    assert [p.name for p in e.grid.points()][:2] == ["stage0_mb4_w2", "stage0_mb8_w2"]
    assert e.global_batch(8, 2) == 16


@pytest.mark.parametrize(
    "raw, expected",
    [
        ({"steps": 5, "grid": {"stage": [0, 5]}}, "grid.stage[1]: should be 0, 1, 2 or 3, got 5"),
        ({"steps": 5, "grid": {"stages": [0]}}, "grid.stages: unknown key (did you mean 'stage'?)"),
        ({"steps": "ten"}, "steps: should be a valid integer, got 'ten'"),
        (
            {"steps": 5, "grid": {"num_workers": [0]}},
            "grid.num_workers: must be integers of at least 1, got 0",
        ),
        (
            {"steps": 5, "grid": {"micro_batch_size": [-4]}},
            "grid.micro_batch_size: must be integers of at least 1",
        ),
        ({"steps": 5, "device": "cpu", "precision": "fp16"}, "precision fp16 needs a GPU"),
        ({}, "set exactly one of epochs or steps"),
        ({"steps": 2, "warmup_steps": 2}, "warmup_steps (2) must be less than steps (2)"),
        ({"steps": 2, "warmup_steps": 0}, "warmup_steps: should be greater than or equal to 1, got 0"),
        ({"steps": 5, "grid": {"backend": "torch_zero", "stage": [3]}}, "torch_zero has stages 0, 1, not 3"),
        ({"steps": 5, "grid": {"backend": "fsdp", "stage": [1, 2]}}, "fsdp has stages 2, 3, not 1"),
        (
            {"steps": 5, "grid": {"stage": [0], "offload_optimizer": ["cpu"]}},
            "offload_optimizer needs backend deepspeed with stage 1, 2 or 3",
        ),
        (
            {
                "steps": 5,
                "grid": {"backend": ["fsdp", "torch_zero"], "stage": [2], "offload_optimizer": "cpu"},
            },
            "no combination of grid.backend",
        ),
        ({"steps": 5, "model": "hf:gpt2", "dataset": "mnist"}, "dataset: mnist is for the presets"),
        ({"steps": 5, "cpus_per_worker": 2}, "it belongs in the runtime: section (runtime.cpus_per_worker)"),
        ({"steps": 5, "modl_config": {}}, "did you mean 'model_config'?"),
        ({"steps": 5, "optimizer": {"lrr": 0.1}}, "optimizer.lrr: unknown key (did you mean 'lr'?)"),
        ({"steps": True}, "steps: should be a valid integer, got True"),
        (
            {"steps": 5, "runtime": {"storage_path": "s3://bucket/x?access_key=AKIA&secret_key=abc"}},
            "runtime.storage_path: must not contain credentials",
        ),
        (
            {"steps": 5, "runtime": {"storage_path": "s3://user:pa55@bucket/x"}},
            "must not contain credentials",
        ),
        (
            {"steps": 5, "runtime": {"max_concurrent_trials": 0}},
            "runtime.max_concurrent_trials: should be greater than 0, got 0",
        ),
        (
            {"steps": 5, "model": "hf:gpt2", "seq_len": 256, "grid": {"seq_len": [128, 512]}},
            "seq_len 256 and grid.seq_len [128, 512] disagree",
        ),
        ({"steps": 5, "grid": {"seq_len": [128, 0]}}, "grid.seq_len: must be integers of at least 1, got 0"),
    ],
)
def test_bad_values_are_one_line_naming_key_and_allowed(raw, expected):
    with pytest.raises(ConfigError) as caught:
        validate_experiment(raw)
    message = str(caught.value)
    assert expected in message and "\n" not in message


@pytest.mark.parametrize("item", ["steps", "=3", "a..b=1", "steps=[1"])
def test_malformed_set_is_rejected(item):
    with pytest.raises(ConfigError, match="--set"):
        apply_override({}, item)


def test_set_into_a_value_is_rejected():
    with pytest.raises(ConfigError, match="steps is a value, not a section"):
        apply_override({"steps": 1}, "steps.x=1")


def test_plan_packs_trials_onto_the_cluster_and_skips_what_cannot_fit():
    from ray_zero.run.plan import Cluster, plan_sweep

    experiment = validate_experiment({"steps": 4, "grid": {"stage": [0, 1], "num_workers": [1, 2, 4]}})
    plan = plan_sweep(experiment, Cluster(gpus=2, cpus=32, source="a 2-GPU machine"))
    assert plan.use_gpu and plan.precision == "fp16" and plan.capacity == 2
    assert [p.num_workers for p, _ in plan.skipped] == [4, 4] and "room for 2 GPUs" in plan.skipped[0][1]
    assert plan.max_concurrent_trials == 1  # the largest runnable trial takes both GPUs
    ones = validate_experiment({"steps": 4, "grid": {"stage": [0, 1], "num_workers": [1]}})
    assert plan_sweep(ones, Cluster(gpus=2, cpus=32, source="x")).max_concurrent_trials == 2
    limited = ones.model_copy(
        update={"runtime": ones.runtime.model_copy(update={"max_concurrent_trials": 1})}
    )
    assert plan_sweep(limited, Cluster(gpus=2, cpus=32, source="x")).max_concurrent_trials == 1
    cpu = plan_sweep(ones, Cluster(gpus=0, cpus=2, source="a laptop"))
    assert not cpu.use_gpu and cpu.precision == "fp32" and cpu.max_concurrent_trials == 2


def test_plan_starts_one_trial_early_only_where_it_must_wait():
    from ray_zero.run.plan import Cluster, plan_sweep

    two_gpus, laptop = Cluster(gpus=2, cpus=32, source="x"), Cluster(gpus=0, cpus=2, source="y")
    twos = validate_experiment({"steps": 4, "grid": {"stage": [0, 1], "num_workers": [2]}})
    plan = plan_sweep(twos, two_gpus)
    assert (plan.max_concurrent_trials, plan.started_early, plan.trial_drivers) == (1, 1, 2)
    ones = validate_experiment({"steps": 4, "grid": {"stage": [0, 1, 2], "num_workers": [1]}})
    assert plan_sweep(ones, two_gpus).trial_drivers == 3  # two train, one waits
    # Capped below what the GPUs fit, an early trial would train at once: none starts early.
    capped = ones.model_copy(update={"runtime": ones.runtime.model_copy(update={"max_concurrent_trials": 1})})
    assert plan_sweep(capped, two_gpus).trial_drivers == 1
    mixed = validate_experiment({"steps": 4, "grid": {"stage": [0, 1], "num_workers": [1, 2]}})
    assert plan_sweep(mixed, two_gpus).started_early == 0  # a 1-worker trial would fit beside one
    # Off on CPU unless asked; nothing to overlap with a single trial.
    assert plan_sweep(twos, laptop).started_early == 0
    assert (
        plan_sweep(
            twos.model_copy(update={"runtime": twos.runtime.model_copy(update={"overlap_startup": True})}),
            laptop,
        ).started_early
        == 1
    )
    single = validate_experiment({"steps": 4, "grid": {"stage": [1], "num_workers": [2]}})
    assert plan_sweep(single, two_gpus).started_early == 0


def test_several_engines_skip_the_stages_one_of_them_lacks_with_the_reason():
    from ray_zero.run.plan import Cluster, plan_sweep

    e = validate_experiment(
        {"steps": 4, "grid": {"backend": ["deepspeed", "torch_zero", "fsdp"], "stage": [1, 3]}}
    )
    assert [p.name for p in e.grid.points()] == [
        "stage1_mb64_w1",
        "stage3_mb64_w1",
        "torch_zero_stage1_mb64_w1",
        "fsdp_stage3_mb64_w1",
    ]
    plan = plan_sweep(e, Cluster(gpus=0, cpus=2, source="a laptop"))
    skipped = {p.name: reason for p, reason in plan.skipped}
    assert skipped == {
        "torch_zero_stage3_mb64_w1": "torch_zero has stages 0, 1, not 3",
        "fsdp_stage1_mb64_w1": "fsdp has stages 2, 3, not 1",
    }


def test_point_names_say_engine_checkpointing_and_offload():
    assert Point("deepspeed", 2, 8, 2, True, "cpu").name == "stage2_mb8_w2_ac_offloadcpu"
    assert Point("fsdp", 3, 8, 2).name == "fsdp_stage3_mb8_w2"
    assert Point("deepspeed", 1, 8, 2, seq_len=512).name == "stage1_mb8_w2_s512"


def test_seq_len_axis_is_one_point_per_value_and_reaches_the_model_source():
    e = validate_experiment(
        {
            "steps": 4,
            "model": "hf:gpt2",
            "grid": {"stage": [1], "micro_batch_size": [2], "seq_len": [512, 128]},
        }
    )
    points = e.grid.points()
    assert [p.seq_len for p in points] == [128, 512] and e.seq_lens() == [128, 512]
    assert [e.model_source(p).seq_len for p in points] == [128, 512]
    # the top-level seq_len stays: a one-value axis, alone or given twice alike
    one = validate_experiment({"steps": 4, "model": "hf:gpt2", "seq_len": 256})
    assert one.seq_lens() == [256] and one.grid.points()[0].seq_len is None
    assert one.model_source(one.grid.points()[0]).seq_len == 256
    both = validate_experiment({"steps": 4, "model": "hf:gpt2", "seq_len": 256, "grid": {"seq_len": 256}})
    assert [p.seq_len for p in both.grid.points()] == [256, 256]
