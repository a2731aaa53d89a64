# The control for `bench.py --throughput --side-by-side`: bare against bare, both at once, one per GPU,
# R times. Their ratio (GPU 1 / GPU 0) is what the side-by-side method gives with no Ray in it.
#   bash scripts/gpu-bare-pair.sh 4 --set steps=1220 --set warmup_steps=20   # seed model, stage 1, 1 GPU each
set -u
source scripts/gpu-env.sh
REPEATS=$1; shift
python3 -c "import torch, deepspeed"   # compile and cache the imports once, for both sides
for i in $(seq "$REPEATS"); do
  CUDA_VISIBLE_DEVICES=0 python3 bench/bare_once.py experiments/quick.yaml --label "repeat $i, GPU 0" "$@" > /tmp/pair0 2>/tmp/pair0.err &
  CUDA_VISIBLE_DEVICES=1 python3 bench/bare_once.py experiments/quick.yaml --label "repeat $i, GPU 1" "$@" > /tmp/pair1 2>/tmp/pair1.err &
  wait
  cat /tmp/pair0 /tmp/pair1
  python3 - <<'PY'
import re, sys
sys.path[:0] = [".", "bench"]
from bench import timed_overlap
rows = [open(f"/tmp/pair{g}").read() for g in (0, 1)]
rate = [float(re.search(r": ([\d.]+) samples/s", r).group(1)) for r in rows]
span = [tuple(map(float, re.search(r"from ([\d.]+) to ([\d.]+)", r).groups())) for r in rows]
print(f"  ratio GPU 1 / GPU 0: {rate[1] / rate[0]:.4f}, timed_overlap {timed_overlap(*span):.2f}", flush=True)
PY
done 2>&1 | tee "${OUT:-/tmp}/bare-pair.txt"
