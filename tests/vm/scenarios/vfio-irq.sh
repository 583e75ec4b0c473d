# shellcheck shell=dash disable=SC3043  # busybox ash runs it in the guest (it has local)
# Kernel VFIO with the routing engine and MSI-X emulation, on the PF bound
# to vfio-pci (multi-vector), then the mask-storm benchmark on it.
set -u
PF=$(for d in /sys/bus/pci/devices/*; do [ -e "$d/sriov_totalvfs" ] && basename "$d"; done | head -n 1)
[ -n "$PF" ] || { echo "VMTEST FAIL no SR-IOV PF in the VM"; exit 1; }
if vm_host_probe bind "$PF" vfio-pci >/dev/null 2>/tmp/bind.err; then echo "VMTEST PASS pf-bound-to-vfio-pci"; else
  echo "VMTEST FAIL pf-bound-to-vfio-pci: $(cat /tmp/bind.err)"; exit 1; fi

SRIOVD_VM_DEVICE=$PF vm_vfio_test >/tmp/gtest.log 2>&1
cat /tmp/gtest.log
grep '^\[       OK \]' /tmp/gtest.log | sed 's/^\[       OK \] \([^ ]*\).*/VMTEST PASS \1/'
grep '^\[  FAILED  \] .* ([0-9]* ms)$' /tmp/gtest.log | sed 's/^\[  FAILED  \] \([^ ,]*\).*/VMTEST FAIL \1/'
{ grep -q '^\[  PASSED  \]' /tmp/gtest.log && ! grep -q 'FAILED TEST' /tmp/gtest.log; } || echo "VMTEST FAIL vfio-gtest-did-not-pass"

# The VF proxy over vfio-user on the same device (BAR mmap through the
# passed VFIO fd, DMA windows into the container, MSI-X emulation).
SRIOVD_VM_DEVICE=$PF vm_vfio_user_test >/tmp/gtest-vu.log 2>&1
cat /tmp/gtest-vu.log
grep '^\[       OK \]' /tmp/gtest-vu.log | sed 's/^\[       OK \] \([^ ]*\).*/VMTEST PASS \1/'
grep '^\[  FAILED  \] .* ([0-9]* ms)$' /tmp/gtest-vu.log | sed 's/^\[  FAILED  \] \([^ ,]*\).*/VMTEST FAIL \1/'
{ grep -q '^\[  PASSED  \]' /tmp/gtest-vu.log && ! grep -q 'FAILED TEST' /tmp/gtest-vu.log; } || echo "VMTEST FAIL vfio-user-gtest-did-not-pass"

seconds=${MASK_STORM_SECONDS:-2}
if out=$(sriovd-bench-mask-storm --device "$PF" --seconds "$seconds" --busy-poll 2>/tmp/storm.err); then
  echo "VMTEST BENCH $out"
  echo "$out" | grep -q '"lazy_timeouts":0' && echo "VMTEST PASS mask-storm-lazy-loses-nothing" ||
    echo "VMTEST FAIL mask-storm-lazy-loses-nothing"
  echo "$out" | grep -q '"adaptive_timeouts":0' && echo "VMTEST PASS mask-storm-adaptive-loses-nothing" ||
    echo "VMTEST FAIL mask-storm-adaptive-loses-nothing"
else
  echo "VMTEST FAIL mask-storm: $(cat /tmp/storm.err)"
fi
vm_host_probe bind "$PF" nvme >/dev/null 2>&1
[ "$(basename "$(readlink "/sys/bus/pci/devices/$PF/driver")")" = nvme ] && echo "VMTEST PASS pf-back-on-nvme" ||
  echo "VMTEST FAIL pf-back-on-nvme"
