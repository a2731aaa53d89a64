"""The timed window runs stock code (rank level, 2 ranks under gloo): no wrapper on any torch.distributed
collective, Work.wait or DeepSpeed's backend while the timed steps run, and DDP with no comm hook; the
bytes of each collective are still counted, to the byte, in the untimed steps after the window."""

from __future__ import annotations

import time

import pytest
from rank_group import experiment_of, train_rank, trial_spec

from ray_zero.config import Point
from ray_zero.rows import trial_row

COMM = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce")
ENGINES = [
    Point("deepspeed", 0, 16, 2),
    Point("deepspeed", 1, 16, 2),
    Point("deepspeed", 2, 16, 2),
    Point("deepspeed", 3, 16, 2),
    Point("torch_zero", 0, 16, 2),
    Point("torch_zero", 1, 16, 2),
    Point("fsdp", 2, 16, 2),
    Point("fsdp", 3, 16, 2),
]


def train_watching_collectives(rank: int, world_size: int, spec) -> dict:
    """train() with what torch.distributed holds looked at in every forward (a pre-hook on the model) and
    between timed steps (the live gauges' callback), beside the timed window's bounds."""
    import torch.distributed as dist

    from ray_zero.measure.meter import Meter
    from ray_zero.train import comm, worker

    stock = {name: getattr(dist, name) for name in comm._SIZES if hasattr(dist, name)}
    stock_wait = dist.distributed_c10d.Work.__dict__["wait"]
    seen: dict = {"forwards": [], "between": [], "comm_hooks": []}
    bounds: dict[str, float] = {}
    build_engine, start_timing, stop_timing = worker.build_engine, Meter.start_timing, Meter.stop_timing

    def look() -> list[str]:
        changed = [name for name, function in stock.items() if getattr(dist, name) is not function]
        return (
            comm.installed()
            + changed
            + (["Work.wait"] if dist.distributed_c10d.Work.wait is not stock_wait else [])
        )

    def building(model, settings, device):
        engine = build_engine(model, settings, device)
        seen["engine"] = engine
        model.module.register_forward_pre_hook(
            lambda module, args: seen["forwards"].append((time.perf_counter(), look()))
        )
        return engine

    def progress(step, values):
        seen["between"].append(look())
        ddp = getattr(seen["engine"], "model", None)
        if hasattr(ddp, "_get_ddp_logging_data"):
            seen["comm_hooks"].append(ddp._get_ddp_logging_data().get("comm_hook"))

    def start(self, step):
        start_timing(self, step)
        bounds["start"] = time.perf_counter()

    def stop(self, *args):
        bounds["stop"] = time.perf_counter()
        stop_timing(self, *args)

    worker.build_engine, Meter.start_timing, Meter.stop_timing = building, start, stop
    try:
        result = train_rank(rank, world_size, spec, on_progress=progress)
    finally:
        worker.build_engine, Meter.start_timing, Meter.stop_timing = build_engine, start_timing, stop_timing
    inside = [installed for at, installed in seen["forwards"] if bounds["start"] < at < bounds["stop"]]
    after = [installed for at, installed in seen["forwards"] if at > bounds["stop"]]
    return {
        "result": result,
        "inside": inside,
        "after": after,
        "between": seen["between"],
        "comm_hooks": seen["comm_hooks"],
        "ddp": hasattr(getattr(seen["engine"], "model", None), "_get_ddp_logging_data"),
        "left": look(),
    }


@pytest.fixture(scope="module")
def watched(ranks):
    experiment = experiment_of(
        "experiments/quick.yaml",
        "steps=8",
        "warmup_steps=2",
        "dataset=synthetic",
        "runtime.live_metrics_every=1",
        "timing_min_s=0",
    )
    out = {}
    for point in ENGINES:
        spec = trial_spec(experiment, point)
        out[point] = (trial_row(spec), ranks(2).call(train_watching_collectives, spec))
    return out


def test_no_wrapper_while_the_timed_steps_run_and_ddp_keeps_its_own_reducer(watched):
    for point, (_, ranks) in watched.items():
        for seen in ranks:
            timed = seen["result"]["timed_steps"]
            # every timed step's forward saw torch.distributed as torch made it; so did the live gauges
            assert len(seen["inside"]) >= timed - 1 and all(found == [] for found in seen["inside"]), point
            assert seen["between"] and all(found == [] for found in seen["between"]), point
            # the counted steps after the window do wrap them (what the look above would have caught)
            assert len(seen["after"]) == seen["result"]["counted_steps"] and all(seen["after"]), point
            assert seen["left"] == [], point  # and they leave nothing behind
            if point.backend == "torch_zero":
                assert seen["ddp"] and seen["comm_hooks"] and set(seen["comm_hooks"]) == {None}, point


def test_the_counted_steps_find_every_byte_the_communication_model_predicts(watched):
    """DeepSpeed's backend keeps its own references to torch.distributed's functions, DDP's reducer
    all-reduces in C++: neither escapes the count (ray_zero/measure/comm_model.py, to the byte)."""
    for point, (row, ranks) in watched.items():
        predicted = {kind: row[f"predicted_comm_{kind}_bytes"] for kind in COMM}
        assert any(predicted.values()), point
        for seen in ranks:
            assert {kind: seen["result"][f"comm_{kind}_bytes"] for kind in COMM} == predicted, point


def test_the_step_split_still_adds_up_to_the_timed_step(watched):
    parts = ("forward_s", "backward_s", "optimizer_s", "exposed_comm_s")
    for point, (_, ranks) in watched.items():
        for seen in ranks:
            result = seen["result"]
            assert sum(result[name] for name in parts) == pytest.approx(result["step_s"], rel=1e-6), point
            assert min(result[name] for name in parts) >= 0, point
        if point.backend == "fsdp":  # FSDP2 waits for its gathers and reduce-scatters on CPU
            assert all(seen["result"]["exposed_comm_s"] > 0 for seen in ranks), point


def count_ddp_both_ways(rank: int, world_size: int, spec) -> tuple[dict, dict]:
    """One DDP engine: the all-reduce bytes it says its reducer sends, and the bytes torch's own Python
    allreduce_hook sends when registered on that engine's DDP for one more step, counted through
    torch.distributed."""
    import torch
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    from ray_zero.models.describe import build_model_spec
    from ray_zero.train.comm import CommCounter, counting
    from ray_zero.train.engines import build_engine
    from ray_zero.train.settings import EngineSettings

    model = build_model_spec(spec.experiment.model_source())
    engine = build_engine(model, EngineSettings.for_trial(spec, world_size), torch.device("cpu"))
    said = engine.reducer_bytes()
    engine.model.register_comm_hook(None, default_hooks.allreduce_hook)
    batch = model.make_batch(4, torch.device("cpu"), torch.Generator().manual_seed(rank))
    counter = CommCounter(torch.device("cpu"))
    with counting(counter):
        engine.forward_backward(batch, boundary=True)
        engine.step()
    engine.close()
    return said, dict(counter.bytes)


def test_ddp_reducer_bytes_are_what_its_allreduce_hook_sends(ranks):
    tiny_gpt2 = (
        "model=hf:gpt2",
        "seq_len=16",
        "model_config={n_layer: 1, n_embd: 32, n_head: 2, vocab_size: 64}",
    )
    for overrides in (("model=seed",), tiny_gpt2):
        experiment = experiment_of("experiments/quick.yaml", "dataset=synthetic", *overrides)
        point = Point("torch_zero", 0, 4, 2)
        for said, counted in ranks(2).call(count_ddp_both_ways, trial_spec(experiment, point)):
            assert said == {"all_reduce": counted["all_reduce"]} and said["all_reduce"] > 0, overrides
