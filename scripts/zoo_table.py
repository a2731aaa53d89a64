"""README's zoo table from the zoo's result folders (scripts/gpu-zoo.sh): one row per family, one column
per engine, each cell the peak allocated GiB measured (predicted) in bf16 / fp16 (one figure where the two
agree), and the range of measured over predicted.

    python scripts/zoo_table.py results/h200-2026-12-03/zoo
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pandas as pd

FAMILIES = {  # folder stem: the family as README names it
    "zoo_bert_base": "BERT-base MLM, seq 512",
    "zoo_t5_base": "T5-base, seq 512",
    "zoo_llama_1b": "Llama shape, seq 2048",
    "zoo_moe": "Mixtral shape, 8 experts, seq 1024",
    "zoo_vit_b16": "ViT-B/16",
    "zoo_resnet50": "ResNet-50, BatchNorm",
    "zoo_convnext_tiny": "ConvNeXt-T",
}
ENGINES = [  # (backend, stage, column)
    ("deepspeed", 1, "DeepSpeed ZeRO-1"),
    ("deepspeed", 3, "DeepSpeed ZeRO-3"),
    ("fsdp", 3, "FSDP2 (stage 3)"),
    ("torch_zero", 1, "DDP + ZeRO optimizer"),
]
PRECISIONS = ("bf16", "fp16")


def grid_rows(folder: Path) -> pd.DataFrame:
    rows = pd.read_csv(folder / "results.csv")
    return rows[~rows["trial"].str.endswith("_calibration") & (rows["status"] == "ok")]


def table(root: Path) -> tuple[str, list[float], list[str]]:
    """The markdown table, every ratio it shows, and the rows that failed or are missing."""
    lines = [
        "| model (micro-batch) | " + " | ".join(c for _, _, c in ENGINES) + " |",
        "|---|" + "---|" * len(ENGINES),
    ]
    ratios, missing = [], []
    for stem, label in FAMILIES.items():
        runs = {p: grid_rows(root / f"{stem}_{p}") for p in PRECISIONS if (root / f"{stem}_{p}").is_dir()}
        if not runs:
            continue
        first = next(iter(runs.values()))
        params = int(first["params"].iloc[0])
        size = f"{params / 1e9:.1f} B" if params >= 1e9 else f"{params / 1e6:.1f} M"
        cells = []
        for backend, stage, _ in ENGINES:
            parts = []
            for precision in PRECISIONS:
                rows = runs.get(precision)
                row = None if rows is None else rows[(rows.backend == backend) & (rows.stage == stage)]
                if row is None or row.empty:
                    parts.append("-")
                    missing.append(f"{stem} {precision} {backend} {stage}")
                    continue
                r = row.iloc[0]
                ratios.append(r["measured_over_predicted"])
                parts.append(f"{r['peak_allocated_gib_max']:.2f} ({r['predicted_peak_gib']:.2f})")
            cells.append(parts[0] if len(set(parts)) == 1 else " / ".join(parts))  # one figure where alike
        mb = int(first["micro_batch_size"].iloc[0])
        lines.append(f"| {label}, {size} ({mb}) | " + " | ".join(cells) + " |")
    return "\n".join(lines), ratios, missing


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", type=Path, help="the folder holding zoo_FAMILY_PRECISION result folders")
    args = parser.parse_args()
    text, ratios, missing = table(args.root)
    print(text)
    if ratios:
        print(f"\n{len(ratios)} peaks, measured/predicted {min(ratios):.3f}-{max(ratios):.3f}")
    if missing:
        print(f"no ok row: {', '.join(missing)}", file=sys.stderr)
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
