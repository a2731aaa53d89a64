"""`python -m ray_zero fit`: the largest micro-batch that fits, for every (engine, stage, workers) of the
grid, and the fastest of them exported as the config to train with.

One search (ray_zero/fit_search.py) per point, all its probes inside one Ray Train run (ray_zero/
search_trial.py drives it from a thread of this process; ray_zero/probing.py runs it on the ranks): the
ranks build the model once and train each probe's few steps in a fresh engine, a row of the same tables
as a sweep's trial; searches of different points run side by side where the cluster has room. The
search's calibration (GPU, a model that is not a preset) comes first and its answer's timed run last,
in the same run. Writes fit.csv, fit.md (with the run each probe ran in), best_ds_config.json (the
DeepSpeed config the fastest DeepSpeed rank passed to deepspeed.initialize), best_config.json,
best_experiment.yaml + best_command.txt, fit.png.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import pandas as pd
import ray
import yaml

from ray_zero.config import ConfigError, Experiment, Point
from ray_zero.measure import calibration
from ray_zero.measure.search import BracketSearch, Steps
from ray_zero.report.frame import markdown_table
from ray_zero.report.plots import write_fit_plot
from ray_zero.report.tables import write_pages
from ray_zero.rows import one_line_reason, trial_row
from ray_zero.run.search_trial import SearchState, drive_search, is_probe, recorded, search_name
from ray_zero.run.sweep import Recorder, Session, SweepIncomplete
from ray_zero.store import atomic_write, load_trials, publish
from ray_zero.train.probing import SearchSpec, calibration_probes

PROBE_STEPS = 3
"""Steps of a probe (1 of warm-up): the peak comes with the first optimizer steps."""


@dataclass(frozen=True)
class FitSettings:
    budget_gib: Optional[float] = None
    margin_gib: float = 2.0
    granularity: Optional[int] = None
    max_micro_batch: int = 65536

    @classmethod
    def from_args(cls, args, experiment: Experiment) -> "FitSettings":
        if args.budget_gib is not None and args.budget_gib <= 0:
            raise ConfigError(f"--budget-gib {args.budget_gib}: give a positive number of GiB per rank")
        if args.granularity is not None and args.granularity < 1:
            raise ConfigError(f"--granularity {args.granularity}: give a whole number of samples, at least 1")
        if args.budget_gib is None and experiment.device == "cpu":
            raise ConfigError(
                "fit on CPU needs --budget-gib G: the peak resident set per worker to stay within"
            )
        return cls(args.budget_gib, args.margin_gib, args.granularity, args.max_micro_batch)

    def budget(self, session: Session) -> float:
        if self.budget_gib is not None:
            return self.budget_gib
        if not session.plan.use_gpu:
            raise ConfigError(
                "fit on CPU needs --budget-gib G: the peak resident set per worker to stay within"
            )
        if not session.cluster.gpu_memory_gib:
            raise ConfigError("fit on a cluster whose GPUs are on other nodes needs --budget-gib G")
        return session.cluster.gpu_memory_gib - self.margin_gib


def _key(point: Point) -> Point:
    return point.replace(micro_batch_size=0)


def _key_of_row(row: dict[str, Any]) -> Point:
    return Point(
        row["backend"],
        row["stage"],
        0,
        row["num_workers"],
        bool(row["activation_checkpointing"]),
        row["offload_optimizer"],
    )


def _searches(session: Session, budget: float, steps: Steps, rows: list[dict]) -> list[SearchSpec]:
    """One search per (engine, stage, workers, ...) point, with the probes a resumed fit already ran; a
    search that is done (its answer timed, or nothing left to probe) is left out."""
    probe_steps = min(PROBE_STEPS, session.experiment.steps or PROBE_STEPS)
    probe = session.experiment.probe(probe_steps)
    # The probes' own rates serve when the experiment is no longer than a probe; else each answer is timed.
    timed = session.experiment if (session.experiment.steps or 10**9) > probe_steps else None
    calibrate = calibration.wanted(session.experiment, session.plan.use_gpu)
    searches = []
    for key in _keys(session):
        state = SearchState(
            SearchSpec(
                session.spec(key.replace(micro_batch_size=steps.smallest), probe),
                budget,
                steps,
                timed,
                calibrate,
            )
        )
        for row in rows:
            if _key_of_row(row) == key:
                state.add(row)
        if state.in_flight() is not None:
            searches.append(state.for_next_run())
    return searches


def _keys(session: Session) -> list[Point]:
    return list(dict.fromkeys(_key(p) for p in session.plan.runnable))


def run_fit(
    experiment: Experiment,
    output_dir: Path,
    model,
    settings: FitSettings,
    address: Optional[str] = None,
    resume: bool = False,
    diagnostics: bool = False,
    verbose: bool = False,
    command: Optional[str] = None,
):
    """Search, time, write the fit tables and the best configs; return the results table."""
    sizes = experiment.grid.micro_batch_size
    with Session(experiment, model, output_dir, address, command, resume, diagnostics, verbose) as session:
        budget = settings.budget(session)
        largest = min(settings.max_micro_batch, max(sizes)) if len(sizes) > 1 else settings.max_micro_batch
        steps = Steps(settings.granularity, largest)
        searches = _searches(session, budget, steps, load_trials(session.output_dir) if resume else [])
        print(
            f"ray_zero: fit: {len(searches)} searches for the largest micro-batch within {budget:.2f} GiB "
            "per rank "
            f"on {'GPU' if session.plan.use_gpu else 'CPU'}, {session.plan.precision}, each in one Ray Train "
            "run; "
            f"results in {session.output_dir}",
            flush=True,
        )
        session.resume = False  # a resumed fit starts new searches from the probes its rows recorded
        if searches:
            recorder = Recorder(
                session.output_dir,
                session.storage,
                None,
                pages=False,
                on_row=CalibrationWriter(session, len(calibration_probes(searches[0]))),
            )
            run_searches(session, searches, recorder)
        frame = session.finish(pages=False)  # write_fit draws the pages, with the fit's section
        rows = load_trials(session.output_dir)
        fit_table = write_fit(session, rows, budget, steps, frame)
        if _searches(session, budget, steps, rows):
            raise SweepIncomplete(len(frame), len(frame) + 1)
        print(markdown_table(fit_table, list(fit_table.columns)), flush=True)
        return frame


def run_searches(session: Session, searches: list[SearchSpec], recorder: Recorder) -> None:
    """Drive every search from a thread of this process (ray_zero/search_trial.py), as many at once as
    the plan runs trials; each row recorded as it comes. A driver that fails itself (a bug, Ray gone)
    leaves a failed row for its search, and the others go on."""
    log = ray.get_actor(session.log_name)
    lock = threading.Lock()
    waiting, running = list(searches), [0]
    stamp = int(time.time())

    def record(row: dict[str, Any]) -> None:
        with lock:
            recorder.record(row, running=running[0])

    def driver() -> None:
        while True:
            with lock:
                if not waiting:
                    return
                search = waiting.pop(0)
                running[0] += 1
            try:
                drive_search(search, f"fit{stamp}-{search_name(search)}", log, record)
            except Exception as error:  # noqa: BLE001  one search's driver: the others go on
                record(
                    {
                        **trial_row(search.spec),
                        "status": "failed",
                        "error": f"the search's driver failed: {one_line_reason(error)}",
                    }
                )
            finally:
                with lock:
                    running[0] -= 1

    threads = [
        threading.Thread(target=driver, name=f"ray_zero fit driver {i}", daemon=True)
        for i in range(min(len(searches), session.plan.trial_drivers))
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        while thread.is_alive():  # in steps: Ctrl-C reaches this thread, and the session ends the runs
            thread.join(0.5)


class CalibrationWriter:
    """calibration.json as soon as a search has measured its activations (each search calibrates at its
    own point; per engine, the first search to finish its calibration speaks for it), so that the rows
    recorded after it carry the calibrated prediction, as a sweep's do."""

    def __init__(self, session: Session, sizes: int):
        self.output_dir, self.experiment = session.output_dir, session.experiment
        self.use_gpu, self.precision, self.sizes = session.plan.use_gpu, session.plan.precision, sizes

    def __call__(self, row: dict[str, Any]) -> None:
        if not row["trial"].endswith("_calibration"):
            return
        rows = load_trials(self.output_dir)
        chosen: list[dict] = []
        for backend in dict.fromkeys(r["backend"] for r in rows if r["trial"].endswith("_calibration")):
            by_search: dict[Point, list[dict]] = {}
            for r in rows:
                if r["trial"].endswith("_calibration") and r["backend"] == backend:
                    by_search.setdefault(_key_of_row(r), []).append(r)
            complete = [mine for mine in by_search.values() if len(mine) >= self.sizes]
            chosen += complete[0] if complete else []
        if chosen:
            found = calibration.write_calibration(
                self.output_dir, self.experiment, chosen, self.use_gpu, self.precision
            )
            print(f"ray_zero: {calibration.summary(found)}", flush=True)


def _search_of(rows: list[dict], budget: float, steps: Steps) -> BracketSearch:
    found = BracketSearch(budget, steps)
    for row in rows:
        probe = recorded(row)
        found.record(probe.micro_batch_size, probe.status, probe.peak_gib, probe.per_sample_gib, probe.error)
    return found


def write_fit(
    session: Session, rows: list[dict], budget: float, steps: Steps, results: pd.DataFrame
) -> pd.DataFrame:
    """fit.csv, fit.md, the best configs, the plots and report.html; the fit table."""
    by_name = {row["trial"]: row for row in rows}
    table = []
    for key in _keys(session):
        mine = [r for r in rows if _key_of_row(r) == key]
        probes = [r for r in mine if is_probe(r)]
        search = _search_of(probes, budget, steps)
        answer = search.answer
        timed = by_name.get(key.replace(micro_batch_size=answer).name + "_timed") if answer else None
        probe = by_name.get(key.replace(micro_batch_size=answer).name) if answer else None
        guesses = [r.get("first_guess") for r in probes if r.get("first_guess") is not None]
        searched = [r for r in mine if not r["trial"].endswith("_timed")]
        started = min((r.get("search_started_at") or r["recorded_at"] for r in mine), default=None)
        table.append(
            {
                "backend": key.backend,
                "stage": key.stage,
                "num_workers": key.num_workers,
                "activation_checkpointing": key.activation_checkpointing,
                "offload_optimizer": key.offload_optimizer,
                "max_micro_batch": answer,
                "peak_gib": (probe or {}).get("peak_allocated_gib_max"),
                "budget_gib": budget,
                "predicted_max": guesses[0] if guesses else None,
                "samples_per_s": (timed or probe or {}).get("samples_per_s"),
                "probes": len(search.probes) + (1 if search.stopped else 0),
                "runs": len({r.get("run") for r in mine if r.get("run")}),
                "search_s": max(r["recorded_at"] for r in searched) - started if searched else None,
                "note": search.stopped or ("" if answer else "does not fit at the smallest micro-batch"),
                "timed_trial": (timed or probe or {}).get("trial"),
            }
        )
    frame = pd.DataFrame(table)
    out = session.output_dir
    atomic_write(out / "fit.csv", frame.drop(columns=["timed_trial"]).to_csv(index=False))
    # Each probe (and calibration or timed run) with the Ray Train run it ran in: one per search, unless a
    # run ended early (out of memory at several workers, memory left in use, a worker that died).
    probes = pd.DataFrame(
        [
            {
                "trial": r["trial"],
                "status": r["status"],
                "peak_gib": r.get("peak_allocated_gib_max"),
                "run": r.get("run"),
            }
            for r in rows
            if r.get("status") != "skipped"
        ]
    )
    atomic_write(
        out / "fit.md",
        f"# {session.experiment.name}: fit\n\n"
        + "\n".join(f"- {k}: {v}" for k, v in session.provenance.items() if k != "experiment")
        + "\n\n"
        + markdown_table(
            frame.drop(columns=["timed_trial"]), [c for c in frame.columns if c != "timed_trial"]
        )
        + "\n"
        + (
            "\n## Probes, in the order they ran\n\n" + markdown_table(probes, list(probes.columns)) + "\n"
            if not probes.empty
            else ""
        ),
    )
    _write_best(session, frame, by_name)
    write_fit_plot(frame, out / "fit.png")
    write_pages(out, results)  # the sweep's plots and the page, with the fit's section
    publish(out, session.storage)
    return frame.drop(columns=["timed_trial"])


def _write_best(session: Session, frame: pd.DataFrame, rows: dict[str, dict]) -> None:
    """The fastest fitting point's engine config, key for key what its rank 0 was built with, and the
    one-point sweep that reruns it."""
    fitting = frame[frame["samples_per_s"].notna()]
    if fitting.empty:
        return
    out = session.output_dir
    best_ds = {}
    for workers, group in fitting[fitting["backend"] == "deepspeed"].groupby("num_workers"):
        winner = group.sort_values("samples_per_s", ascending=False).iloc[0]
        best_ds[int(workers)] = rows[winner["timed_trial"]]["per_rank"][0]["engine_config"]
    if best_ds:
        only = len(best_ds) == 1
        atomic_write(
            out / "best_ds_config.json",
            json.dumps(
                next(iter(best_ds.values())) if only else {f"{w}_workers": c for w, c in best_ds.items()},
                indent=2,
            ),
        )
    winner = fitting.sort_values("samples_per_s", ascending=False).iloc[0]
    atomic_write(
        out / "best_config.json",
        json.dumps(
            {
                "backend": winner["backend"],
                "stage": int(winner["stage"]),
                "micro_batch_size": int(winner["max_micro_batch"]),
                "num_workers": int(winner["num_workers"]),
                "activation_checkpointing": bool(winner["activation_checkpointing"]),
                "offload_optimizer": winner["offload_optimizer"],
                "samples_per_s": float(winner["samples_per_s"]),
                "engine_config": rows[winner["timed_trial"]]["per_rank"][0]["engine_config"],
            },
            indent=2,
        ),
    )
    point = {
        "backend": [winner["backend"]],
        "stage": [int(winner["stage"])],
        "micro_batch_size": [int(winner["max_micro_batch"])],
        "num_workers": [int(winner["num_workers"])],
        "activation_checkpointing": [bool(winner["activation_checkpointing"])],
        "offload_optimizer": [winner["offload_optimizer"]],
    }
    experiment = session.experiment.model_dump(mode="json") | {
        "name": f"{session.experiment.name}_best",
        "grid": point,
    }
    atomic_write(out / "best_experiment.yaml", yaml.safe_dump(experiment, sort_keys=False))
    atomic_write(out / "best_command.txt", f"python -m ray_zero sweep {out / 'best_experiment.yaml'}\n")
