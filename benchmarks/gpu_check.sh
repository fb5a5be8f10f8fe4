#!/usr/bin/env bash
# The coordinator on a GPU, for a machine with one CUDA device and the checkout installed
# (pip install -e ".[all]"): first tests/test_gpu.py (the server side and the estimator's calibration with
# --device cuda, against the CPU), then the accuracy benchmark's `--preset gpu` (FedSGA against static at p_ref,
# Dirichlet(0.1), all of CIFAR-10 at width 1.0, sized by estimate to ~8 minutes), then the figures to record
# in benchmarks/RESULTS.md: the GPU, torch and CUDA versions, each run's wall time and seconds per round, its
# accuracy, the peak GPU memory, and a report of the runs.
#
#   benchmarks/gpu_check.sh [--data CIFAR10.npz] [--out runs/gpu_check] [accuracy.py's options ...]
#
# CIFAR-10 comes from accuracy.py's default npz (~/.cache/fedsga-edge/cifar10.npz) or --data (an npz as README.md
# "Data" describes, or `--data cifar10 --data-root DIR` for torchvision's layout); a GPU machine that cannot reach
# the network needs it copied over first. Exit status: 0 done, 1 a failure, 77 no CUDA device here.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
OUT=runs/gpu_check
args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --out) OUT=$2; shift 2 ;;
    *) args+=("$1"); shift ;;
  esac
done

if ! "$PYTHON" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  echo "gpu check not run: torch sees no CUDA device on this machine"; exit 77
fi
"$PYTHON" - <<'EOF'
import torch
p = torch.cuda.get_device_properties(0)
print(f"[gpu] {p.name}, {p.total_memory / 2**30:.1f} GiB, compute capability {p.major}.{p.minor}; "
      f"torch {torch.__version__}, CUDA {torch.version.cuda}, cuDNN {torch.backends.cudnn.version()}")
EOF

t=$SECONDS
"$PYTHON" -m pytest -q -p no:cacheprovider tests/test_gpu.py -rs
echo "[gpu] tests/test_gpu.py passed ($((SECONDS - t)) s)"

# The benchmark, with the GPU's memory sampled once a second beside it (nvidia-smi, where there is one).
rm -rf "$OUT" && mkdir -p "$OUT"
sampler=""
if command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader,nounits -l 1 > "$OUT/gpu_samples.csv" &
  sampler=$!
  trap '[ -n "$sampler" ] && kill "$sampler" 2>/dev/null || true' EXIT
fi
t=$SECONDS
"$PYTHON" benchmarks/accuracy.py --preset gpu --out "$OUT" --no-progress "${args[@]}"
bench_s=$((SECONDS - t))
if [ -n "$sampler" ]; then kill "$sampler" 2>/dev/null || true; sampler=""; fi

"$PYTHON" - "$OUT" "$bench_s" <<'EOF'
import json, statistics, sys
from pathlib import Path

out, bench_s = Path(sys.argv[1]), int(sys.argv[2])
print(f"[gpu] --preset gpu: {bench_s} s in all (the preset's estimate: ~8 minutes)")
for run in sorted(p.parent for p in out.rglob("metrics.jsonl")):
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    summary = json.loads((run / "summary.json").read_text()) if (run / "summary.json").is_file() else {}
    secs = [r["round_s"] for r in rows if isinstance(r.get("round_s"), (int, float))]
    accs = [(r["round"], r["test_acc"]) for r in rows if isinstance(r.get("test_acc"), (int, float))]
    print(f"[gpu] {run.relative_to(out)}: {len(rows)} rounds, wall {summary.get('wall_s', float('nan')):.1f} s, "
          f"seconds per round median {statistics.median(secs):.1f} (first {secs[0]:.1f}, max {max(secs):.1f}), "
          f"test accuracy by round {', '.join(f'{t}: {100 * a:.2f} %' for t, a in accs)}, "
          f"final {100 * summary.get('final_acc', float('nan')):.2f} %, "
          f"{summary.get('bytes_total', 0) / 1e6:.1f} MB on the wire")
samples = out / "gpu_samples.csv"
if samples.is_file() and samples.stat().st_size:
    used = [float(x.split(",")[0]) for x in samples.read_text().splitlines() if x.strip()]
    util = [float(x.split(",")[1]) for x in samples.read_text().splitlines() if x.strip()]
    print(f"[gpu] GPU memory used: peak {max(used):.0f} MiB; utilisation mean {statistics.mean(util):.0f} % "
          f"over {len(util)} one-second samples")
EOF
"$PYTHON" -m fedsga_edge.cli.main report "$OUT" --out "$OUT/report" >/dev/null
echo "[gpu] report: $OUT/report/report.html; record the lines above in benchmarks/RESULTS.md"
