# shellcheck shell=bash
# QEMU 11 with its vfio-user client (sourced). Debian 12 has no vfio-user
# client (QEMU 7.2); Debian 13's backports suite has QEMU 11.1, built for
# Debian 13's libc. So a Debian 13 root is debootstrapped once, QEMU is
# installed in it from trixie-backports, and QEMU runs chrooted there with
# /dev, /proc, /sys and a work directory bind-mounted; sriovd runs on the
# host. The guest is Debian 13's 6.12 kernel with a busybox initramfs.
# Everything comes from Debian's registry (the mirror the host's apt
# already uses) and is cached under $VM_CACHE/trixie-qemu between runs.
#
#   q11_prepare              # builds or checks the cache; prints nothing
#   q11_root / q11_kernel    # the root, the kernel directory (vmlinuz, modules/)
#   q11_qemu WORKDIR ARGS... # qemu-system-x86_64 in the root; WORKDIR is
#                            # bind-mounted at the same path inside it

# shellcheck source=vm-lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/vm-lib.sh"

Q11_DIR=$VM_CACHE/trixie-qemu
# What the guest loads, in order: virtio-mmio (for QEMU's microvm machine,
# scripts/bench mmio) and virtio-net (virtio_pci is built into Debian 13's
# kernel).
Q11_MODULES="drivers/virtio/virtio_mmio net/core/failover drivers/net/net_failover drivers/net/virtio_net"

q11_root() { echo "$Q11_DIR/root"; }
q11_kernel() { echo "$Q11_DIR/kernel"; }

# Two caches: the root with QEMU, then the guest kernel fetched through the
# root's apt (each kept while its builder is unchanged).
q11_prepare() {
  local p pkgs=()
  for p in debootstrap busybox-static cpio kmod xz-utils; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || pkgs+=("$p")
  done
  if ((${#pkgs[@]})); then
    [[ $EUID -eq 0 ]] || { vm_log "missing ${pkgs[*]} and not root to install them"; return 1; }
    DEBIAN_FRONTEND=noninteractive apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${pkgs[@]}" >&2
  fi
  vm_cache "$Q11_DIR/root" q11_root_build || return 1
  vm_cache "$Q11_DIR/kernel" q11_kernel_build
}

# q11_root_build DIR: Debian 13 (minbase) with QEMU from trixie-backports.
q11_root_build() {
  local root=$1 mirror version
  mirror=$(vm_mirror)
  [[ -n $mirror ]] || { vm_log "no Debian mirror in the host's apt sources"; return 1; }
  vm_log "debootstrapping Debian 13 into $root (once; a few minutes)"
  debootstrap --variant=minbase trixie "$root" "$mirror" >"$Q11_DIR/debootstrap.log" 2>&1 ||
    { vm_log "debootstrap failed; see $Q11_DIR/debootstrap.log"; tail -n 20 "$Q11_DIR/debootstrap.log"; return 1; }
  cat >"$root/etc/apt/sources.list.d/debian.sources" <<EOF
Types: deb
URIs: $mirror
Suites: trixie trixie-updates trixie-backports
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
EOF
  rm -f "$root/etc/apt/sources.list"
  chroot "$root" apt-get update -qq || return 1
  vm_log "installing qemu-system-x86 from trixie-backports in the root"
  chroot "$root" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
    -t trixie-backports qemu-system-x86 || return 1
  chroot "$root" apt-get clean || true
  version=$(chroot "$root" qemu-system-x86_64 --version | head -n 1)
  [[ $version =~ version\ (1[1-9]|[2-9][0-9])\. ]] || { vm_log "the root's QEMU is not 11 or newer: $version"; return 1; }
  vm_log "ready: $version"
}

# q11_kernel_build DIR: Debian 13's 6.12 guest kernel, its vmlinuz and the
# modules above (DIR/vmlinuz, DIR/modules, DIR/version).
q11_kernel_build() {
  local dir=$1 root=$Q11_DIR/root kpkg
  # Named like linux-image-6.12.NN+deb13-amd64 (the signed one).
  kpkg=$(q11_chroot apt-cache search --names-only '^linux-image-6\.12\.[0-9]+[^-]*-amd64$' | awk '{print $1}' |
    grep -v -e '-unsigned' -e '-dbg' | sort -V | tail -n 1)
  [[ -n $kpkg ]] || { vm_log "no linux-image-6.12 package in Debian 13"; return 1; }
  rm -rf "$root/tmp/kernel"
  mkdir -p "$root/tmp/kernel"
  chmod 777 "$root/tmp/kernel"
  q11_chroot sh -c "cd /tmp/kernel && apt-get download $kpkg" || return 1
  local kver=${kpkg#linux-image-} x
  x=$(mktemp -d)
  mkdir -p "$dir/modules"
  # Modules are compressed (.ko.xz) under lib/ or usr/lib/: busybox's
  # insmod takes them plain.
  local patterns=("./boot/vmlinuz-$kver") m f
  for m in $Q11_MODULES; do patterns+=("*/modules/$kver/kernel/$m.ko*"); done
  dpkg-deb --fsys-tarfile "$root"/tmp/kernel/*.deb | tar -x -C "$x" --wildcards "${patterns[@]}" ||
    { vm_log "$kpkg lacks a module the guest needs"; rm -rf "$x"; return 1; }
  cp "$x/boot/vmlinuz-$kver" "$dir/vmlinuz"
  for m in $Q11_MODULES; do
    f=$(find "$x" -path "*/kernel/$m.ko*" | head -n 1)
    case $f in
      *.xz) xz -dc "$f" ;;
      *.zst) zstd -dc "$f" ;;
      *) cat "$f" ;;
    esac >"$dir/modules/$(basename "$m").ko"
  done
  rm -rf "$x" "$root/tmp/kernel"
  echo "$kver" >"$dir/version"
  vm_log "ready: guest kernel $kver"
}

q11_chroot() {
  local root=$Q11_DIR/root
  chroot "$root" "$@"
}

# Mounts are per run, in a private mount namespace (unshare -m), so a
# killed test leaves no mount on the host.
# q11_qemu WORKDIR ARG... : runs QEMU in the root with WORKDIR visible at
# the same path. Started with &, it execs all the way (the subshell becomes
# unshare, sh, chroot, then QEMU): $! is QEMU's PID, to be ended by it.
q11_qemu() {
  local work=$1
  shift
  local root=$Q11_DIR/root
  # shellcheck disable=SC2016  # expanded by the inner sh
  exec unshare -m --propagation private sh -c '
    root=$1 work=$2; shift 2
    mount --rbind /dev "$root/dev" && mount -t proc proc "$root/proc" && mount --rbind /sys "$root/sys" &&
      mkdir -p "$root$work" && mount --bind "$work" "$root$work" &&
      exec chroot "$root" /usr/bin/qemu-system-x86_64 "$@"' q11 "$root" "$work" "$@"
}

# q11_initramfs OUT SCENARIO BINARY... : a busybox initramfs with the 6.12
# modules, the binaries (and their libraries) and one scenario script.
q11_initramfs() {
  local out=$1 scenario=$2
  shift 2
  vm_initramfs "$out" "$scenario" "$Q11_DIR/kernel/modules" "$Q11_MODULES" "$@"
}
