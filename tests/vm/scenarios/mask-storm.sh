# shellcheck shell=dash disable=SC3043  # busybox ash runs it in the guest (it has local)
# scripts/bench mask-storm: the benchmark alone, on the PF bound to vfio-pci.
set -u
PF=$(for d in /sys/bus/pci/devices/*; do [ -e "$d/sriov_totalvfs" ] && basename "$d"; done | head -n 1)
vm_host_probe bind "$PF" vfio-pci >/dev/null || { echo "VMTEST FAIL bind $PF to vfio-pci"; exit 1; }
if out=$(sriovd-bench-mask-storm --device "$PF" --seconds "${MASK_STORM_SECONDS:-3}" --busy-poll); then
  echo "VMTEST BENCH $out"
  echo "VMTEST PASS mask-storm"
else
  echo "VMTEST FAIL mask-storm"
fi
vm_host_probe bind "$PF" nvme >/dev/null
