# A ray_zero rank's threads while it trains, with and without hold_main_thread (2-core CPU machine):
#   bash bench/results/thread-wakes-cpu-2core/run.sh > bench/results/thread-wakes-cpu-2core/wakes.txt
# Seed model, stage 1, 1 worker, micro-batch 2 (a ~9 ms host-bound step), 6,000 timed steps; the
# rank's threads are read over 5 s, 45 s after the sweep starts (in the timed steps, which end after 70 s).
for hold in false true; do
  out=$(mktemp -d /tmp/wakes.XXXX) && rmdir "$out"
  python -m ray_zero sweep experiments/quick.yaml --set steps=6020 --set warmup_steps=20 --set 'grid.stage=[1]' \
    --set 'grid.num_workers=[1]' --set 'grid.micro_batch_size=[2]' --set hold_main_thread=$hold \
    --output "$out" > "$out.log" 2>&1 &
  sleep 45
  echo "## hold_main_thread=$hold"
  rank=$(pgrep -f 'ray::RayTrainWorker' | head -1)
  python bench/thread_wakes.py "$rank" 5 --top 8
  echo "main thread, 0.1 s of its system calls (strace):"   # Ray's task loop re-arms a 10 ms timer
  timeout 0.1 strace -p "$rank" -tt 2>&1 | grep -E "timerfd_settime|futex" | head -6
  wait
  python -c "import pandas as pd; r = pd.read_csv('$out/per_rank.csv').iloc[0]; \
print(f'training thread over the timed steps: {r.timed_voluntary_switches / r.timed_steps:.3f} blocks a step, ' \
      f'{r.samples_per_s:.1f} samples/s, main thread held: {r.main_thread_held}')"
  rm -rf "$out" "$out.log"
done
