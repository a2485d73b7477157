#!/usr/bin/env bash
# The one command for a lent H200 (the device tool's `run`, from the repo root):
#
#   bash benchmarks/h200_device_run.sh   # writes $OUT/{env.txt,gpu.json,gpu.md,gpu.log,gpu.png}
#
# Environment first (GPU, driver, jax/jaxlib/flax versions), then the kernel
# benchmark with --keep-going, so one wrong or failing kernel costs its row,
# not the run. gpu.json / gpu.md are rewritten after every row: a run cut
# short by the device time limit still brings back what it measured.
# Pre-flight on the CPU first: python benchmarks/gpu_kernels.py --lower-only
set -uo pipefail
out="${OUT:?OUT must name the output folder}"
python="${PYTHON:-python3}"
cd "$(dirname "${BASH_SOURCE[0]}")/.."

{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
  "$python" - <<'EOF'
import importlib.metadata as md
import sys

import jax

print("python", sys.version.split()[0])
for package in ("jax", "jaxlib", "flax", "numpy", "torch"):
    try:
        print(package, md.version(package))
    except md.PackageNotFoundError:
        print(package, "not installed")
print("devices", jax.devices())
EOF
} >"$out/env.txt" 2>&1
cat "$out/env.txt"

PYTHONPATH=. "$python" benchmarks/gpu_kernels.py --keep-going --time-budget "${TIME_BUDGET:-420}" \
  --json "$out/gpu.json" --markdown "$out/gpu.md" 2>&1 | tee "$out/gpu.log"
status="${PIPESTATUS[0]}"
if [ -f "$out/gpu.json" ]; then  # matplotlib may be missing there: then plot after fetching
  "$python" benchmarks/plot_gpu_kernels.py "$out/gpu.json" -o "$out/gpu.png" \
    || echo "no plot here; run benchmarks/plot_gpu_kernels.py on the fetched gpu.json"
fi
exit "$status"
