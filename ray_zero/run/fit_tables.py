"""fit's tables and files from its rows: fit.csv and fit.md (each setting's answer, its probes and the
run each ran in), best_ds_config.json, best_config.json, best_experiment.yaml + best_command.txt, fit.png,
and the report page with its fit section."""

from __future__ import annotations

import json
from typing import Any

import pandas as pd
import yaml

from ray_zero.config import Point
from ray_zero.measure.search import TARGETS, BracketSearch, Steps
from ray_zero.report.frame import markdown_table
from ray_zero.report.tables import write_pages
from ray_zero.run.search_trial import is_probe, recorded
from ray_zero.run.session import Session
from ray_zero.store import atomic_write, publish


def key_of_point(point: Point, target: str = "micro_batch") -> Point:
    """A search's key: its point with the searched value (micro-batch, or seq_len) zeroed."""
    return point.replace(**{TARGETS[target]: 0})


def key_of_row(row: dict[str, Any], target: str = "micro_batch") -> Point:
    point = Point(
        row["backend"],
        row["stage"],
        row["micro_batch_size"],
        row["num_workers"],
        bool(row["activation_checkpointing"]),
        row["offload_optimizer"],
        row.get("seq_len"),
    )
    return key_of_point(point, target)


def keys_of(session: Session, target: str = "micro_batch") -> list[Point]:
    return list(dict.fromkeys(key_of_point(p, target) for p in session.plan.runnable))


def _search_of(rows: list[dict], budget: float, steps: Steps, field: str) -> BracketSearch:
    found = BracketSearch(budget, steps)
    for row in rows:
        probe = recorded(row, field)
        found.record(probe.micro_batch_size, probe.status, probe.peak_gib, probe.per_sample_gib, probe.error)
    return found


def write_fit(
    session: Session,
    rows: list[dict],
    budget: float,
    steps: Steps,
    results: pd.DataFrame,
    target: str = "micro_batch",
) -> pd.DataFrame:
    """fit.csv, fit.md, the best configs, report.html and its figure files; the fit table: per setting the
    largest micro-batch (max_micro_batch; at each seq_len of an axis) or, with target seq_len, the longest
    sequence at its micro-batch (max_seq_len)."""
    by_name = {row["trial"]: row for row in rows}
    field = TARGETS[target]
    axis = target == "micro_batch" and len(session.experiment.seq_lens()) > 1
    table = []
    for key in keys_of(session, target):
        mine = [r for r in rows if key_of_row(r, target) == key]
        probes = [r for r in mine if is_probe(r)]
        search = _search_of(probes, budget, steps, field)
        answer = search.answer
        timed = by_name.get(key.replace(**{field: answer}).name + "_timed") if answer else None
        probe = by_name.get(key.replace(**{field: answer}).name) if answer else None
        guesses = [r.get("first_guess") for r in probes if r.get("first_guess") is not None]
        searched = [r for r in mine if not r["trial"].endswith("_timed")]
        started = min((r.get("search_started_at") or r["recorded_at"] for r in mine), default=None)
        smallest = "sequence" if target == "seq_len" else "micro-batch"
        table.append(
            {
                "backend": key.backend,
                "stage": key.stage,
                "num_workers": key.num_workers,
                "activation_checkpointing": key.activation_checkpointing,
                "offload_optimizer": key.offload_optimizer,
                **({"seq_len": key.seq_len} if axis else {}),
                **({"micro_batch_size": key.micro_batch_size} if target == "seq_len" else {}),
                f"max_{target}": answer,
                "peak_gib": (probe or {}).get("peak_allocated_gib_max"),
                "budget_gib": budget,
                "predicted_max": guesses[0] if guesses else None,
                "samples_per_s": (timed or probe or {}).get("samples_per_s"),
                "probes": len(search.probes) + (1 if search.stopped else 0),
                "runs": len({r.get("run") for r in mine if r.get("run")}),
                "search_s": max(r["recorded_at"] for r in searched) - started if searched else None,
                "note": search.stopped or ("" if answer else f"does not fit at the smallest {smallest}"),
                "timed_trial": (timed or probe or {}).get("trial"),
            }
        )
    frame = pd.DataFrame(table)
    out = session.output_dir
    atomic_write(out / "fit.csv", frame.drop(columns=["timed_trial"]).to_csv(index=False))
    # Each probe (and calibration or timed run) with the Ray Train run it ran in: one per search, or per
    # group of searches that share a run, unless a run ended early (out of memory at several workers,
    # memory left in use, a worker that died).
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
        + "\n\npredicted_max: where the search started, the largest size whose predicted peak at its error "
        "band's upper end is within budget_gib (the band: trials.jsonl's predicted_band).\n\n"
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
    _write_best(session, frame, by_name, target)
    write_pages(out, results)  # the page and its figure files, fit.png with them
    publish(out, session.storage)
    return frame.drop(columns=["timed_trial"])


def _write_best(session: Session, frame: pd.DataFrame, rows: dict[str, dict], target: str) -> None:
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
    # The winner's point: its answer in the searched field, the rest as its search had them.
    micro = int(winner["micro_batch_size" if target == "seq_len" else "max_micro_batch"])
    seq_len = winner.get("max_seq_len" if target == "seq_len" else "seq_len")
    lengths = {"seq_len": int(seq_len)} if seq_len is not None and pd.notna(seq_len) else {}
    atomic_write(
        out / "best_config.json",
        json.dumps(
            {
                "backend": winner["backend"],
                "stage": int(winner["stage"]),
                "micro_batch_size": micro,
                **lengths,
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
        "micro_batch_size": [micro],
        "num_workers": [int(winner["num_workers"])],
        "activation_checkpointing": [bool(winner["activation_checkpointing"])],
        "offload_optimizer": [winner["offload_optimizer"]],
    }
    experiment = session.experiment.model_dump(mode="json") | {
        "name": f"{session.experiment.name}_best",
        "grid": point,
        **lengths,
    }
    atomic_write(out / "best_experiment.yaml", yaml.safe_dump(experiment, sort_keys=False))
    atomic_write(out / "best_command.txt", f"python -m ray_zero sweep {out / 'best_experiment.yaml'}\n")
