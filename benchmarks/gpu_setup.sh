# Sourced by a session's GPU script (benchmarks/gpu_sessionNN.sh) on the device machine: installs
# the wheels of .whl/ (../shared/tools/device-wheels, then benchmarks/build_device_wheels.sh) into
# /tmp/site, removes the checkout's torchhal so the installed wheels are what runs, as a user has
# them, and sets up $RAW, whose results `pack` puts into $OUT/results.tgz (the device tool returns
# at most 8 files). `install_old_build` puts the session start's torchhal wheel (.whl_old/) beside
# them, in /tmp/old.
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
rm -rf torchhal
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null || exit 1
export PYTHONUNBUFFERED=1 TORCHHAL_CACHE_DIR=/tmp/cache PYTHONPATH=/tmp/site
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
RAW=$OUT/raw; mkdir -p "$RAW"
pack() { tar czf "$OUT/results.tgz" -C "$OUT" raw && rm -rf "$RAW"; }
install_old_build() {
  cp -r /tmp/site /tmp/old
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/old .whl_old/torchhal-*.whl \
    2>/dev/null || exit 1
}
