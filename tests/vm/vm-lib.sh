# The real-kernel VM harness (sourced). A Debian kernel boots under QEMU TCG
# with an emulated Intel IOMMU and an SR-IOV NVMe PF; a busybox initramfs
# carries the binaries under test and one scenario script, whose
# "VMTEST PASS|FAIL name" lines come back on the serial console.
# Reused by every layer that needs real VFIO: give vm_run other binaries and
# another scenario.

if [[ -n ${SRIOVD_VM_CACHE:-} ]]; then
  VM_CACHE=$SRIOVD_VM_CACHE
elif [[ $EUID -eq 0 ]]; then
  VM_CACHE=/var/cache/sriovd-vm
else
  VM_CACHE=${XDG_CACHE_HOME:-$HOME/.cache}/sriovd-vm
fi
VM_TIMEOUT=${SRIOVD_VM_TIMEOUT:-300}
# Loaded in this order by the guest's init (TESTING.md): VFIO, then NVMe.
VM_MODULES="virt/lib/irqbypass drivers/vfio/vfio drivers/vfio/vfio_iommu_type1 drivers/vfio/vfio_virqfd
  drivers/vfio/pci/vfio-pci-core drivers/vfio/pci/vfio-pci drivers/pci/pci-stub crypto/crct10dif_common
  lib/crc-t10dif lib/crc64 crypto/crc64_rocksoft_generic lib/crc64-rocksoft block/t10-pi
  drivers/nvme/host/nvme-core drivers/nvme/host/nvme
  drivers/virtio/virtio_ring drivers/virtio/virtio drivers/virtio/virtio_pci_modern_dev
  drivers/virtio/virtio_pci_legacy_dev drivers/virtio/virtio_pci net/core/failover drivers/net/net_failover
  drivers/net/virtio_net"
# The emulated IOMMU's address width: 48 bits, so that a client whose IOVAs
# are its virtual addresses (around 2^46) can map them; QEMU 7.2 defaults to
# 39 (VM_IOMMU_AW_BITS=39 to try that: DMA_MAP then refuses, naming the
# container's range).
# Extra QEMU arguments for a scenario (a vhost-user netdev, say).
VM_QEMU_EXTRA=${VM_QEMU_EXTRA:-}

vm_log() { echo "vm: $*" >&2; }

# The URI the host's own apt uses for Debian's main archive (never written
# down here): deb822 sources first, then the one-line format.
vm_mirror() {
  local m
  m=$(awk '/^URIs:/ && $2 !~ /security/ {print $2; exit}' /etc/apt/sources.list.d/*.sources 2>/dev/null || true)
  [[ -n $m ]] || m=$(awk '$1 == "deb" && $2 !~ /security/ && $2 ~ /^https?:/ {print $2; exit}' \
    /etc/apt/sources.list /etc/apt/sources.list.d/*.list 2>/dev/null || true)
  echo "$m"
}

# Installs QEMU and the initramfs tools when missing.
vm_install_tools() {
  local missing=()
  for p in qemu-system-x86 busybox-static cpio kmod; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  ((${#missing[@]} == 0)) && return 0
  if [[ $EUID -ne 0 ]]; then
    vm_log "missing ${missing[*]} and not root to install them"
    return 1
  fi
  vm_log "installing ${missing[*]}"
  DEBIAN_FRONTEND=noninteractive apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >&2
}

# Fetches the newest Debian 6.1 kernel once and keeps vmlinuz and the
# modules the guest needs under $VM_CACHE/<version>. Prints that directory.
vm_kernel() {
  local dir
  dir=$(ls -d "$VM_CACHE"/6.1.0-*-amd64 2>/dev/null | sort -V | tail -n 1)
  if [[ -n $dir && -f $dir/vmlinuz ]]; then
    local complete=1
    for m in $VM_MODULES; do [[ -f $dir/modules/$(basename "$m").ko ]] || complete=0; done
    if [[ $complete -eq 1 ]]; then
      echo "$dir"
      return 0
    fi
    rm -rf "$dir"  # made for a shorter module list: fetch again
  fi
  local pkg
  pkg=$(apt-cache search --names-only '^linux-image-6\.1\.0-[0-9]+-amd64$' | awk '{print $1}' | sort -V | tail -n 1)
  if [[ -z $pkg ]]; then
    apt-get update -qq >&2
    pkg=$(apt-cache search --names-only '^linux-image-6\.1\.0-[0-9]+-amd64$' | awk '{print $1}' | sort -V | tail -n 1)
  fi
  [[ -n $pkg ]] || { vm_log "no linux-image-6.1.0-*-amd64 package found"; return 1; }
  local version=${pkg#linux-image-}
  local tmp
  tmp=$(mktemp -d)
  vm_log "downloading $pkg"
  (cd "$tmp" && chmod 777 "$tmp" && apt-get download "$pkg" >&2) || { rm -rf "$tmp"; return 1; }
  mkdir -p "$tmp/x"
  local patterns=("./boot/vmlinuz-$version")
  for m in $VM_MODULES; do patterns+=("./lib/modules/$version/kernel/$m.ko"); done
  dpkg-deb --fsys-tarfile "$tmp"/*.deb | tar -x -C "$tmp/x" "${patterns[@]}"
  dir="$VM_CACHE/$version"
  mkdir -p "$dir/modules"
  cp "$tmp/x/boot/vmlinuz-$version" "$dir/vmlinuz"
  for m in $VM_MODULES; do cp "$tmp/x/lib/modules/$version/kernel/$m.ko" "$dir/modules/"; done
  rm -rf "$tmp"
  echo "$dir"
}

# Copies a dynamically linked binary and the libraries ldd names into ROOT.
vm_add_binary() {
  local root=$1 bin=$2 dest=${3:-/bin/$(basename "$2")}
  install -D -m 0755 "$bin" "$root$dest"
  ldd "$bin" 2>/dev/null | awk '/=> \//{print $3} /^\t\/.*ld-linux/{print $1}' | while read -r lib; do
    [[ -f $root$lib ]] || install -D -m 0755 "$lib" "$root$lib"
  done
}

# vm_initramfs OUT SCENARIO MODULE_DIR "MODULES" BINARY... : a busybox
# initramfs with the modules (loaded in the order given), the binaries and
# their libraries, the guest's init and one scenario script.
vm_initramfs() {
  local out=$1 scenario=$2 module_dir=$3 modules=$4
  shift 4
  local root
  root=$(mktemp -d)
  mkdir -p "$root"/{bin,sbin,proc,sys,dev,tmp,run,etc,var/lib,modules}
  cp /bin/busybox "$root/bin/busybox"
  cp "$module_dir"/*.ko "$root/modules/"
  # The kernel's modules.alias, where the cache has one (VF drivers are
  # found through it).
  if [[ -f $module_dir/../modules.alias && -f $module_dir/../version ]]; then
    install -D -m 0644 "$module_dir/../modules.alias" "$root/lib/modules/$(cat "$module_dir/../version")/modules.alias"
  fi
  : >"$root/modules.order"
  for m in $modules; do basename "$m" >>"$root/modules.order"; done
  for b in "$@"; do vm_add_binary "$root" "$b"; done
  install -m 0755 "$(dirname "${BASH_SOURCE[0]}")/guest-init" "$root/init"
  install -m 0644 "$scenario" "$root/scenario.sh"
  install -m 0644 "$(dirname "${BASH_SOURCE[0]}")/guest-lib.sh" "$root/guest-lib.sh"
  (cd "$root" && find . | cpio -o -H newc --quiet | gzip -1) >"$out"
  rm -rf "$root"
}

# vm_run SCENARIO LOG BINARY... : builds the initramfs, boots, writes the
# console to LOG, and returns 0 when the scenario ended and every check passed.
vm_run() {
  local scenario=$1 log=$2
  shift 2
  local kernel
  kernel=$(vm_kernel) || return 1
  local initrd
  initrd=$(mktemp /tmp/sriovd-vm-initrd.XXXXXX)
  vm_initramfs "$initrd" "$scenario" "$kernel/modules" "$VM_MODULES" "$@"

  vm_log "booting $(basename "$kernel") with $(basename "$scenario") (timeout ${VM_TIMEOUT}s)"
  local rc=0
  timeout --kill-after=10 "$VM_TIMEOUT" qemu-system-x86_64 \
    -accel tcg -M q35,kernel-irqchip=split -cpu max -m 768 -smp 2 \
    -device intel-iommu,intremap=on,aw-bits=${VM_IOMMU_AW_BITS:-48}${VM_IOMMU_OPTS:-} \
    -device pcie-root-port,id=rp1,slot=1 \
    -device nvme-subsys,id=subsys0 \
    -device nvme,serial=sriovd0,bus=rp1,subsys=subsys0,sriov_max_vfs=2,sriov_vq_flexible=4,sriov_vi_flexible=2,max_ioqpairs=6,msix_qsize=8 \
    -kernel "$kernel/vmlinuz" -initrd "$initrd" $VM_QEMU_EXTRA \
    -append "console=ttyS0 intel_iommu=on iommu=pt quiet loglevel=3 panic=-1 vmtest_watchdog=$((VM_TIMEOUT - 45))" \
    -display none -serial stdio -monitor none -no-reboot </dev/null >"$log" 2>&1 || rc=$?
  rm -f "$initrd"
  vm_verdict "$log" "$rc" "$log"
}

# vm_verdict RESULTS QEMU_RC LOG: the scenario's "VMTEST PASS|FAIL" lines in
# RESULTS, listed; 0 when it ended ("VMTEST END") and every check passed.
vm_verdict() {
  local results=$1 rc=$2 log=$3
  if ! grep -q '^VMTEST END' "$results" 2>/dev/null; then
    vm_log "the guest did not finish (qemu exit $rc); console in $log"
    return 1
  fi
  local passed failed
  passed=$(grep -c '^VMTEST PASS' "$results" || true)
  failed=$(grep -c '^VMTEST FAIL' "$results" || true)
  grep -E '^VMTEST (PASS|FAIL)' "$results" | sed 's/^/  /' >&2
  vm_log "$passed passed, $failed failed"
  [[ $failed -eq 0 && $passed -gt 0 ]]
}
