# The 1-GPU throughput gap, with Ray put into the bare process step by step (bench/bare_deepspeed.py's
# switches): bare; bare with Ray's modules imported before torch; bare also connected to a private Ray as
# its driver; and a ray_zero trial. Seed model, stage 1, micro-batch 64, 1 worker, one after another,
# the order turning each round; rounds start while less than LIMIT seconds have passed.
#   bash scripts/gpu-ray-in-bare.sh 1020 460     # 1,000 timed steps a run, rounds until 460 s
set -u
source scripts/gpu-env.sh
STEPS=$1 LIMIT=$2
R=$(mktemp -d /tmp/bench.XXXX)
python3 -c "import torch, deepspeed, ray.train.torch, ray.tune"   # compile and cache the imports once
SET=(--set steps=$STEPS --set warmup_steps=20)
run() {   # $1: variant, $2: round
  case "$1" in
    bare) python3 bench/bare_once.py experiments/quick.yaml --label "round $2 bare" "${SET[@]}" ;;
    import) BARE_IMPORT_RAY=1 python3 bench/bare_once.py experiments/quick.yaml --label "round $2 bare+import-ray" "${SET[@]}" ;;
    init) BARE_RAY_INIT=1 python3 bench/bare_once.py experiments/quick.yaml --label "round $2 bare+ray-init" "${SET[@]}" ;;
    ray) python3 -m ray_zero sweep experiments/quick.yaml "${SET[@]}" --set 'grid.stage=[1]' --set 'grid.num_workers=[1]' \
           --output $R/ray-$2 > $R/ray-$2.log 2>&1
         python3 - "$R/ray-$2/per_rank.csv" "$2" <<'PY'
import sys, pandas as pd
sys.path.insert(0, "bench")
from bench import thread_figures
ranks = pd.read_csv(sys.argv[1]).to_dict("records")
thread = thread_figures(ranks)
print(f"round {sys.argv[2]} ray_zero: {ranks[0]['samples_per_s']:.1f} samples/s, thread CPU "
      f"{thread['thread_cpu_ms_per_step']:.3f} ms a step, blocks {thread['thread_blocks_per_step']:.3f} a step, "
      f"timed {ranks[0]['timed_s']:.2f} s")
PY
         ;;
  esac
}
ORDER=(bare import init ray)
START=$SECONDS round=0
while [ $((SECONDS - START)) -lt "$LIMIT" ]; do
  round=$((round + 1))
  for i in 0 1 2 3; do run "${ORDER[$(( (i + round - 1) % 4 ))]}" $round; done
done 2>&1 | grep -E "^round|Error|rror:" | tee $R/rounds.txt
cd $R && tar czf $OUT/$(basename $R).tgz --exclude='tune' --exclude='train' .
