#!/usr/bin/env bash
# The main job: set up, then `torchhal info` and `torchhal demo` on the hardware present
# (the CPU and the simulated ASIC when there is no accelerator).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/torchhal info
.venv/bin/torchhal demo
