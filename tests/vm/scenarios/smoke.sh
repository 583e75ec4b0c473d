# shellcheck shell=dash disable=SC3043  # busybox ash runs it in the guest (it has local)
# The VM itself: IOMMU on, VFIO loaded, an SR-IOV PF present.
pf=$(for d in /sys/bus/pci/devices/*; do [ -e "$d/sriov_totalvfs" ] && basename "$d"; done | head -n 1)
[ -n "$pf" ] && echo "VMTEST PASS sriov-pf-present $pf" || echo "VMTEST FAIL sriov-pf-present"
[ -c /dev/vfio/vfio ] && echo "VMTEST PASS vfio-container-node" || echo "VMTEST FAIL vfio-container-node"
[ -e "/sys/bus/pci/devices/$pf/iommu_group" ] && echo "VMTEST PASS iommu-groups" || echo "VMTEST FAIL iommu-groups"
echo "totalvfs $(cat "/sys/bus/pci/devices/$pf/sriov_totalvfs") driver $(basename "$(readlink "/sys/bus/pci/devices/$pf/driver")")"
