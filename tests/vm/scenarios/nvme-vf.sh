# shellcheck shell=dash disable=SC3043  # busybox ash runs it in the guest (it has local)
# An NVMe VF as a working device (issue 12, item 6), then exported by the
# VF proxy and driven end to end by a foreign vfio-user client: the PF (on
# the kernel's nvme driver) gives the VF's secondary controller its queue
# and interrupt resources and brings it online (vm_nvme_virt), the VF goes
# to vfio-pci, and NvmeThroughTheExport runs Identify on it under each
# MSI-X policy.
set -u
PF=$(for d in /sys/bus/pci/devices/*; do [ -e "$d/sriov_totalvfs" ] && basename "$d"; done | head -n 1)
[ -n "$PF" ] || { echo "VMTEST FAIL no SR-IOV PF in the VM"; exit 1; }
ctrl=
i=0
while [ $i -lt 100 ]; do
  ctrl=
  for c in "/sys/bus/pci/devices/$PF/nvme"/*; do [ -e "$c" ] && ctrl=${c##*/} && break; done
  [ -n "$ctrl" ] && [ -c "/dev/$ctrl" ] && break
  sleep 0.1
  i=$((i + 1))
done
[ -n "$ctrl" ] || { echo "VMTEST FAIL pf-has-an-nvme-controller"; exit 1; }
echo "VMTEST PASS pf-has-an-nvme-controller $ctrl"
vm_nvme_virt list "/dev/$ctrl"
if vm_nvme_virt assign "/dev/$ctrl" 1 2>/tmp/virt.err; then echo "VMTEST PASS vf-resources-assigned"; else
  echo "VMTEST FAIL vf-resources-assigned: $(cat /tmp/virt.err)"; exit 1; fi
echo 0 >"/sys/bus/pci/devices/$PF/sriov_drivers_autoprobe"
echo 1 >"/sys/bus/pci/devices/$PF/sriov_numvfs"
VF=$(basename "$(readlink "/sys/bus/pci/devices/$PF/virtfn0")")
[ -n "$VF" ] || { echo "VMTEST FAIL vf-created"; exit 1; }
echo "VMTEST PASS vf-created $VF"
if vm_nvme_virt online "/dev/$ctrl" 1 2>/tmp/virt.err; then echo "VMTEST PASS vf-controller-online"; else
  echo "VMTEST FAIL vf-controller-online: $(cat /tmp/virt.err)"; exit 1; fi
vm_nvme_virt list "/dev/$ctrl"
if vm_host_probe bind "$VF" vfio-pci >/dev/null 2>/tmp/bind.err; then echo "VMTEST PASS vf-bound-to-vfio-pci"; else
  echo "VMTEST FAIL vf-bound-to-vfio-pci: $(cat /tmp/bind.err)"; exit 1; fi

SRIOVD_VM_DEVICE=$VF vm_vfio_user_test --gtest_filter='Policies/NvmeThroughTheExport.*' >/tmp/gtest-nvme.log 2>&1
cat /tmp/gtest-nvme.log
grep '^\[       OK \]' /tmp/gtest-nvme.log | sed 's/^\[       OK \] \([^ ]*\).*/VMTEST PASS \1/'
grep '^\[  FAILED  \] .* ([0-9]* ms)$' /tmp/gtest-nvme.log | sed 's/^\[  FAILED  \] \([^ ,]*\).*/VMTEST FAIL \1/'
{ grep -q '^\[  PASSED  \]' /tmp/gtest-nvme.log && ! grep -q 'FAILED TEST' /tmp/gtest-nvme.log; } || echo "VMTEST FAIL nvme-vf-gtest-did-not-pass"
echo 0 >"/sys/bus/pci/devices/$PF/sriov_numvfs"
