# The conformance zoo (experiments/zoo_*.yaml) on the lent H200 machine, from the repository root: each
# family at the size its users train, every engine of its grid, calibrated per engine (scripts/zoo.py).
# Leaves one tarball of result folders in $OUT, whatever finished within BUDGET seconds (default 540).
#   bash scripts/gpu-zoo.sh [FAMILY ...]     # FAMILY: zoo_resnet50 zoo_bert_base ... (default: all)
#   PRECISIONS="bf16 fp16" (the default) or one of them
set -u
source scripts/gpu-env.sh   # scripts/zoo.py plans with cluster.py, which imports Ray
FAMILIES=("$@")
[ ${#FAMILIES[@]} -eq 0 ] && FAMILIES=(zoo_llama_1b zoo_moe zoo_t5_base zoo_bert_base zoo_vit_b16 zoo_resnet50 zoo_convnext_tiny)
R=$(mktemp -d /tmp/zoo.XXXX)
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $R/gpu.txt
python3 scripts/zoo.py $(printf 'experiments/%s.yaml ' "${FAMILIES[@]}") --precision ${PRECISIONS:-bf16 fp16} \
  --output $R --budget-s "${BUDGET:-540}" 2>&1 | grep -E "^zoo:|Error|error" | cut -c1-260 | tee $R/zoo.log
cd $R && tar czf $OUT/zoo.tgz . ; echo "zoo: tarball $(du -h $OUT/zoo.tgz | cut -f1)"
