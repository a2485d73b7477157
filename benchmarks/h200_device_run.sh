#!/usr/bin/env bash
# The one command for a lent H200 (the device tool's `run`, from the repo root,
# timeout_s 580):
#
#   bash benchmarks/h200_device_run.sh
#
# writes under $OUT:
#   env.txt                GPU, driver, python and package versions
#   selfcheck_T<T>.json/.log  k3jax selfcheck --tune first: every kernel configuration
#                          of the K3 MoE layer on this GPU (tp 1, T 16 / 256 / 4096
#                          tokens) checked against XLA (verdict, max relative
#                          error) and its candidate tilings timed, SELFCHECK_BUDGET
#                          (default 120 s) with the exports;
#                          the cache under $OUT/k3jax-cache
#   tuned_tiles_T<T>.json  the tuned picks in tile_table.json's format (k3jax tune
#                          --export, read back from that cache: no new timing)
#   headline.json/.md/.log the headline subset first (EP 16 at 16 / 256 / 4096 /
#                          16384 tokens, MLP tp 1 and 8 at T 8 and 2048), 150 s;
#                          both 256-token rows time their x-lean decode tiling
#                          (the x_lean peer) beside the launcher's pick; the
#                          MXFP4 decode rows (16 / 256 tokens: the packed
#                          kernel, the bf16 kernel, dequantize + XLA) run
#                          right after the MLP rows (--mxfp4-decode-first)
#   checks.json/.log       benchmarks.gpu_kernel_checks: correctness on the device (f32,
#                          NaN tails, empty groups, padding, prefill tiles,
#                          two runs bitwise equal), with ptxas's register and
#                          spill report (MOSAIC_GPU_DUMP_PTXAS=1); spills.txt
#   gpu.json/.md/.log      benchmarks.kernel_sweep --keep-going: the timed sweep (every
#                          config compiled before any is timed; compile and
#                          run time per row; the cost model's prediction in
#                          each row; XLA baselines too big for the GPU skipped)
#   serialized.txt         ptxas warnings that a WGMMA was serialized (fails)
#   gpu.png                the plot, when matplotlib is there
#
# Each step has its own timeout, so a hang costs that step, not the run: the
# selfcheck 120 s, the headline 150 s, the checks 150 s, the sweep TIME_BUDGET
# (default 90 s) to start configs plus 120 s to finish one: about 580 s in all. The sweep runs even when the
# checks fail or time out: it checks every output itself.
# gpu.json / gpu.md are rewritten after every row. Pre-flight on the CPU
# first: python -m benchmarks.lower_check
set -uo pipefail
out="${OUT:?OUT must name the output folder}"
python="${PYTHON:-python3}"
budget="${TIME_BUDGET:-90}"
# selfcheck + tune exports share one clock
SELFCHECK_BUDGET="${SELFCHECK_BUDGET:-120}"
cd "$(dirname "${BASH_SOURCE[0]}")/.."

{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
  "$python" - <<'EOF'
import importlib.metadata as md
import sys

import jax

print("python", sys.version.split()[0])
for package in ("jax", "jaxlib", "flax", "numpy", "torch", "matplotlib"):
    try:
        print(package, md.version(package))
    except md.PackageNotFoundError:
        print(package, "not installed")
print("devices", jax.devices())
EOF
} >"$out/env.txt" 2>&1
cat "$out/env.txt"

export K3JAX_CACHE_DIR="$out/k3jax-cache"
selfcheck_start=$SECONDS
for tokens in 16 256 4096; do
  left=$((SELFCHECK_BUDGET - (SECONDS - selfcheck_start)))
  [ "$left" -le 10 ] && { echo "# selfcheck: no time left for T $tokens"; break; }
  PYTHONPATH=. K3JAX_TUNE_REPEATS=10 timeout "$left" "$python" -m k3jax selfcheck --tune \
    --preset k3 --layer 1 --tokens "$tokens" --json \
    >"$out/selfcheck_T$tokens.json" 2>"$out/selfcheck_T$tokens.log"
  echo "# selfcheck --tune T $tokens exit $?"; tail -3 "$out/selfcheck_T$tokens.log"
  left=$((SELFCHECK_BUDGET - (SECONDS - selfcheck_start)))
  [ "$left" -le 5 ] && { echo "# selfcheck: no time left to export T $tokens"; break; }
  PYTHONPATH=. timeout "$left" "$python" -m k3jax tune --preset k3 --layer 1 --tokens "$tokens" \
    --json --export "$out/tuned_tiles_T$tokens.json" >/dev/null 2>>"$out/selfcheck_T$tokens.log"
done
# The benchmarks below check every output themselves: no check on first use there.
export K3JAX_SELFCHECK=0

PYTHONPATH=. timeout 150 "$python" -m benchmarks.kernel_sweep --keep-going --time-budget 90 \
  --ep 16 --tokens 16 256 4096 16384 --tp 1 8 --mlp-tokens 8 2048 --mxfp4-decode-first \
  --json "$out/headline.json" --markdown "$out/headline.md" >"$out/headline.log" 2>&1
headline=$?
tail -25 "$out/headline.log"
echo "# headline exit $headline"

MOSAIC_GPU_DUMP_PTXAS=1 PYTHONPATH=. timeout 150 "$python" -m benchmarks.gpu_kernel_checks \
  --json "$out/checks.json" >"$out/checks.log" 2>&1
checks=$?
grep -v "^ptxas info\|^ptxas .*Compiling\|Used [0-9]* registers" "$out/checks.log" | tail -40
grep -i "spill\|Used [0-9]* registers" "$out/checks.log" | sort | uniq -c >"$out/spills.txt"
echo "# gpu_kernel_checks exit $checks; register/spill lines: $(wc -l <"$out/spills.txt")"

grep -i "wgmma.*serializ\|serializ.*wgmma" "$out/checks.log" "$out/headline.log" >"$out/serialized.txt"
if [ -s "$out/serialized.txt" ]; then
  echo "# FAIL: ptxas serialized a WGMMA:"; head -5 "$out/serialized.txt"
  [ "$checks" -eq 0 ] && checks=1
fi
[ "$checks" -eq 124 ] && echo "# the correctness pass timed out: running the sweep anyway"
PYTHONPATH=. timeout $((budget + 120)) "$python" -m benchmarks.kernel_sweep --keep-going \
  --time-budget "$budget" --json "$out/gpu.json" --markdown "$out/gpu.md" 2>&1 | tee "$out/gpu.log"
status="${PIPESTATUS[0]}"
if [ -f "$out/gpu.json" ]; then  # matplotlib may be missing there: then plot after fetching
  PYTHONPATH=. "$python" -m benchmarks.plot_gpu_kernels "$out/gpu.json" -o "$out/gpu.png" \
    || echo "no plot here; run python -m benchmarks.plot_gpu_kernels on the fetched gpu.json"
fi
[ "$checks" -ne 0 ] && [ "$status" -eq 0 ] && status="$checks"
[ "$headline" -ne 0 ] && [ "$status" -eq 0 ] && status="$headline"
exit "$status"
