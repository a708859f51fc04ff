#!/usr/bin/env bash
# The GPU checks in one run (under 5 minutes on one GPU): the CUDA-only tests (marker `cuda`:
# among them CUDA state into the node-local tier and back, sync and with pinned_staging, and
# Lightning's ModelParallelStrategy, FSDP2 on the GPU, killed mid-save and resumed, and the
# Hugging Face EngineTrainer under accelerate's FSDP2 on the GPU, stopped and resumed),
# sync and async save/load round trips of CUDA tensors checked bit-exact, `overlap` with a real
# training loop on the GPU, and benchmarks/async_bench.py --device cuda. Every figure goes into
# one JSON file: $1, default gpu_check.json. Without CUDA it says so in one line and exits 0.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
OUT=${1:-gpu_check.json}
if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    echo "gpu_check: no CUDA device here; nothing was run or claimed"
    exit 0
fi
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
"$PY" -m pytest -q -p no:cacheprovider -m cuda tests/ --junitxml "$TMP/cuda_tests.xml" --timeout 240 || echo "cuda tests failed" >"$TMP/failed"
"$PY" benchmarks/async_bench.py --device cuda --sizes 256,1024 --reps 3 --rss-saves 5 --train-rounds 2 \
    --overlap-sizes 256,1024 --out "$TMP/bench.json" >"$TMP/bench.txt"
"$PY" - "$TMP" "$OUT" <<'PYEOF'
import json, sys, xml.etree.ElementTree as ET
tmp, out = sys.argv[1], sys.argv[2]
suite = ET.parse(f"{tmp}/cuda_tests.xml").getroot().find("testsuite") or ET.parse(f"{tmp}/cuda_tests.xml").getroot()
tests = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
import os, torch
result = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "cuda_tests": tests,
          "cuda_tests_failed": os.path.exists(f"{tmp}/failed"),
          "bench": json.load(open(f"{tmp}/bench.json")), "bench_table": open(f"{tmp}/bench.txt").read()}
json.dump(result, open(out, "w"), indent=2)
print(f"gpu_check: {tests} -> {out}")
PYEOF
