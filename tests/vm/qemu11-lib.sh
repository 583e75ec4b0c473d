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
# Bump when what the cache holds changes: an older cache is built again.
Q11_STAMP_VERSION=3
# What the guest loads, in order: virtio-net (virtio_pci is built into
# Debian 13's kernel).
Q11_MODULES="net/core/failover drivers/net/net_failover drivers/net/virtio_net"

q11_root() { echo "$Q11_DIR/root"; }
q11_kernel() { echo "$Q11_DIR/kernel"; }


q11_prepare() {
  if [[ -f $Q11_DIR/stamp ]] && [[ $(cat "$Q11_DIR/stamp") == "$Q11_STAMP_VERSION" ]] &&
    [[ -x $Q11_DIR/root/usr/bin/qemu-system-x86_64 ]] && [[ -f $Q11_DIR/kernel/vmlinuz ]]; then
    return 0
  fi
  [[ $EUID -eq 0 ]] || { vm_log "building the Debian 13 root needs root"; return 1; }
  local mirror
  mirror=$(vm_mirror)
  [[ -n $mirror ]] || { vm_log "no Debian mirror in /etc/apt/sources.list.d/debian.sources"; return 1; }
  local pkgs=()
  for p in debootstrap busybox-static cpio kmod xz-utils; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || pkgs+=("$p")
  done
  if ((${#pkgs[@]})); then
    DEBIAN_FRONTEND=noninteractive apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${pkgs[@]}" >&2
  fi
  local root=$Q11_DIR/root
  # Two steps, each kept once done: the root with QEMU, then the kernel.
  if [[ ! -f $Q11_DIR/root-ready ]]; then
    q11_umount_all
    rm -rf "$Q11_DIR"
    mkdir -p "$Q11_DIR"
    vm_log "debootstrapping Debian 13 into $root (once; a few minutes)"
    debootstrap --variant=minbase trixie "$root" "$mirror" >"$Q11_DIR/debootstrap.log" 2>&1 ||
      { vm_log "debootstrap failed; see $Q11_DIR/debootstrap.log"; tail -n 20 "$Q11_DIR/debootstrap.log" >&2; return 1; }
    cat >"$root/etc/apt/sources.list.d/debian.sources" <<EOF
Types: deb
URIs: $mirror
Suites: trixie trixie-updates trixie-backports
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
EOF
    rm -f "$root/etc/apt/sources.list"
    q11_chroot apt-get update -qq >&2 || return 1
    vm_log "installing qemu-system-x86 from trixie-backports in the root"
    q11_chroot env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
      -t trixie-backports qemu-system-x86 >&2 || return 1
    q11_chroot apt-get clean >&2 || true
    touch "$Q11_DIR/root-ready"
  fi
  local version
  version=$(q11_chroot qemu-system-x86_64 --version | head -n 1)
  [[ $version =~ version\ (1[1-9]|[2-9][0-9])\. ]] ||
    { vm_log "the root's QEMU is not 11 or newer: $version"; return 1; }
  # The guest kernel: Debian 13's 6.12, its vmlinuz and the modules above.
  local kpkg
  # Named like linux-image-6.12.NN+deb13-amd64 (the signed one).
  kpkg=$(q11_chroot apt-cache search --names-only '^linux-image-6\.12\.[0-9]+[^-]*-amd64$' | awk '{print $1}' |
    grep -v -e '-unsigned' -e '-dbg' | sort -V | tail -n 1)
  [[ -n $kpkg ]] || { vm_log "no linux-image-6.12 package in Debian 13"; return 1; }
  mkdir -p "$root/tmp/kernel"
  (cd "$root/tmp/kernel" && chmod 777 . && q11_chroot sh -c "cd /tmp/kernel && apt-get download $kpkg" >&2) ||
    return 1
  local kver=${kpkg#linux-image-}
  local x=$Q11_DIR/x
  mkdir -p "$x" "$Q11_DIR/kernel/modules"
  # Modules are compressed (.ko.xz) under lib/ or usr/lib/: busybox's
  # insmod takes them plain.
  local patterns=("./boot/vmlinuz-$kver")
  for m in $Q11_MODULES; do patterns+=("*/modules/$kver/kernel/$m.ko*"); done
  dpkg-deb --fsys-tarfile "$root"/tmp/kernel/*.deb | tar -x -C "$x" --wildcards "${patterns[@]}" ||
    { vm_log "$kpkg lacks a module the guest needs"; return 1; }
  cp "$x/boot/vmlinuz-$kver" "$Q11_DIR/kernel/vmlinuz"
  local f
  for m in $Q11_MODULES; do
    f=$(find "$x" -path "*/kernel/$m.ko*" | head -n 1)
    case $f in
      *.xz) xz -dc "$f" ;;
      *.zst) zstd -dc "$f" ;;
      *) cat "$f" ;;
    esac >"$Q11_DIR/kernel/modules/$(basename "$m").ko"
  done
  rm -rf "$x" "$root/tmp/kernel"
  echo "$kver" >"$Q11_DIR/kernel/version"
  echo "$version" >"$Q11_DIR/qemu-version"
  echo "$Q11_STAMP_VERSION" >"$Q11_DIR/stamp"
  vm_log "ready: $version, guest kernel $kver"
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
  exec unshare -m --propagation private sh -c '
    root=$1 work=$2; shift 2
    mount --rbind /dev "$root/dev" && mount -t proc proc "$root/proc" && mount --rbind /sys "$root/sys" &&
      mkdir -p "$root$work" && mount --bind "$work" "$root$work" &&
      exec chroot "$root" /usr/bin/qemu-system-x86_64 "$@"' q11 "$root" "$work" "$@"
}

q11_umount_all() {
  # Only for a root left from a run without a mount namespace (none here);
  # kept so that rm -rf never walks into a bound /dev or /sys.
  local root=$Q11_DIR/root m
  [[ -d $root ]] || return 0
  for m in $(awk -v r="$root" '$2 ~ "^"r {print $2}' /proc/mounts | sort -r); do umount -l "$m" 2>/dev/null || true; done
}

# q11_initramfs OUT SCENARIO BINARY... : a busybox initramfs with the 6.12
# modules, the binaries (and their libraries) and one scenario script.
q11_initramfs() {
  local out=$1 scenario=$2
  shift 2
  vm_initramfs "$out" "$scenario" "$Q11_DIR/kernel/modules" "$Q11_MODULES" "$@"
}
