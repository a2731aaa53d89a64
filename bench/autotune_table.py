"""bench/autotune_bench.py's table from what its parts left in OUT: each tool's wall time, experiments, the
largest micro-batch per stage, its answer and that answer's samples/s, read from the tools' own files.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pandas as pd
from common import ROOT, machine, versions

sys.path.insert(0, str(ROOT))

from ray_zero.config import is_calibration  # noqa: E402
from ray_zero.report.frame import markdown_table  # noqa: E402

RUN_FILE = "bench_run.json"
"""How a part ran (its command, wall time, exit code, whether it was stopped), beside its output."""


def _run_info(folder: Path) -> dict:
    path = folder / RUN_FILE
    return json.loads(path.read_text()) if path.is_file() else {}


def _failure(folder: Path, run: dict) -> str:
    """One line saying how a part ended badly ('' when it did not)."""
    if run.get("timed_out"):
        return f"stopped at the time limit after {run['wall_s']} s"
    if run.get("rc") in (0, None):
        return ""
    lines = [
        line.strip()
        for line in folder.with_suffix(".log").read_text(errors="replace").splitlines()
        if line.strip()
    ]
    errors = [line for line in lines if "error" in line.lower()]
    return f"rc {run['rc']}: {(errors or lines or ['no output'])[-1][:200]}"


def _stages_text(best: dict[int, int | None]) -> str:
    return ", ".join(
        f"{stage}: {value if value is not None else '-'}" for stage, value in sorted(best.items())
    )


def read_autotuner(folder: Path, stages: list[int]) -> dict:
    """Experiments, largest micro-batch that ran per stage, the answer and its throughput, from the
    autotuner's own files (results_dir/<experiment>/{exp.json,metrics.json,stderr.log}, summary.txt,
    ds_config_optimal.json); a stopped autotuner's best finished experiment stands in for its answer."""
    from deepspeed.autotuning.utils import search_error  # what the autotuner itself takes as a failure

    results = folder / "autotuning_results"
    run = _run_info(folder)
    row = {
        "tool": "DeepSpeed autotuner (fast, throughput)",
        "wall_s": run.get("wall_s"),
        "command": run.get("command"),
    }
    experiments, notes = [], []
    for exp_file in sorted(results.glob("*/exp.json"), key=lambda p: p.stat().st_mtime):
        exp = json.loads(exp_file.read_text())
        config, result_dir = exp["ds_config"], exp_file.parent
        metrics = result_dir / "metrics.json"
        experiments.append(
            {
                "name": exp["name"],
                "stage": config.get("zero_optimization", {}).get("stage"),
                "micro": config.get("train_micro_batch_size_per_gpu"),
                "gas": config.get("gradient_accumulation_steps", 1),
                "error": search_error(str(result_dir / "stderr.log")),
                "oom": "out of memory" in (result_dir / "stderr.log").read_text(errors="replace").lower()
                if (result_dir / "stderr.log").is_file()
                else False,
                "throughput": json.loads(metrics.read_text())["throughput"] if metrics.is_file() else None,
            }
        )
    tuned = [e for e in experiments if e["name"] != "profile_model_info"]
    ran = [e for e in tuned if e["throughput"] is not None and not e["error"]]
    row["experiments"] = len(experiments)
    row["max_micro_batch"] = _stages_text(
        {s: max((e["micro"] for e in ran if e["stage"] == s), default=None) for s in stages}
    )
    failed = [e for e in tuned if e not in ran]
    other = [e for e in failed if not e["oom"]]
    if experiments:
        notes.append(
            f"incl. the model-info profile run; {len(failed)} of {len(tuned)} tuning runs gave no metric, "
            f"{len(failed) - len(other)} of them out of memory"
            + (
                f" (other: {other[0]['name']}: {(other[0]['error'] or 'no metrics.json')[:120].strip()})"
                if other
                else ""
            )
        )
    optimal = results / "ds_config_optimal.json"
    if optimal.is_file():
        config = json.loads(optimal.read_text())
        answer = (
            config["zero_optimization"]["stage"],
            config["train_micro_batch_size_per_gpu"],
            config.get("gradient_accumulation_steps", 1),
        )
        measured = [e["throughput"] for e in ran if (e["stage"], e["micro"], e["gas"]) == answer]
        row["answer_from"] = "ds_config_optimal.json"
    elif ran:
        best = max(ran, key=lambda e: e["throughput"])
        answer, measured = (best["stage"], best["micro"], best["gas"]), [best["throughput"]]
        row["answer_from"] = "best finished experiment (no ds_config_optimal.json)"
        notes.append("no answer written: its best finished experiment stands in")
    else:
        answer, measured = None, []
    if answer:
        row["stage"], row["micro_batch_size"], row["gradient_accumulation_steps"] = answer
        row["recommended"] = f"stage {answer[0]}, micro-batch {answer[1]}" + (
            f" x {answer[2]} accumulated" if answer[2] != 1 else ""
        )
        row["reported"] = f"{max(measured):.1f} samples/s (DeepSpeed's timers)" if measured else None
    summary = results / "summary.txt"
    if summary.is_file():
        notes.append(
            summary.read_text().strip().splitlines()[-1].strip()
        )  # "Tuning completed in ... experiments: N."
    failure = _failure(folder, run) if run else "not run"
    row["note"] = "; ".join(([failure] if failure else []) + notes)
    return row


def read_fit(folder: Path) -> dict:
    """fit.csv (largest micro-batch per stage, probes, samples/s), best_config.json, results.csv (every
    trial)."""
    run = _run_info(folder)
    row = {"tool": "ray_zero fit", "wall_s": run.get("wall_s"), "command": run.get("command")}
    failure = _failure(folder, run) if run else "not run"
    if (folder / "fit.csv").is_file():
        fit = pd.read_csv(folder / "fit.csv")
        row["experiments"] = len(pd.read_csv(folder / "results.csv"))
        row["max_micro_batch"] = _stages_text(
            {
                int(r.stage): None if pd.isna(r.max_micro_batch) else int(r.max_micro_batch)
                for r in fit.itertuples()
            }
        )
        failure = "; ".join(
            filter(
                None,
                [
                    failure,
                    f"{int(fit['probes'].sum())} probes; "
                    f"{row['experiments'] - int(fit['probes'].sum())} calibration and timing trials",
                ],
            )
        )
    if (folder / "best_config.json").is_file():
        best = json.loads((folder / "best_config.json").read_text())
        row.update(
            stage=best["stage"],
            micro_batch_size=best["micro_batch_size"],
            gradient_accumulation_steps=None,
            recommended=f"stage {best['stage']}, micro-batch {best['micro_batch_size']}",
            reported=f"{best['samples_per_s']:.1f} samples/s (its timed trial)",
            samples_per_s=round(best["samples_per_s"], 1),
            answer_from="best_config.json",
        )
    row["note"] = failure
    return row


def read_sweep(folder: Path) -> tuple[float | None, str]:
    run = _run_info(folder)
    if not (folder / "results.csv").is_file():
        return None, ("timing sweep: " + (_failure(folder, run) or "no results.csv")) if run else ""
    results = pd.read_csv(folder / "results.csv")
    results = results[~results["trial"].map(is_calibration)] if "trial" in results else results
    if results.empty:  # stopped before its trial finished
        return None, "timing sweep: " + (_failure(folder, run) or "no trial finished")
    result = results.iloc[0]
    if result["status"] != "ok":
        return None, f"timing sweep: {result['status']}: {str(result.get('error', ''))[:160]}"
    return round(float(result["samples_per_s"]), 1), ""


def provenance(command: str) -> str:
    found = versions(("torch", "deepspeed", "ray", "transformers"))
    return (
        f"- date: {time.strftime('%Y-%m-%d %H:%M')}\n- machine: {machine()}\n"
        f"- {', '.join(f'{name} {version}' for name, version in found.items())}\n"
        f"- command: python bench/autotune_bench.py {command}\n"
    )


def write_table(out: Path, stages: list[int], command: str) -> pd.DataFrame:
    def guarded(tool: str, read) -> dict:  # a half-written folder costs its own row's figures, not the table
        try:
            return read()
        except Exception as error:
            return {
                "tool": tool,
                "note": f"reading its results failed: {type(error).__name__}: {error}"[:240],
            }

    def autotuner_row() -> dict:
        row = read_autotuner(out / "autotuner", stages)
        row["samples_per_s"], problem = read_sweep(out / "sweep-autotuner")
        row["note"] = "; ".join(filter(None, [row["note"], problem]))
        return row

    rows = []
    if (out / "fit").is_dir():
        rows.append(guarded("ray_zero fit", lambda: read_fit(out / "fit")))
    if (out / "autotuner").is_dir():
        rows.append(guarded("DeepSpeed autotuner (fast, throughput)", autotuner_row))
    columns = [
        "tool",
        "wall_s",
        "experiments",
        "max_micro_batch",
        "recommended",
        "reported",
        "samples_per_s",
        "note",
    ]
    table = pd.DataFrame(rows).reindex(columns=columns + ["answer_from", "command"])
    table.to_csv(out / "autotune_bench.csv", index=False)
    text = (
        f"# fit against DeepSpeed's autotuner: stages {stages}, 1 worker\n\n{provenance(command)}\n"
        "wall_s: the tool's process, start to exit (its answer written); experiments: trials or launches "
        "run; "
        "max_micro_batch: per stage, the largest micro-batch that ran (fit: fitted its budget); "
        "samples_per_s: the answer timed by ray_zero's worker (fit's timed trial; a one-point sweep for the "
        "autotuner's).\n\n"
        + markdown_table(table[columns], columns)
        + "\n\nCommands:\n\n"
        + "".join(
            f"- {r['tool']}: `{r['command']}`\n" for _, r in table.iterrows() if isinstance(r["command"], str)
        )
    )
    sweep = _run_info(out / "sweep-autotuner")
    if sweep:
        text += f"- timing the autotuner's answer: `{sweep['command']}`\n"
    (out / "autotune_bench.md").write_text(text)
    print(text, flush=True)
    return table

