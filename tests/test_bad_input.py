"""Each kind of bad input: exit code 2, one line naming the problem and what is allowed, no traceback,
and Ray never started (no dashboard line)."""

from __future__ import annotations

import pytest

QUICK = "experiments/quick.yaml"
# (case, arguments after `sweep` with {tmp} for the test's folder, what the one line must say)
CASES = [
    ("malformed yaml", ["{tmp}/broken.yaml"], "malformed YAML at line"),
    ("not a mapping", ["{tmp}/list.yaml"], "must hold a mapping of keys"),
    ("unknown key", [QUICK, "--set", "grid.stages=[0]"], "grid.stages: unknown key (did you mean 'stage'?)"),
    ("wrong type", [QUICK, "--set", "steps=many"], "steps: should be a valid integer, got 'many'"),
    ("stage out of range", [QUICK, "--set", "grid.stage=[0,4]"], "should be 0, 1, 2 or 3, got 4"),
    (
        "batch below one",
        [QUICK, "--set", "grid.micro_batch_size=[0]"],
        "micro_batch_size: must be integers of at least 1",
    ),
    (
        "workers below one",
        [QUICK, "--set", "grid.num_workers=[0,1]"],
        "num_workers: must be integers of at least 1",
    ),
    ("no point fits", [QUICK, "--set", "grid.num_workers=[4096]"], "no grid point can run"),
    ("fp16 on cpu", [QUICK, "--set", "precision=fp16", "--set", "device=cpu"], "precision fp16 needs a GPU"),
    (
        "retries below zero",
        [QUICK, "--set", "runtime.max_failures=-1"],
        "runtime.max_failures: should be greater than or equal to 0",
    ),
    ("launcher knob at the top", [QUICK, "--set", "cpus_per_worker=2"], "runtime.cpus_per_worker"),
    (
        "engine without the stage",
        [QUICK, "--set", "grid.backend=fsdp", "--set", "grid.stage=[1]"],
        "fsdp has stages 2, 3, not 1",
    ),
    ("unknown hf model type", [QUICK, "--set", "model=hf:gtp2"], "did you mean 'gpt2'"),
    (
        "unknown hf config key",
        [QUICK, "--set", "model=hf:gpt2", "--set", "model_config.n_layers=2"],
        "n_layers",
    ),
    ("unknown timm model", [QUICK, "--set", "model=timm:vit_tinyy_patch16_224"], "vit_tiny_patch16_224"),
    ("timm model without a head", [QUICK, "--set", "model=timm:vit_small_patch14_dinov2"], "set num_classes"),
    ("factory not importable", [QUICK, "--set", "model=examples/nope.py:build"], "examples/nope.py"),
    ("seq_len beyond the model", [QUICK, "--set", "model=hf:gpt2", "--set", "seq_len=4096"], "4096"),
    (
        "a seq_len axis value beyond the model",
        [QUICK, "--set", "model=hf:gpt2", "--set", "model_config={{n_layer: 1, n_embd: 32, n_head: 2, "
         "n_positions: 256}}", "--set", "grid.seq_len=[128,512]"],
        "grid.seq_len 512: seq_len 512 exceeds hf:gpt2's maximum positions 256 (allowed: 1 to 256)",
    ),  # fmt: skip
    (
        "a seq_len axis on a vision model",
        [QUICK, "--set", "grid.seq_len=[64,128]"],
        "grid.seq_len 128: seq_len 128 not used by seed (it trains on 1x28x28 MNIST-shaped images",
    ),
    (
        "seq_len and its axis disagree",
        [QUICK, "--set", "model=hf:gpt2", "--set", "seq_len=64", "--set", "grid.seq_len=[64,128]"],
        "seq_len 64 and grid.seq_len [64, 128] disagree",
    ),
    (
        "a LoRA target that matches no module",
        [QUICK, "--set", "model=hf:gpt2", "--set", "model_config={{n_layer: 1, n_embd: 32, n_head: 2}}",
         "--set", "finetune={{lora: {{r: 4, target_modules: [c_attn, q_proj]}}}}"],
        "finetune.lora.target_modules ['q_proj'] match no module of hf:gpt2 (its linear, convolution and "
        "embedding layers: c_attn, c_fc, c_proj",
    ),  # fmt: skip
    (
        "a freeze pattern that matches nothing",
        [QUICK, "--set", "finetune={{freeze: ['head.*', 'embed*']}}"],
        "finetune.freeze 'embed*' matches no parameter of seed (a pattern matches whole names, as "
        "named_parameters() gives them: 'pos_embed', 'patch_embed.weight'",
    ),
    ("a freeze of everything", [QUICK, "--set", "finetune={{freeze: ['*']}}"], "leaves no parameter of seed"),
    (
        "an empty finetune section",
        [QUICK, "--set", "finetune={{}}"],
        "finetune: give lora, freeze or both",
    ),
    (
        "model states beyond memory",
        [
            QUICK,
            "--set",
            "model=hf:llama",
            "--set",
            "model_config={{hidden_size: 4096, num_hidden_layers: 16, intermediate_size: 11008, num_attention_heads: 32}}",  # noqa: E501
            "--set",
            "seq_len=16",
        ],
        "GiB of model states",
    ),
    ("missing file", ["{tmp}/nope.yaml"], "experiment file not found"),
    ("unwritable output", [QUICK, "--output", "{tmp}/a_file/out"], "is not writable"),
    ("malformed set", [QUICK, "--set", "steps"], "expected KEY=VALUE"),
    ("output of an earlier sweep", [QUICK, "--output", "{tmp}/earlier"], "already holds a sweep's results"),
    ("unknown option", [QUICK, "--stages", "1"], "unrecognized arguments"),
    (
        "a profile that is not there",
        [QUICK, "--set", "runtime.profile={tmp}/nope.json"],
        "runtime.profile {tmp}/nope.json: cannot read it",
    ),
    (
        "a profile of another command",
        [QUICK, "--profile", "{tmp}/bandwidth.json"],
        "runtime.profile {tmp}/bandwidth.json: not a file of `python -m ray_zero profile`",
    ),
]


# These run as a user runs them, in a fresh process (the message comes before any import of Ray, torch
# or DeepSpeed could print); the others call the same `main` in this process (a new process per case costs
# 4-9 s of imports on 2 cores).
IN_A_FRESH_PROCESS = {"malformed yaml", "unknown option"}


def _files(tmp_path):
    (tmp_path / "broken.yaml").write_text("steps: 4\ngrid: {stage: [0, 1]\n")
    (tmp_path / "list.yaml").write_text("- steps\n")
    (tmp_path / "a_file").write_text("not a folder")
    (tmp_path / "bandwidth.json").write_text('{"kind": "ray_zero bandwidth", "results": []}')
    (tmp_path / "earlier").mkdir()
    (tmp_path / "earlier" / "trials.jsonl").write_text('{"trial": "stage0_mb64_w1", "status": "ok"}\n')


@pytest.mark.parametrize("case, args, expected", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_one_clear_line_before_ray_starts(case, args, expected, tmp_path, cli, capsys):
    _files(tmp_path)
    argv = ["sweep", *[a.format(tmp=tmp_path) for a in args]]
    if case in IN_A_FRESH_PROCESS:
        done = cli(*argv)
        returncode, stdout, stderr = done.returncode, done.stdout, done.stderr
    else:
        returncode, stdout, stderr = _main_here(argv, capsys)
    stderr_lines = [line for line in stderr.splitlines() if line.strip()]
    assert returncode == 2, stderr
    assert len(stderr_lines) == 1, stderr
    expected = expected.format(tmp=tmp_path)
    assert expected in stderr_lines[0] and stderr_lines[0].startswith("ray_zero: error: ")
    assert "Traceback" not in stderr and "dashboard" not in stdout


def _main_here(argv: list[str], capsys) -> tuple[int, str, str]:
    """`python -m ray_zero ARGV` in this process: (exit code, stdout, stderr); Ray must not start."""
    import ray

    from ray_zero.__main__ import main

    ray_before = ray.is_initialized()
    try:
        returncode = main(argv)
    except SystemExit as exit_:  # argparse's errors exit
        returncode = exit_.code
    stdout, stderr = capsys.readouterr()
    assert ray.is_initialized() == ray_before  # no Ray started for bad input
    return returncode, stdout, stderr


def test_fp16_on_a_cpu_only_machine_is_refused_before_ray(capsys, monkeypatch):
    import torch

    # A machine without GPUs, also where the suite runs on one (torch caches its device count).
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    code, stdout, stderr = _main_here(["sweep", QUICK, "--set", "precision=fp16"], capsys)
    assert code == 2 and "fp16 needs a GPU" in stderr and "dashboard" not in stdout


def test_lora_without_peft_installed_names_the_extra(capsys, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "peft", None)  # as where peft is not installed: its import fails
    args = ["sweep", QUICK, "--set", "model=hf:gpt2", "--set", "finetune={lora: {target_modules: [c_attn]}}"]
    code, stdout, stderr = _main_here(args, capsys)
    assert code == 2 and len(stderr.strip().splitlines()) == 1, stderr
    assert "finetune.lora needs the PEFT library, not installed here: pip install 'ray_zero[finetune]'" in (
        stderr
    )
    assert "Traceback" not in stderr and "dashboard" not in stdout


def test_report_of_a_folder_without_results(tmp_path, capsys):
    code, _, stderr = _main_here(["report", str(tmp_path)], capsys)
    assert code == 2 and "no trials.jsonl here" in stderr and "Traceback" not in stderr


def test_fit_on_cpu_without_a_budget_is_refused(capsys):
    code, _, stderr = _main_here(["fit", QUICK, "--set", "device=cpu"], capsys)
    assert code == 2 and "needs --budget-gib" in stderr and "Traceback" not in stderr


@pytest.mark.parametrize("gib", ["-3", "0", "nan"])
def test_estimate_refuses_a_gpu_of_no_memory(gib, capsys):
    code, _, stderr = _main_here(["estimate", "--model", "seed", "--gpu-gib", gib], capsys)
    assert code == 2 and f"--gpu-gib {gib}: a GPU's memory in GiB" in stderr and "Traceback" not in stderr


def test_a_timm_model_built_with_no_classifier_head_is_refused_in_one_line(capsys):
    # Issue 65 item 5: DINOv2's encoder defaults to 0 classes; estimate printed a traceback
    # ("random_ expects 'from' to be less than 'to'") before.
    code, _, stderr = _main_here(["estimate", "--model", "timm:vit_small_patch14_dinov2"], capsys)
    assert code == 2 and "has no classifier head (it is built with 0 classes); set num_classes" in stderr
    assert "Traceback" not in stderr and len(stderr.strip().splitlines()) == 1
