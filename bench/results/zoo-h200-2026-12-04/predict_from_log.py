"""Predicted peaks of the Swin-T / RegNetY-016 runs on one H200 (2026-12-04), whose rows scripts/zoo.py
could not write (a field the row schema refused, since fixed): the code zoo.py runs (trial_row,
finish_row) with the calibration.json that run wrote beside the log, on a GPU's terms; the measured peaks
from its console (3 decimals).

    python bench/results/zoo-h200-2026-12-04/predict_from_log.py bench/results/zoo-h200-2026-12-04/swin_regnet_zoo.log
"""
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[2]))
from ray_zero.config import TrialSpec
from ray_zero.experiment_file import load_experiment
from ray_zero.measure.calibration import read_calibration
from ray_zero.models.describe import describe_model
from ray_zero.rows import finish_row, trial_row
from ray_zero.run.plan import Cluster, plan_sweep

log = Path(sys.argv[1]).read_text()
measured = {}
family = None
for line in log.splitlines():
    m = re.match(r"zoo: (zoo_\w+) (bf16|fp16):", line)
    if m: family = (m.group(1), m.group(2)); continue
    m = re.match(r"zoo:\s+(\S+): ok peak ([\d.]+) GiB", line)
    if m and family: measured[(family, m.group(1))] = float(m.group(2))
for (fam, prec) in sorted({k[0] for k in measured}):
    exp = load_experiment(str(HERE.parents[2] / f"experiments/{fam}.yaml"), [f"precision={prec}"]).with_absolute_paths()
    model = describe_model(exp.model_source())
    plan = plan_sweep(exp, Cluster(gpus=1, cpus=16, source="H200", gpu_memory_gib=139.8))
    cal_dir = HERE / f"{fam}_{prec}"
    cal = read_calibration(cal_dir)
    for p in plan.runnable:
        spec = TrialSpec(exp, p, plan.precision, True, model, "/tmp/x")
        row = trial_row(spec)
        peak = measured.get(((fam, prec), row["trial"]))
        row.update(status="ok", peak_allocated_gib_max=peak)
        row = finish_row(row, cal)
        print(f"{fam} {prec} {row['trial']}: measured {peak} predicted {row.get('predicted_peak_gib'):.3f} ratio {peak/row['predicted_peak_gib']:.3f}  states {row.get('predicted_model_state_gib'):.3f}")
