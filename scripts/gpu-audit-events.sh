# The filelock audit-hook lead on the lent GPU machine (Python 3.12): the seed model's DeepSpeed step
# (stage 1, fp16, one rank) timed without filelock and with it imported first, alternating, R times each;
# then the audit events such a step raises.
#   bash scripts/gpu-audit-events.sh 3
set -u
source scripts/gpu-env.sh
python3 -c "import torch, deepspeed"   # compile and cache the imports once, for both sides
for i in $(seq "${1:-3}"); do
  python3 bench/audit_events.py cuda 2>/dev/null | tail -1
  python3 bench/audit_events.py cuda --filelock 2>/dev/null | tail -1
done | tee "${OUT:-/tmp}/audit-events.jsonl"
