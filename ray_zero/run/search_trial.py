"""`fit`'s searches in `TorchTrainer` runs, driven from a thread of fit's own process: the searches whose
points share their workers (ray_zero/run/fit.py groups them) in one run, one after another, more runs
only when a run ends early.

`search_loop` runs on every worker: `ray_zero.train.probing.run_searches` probes micro-batch after
micro-batch, each probe a `ray.train.report` that names its search. `drive_searches` is their driver: it
starts the run, turns each probe's all-rank report (the trial log, ray_zero/run/trial.py) into a results
row (the row a sweep's trial makes) as it arrives, and hands it to `record`. No Tune: a run is long and
its rows come while it trains, and fit's process already holds what a Tune trial's process would import
again. A run can end before its searches do: a rank out of memory with several workers, an
out-of-memory probe that left memory in use, a worker that died. The driver then knows which probe was in
flight (the searches run in order and are deterministic: each replays its recorded rows), records it,
and goes on in a fresh run with the searches left (out of memory), tries that probe again in one (a died
worker, up to `runtime.max_failures` times per group), or ends that search (any other failure) and goes on
with the others. Public Ray API only.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from typing import Any, Callable, Optional

import ray
from ray.train import TrainingFailedError

from ray_zero.config import is_calibration
from ray_zero.measure import calibration, correction
from ray_zero.measure.correction import Corrections
from ray_zero.measure.prediction import GIB
from ray_zero.rows import aggregate_ranks, finish_row, trial_row
from ray_zero.run.trial import failure_fields, torch_trainer, train_environment
from ray_zero.train.search_spec import RecordedProbe, SearchSpec, calibration_probes

POLL_S = 0.5
"""How often the driver looks for new probe reports while its run trains."""
REPORT_WAIT_S = 60.0
"""How long a rank waits for the trial log to have its probe's report before it goes on regardless."""


def search_loop(config: dict[str, Any]) -> None:
    """Ray Train entry point on every worker: this rank's part of the searches, one report per probe."""
    import ray.train
    import ray.train.torch
    import torch

    from ray_zero.train.probing import run_searches

    searches: list[SearchSpec] = config["searches"]
    log, key = config["log"], config["log_key"]
    context = ray.train.get_context()
    rank, world_size = context.get_world_rank(), context.get_world_size()
    attempt = ray.get(log.started.remote(key, rank))
    device = ray.train.torch.get_device() if searches[0].spec.use_gpu else torch.device("cpu")
    node = ray.get_runtime_context().get_node_id()
    reports = [ray.get(log.reports_received.remote(key))]

    def report(result: dict[str, Any]) -> None:
        ray.train.report({**result, "node_id": node, "pid": os.getpid(), "run": config["run"]})
        # On to the next probe only once the trial log has this one: a report still queued in a worker
        # that dies (the next probe's, or the next search's) never reaches the controller.
        reports[0] += 1
        waited = time.monotonic()
        while ray.get(log.reports_received.remote(key)) < reports[0]:
            if time.monotonic() - waited > REPORT_WAIT_S:
                break  # the row may be lost; the driver then runs the probe again
            time.sleep(POLL_S / 5)

    run_searches(searches, rank, world_size, device, report, attempt=attempt)


def recorded(row: dict[str, Any], field: str = "micro_batch_size") -> RecordedProbe:
    """A probe row as the search records it: the value searched (`field`: micro_batch_size or seq_len),
    the largest peak over ranks, activations per sample (or per token)."""
    value = row[field]
    rise = row.get("micro_batch_rise_bytes_per_rank_max") or row.get("saved_for_backward_bytes_per_rank_max")
    return RecordedProbe(
        value,
        row["status"],
        row.get("peak_allocated_gib_max"),
        rise / GIB / value if rise and value else None,
        row.get("error") or "",
    )


def is_probe(row: dict[str, Any]) -> bool:
    return not row["trial"].endswith(("_timed", "_calibration"))


class SearchState:
    """The driver's view of one search: its rows so far, and what a fresh run needs to go on."""

    def __init__(self, search: SearchSpec):
        self.search = search
        self.rows: list[dict[str, Any]] = []
        self.ended = False
        """A failure other than memory ended the search (its driver recorded the failed row)."""

    def add(self, row: dict[str, Any]) -> None:
        self.rows.append(row)

    def for_next_run(self) -> SearchSpec:
        """The search with what its rows measured: probes done, calibration once all its probes have rows."""
        search = dataclasses.replace(
            self.search,
            done=self.search.done + tuple(recorded(r, self.search.field) for r in self.rows if is_probe(r)),
        )
        if search.needs_calibration():
            calibrating = [r for r in self.rows if is_calibration(r["trial"])]
            if {r["micro_batch_size"] for r in calibrating} >= {
                s.point.micro_batch_size for s in calibration_probes(search)
            }:
                search = dataclasses.replace(
                    search, calibration=calibration.per_sample_bytes(calibrating, search.spec.use_gpu)
                )
        return search

    def in_flight(self) -> Optional[tuple[int, str]]:
        """(value, label) of the next probe the search would run (a micro-batch, or a seq_len): the one a
        run that ended early was on. None: the search is done."""
        if self.ended:
            return None
        search = self.for_next_run()
        if search.needs_calibration():
            done = {r["micro_batch_size"] for r in self.rows if is_calibration(r["trial"])}
            return next(
                (s.point.micro_batch_size, "calibration")
                for s in calibration_probes(search)
                if s.point.micro_batch_size not in done
            )
        found = search.search()
        micro = found.next_probe()
        if micro is not None:
            return micro, ""
        if (
            found.answer is not None
            and search.timed is not None
            and not any(r["trial"].endswith("_timed") for r in self.rows)
        ):
            return found.answer, "timed"
        return None


def _spec(search: SearchSpec, value: int, label: str):
    return at_its_length(search.at(value, search.timed if label == "timed" else None, label))


_DESCRIBED: dict[str, Any] = {}
"""The model described at each length fit --target seq_len probed (models.describe.ModelInfo)."""


def at_its_length(spec):
    """The spec with its model described at the point's own seq_len (its FLOPs, sample bytes and seq_len,
    which its row records), once per length: fit --target seq_len probes lengths no grid named."""
    length = spec.point.seq_len
    if length is None or length in spec.model.by_seq_len:
        return spec
    from ray_zero.models.describe import describe_model

    key = repr(spec.model_source())
    if key not in _DESCRIBED:
        _DESCRIBED[key] = describe_model(spec.model_source())
    model = dataclasses.replace(spec.model, by_seq_len={**spec.model.by_seq_len, length: _DESCRIBED[key]})
    return dataclasses.replace(spec, model=model)


def _row(search: SearchSpec, ranks: list[dict[str, Any]], started_at: float) -> dict[str, Any]:
    """A probe's results row from all ranks' reports of it."""
    first = ranks[0]
    spec = _spec(search, first[search.field], first.get("label") or "")
    row = trial_row(spec)
    row.update(correction.corrected_fields(row, search.correction))
    row.update(aggregate_ranks(ranks))
    oom = [r for r in ranks if r.get("probe_status") == "oom"]
    # wall_s: the probe's own time in its run (model, data, engine, steps), the slowest rank's
    row.update(
        status="oom" if oom else "ok",
        attempts=1,
        run=first.get("run"),
        search_started_at=started_at,
        wall_s=max(
            sum(
                r.get(k) or 0.0
                for k in ("model_build_s", "data_load_s", "initialize_s", "warmup_s", "timed_s")
            )
            for r in ranks
        ),
        first_guess=first.get("first_guess"),
    )
    if oom:
        row["error"] = oom[0].get("error")
    row["per_rank"] = [
        {"trial": spec.name, **{k: v for k, v in r.items() if k not in ("diagnostics", "error", "search")}}
        for r in ranks
    ]
    return row


def drive_searches(
    searches: list[SearchState], key: str, log, record: Callable[[dict[str, Any]], None]
) -> None:
    """Run the searches (points that share their workers) to their ends, in order, in as few TorchTrainer
    runs as it takes; `record(row)` gets each probe's row as it comes (and the search's state adds it).
    `key` names the runs (unique within the trial log `log`)."""
    first = searches[0].search.spec
    train_environment(first.private_ray)
    states = {state.search.name: state for state in searches}
    started_at = time.time()
    retries = 0
    for runs in range(1, 10**6):
        left = [state for state in states.values() if state.in_flight() is not None]
        if not left:
            return
        run = f"{key}-run{runs}"
        found = ray.get(log.corrections.remote())
        current = [_planned(state.for_next_run(), found) for state in left]
        trainer = torch_trainer(
            search_loop,
            {"searches": current, "log": log, "log_key": key, "run": run},
            current[0].spec,
            run,
            log,
            key,
            max_failures=0,
        )
        outcome: dict[str, Any] = {}

        def fit() -> None:
            try:
                trainer.fit()
            except TrainingFailedError as error:
                outcome["error"] = error

        # fit() returns only when the run ends: the rows of its probes are recorded while it trains.
        thread = threading.Thread(target=fit, name=f"ray_zero {run}", daemon=True)
        thread.start()
        reported = 0
        while thread.is_alive():
            thread.join(POLL_S)
            reported += _take_rows(log, key, states, started_at, record)
        reported += _take_rows(log, key, states, started_at, record)
        flying = next((state for state in left if state.in_flight() is not None), None)
        if flying is None:
            continue  # every search of the run is done
        error = outcome.get("error")
        if error is None:
            if reported:
                continue  # an out-of-memory probe left memory in use: a fresh run goes on
            fields = {"status": "failed", "error": "the run ended without a probe's report"}
        else:
            fields = failure_fields(error)
            if fields["status"] != "oom" and retries < first.experiment.runtime.max_failures:
                retries += 1  # a worker that died: the same probe again, in a fresh run
                continue
        micro, label = flying.in_flight()
        row = trial_row(_spec(flying.search, micro, label))
        row.update(fields, attempts=1, run=run, search_started_at=started_at, wall_s=None)
        flying.add(row)
        record(row)
        flying.ended = fields["status"] != "oom"  # any other failure ends that search


def _planned(search: SearchSpec, corrections: Corrections) -> SearchSpec:
    """A search not yet probed takes its engine's correction, if a probe before it missed its band."""
    if search.done or search.correction is not None or search.target != "micro_batch":
        return search
    point = search.spec.point
    found = corrections.for_row(
        {"backend": point.backend, "activation_checkpointing": point.activation_checkpointing}
    )
    return dataclasses.replace(search, correction=found) if found else search


def _take_rows(log, key: str, states: dict[str, SearchState], started_at: float, record) -> int:
    reports = ray.get(log.take_reports.remote(key))
    for ranks in reports:
        state = states[ranks[0]["search"]]
        row = _row(state.search, ranks, started_at)
        state.add(row)
        record(row)
        missed = correction.from_row(finish_row(dict(row)))
        if missed is not None:  # the searches of its engine not yet probed start from what it measured
            log.missed.remote(missed)
    return len(reports)
