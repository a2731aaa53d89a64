# Why is the seed model (a host-bound 12 ms step) 2-10 % slower under Ray Train than bare, paired
# (bench/results/throughput-seed-h200x2)? On the lent 2 x H200 machine: Ray Train's start-up profile
# (cut 6), then seed model, stage 1, 1 GPU: bare, bare training in a second thread, a ray_zero trial
# with py-spy sampling which of the worker's threads hold the GIL, bare again.
#   bash scripts/gpu-host-bound.sh           # the above
#   bash scripts/gpu-host-bound.sh order     # bare and bare-in-a-thread alternating, then ray_zero, then bare:
#                                            # drift over the call against the thread's own cost
set -u
source scripts/gpu-env.sh
R=$(mktemp -d /tmp/hb.XXXX)
python3 -c "import torch, deepspeed, ray.train.torch"   # compile and cache the imports once
command -v py-spy || echo "no py-spy"
MODE=${1:-profile}
[ "$MODE" = profile ] && timeout 150 python3 bench/startup_profile.py experiments/quick.yaml --set 'grid.stage=[1]' --set 'grid.num_workers=[2]' \
  --output $R/startup-seed-w2 > $R/startup.log 2>&1; echo "profile rc=$?"
S="experiments/quick.yaml"; SS="steps=1520 warmup_steps=20"
bare() {  # label
  python3 bench/bare_once.py $S --label "$1" --workers 1 $(printf -- '--set %s ' $SS) 2>>$R/bare.err | tee -a $R/results.txt
}
spy() {  # wait for the trial's worker, then sample it inside its timed window
  local pid=""
  for _ in $(seq 120); do pid=$(pgrep -f "ray::RayTrainWorker" | head -1); [ -n "$pid" ] && break; sleep 0.5; done
  [ -z "$pid" ] && { echo "no worker found" > $R/spy.txt; return; }
  sleep 24
  py-spy dump --pid $pid > $R/dump.txt 2>&1
  py-spy record --pid $pid --nonblocking --gil --threads --duration 8 --rate 200 --format raw -o $R/gil.txt > $R/spy.txt 2>&1
  py-spy record --pid $pid --nonblocking --threads --idle --duration 4 --rate 100 --format raw -o $R/all.txt >> $R/spy.txt 2>&1
}
busy() { echo "-- $1: busiest processes"; top -b -n 1 -o %CPU | sed -n 7,14p | cut -c1-110; echo "ray processes: $(pgrep -c -f 'ray::|raylet|gcs_server')"; }
if [ "$MODE" = order ]; then
  busy start
  for i in 1 2; do
    bare "seed w1 bare ($i)"
    ( export BARE_TRAIN_THREAD=1; bare "seed w1 bare, training thread ($i)" )
  done
else
  bare "seed w1 bare"
  ( export BARE_TRAIN_THREAD=1; bare "seed w1 bare, training thread" )
fi
command -v py-spy > /dev/null && spy & python3 -m ray_zero sweep $S --set 'grid.stage=[1]' --set 'grid.num_workers=[1]' --set steps=1520 --set warmup_steps=20 \
  --output $R/seed-ray > $R/seed-ray.log 2>&1; wait
echo "seed w1 ray_zero: $(grep '^ray_zero: stage' $R/seed-ray.log)" | tee -a $R/results.txt
busy "after the sweep" | tee -a $R/results.txt
bare "seed w1 bare again"
grep -A12 "controller log" $R/startup-seed-w2/startup.md | head -8
python3 - "$R" <<'PY'
import collections, re, sys
for name in ("gil", "all"):
    try: lines = open(f"{sys.argv[1]}/{name}.txt").read().splitlines()
    except OSError: print(name, "missing"); continue
    per_thread = collections.Counter()
    for line in lines:
        stack, _, count = line.rpartition(" ")
        per_thread[stack.split(";")[0]] += int(count)
    total = sum(per_thread.values())
    print(f"{name}: {total} samples")
    for thread, n in per_thread.most_common(8): print(f"  {n / total:6.1%}  {thread[:120]}")
PY
cd $R && tar czf $OUT/hb.tgz --exclude='tune' --exclude='train' .
