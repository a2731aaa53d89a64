"""Plots of a results table (matplotlib PNGs beside results.csv). Needs neither Ray nor a GPU."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import matplotlib

matplotlib.use("Agg")  # files only: no display on clusters or CI
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402

from ray_zero.report.formatting import SETTING_KEYS, setting_label  # noqa: E402


def _memory_label(frame: pd.DataFrame) -> str:
    return (
        "peak resident memory per worker process (GiB)"
        if set(frame["memory_kind"].dropna()) == {"cpu_rss"}
        else "peak CUDA memory allocated per rank, max over ranks (GiB)"
    )


def _series(frame: pd.DataFrame):
    """One line per engine setting: (label, rows), e.g. "stage 1" or "fsdp stage 3 +ckpt"."""
    for index, (values, group) in enumerate(frame.groupby(SETTING_KEYS, sort=True, dropna=False)):
        yield index, setting_label(dict(zip(SETTING_KEYS, values)), offload_place=False), group


def _title(frame: pd.DataFrame, extra: str) -> str:
    first = frame.iloc[0]
    return f"{first['model']} ({int(first['params']):,} params), {first['precision']}, {extra}"


def _by_workers(frame: pd.DataFrame, path: Path, column: str, ylabel: str, predicted: str | None) -> None:
    micro = frame["micro_batch_size"].min()
    rows = frame[frame["micro_batch_size"] == micro]
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    for index, label, group in _series(rows):
        group = group.sort_values("num_workers")
        color = f"C{index % 10}"
        ax.plot(group["num_workers"], group[column], "o-", color=color, label=f"{label} measured")
        if predicted and set(frame["memory_kind"].dropna()) == {"cuda"}:
            ax.plot(
                group["num_workers"],
                group[predicted],
                "s--",
                color=color,
                alpha=0.7,
                label=f"{label} predicted",
            )
    ax.set_xlabel("workers (data-parallel ranks)")
    ax.set_xticks(sorted(rows["num_workers"].unique()))
    ax.set_ylabel(ylabel)
    ax.set_ylim(bottom=0)
    ax.set_title(_title(rows, f"micro-batch {micro}"), fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _by_batch(frame: pd.DataFrame, path: Path) -> None:
    workers = frame["num_workers"].min()
    rows = frame[frame["num_workers"] == workers]
    fig, (memory, speed) = plt.subplots(1, 2, figsize=(10, 4.2))
    for index, label, group in _series(rows):
        group = group.sort_values("micro_batch_size")
        memory.plot(
            group["micro_batch_size"],
            group["peak_allocated_gib_max"],
            "o-",
            color=f"C{index % 10}",
            label=label,
        )
        speed.plot(
            group["micro_batch_size"], group["samples_per_s"], "o-", color=f"C{index % 10}", label=label
        )
    for ax, label in ((memory, _memory_label(rows)), (speed, "samples/s, all ranks")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("micro-batch size per rank")
        ax.set_ylabel(label, fontsize=8)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(_title(rows, f"{workers} worker(s)"), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_plots(frame: pd.DataFrame, output_dir: Path) -> list[Path]:
    """memory.png and throughput.png (against workers), batch.png when there are several batch sizes."""
    ok = frame[frame["status"] == "ok"]
    if ok.empty:
        return []
    written = [output_dir / "memory.png", output_dir / "throughput.png"]
    _by_workers(ok, written[0], "peak_allocated_gib_max", _memory_label(ok), "predicted_peak_gib")
    _by_workers(ok, written[1], "samples_per_s", "samples/s, summed over ranks", None)
    if ok["micro_batch_size"].nunique() > 1:
        written.append(output_dir / "batch.png")
        _by_batch(ok, written[-1])
    return written


def write_fit_plot(fit: pd.DataFrame, path: Path) -> Optional[Path]:
    """fit.png: the largest micro-batch that fits and its samples/s, against workers, one line per engine
    setting."""
    found = fit[fit["max_micro_batch"].notna()]
    if found.empty:
        return None
    fig, (size, speed) = plt.subplots(1, 2, figsize=(10, 4.2))
    for index, label, group in _series(found):
        group = group.sort_values("num_workers")
        size.plot(group["num_workers"], group["max_micro_batch"], "o-", color=f"C{index % 10}", label=label)
        speed.plot(group["num_workers"], group["samples_per_s"], "o-", color=f"C{index % 10}", label=label)
    for ax, label in ((size, "largest micro-batch that fits"), (speed, "samples/s at it, all ranks")):
        ax.set_xlabel("workers (data-parallel ranks)")
        ax.set_xticks(sorted(found["num_workers"].unique()))
        ax.set_ylabel(label)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"fit within {found['budget_gib'].iloc[0]:.2f} GiB per rank", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
