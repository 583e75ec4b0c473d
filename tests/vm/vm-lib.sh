# shellcheck shell=bash
# The real-kernel VM harness (sourced). A Debian kernel boots under QEMU TCG
# with an emulated Intel IOMMU and an SR-IOV NVMe PF; a busybox initramfs
# carries the binaries under test and one scenario script, whose
# "VMTEST PASS|FAIL name" lines come back on the serial console.
# Reused by every layer that needs real VFIO: give vm_run other binaries and
# another scenario.

# What existed before these libraries defined anything: the environment and
# bash's own variables, which no cache key reads (vm_cache_key).
VM_VARS_BEFORE=" $(compgen -v | tr '\n' ' ') "
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

# Caches. What a test builds from Debian's packages once (kernels, unpacked
# QEMU, debootstrapped roots) is kept under $VM_CACHE between runs, one
# directory per cache, built by a function of these libraries (its builder).
# Each cache is keyed by what builds it: the builder's text, the text of every
# library function it calls (transitively), the library globals they read and
# the builder's arguments. A cache whose key is not its builder's - the
# builder changed, or an earlier build did not finish - is built again, never
# used: a change to a builder is exercised by the next run on every machine,
# not only on the one without a cache.

# vm_cache_key BUILDER [ARG...]: prints the key (a SHA-256).
vm_cache_key() {
  (
    shopt -s extdebug  # declare -F names the file that defined a function
    local -A seen=() vars=()
    local queue=("$1") f word where out=""
    shift
    while ((${#queue[@]})); do
      f=${queue[0]}
      queue=("${queue[@]:1}")
      [[ -n ${seen[$f]:-} ]] && continue
      seen[$f]=1
      out+="$(declare -f "$f")"$'\n'
      for word in $(declare -f "$f" | grep -oE '[A-Za-z_][A-Za-z0-9_]*' | sort -u); do
        # A function of a library (a *-lib.sh or scripts/lib/*.sh file), not
        # of the script that sourced it: a caller's own functions would make
        # the key depend on who asks.
        if [[ -z ${seen[$word]:-} ]] && where=$(declare -F "$word") &&
          [[ ${where##* } == *-lib.sh || ${where##* } == */lib/*.sh ]]; then
          queue+=("$word")
        fi
        if [[ $word =~ ^[A-Z][A-Z0-9_]*$ && $VM_VARS_BEFORE != *" $word "* ]] &&
          declare -p "$word" >/dev/null 2>&1; then
          vars[$word]=1
        fi
      done
    done
    for word in $(printf '%s\n' "${!vars[@]}" | sort); do out+="$(declare -p "$word")"$'\n'; done
    out+="arguments: $*"
    sha256sum <<<"$out" | cut -d' ' -f1
  )
}

# vm_cache_remove DIR: unmounts what a run left mounted below DIR (a root's
# bound /dev, say: rm -rf must never walk into it) and removes DIR.
vm_cache_remove() {
  local dir=$1 m
  [[ -e $dir ]] || return 0
  awk -v d="$(realpath "$dir")" 'index($2, d "/") == 1 {print $2}' /proc/mounts | sort -r |
    while read -r m; do umount -l "$m" 2>/dev/null || true; done
  rm -rf "$dir"
}

# vm_cache DIR BUILDER [ARG...]: makes DIR hold what `BUILDER DIR ARG...`
# builds into the empty directory DIR, building it when DIR's key is not
# BUILDER's. One build at a time per cache (flock on DIR.lock); the key is
# written last, so a cache with a key is complete.
vm_cache() {
  local dir=$1 builder=$2 key
  shift 2
  key=$(vm_cache_key "$builder" "$@") || return 1
  [[ -f $dir/.cache-key && $(<"$dir/.cache-key") == "$key" ]] && return 0
  mkdir -p "$(dirname "$dir")"
  (
    exec {lock}>"$dir.lock"
    flock "$lock"
    [[ -f $dir/.cache-key && $(<"$dir/.cache-key") == "$key" ]] && exit 0
    [[ $EUID -eq 0 ]] || { vm_log "building the cache $dir needs root"; exit 1; }
    if [[ -e $dir ]]; then
      vm_log "$dir was built by another version of $builder (or not finished): building it again"
    else
      vm_log "building $dir ($builder; once, then kept until $builder changes)"
    fi
    vm_cache_remove "$dir"
    mkdir -p "$dir"
    "$builder" "$dir" "$@" >&2 || { vm_log "$builder failed: $dir not built"; exit 1; }
    echo "$key" >"$dir/.cache-key"
  )
}

# The newest Debian 6.1 kernel: vmlinuz, the modules the guest needs and
# their version, in the cache kernel-6.1. Prints its directory.
vm_kernel() {
  local dir=$VM_CACHE/kernel-6.1
  vm_cache "$dir" vm_kernel_build || return 1
  echo "$dir"
}

vm_kernel_build() {
  local dir=$1 pkg
  pkg=$(apt-cache search --names-only '^linux-image-6\.1\.0-[0-9]+-amd64$' | awk '{print $1}' | sort -V | tail -n 1)
  if [[ -z $pkg ]]; then
    apt-get update -qq
    pkg=$(apt-cache search --names-only '^linux-image-6\.1\.0-[0-9]+-amd64$' | awk '{print $1}' | sort -V | tail -n 1)
  fi
  [[ -n $pkg ]] || { vm_log "no linux-image-6.1.0-*-amd64 package found"; return 1; }
  local version=${pkg#linux-image-} tmp
  tmp=$(mktemp -d)
  vm_log "downloading $pkg"
  (cd "$tmp" && chmod 777 "$tmp" && apt-get download "$pkg") || { rm -rf "$tmp"; return 1; }
  mkdir -p "$tmp/x" "$dir/modules"
  local patterns=("./boot/vmlinuz-$version") m
  for m in $VM_MODULES; do patterns+=("./lib/modules/$version/kernel/$m.ko"); done
  dpkg-deb --fsys-tarfile "$tmp"/*.deb | tar -x -C "$tmp/x" "${patterns[@]}" || { rm -rf "$tmp"; return 1; }
  cp "$tmp/x/boot/vmlinuz-$version" "$dir/vmlinuz"
  for m in $VM_MODULES; do cp "$tmp/x/lib/modules/$version/kernel/$m.ko" "$dir/modules/"; done
  echo "$version" >"$dir/version"
  rm -rf "$tmp"
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

  vm_log "booting $(cat "$kernel/version") with $(basename "$scenario") (timeout ${VM_TIMEOUT}s)"
  local rc=0
  # shellcheck disable=SC2086  # VM_QEMU_EXTRA is several arguments
  timeout --kill-after=10 "$VM_TIMEOUT" qemu-system-x86_64 \
    -accel tcg -M q35,kernel-irqchip=split -cpu max -m 768 -smp 2 \
    -device "intel-iommu,intremap=on,aw-bits=${VM_IOMMU_AW_BITS:-48}${VM_IOMMU_OPTS:-}" \
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
