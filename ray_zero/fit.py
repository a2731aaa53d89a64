"""`python -m ray_zero fit`: the largest micro-batch that fits, for every (engine, stage, workers) of the
grid, and the fastest of them exported as the config to train with.

A Tune `Searcher` runs one `BracketSearch` (ray_zero/fit_search.py) per point: every probe is a real trial
(the same code path as `sweep`), a row of the same tables; probes of different points run side by side
where the cluster has room. Then each point's largest fitting micro-batch is timed for the experiment's
full length. Writes fit.csv, fit.md, best_ds_config.json (the DeepSpeed config the fastest DeepSpeed
rank passed to deepspeed.initialize), best_config.json, best_experiment.yaml + best_command.txt, fit.png.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import pandas as pd
import yaml
from ray.tune.search import Searcher

from ray_zero.config import ConfigError, Experiment, Point
from ray_zero.fit_search import BracketSearch, Steps, largest_predicted_to_fit
from ray_zero.memory_model import GIB, predict_point
from ray_zero import calibration
from ray_zero.report import markdown_table, read_calibration
from ray_zero.store import atomic_write, load_trials
from ray_zero.sweep import Session, SweepIncomplete, calibrate
from ray_zero.trial import trial_config

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
            raise ConfigError("fit on CPU needs --budget-gib G: the peak resident set per worker to stay within")
        return cls(args.budget_gib, args.margin_gib, args.granularity, args.max_micro_batch)

    def budget(self, session: Session) -> float:
        if self.budget_gib is not None:
            return self.budget_gib
        if not session.plan.use_gpu:
            raise ConfigError("fit on CPU needs --budget-gib G: the peak resident set per worker to stay within")
        if not session.cluster.gpu_memory_gib:
            raise ConfigError("fit on a cluster whose GPUs are on other nodes needs --budget-gib G")
        return session.cluster.gpu_memory_gib - self.margin_gib


def _key(point: Point) -> Point:
    return point.replace(micro_batch_size=0)


def first_guess(session: Session, key: Point, budget_gib: float, steps: Steps,
                calibrated: Optional[dict] = None) -> Optional[int]:
    """The largest micro-batch the memory model says fits (GPU, where it predicts activations: the presets'
    shapes, or a calibration), else None."""
    if not session.plan.use_gpu:
        return None

    def predicted(micro: int) -> Optional[float]:
        row = {**_row_of(session, key.replace(micro_batch_size=micro)), "memory_kind": "cuda"}
        peak = predict_point(row, calibrated).peak_bytes
        return None if peak is None else peak / GIB

    return largest_predicted_to_fit(predicted, budget_gib, steps)


def _row_of(session: Session, point: Point) -> dict[str, Any]:
    from ray_zero.rows import trial_row

    return trial_row(session.spec(point))


class FitSearcher(Searcher):
    """Suggests each point's next probe as soon as its last one is back; then one timing run per point."""

    def __init__(self, session: Session, searches: dict[Point, BracketSearch], probe: Experiment, timed: Experiment):
        super().__init__()
        self.session, self.searches, self.probe, self.timed = session, searches, probe, timed
        self.in_flight: dict[str, tuple[Point, str]] = {}  # trial id -> (key, "probe" | "timed")
        self.timing_started: set[Point] = set()
        self.started_at: dict[Point, float] = {}
        self.finished_at: dict[Point, float] = {}

    def set_search_properties(self, metric, mode, config, **spec) -> bool:
        return True  # the searches hold everything; there is no metric to optimise

    def save(self, checkpoint_path: str) -> None:
        """Nothing to save: a resumed fit rebuilds its searches from the probes' rows (trials.jsonl)."""

    def restore(self, checkpoint_path: str) -> None:
        """See save."""

    def _busy(self, key: Point) -> bool:
        return any(k == key for k, _ in self.in_flight.values())

    def suggest(self, trial_id: str):
        for key, search in self.searches.items():
            if self._busy(key) or key in self.timing_started:
                continue
            micro = search.next_probe()
            if micro is not None:
                self.started_at.setdefault(key, time.time())
                self.in_flight[trial_id] = (key, "probe")
                return self._config(key.replace(micro_batch_size=micro), self.probe, "")
            self.finished_at.setdefault(key, time.time())
            self.timing_started.add(key)
            if search.answer is not None and self.timed is not None:
                self.in_flight[trial_id] = (key, "timed")
                return self._config(key.replace(micro_batch_size=search.answer), self.timed, "timed")
        return Searcher.FINISHED if not self.in_flight and len(self.timing_started) == len(self.searches) else None

    def _config(self, point: Point, experiment: Experiment, label: str) -> dict:
        spec = self.session.spec(point, experiment)
        spec = type(spec)(**{**spec.__dict__, "label": label})
        return {"trial": trial_config(spec), "log_name": self.session.log_name}

    def on_trial_complete(self, trial_id: str, result: Optional[dict] = None, error: bool = False) -> None:
        key, role = self.in_flight.pop(trial_id, (None, None))
        if key is None or role != "probe":
            return
        result = result or {}
        micro = result.get("micro_batch_size")
        status = result.get("status", "failed")
        rise = result.get("micro_batch_rise_bytes_per_rank_max") or result.get("saved_for_backward_bytes_per_rank_max")
        per_sample = rise / GIB / micro if rise and micro else None
        if micro is None:
            self.searches[key].stopped = "a probe's trial ended without a result"
        else:
            self.searches[key].record(micro, status, result.get("peak_allocated_gib_max"), per_sample,
                                      result.get("error") or "")


def _searches_from_rows(session: Session, rows: list[dict], budget: float, steps: Steps,
                        calibrated: Optional[dict]) -> dict[Point, BracketSearch]:
    """One search per (engine, stage, workers, ...) point, with the probes a resumed fit already ran."""
    keys = list(dict.fromkeys(_key(p) for p in session.plan.runnable))
    searches = {key: BracketSearch(budget, steps, first_guess(session, key, budget, steps, calibrated)) for key in keys}
    for row in rows:
        key = Point(row["backend"], row["stage"], 0, row["num_workers"], bool(row["activation_checkpointing"]),
                    row["offload_optimizer"])
        if key in searches and not row["trial"].endswith(("_timed", "_calibration")):
            searches[key].record(row["micro_batch_size"], row["status"], row.get("peak_allocated_gib_max"),
                                 error=row.get("error") or "")
    return searches


def run_fit(experiment: Experiment, output_dir: Path, model, settings: FitSettings, address: Optional[str] = None,
            resume: bool = False, diagnostics: bool = False, verbose: bool = False, command: Optional[str] = None):
    """Search, time, write the fit tables and the best configs; return the results table."""
    sizes = experiment.grid.micro_batch_size
    with Session(experiment, model, output_dir, address, command, resume, diagnostics, verbose) as session:
        budget = settings.budget(session)
        largest = min(settings.max_micro_batch, max(sizes)) if len(sizes) > 1 else settings.max_micro_batch
        steps = Steps(settings.granularity, largest)
        probe_steps = min(PROBE_STEPS, session.experiment.steps or PROBE_STEPS)
        probe = session.experiment.probe(probe_steps)
        calibrated = read_calibration(session.output_dir)
        if calibrated is None and calibration.wanted(session.experiment, session.plan.use_gpu):
            calibrated = calibrate(session)
        searches = _searches_from_rows(session, load_trials(session.output_dir) if resume else [], budget, steps,
                                       calibrated)
        print(f"ray_zero: fit: {len(searches)} searches for the largest micro-batch within {budget:.2f} GiB per rank "
              f"on {'GPU' if session.plan.use_gpu else 'CPU'}, {session.plan.precision}; results in {session.output_dir}",
              flush=True)
        # The probes' own rates serve when the experiment is no longer than a probe; else each answer is timed.
        timed = session.experiment if (session.experiment.steps or 10 ** 9) > probe_steps else None
        searcher = FitSearcher(session, searches, probe, timed)
        session.resume = False  # a resumed fit starts a new Tuner from the searches' recorded probes
        started = time.time()
        session.tuner({}, None, search_alg=searcher, tune_name=f"tune-fit-{int(started)}").fit()
        frame = session.finish()
        fit_table = write_fit(session, searches, searcher, budget)
        if any(search.next_probe() is not None for search in searches.values()):
            raise SweepIncomplete(len(frame), len(frame) + 1)
        print(markdown_table(fit_table, list(fit_table.columns)), flush=True)
        return frame


def write_fit(session: Session, searches: dict[Point, BracketSearch], searcher: FitSearcher, budget: float) -> pd.DataFrame:
    rows = {row["trial"]: row for row in load_trials(session.output_dir)}
    table = []
    for key, search in searches.items():
        answer = search.answer
        timed = rows.get(key.replace(micro_batch_size=answer).name + "_timed") if answer else None
        probe = rows.get(key.replace(micro_batch_size=answer).name) if answer else None
        table.append({
            "backend": key.backend, "stage": key.stage, "num_workers": key.num_workers,
            "activation_checkpointing": key.activation_checkpointing, "offload_optimizer": key.offload_optimizer,
            "max_micro_batch": answer, "peak_gib": (probe or {}).get("peak_allocated_gib_max"), "budget_gib": budget,
            "predicted_max": search.first_guess, "samples_per_s": (timed or probe or {}).get("samples_per_s"),
            "probes": len(search.probes) + (1 if search.stopped else 0),
            "search_s": searcher.finished_at.get(key, time.time()) - searcher.started_at.get(key, time.time()),
            "note": search.stopped or ("" if answer else "does not fit at the smallest micro-batch"),
            "timed_trial": (timed or probe or {}).get("trial")})
    frame = pd.DataFrame(table)
    out = session.output_dir
    atomic_write(out / "fit.csv", frame.drop(columns=["timed_trial"]).to_csv(index=False))
    atomic_write(out / "fit.md", f"# {session.experiment.name}: fit\n\n" + "\n".join(
        f"- {k}: {v}" for k, v in session.provenance.items() if k != "experiment") + "\n\n"
        + markdown_table(frame.drop(columns=["timed_trial"]), [c for c in frame.columns if c != "timed_trial"]) + "\n")
    _write_best(session, frame, rows)
    from ray_zero.html_report import write_html_report
    from ray_zero.plots import write_fit_plot

    write_fit_plot(frame, out / "fit.png")
    write_html_report(out)  # again, now with the fit's section
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
        atomic_write(out / "best_ds_config.json", json.dumps(next(iter(best_ds.values())) if only else
                                                               {f"{w}_workers": c for w, c in best_ds.items()}, indent=2))
    winner = fitting.sort_values("samples_per_s", ascending=False).iloc[0]
    atomic_write(out / "best_config.json", json.dumps({
        "backend": winner["backend"], "stage": int(winner["stage"]), "micro_batch_size": int(winner["max_micro_batch"]),
        "num_workers": int(winner["num_workers"]), "activation_checkpointing": bool(winner["activation_checkpointing"]),
        "offload_optimizer": winner["offload_optimizer"], "samples_per_s": float(winner["samples_per_s"]),
        "engine_config": rows[winner["timed_trial"]]["per_rank"][0]["engine_config"]}, indent=2))
    point = {"backend": [winner["backend"]], "stage": [int(winner["stage"])],
             "micro_batch_size": [int(winner["max_micro_batch"])], "num_workers": [int(winner["num_workers"])],
             "activation_checkpointing": [bool(winner["activation_checkpointing"])],
             "offload_optimizer": [winner["offload_optimizer"]]}
    experiment = session.experiment.model_dump(mode="json") | {"name": f"{session.experiment.name}_best", "grid": point}
    atomic_write(out / "best_experiment.yaml", yaml.safe_dump(experiment, sort_keys=False))
    atomic_write(out / "best_command.txt", f"python -m ray_zero sweep {out / 'best_experiment.yaml'}\n")
