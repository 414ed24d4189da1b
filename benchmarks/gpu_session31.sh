#!/usr/bin/env bash
# The thirty-first session's GPU checks (wheels: ../shared/tools/device-wheels, then
# benchmarks/build_device_wheels.sh). Every result goes to $OUT/raw, packed into $OUT/results.tgz:
#   bash benchmarks/gpu_session31.sh final  # one GPU: the conformance kit (its new numerics_settings
#                                           # check), torch's numerics switches and the fingerprint
#                                           # on a CUDA torch, torchhal profile (its TF32 row), the GPU
#                                           # tests (plugin with the review's fixes, real GPU, every
#                                           # kernel file but attention's shape sweep, prepare) after
#                                           # the autograd Function's forward/setup_context split
#   bash benchmarks/gpu_session31.sh mesh   # two GPUs: the distributed and collective GPU tests (Mesh
#                                           # from its own groups under FSDP2 over NCCL), then the new
#                                           # mesh/host/device-rule tests on torch 2.11 (gloo)
set -uo pipefail
phase=${1:?final}
source "$(dirname "$0")/gpu_setup.sh"
if [ "$phase" = final ]; then
  timeout 150 python3 -m torchhal conformance nvidia --json > "$RAW/conformance_nvidia.json" 2> "$RAW/conformance_nvidia.err"
  echo "conformance rc=$?"
  python3 -c "import json,sys; r=json.load(open(sys.argv[1])); print(r['summary']); [print(' ', c['check'], c['status'], c['reason'][:150]) for c in r['checks'] if c['status']!='passed' or c['check']=='adapter.numerics_settings']" "$RAW/conformance_nvidia.json"
  timeout 120 python3 -m pytest -q -p no:cacheprovider tests/core/test_torch_flags.py \
    tests/evaluation/test_experiment_edge_cases.py -k "flags or block or fingerprint" 2>&1 \
    | tee "$RAW/flags_tests.log" | tail -3
  echo "flags tests rc=${PIPESTATUS[0]}"
  python3 -c "import torch; torch.backends.cuda.matmul.fp32_precision = 'tf32'; from torchhal.cli import main; main()" \
    profile cuda:0 > "$RAW/profile.log" 2>&1
  echo "profile (per-backend TF32 API set first) rc=$?"; tail -14 "$RAW/profile.log"
  timeout 400 python3 -m pytest -q -m gpu -p no:cacheprovider -rs tests/plugins/test_nvidia.py tests/gpu \
    tests/kernels/gpu tests/distributed/gpu/test_prepare_gpu.py -k "not shape_sweep" 2>&1 \
    | tee "$RAW/gpu_tests_final.log" | tail -8
  echo "gpu tests rc=${PIPESTATUS[0]}"
  pack; exit 0
fi
if [ "$phase" = mesh ]; then
  nvidia-smi topo -m > "$RAW/topo.txt" 2>&1
  timeout 360 python3 -m pytest -q -m gpu -p no:cacheprovider -rs tests/distributed/gpu tests/collectives 2>&1 \
    | tee "$RAW/distributed_gpu.log" | tail -8
  echo "distributed gpu tests rc=${PIPESTATUS[0]}"
  # the new mesh, host and device rules on torch 2.11 (gloo, simulated devices: sort_ranks, from_group)
  timeout 180 python3 -m pytest -q -p no:cacheprovider tests/distributed/test_mesh_groups.py \
    tests/distributed/test_host_and_device_rules.py tests/distributed/test_policy_and_arguments.py 2>&1 \
    | tee "$RAW/mesh_cpu_tests.log" | tail -4
  echo "mesh cpu tests rc=${PIPESTATUS[0]}"
  pack; exit 0
fi
echo "unknown phase $phase" >&2; exit 2
