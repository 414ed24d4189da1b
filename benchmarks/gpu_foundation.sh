#!/usr/bin/env bash
# Foundation checks on the GPU host (run through the device tool; see benchmarks/build_device_wheels.sh).
# Real-device adapter tests, info, profile, conformance, discovery and dispatch benchmarks.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export TORCHHAL_CACHE_DIR=$OUT/cache
OUT=${OUT:-/tmp/out}
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv
nvidia-smi topo -m
python3 -m torchhal_nvidia.probe "$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), recorded by benchmarks/gpu_foundation.sh on $(date -u +%F)" > "$OUT/probe_record.json"
python3 -m torchhal info --json > "$OUT/info.json"
COLUMNS=160 python3 -m torchhal info
python3 -m pytest -q -m gpu tests/gpu tests/plugins -p no:cacheprovider 2>&1 | tail -15
COLUMNS=160 python3 -m torchhal profile cuda:0 --refresh
python3 -m torchhal profile cuda:0 --json > "$OUT/profile_cuda0.json"
python3 - <<'PY' 2>&1 | tail -40
import json, os
from torchhal.testing import run_conformance, format_report
report = run_conformance("nvidia")
print(format_report(report))
open(os.path.join(os.environ["OUT"], "conformance_nvidia.json"), "w").write(report.to_json())
PY
python3 benchmarks/bench_discovery.py --samples 10 --out "$OUT/discovery.json"
python3 benchmarks/bench_dispatch.py --out "$OUT/dispatch.json"
