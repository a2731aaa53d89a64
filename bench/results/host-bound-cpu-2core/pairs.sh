# Seed model, stage 1, micro-batch 2 (a host-bound ~9 ms step on the 2-core CPU machine), 1 worker: bare
# (bench/bare_once.py: torchrun) and a one-trial ray_zero sweep, alternating; prints samples/s and, from the
# rank's record, the timed steps' wall time, the training thread's CPU time and the collector's time.
# Run from the repository root: bash bench/results/host-bound-cpu-2core/pairs.sh
S="--set steps=1520 --set warmup_steps=20"
bare() { /work/venv/bin/python bench/bare_once.py experiments/quick.yaml --label bare --micro-batch 2 $S 2>&1 | grep "^bare" | cut -d, -f1,2; f=$(ls -td /tmp/tmp*/ | head -1); /work/venv/bin/python -c "
import json,sys; r=json.load(open('${f}stage1_mb2_w1.out.json'))['ranks'][0]; print({k: round(r[k],3) for k in ['timed_s','timed_thread_cpu_s','timed_gc_s']})" 2>&1 | tail -1; }
rz() { rm -rf /tmp/gc-sweep; /work/venv/bin/python -m ray_zero sweep experiments/quick.yaml $S --set 'grid.stage=[1]' --set 'grid.num_workers=[1]' --set 'grid.micro_batch_size=[2]' --output /tmp/gc-sweep 2>&1 | grep -o "ok; .*samples/s" ; /work/venv/bin/python -c "
import pandas as pd; r=pd.read_csv('/tmp/gc-sweep/per_rank.csv').iloc[0]; print({k: round(r[k],3) for k in ['timed_s','timed_thread_cpu_s','timed_gc_s']})"; }
for o in rz bare bare rz rz bare bare rz; do echo "$o: $($o)"; done
