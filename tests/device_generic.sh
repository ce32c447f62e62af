#!/usr/bin/env bash
# The device path is generic (Note [One device per rank], train/plan/device.h):
# host memory is named in src/ only on lines that say why with a
# "// host:" comment (offloaded state, checkpoint bytes, CPU autocast, ...).
# Any other kCPU, DeviceType::CPU or .cpu() would pin a GPU run to the CPU.
set -euo pipefail
src=${1:?usage: device_generic.sh SRC_DIR}
bad=$(grep -rnE 'kCPU|DeviceType::CPU|\.cpu\(\)' "$src" --include='*.cpp' --include='*.h' | grep -v '// host:' || true)
if [ -n "$bad" ]; then
  echo "host memory named without a '// host:' reason:"
  echo "$bad"
  exit 1
fi
echo "every host-memory line in $src says why"
