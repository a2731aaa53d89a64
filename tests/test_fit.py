"""`fit` end to end through Ray on CPU: a tiny GPT-2 at seq_len 512 whose activations dominate its memory
(each worker's peak resident set grows by about 0.3 GiB per 32 samples). One search at a time, so the
two searches (DeepSpeed stages 1 and 2, one worker each) share one Ray Train run: stage 1 finds the
largest micro-batch within the budget, bracketed by its own probes; then stage 2 loses its worker
(killed) and goes on in a fresh run, where its probe fails for another reason than memory: that ends
that search alone. The best config then trains in a fresh
`deepspeed.initialize` on a rank of the harness. In-process probing at rank level: tests/test_probing.py;
the search's logic against exhaustive tables, without trials: tests/test_fit_search.py."""

from __future__ import annotations

import json

import pandas as pd
import pytest
from conftest import ROOT

from ray_zero.experiment_file import load_experiment
from ray_zero.measure.search import FitSettings
from ray_zero.models.describe import describe_model
from ray_zero.run.fit import run_fit

# One of README's budgets, between the peaks of 64 and 96 samples here (tests/test_fit_search.py): the
# search probes 32, then the largest (96, over the budget), then where their line crosses it, 64. A probe
# of 128 would cost more than those three together (21 s of the 2-core machine).
GRANULARITY, LARGEST = 32, 96
BUDGET_GIB = 2.035


@pytest.fixture(scope="module")
def fit(ray_instance, tmp_path_factory):
    output = tmp_path_factory.mktemp("fit")
    experiment = load_experiment(
        ROOT / "experiments" / "fit_gpt2_cpu.yaml",
        [
            "grid.stage=[1,2]",
            "runtime.max_failures=1",
            "runtime.max_concurrent_trials=1",
            "fault=[{kind: sigkill, stage: 2, step: 1, attempts: 1}, {kind: error, stage: 2, step: 1}]",
        ],
    )
    model = describe_model(experiment.model, experiment.model_options, experiment.seq_len)
    run_fit(
        experiment,
        output,
        model,
        FitSettings(budget_gib=BUDGET_GIB, granularity=GRANULARITY, max_micro_batch=LARGEST),
        command="pytest fit",
    )
    return output, pd.read_csv(output / "fit.csv").set_index("stage")


def test_the_answer_is_bracketed_by_its_own_probes(fit):
    output, table = fit
    rows = pd.read_csv(output / "results.csv")
    assert len(rows) == table["probes"].sum()  # every probe is a row
    probes = rows[rows["stage"] == 1].set_index("micro_batch_size")
    assert set(probes["status"]) <= {"ok", "oom"} and 2 <= len(probes) <= 6, probes[
        ["status", "peak_allocated_gib_max"]
    ]
    answer = int(table.loc[1, "max_micro_batch"])
    assert probes.loc[answer, "peak_allocated_gib_max"] <= BUDGET_GIB == table.loc[1, "budget_gib"]
    assert table.loc[1, "peak_gib"] == probes.loc[answer, "peak_allocated_gib_max"]
    if answer < LARGEST:  # the next size up was measured over the budget
        assert probes.loc[answer + GRANULARITY, "peak_allocated_gib_max"] > BUDGET_GIB
    assert table.loc[1, "samples_per_s"] > 0
    # One Ray Train run, one process per rank: the probes ran one after another in the same worker.
    records = [r for r in _records(output) if r["stage"] == 1]
    assert table.loc[1, "runs"] == 1 and len({r["run"] for r in records}) == 1
    assert len({r["per_rank"][0]["pid"] for r in records}) == 1
    assert "| run |" in (output / "fit.md").read_text()


def test_a_failing_probe_ends_only_its_own_search(fit):
    output, table = fit
    rows = pd.read_csv(output / "results.csv")
    assert "injected error" in table.loc[2, "note"] and pd.isna(table.loc[2, "max_micro_batch"])
    assert table.loc[2, "probes"] == 1 and list(rows[rows["stage"] == 2]["status"]) == ["failed"]
    assert not pd.isna(table.loc[1, "max_micro_batch"])
    # Stage 2's search began in stage 1's run, after it: its killed worker's probe ran again in the
    # group's second run, where the injected error ended it.
    failed = [r for r in _records(output) if r["stage"] == 2]
    first_run = {r["run"] for r in _records(output) if r["stage"] == 1}.pop()
    assert first_run.endswith("stage1_w1+1-run1"), first_run
    assert len(failed) == 1 and failed[0]["run"] == first_run.replace("-run1", "-run2")


def _records(output) -> list[dict]:
    return [json.loads(line) for line in (output / "trials.jsonl").read_text().splitlines()]


def test_best_config_is_what_the_winner_passed_to_deepspeed_and_trains_afresh(fit, ranks):
    output, _ = fit
    best = json.loads((output / "best_ds_config.json").read_text())
    winner = [
        r
        for r in _records(output)
        if r["micro_batch_size"] == best["train_micro_batch_size_per_gpu"]
        and r["stage"] == best["zero_optimization"]["stage"]
    ][0]
    assert best == winner["per_rank"][0]["engine_config"]  # key for key what its rank passed to initialize
    assert (output / "best_command.txt").read_text().startswith("python -m ray_zero sweep ")
    assert (output / "fit.png").stat().st_size > 1000 and "fit" in (output / "report.html").read_text()
    losses = ranks(1).call(train_with_config, best)[0]
    assert losses[-1] < losses[0], losses


def train_with_config(rank: int, world_size: int, config: dict) -> list[float]:
    """A user's own script: the fit's model and its best config, straight into deepspeed.initialize."""
    import deepspeed
    import torch

    from ray_zero.models.describe import build_model_spec

    spec = build_model_spec("hf:gpt2", dict(n_layer=2, n_embd=64, n_head=4, vocab_size=1000), seq_len=64)
    engine, *_ = deepspeed.initialize(
        model=spec.module, model_parameters=spec.module.parameters(), config=config
    )
    batch = spec.make_batch(
        config["train_micro_batch_size_per_gpu"], torch.device("cpu"), torch.Generator().manual_seed(0)
    )
    losses = []
    for _ in range(4):
        loss = spec.loss(engine, batch)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses
