# Is a ray_zero rank slower than bare DeepSpeed because of what runs inside it, or because of the Ray
# processes beside it? On the 2-core CPU machine, with the seed model host-bound (stage 1, micro-batch 2,
# 2,500 timed steps, one worker), three ways, alternating:
#   bare    : bare DeepSpeed under torchrun, no Ray on the machine (as bench.py runs it)
#   bare+ray: the same while an idle Ray (`ray start --head`) runs on the machine
#   ray_zero: a ray_zero sweep of the same point on that Ray (`--address auto`)
#   bash bench/results/cluster-load-cpu-2core/run.sh > bench/results/cluster-load-cpu-2core/runs.txt
set -u
W=$(mktemp -d /tmp/cluster-load.XXXX)
SET="--set grid.num_workers=[1] --set grid.stage=[1] --set grid.micro_batch_size=[2] --set steps=2520 --set warmup_steps=20"
python - "$W/trial.json" <<'PY'   # what a ray_zero trial gets for this point, as bench.run_bare writes it
import json, sys
from ray_zero.config import load_experiment
e = load_experiment("experiments/quick.yaml", ["grid.num_workers=[1]", "grid.stage=[1]", "grid.micro_batch_size=[2]",
                                               "steps=2520", "warmup_steps=20"])
json.dump({"experiment": e.model_dump(mode="json"), "point": e.grid.points()[0], "precision": "fp32", "use_gpu": False},
          open(sys.argv[1], "w"))
PY
bare() {  # $1: label
  OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone --nproc_per_node 1 bench/bare_deepspeed.py \
    "$W/trial.json" "$W/bare.json" > "$W/bare.log" 2>&1
  python -c "import json; r = json.load(open('$W/bare.json'))['ranks'][0]; \
print(f'$1: {r[\"samples_per_s\"]:.1f} samples/s, training thread {r[\"timed_thread_cpu_s\"] / r[\"timed_steps\"] * 1e3:.2f} ms CPU a step')"
}
for run in 1 2 3; do
  echo "## run $run"
  bare "bare    "
  ray start --head --num-cpus 2 --include-dashboard=false > "$W/ray-start.log" 2>&1
  bare "bare+ray"
  rm -rf "$W/sweep"
  python -m ray_zero sweep experiments/quick.yaml --address auto $SET --output "$W/sweep" > "$W/sweep.log" 2>&1
  python -c "import pandas as pd; r = pd.read_csv('$W/sweep/per_rank.csv').iloc[0]; \
print(f'ray_zero: {r.samples_per_s:.1f} samples/s, training thread {r.timed_thread_cpu_s / r.timed_steps * 1e3:.2f} ms CPU a step')"
  ray stop > /dev/null 2>&1
done
rm -rf "$W"
