# shellcheck shell=bash
# A Debian 12 guest booted with systemd as PID 1 (sourced): the package as
# an operator installs it, sriovd started by systemctl inside the unit's
# real sandbox. The root is debootstrapped once from the host's own mirror
# (with what the package depends on, and the guest kernel's modules) and
# cached under $VM_CACHE/bookworm-systemd; the guest mounts it read-only
# over 9p with a tmpfs overlay, so nothing a run does stays in the cache.
#
#   sd_prepare DEB           # builds or checks the cache
#   sd_run DEB SCENARIO WORK LOG  # boots; the scenario runs as a systemd
#                            # service and writes VMTEST lines to WORK/results

# shellcheck source=vm-lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/vm-lib.sh"

SD_DIR=$VM_CACHE/bookworm-systemd
# What the guest's init loads from the root's modules before switch_root,
# in order: the root over 9p, the overlay on it.
SD_INIT_MODULES="drivers/virtio/virtio_ring drivers/virtio/virtio drivers/virtio/virtio_pci_modern_dev
  drivers/virtio/virtio_pci_legacy_dev drivers/virtio/virtio_pci fs/netfs/netfs fs/fscache/fscache net/9p/9pnet net/9p/9pnet_virtio fs/9p/9p fs/overlayfs/overlay"
SD_PACKAGES="systemd systemd-sysv udev kmod iproute2 procps python3 dbus"

# The packages DEB depends on (first of each alternative, no versions).
sd_deb_depends() {
  dpkg-deb -f "$1" Depends | tr ',' '\n' | sed -e 's/|.*//' -e 's/(.*)//' -e 's/[[:space:]]//g' | grep -v '^$' | sort -u |
    tr '\n' ' '
}

# sd_prepare DEB: the root for DEB's dependencies and the harness's kernel.
sd_prepare() {
  local deb=$1 kernel
  kernel=$(vm_kernel) || return 1
  # shellcheck disable=SC2046  # one argument per package
  vm_cache "$SD_DIR" sd_build "$(cat "$kernel/version")" $(sd_deb_depends "$deb")
}

# sd_build DIR KERNEL_VERSION PACKAGE...: DIR/root, a Debian 12 root with
# systemd and the packages, and the kernel's modules; DIR/vmlinuz.
sd_build() {
  local dir=$1 version=$2 mirror
  shift 2
  mirror=$(vm_mirror)
  [[ -n $mirror ]] || { vm_log "no Debian mirror in the host's apt sources"; return 1; }
  if ! command -v debootstrap >/dev/null; then
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends debootstrap
  fi
  vm_log "debootstrapping a Debian 12 root with systemd and sriovd's dependencies (once; cached in $dir)"
  debootstrap --variant=minbase --include="${SD_PACKAGES// /,}" bookworm "$dir/root" "$mirror" \
    >"$dir/debootstrap.log" 2>&1 || { vm_log "debootstrap failed; see $dir/debootstrap.log"; return 1; }
  # The package's dependencies through apt in the root (some are virtual
  # packages, which debootstrap cannot resolve).
  DEBIAN_FRONTEND=noninteractive chroot "$dir/root" apt-get install -y -qq --no-install-recommends \
    "$@" >>"$dir/debootstrap.log" 2>&1 ||
    { vm_log "installing sriovd's dependencies in the root failed; see $dir/debootstrap.log"; return 1; }
  chroot "$dir/root" apt-get clean
  # The kernel's modules (the guest boots the harness's kernel): from its
  # package, unpacked, not installed (no initramfs-tools in the root).
  local tmp
  tmp=$(mktemp -d)
  (cd "$tmp" && chmod 777 "$tmp" && apt-get download "linux-image-$version") || { rm -rf "$tmp"; return 1; }
  dpkg-deb -x "$tmp"/*.deb "$tmp/x"
  mkdir -p "$dir/root/lib/modules"
  cp -a "$tmp/x/lib/modules/$version" "$dir/root/lib/modules/"
  cp "$tmp/x/boot/vmlinuz-$version" "$dir/vmlinuz"
  rm -rf "$tmp"
  depmod -b "$dir/root" "$version"
  # A guest that boots to multi-user with nothing in the way: no getty on
  # the console, no password prompts, a hostname.
  echo sriovd-vm >"$dir/root/etc/hostname"
  ln -sf /dev/null "$dir/root/etc/systemd/system/serial-getty@ttyS0.service"
  ln -sf /dev/null "$dir/root/etc/systemd/system/getty@tty1.service"
}

# The busybox initramfs that mounts the root and hands over to systemd.
sd_initramfs() {
  local out=$1 version=$2 root
  root=$(mktemp -d)
  mkdir -p "$root"/{bin,proc,sys,dev,newroot,lower,upper,modules}
  cp /bin/busybox "$root/bin/busybox"
  : >"$root/modules.order"
  for m in $SD_INIT_MODULES; do
    local f="$SD_DIR/root/lib/modules/$version/kernel/$m.ko"
    [[ -f $f ]] || continue  # built in, or not needed by this kernel
    cp "$f" "$root/modules/"
    basename "$m" >>"$root/modules.order"
  done
  install -m 0755 "$(dirname "${BASH_SOURCE[0]}")/systemd-init" "$root/init"
  (cd "$root" && find . | cpio -o -H newc --quiet | gzip -1) >"$out"
  rm -rf "$root"
}

# sd_run DEB SCENARIO WORK LOG: WORK (a fresh directory) is the guest's
# /work: the package, the scenario and its results.
sd_run() {
  local deb=$1 scenario=$2 work=$3 log=$4 kernel version initrd
  sd_prepare "$deb" || return 1
  kernel=$(vm_kernel) || return 1
  version=$(cat "$kernel/version")
  cp "$deb" "$work/sriovd.deb"
  install -m 0755 "$scenario" "$work/scenario.sh"
  install -m 0644 "$(dirname "${BASH_SOURCE[0]}")/guest-lib.sh" "$work/guest-lib.sh"
  for b in "${@:5}"; do install -m 0755 "$b" "$work/"; done
  initrd=$(mktemp /tmp/sriovd-sd-initrd.XXXXXX)
  sd_initramfs "$initrd" "$version"
  vm_log "booting Debian 12 with systemd ($version) for $(basename "$scenario") (timeout ${VM_TIMEOUT}s)"
  local rc=0
  timeout --kill-after=10 "$VM_TIMEOUT" qemu-system-x86_64 \
    -accel tcg -M q35,kernel-irqchip=split -cpu max -m 1024 -smp 2 \
    -device intel-iommu,intremap=on,aw-bits=48 \
    -device pcie-root-port,id=rp1,slot=1 \
    -device nvme-subsys,id=subsys0 \
    -device nvme,serial=sriovd0,bus=rp1,subsys=subsys0,sriov_max_vfs=2,sriov_vq_flexible=4,sriov_vi_flexible=2,max_ioqpairs=6,msix_qsize=8 \
    -virtfs "local,path=$SD_DIR/root,mount_tag=sdroot,security_model=passthrough,readonly=on" \
    -virtfs "local,path=$work,mount_tag=work,security_model=passthrough" \
    -kernel "$SD_DIR/vmlinuz" -initrd "$initrd" \
    -append "console=ttyS0 intel_iommu=on iommu=pt quiet loglevel=3 panic=-1 systemd.show_status=0" \
    -display none -serial stdio -monitor none -no-reboot </dev/null >"$log" 2>&1 || rc=$?
  rm -f "$initrd"
  [[ -f $work/results ]] && cat "$work/results" >>"$log"
  vm_verdict "$work/results" "$rc" "$log"
}
