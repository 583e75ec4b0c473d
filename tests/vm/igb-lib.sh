# shellcheck shell=bash
# QEMU 10 with its SR-IOV NIC model (sourced): the Intel 82576 (`-device
# igb`), whose guest driver (igb) creates igbvf VFs and takes VF settings -
# a real driver for the host layer and the VF bridge. Debian 12 has QEMU
# 7.2 (no igb); bookworm-backports has QEMU 10, built for Debian 12: its
# packages are unpacked (dpkg-deb -x) into $VM_CACHE/qemu10, never
# installed, so the system's QEMU stays. Guest kernels: Debian 12's 6.1 and
# bookworm-backports' 6.12, each with the modules below, cached under
# $VM_CACHE/igb-<series>. Everything comes from the mirror the host's apt
# already uses, through a separate apt configuration.
#
#   igb_prepare SERIES        # 6.1 | 6.12: builds or checks the caches
#   igb_run SERIES SCENARIO LOG BINARY...

# shellcheck source=vm-lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/vm-lib.sh"

IGB_QEMU=$VM_CACHE/qemu10
IGB_APT=$VM_CACHE/bpo-apt
# Loaded in this order by the guest's init (a module a kernel has built in,
# or lacks - 6.1 has no vDPA - is left out of its list).
IGB_MODULES="virt/lib/irqbypass drivers/vfio/vfio drivers/vfio/vfio_iommu_type1 drivers/vfio/vfio_virqfd
  drivers/vfio/pci/vfio-pci-core drivers/vfio/pci/vfio-pci drivers/dca/dca drivers/i2c/algos/i2c-algo-bit
  drivers/net/ethernet/intel/igb/igb drivers/net/ethernet/intel/igbvf/igbvf drivers/net/tun drivers/net/veth
  drivers/net/macvlan drivers/net/tap drivers/net/macvtap
  drivers/iommu/iova drivers/vhost/vhost_iotlb drivers/vdpa/vdpa drivers/vdpa/vdpa_user/vduse drivers/virtio/virtio_ring
  drivers/virtio/virtio lib/dim/dimlib net/core/failover drivers/net/net_failover drivers/net/virtio_net
  drivers/virtio/virtio_vdpa drivers/vhost/vhost drivers/vhost/vhost_vdpa"


# apt-get/apt-cache over bookworm-backports only, with lists of its own.
igb_apt() {
  local tool=$1
  shift
  "$tool" -o Dir::Etc::SourceList="$IGB_APT/sources.list" -o Dir::Etc::SourceParts=/dev/null \
    -o Dir::State::Lists="$IGB_APT/lists" -o Dir::Cache::archives="$IGB_APT/archives" "$@"
}

igb_apt_ready() { vm_cache "$IGB_APT" igb_apt_build; }

igb_apt_build() {
  local dir=$1 mirror
  mirror=$(vm_mirror)
  [[ -n $mirror ]] || { vm_log "no Debian mirror in the host's apt sources"; return 1; }
  mkdir -p "$dir/lists/partial" "$dir/archives/partial"
  echo "deb $mirror bookworm-backports main" >"$dir/sources.list"
  igb_apt apt-get update -qq
}

# newest VERSION of PACKAGE in bookworm-backports
igb_candidate() { igb_apt apt-cache policy "$1" | awk '/Candidate:/ {print $2}'; }

igb_qemu_prepare() {
  igb_apt_ready || return 1
  vm_cache "$IGB_QEMU" igb_qemu_build
}

# igb_qemu_build DIR: QEMU 10 from bookworm-backports unpacked into DIR.
igb_qemu_build() {
  local dir=$1 v
  v=$(igb_candidate qemu-system-x86)
  [[ $v == 1:1[0-9].* ]] || { vm_log "bookworm-backports has no QEMU 10 (candidate: '$v')"; return 1; }
  # Its libraries come from Debian 12 itself (it was built there).
  local deps=()
  mapfile -t deps < <(igb_apt apt-cache show "qemu-system-x86=$v" | awk -F': ' '/^Depends:/ {print $2; exit}' |
    tr ',' '\n' | sed 's/(.*//; s/|.*//; s/ //g' | grep -E '^lib' || true)
  local missing=()
  for p in "${deps[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  if ((${#missing[@]})); then
    vm_log "installing QEMU 10's libraries: ${missing[*]}"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" || return 1
  fi
  mkdir -p "$dir/debs"
  (cd "$dir/debs" && chmod 777 . &&
    igb_apt apt-get download -qq "qemu-system-x86=$v" "qemu-system-common=$v" "qemu-system-data=$v" \
      "seabios=$(igb_candidate seabios)") || { vm_log "downloading QEMU 10 failed"; return 1; }
  local d
  for d in "$dir"/debs/*.deb; do dpkg-deb -x "$d" "$dir"; done
  rm -rf "$dir/debs"
  if ldd "$dir/usr/bin/qemu-system-x86_64" | grep -q 'not found'; then
    vm_log "QEMU 10 misses libraries: $(ldd "$dir/usr/bin/qemu-system-x86_64" | grep 'not found' | tr '\n' ' ')"
    return 1
  fi
  vm_log "ready: $("$dir/usr/bin/qemu-system-x86_64" --version | head -n 1)"
}

# igb_kernel SERIES: prints the cache directory (vmlinuz, modules/).
igb_kernel() {
  local dir=$VM_CACHE/igb-$1
  if [[ $1 == 6.12 ]]; then igb_apt_ready || return 1; fi
  vm_cache "$dir" igb_kernel_build "$1" || return 1
  echo "$dir"
}

# igb_kernel_build DIR SERIES
igb_kernel_build() {
  local dir=$1 series=$2 pkg
  case $series in
    6.1)
      pkg=$(apt-cache search --names-only '^linux-image-6\.1\.0-[0-9]+-amd64$' | awk '{print $1}' | sort -V | tail -n 1)
      ;;
    6.12)
      pkg=$(igb_apt apt-cache search --names-only '^linux-image-6\.12\.[0-9]+\+deb12[.0-9]*-amd64$' |
        awk '{print $1}' | sort -V | tail -n 1)
      ;;
    *) vm_log "unknown kernel series $series"; return 1 ;;
  esac
  [[ -n $pkg ]] || { vm_log "no $series kernel package found"; return 1; }
  local kver=${pkg#linux-image-} tmp
  tmp=$(mktemp -d)
  chmod 777 "$tmp"
  vm_log "downloading $pkg"
  if [[ $series == 6.1 ]]; then
    (cd "$tmp" && apt-get download -qq "$pkg") || { rm -rf "$tmp"; return 1; }
  else
    (cd "$tmp" && igb_apt apt-get download -qq "$pkg") || { rm -rf "$tmp"; return 1; }
  fi
  mkdir -p "$tmp/x"
  local patterns=("./boot/vmlinuz-$kver") m f
  for m in $IGB_MODULES; do patterns+=("*/modules/$kver/kernel/$m.ko*"); done
  # A module the kernel has built in or merged (6.12: vfio_virqfd is part
  # of vfio) is not in the package: left out of the list the guest loads.
  dpkg-deb --fsys-tarfile "$tmp"/*.deb | tar -x -C "$tmp/x" --wildcards "${patterns[@]}" 2>/dev/null
  [[ -f $tmp/x/boot/vmlinuz-$kver ]] || { vm_log "$pkg has no vmlinuz"; rm -rf "$tmp"; return 1; }
  mkdir -p "$dir/modules"
  cp "$tmp/x/boot/vmlinuz-$kver" "$dir/vmlinuz"
  : >"$dir/modules.list"
  for m in $IGB_MODULES; do
    f=$(find "$tmp/x" -path "*/kernel/$m.ko*" | head -n 1)
    if [[ -z $f ]]; then
      vm_log "$pkg: no $m module (built in or merged): not loaded"
      continue
    fi
    echo "$m" >>"$dir/modules.list"
    case $f in
      *.xz) xz -dc "$f" ;;
      *.zst) zstd -dc "$f" ;;
      *) cat "$f" ;;
    esac >"$dir/modules/$(basename "$m").ko"
  done
  # modules.alias for these modules (depmod over a tree of them): sriovd
  # finds a VF's own driver through it, as modprobe does.
  mkdir -p "$tmp/d/lib/modules/$kver/kernel"
  cp "$dir"/modules/*.ko "$tmp/d/lib/modules/$kver/kernel/"
  depmod -b "$tmp/d" "$kver" 2>/dev/null || { vm_log "depmod failed"; rm -rf "$tmp"; return 1; }
  cp "$tmp/d/lib/modules/$kver/modules.alias" "$dir/modules.alias"
  rm -rf "$tmp"
  echo "$kver" >"$dir/version"
}

igb_prepare() {
  vm_install_tools || return 1
  igb_qemu_prepare || return 1
  igb_kernel "$1" >/dev/null
}

# igb_run SERIES SCENARIO LOG BINARY... : boots QEMU 10 with an igb PF (two
# ports: the PF under test and a second one on the same emulated wire, a
# socket netdev pair, standing in for the switch port across) and an
# intel-iommu; returns 0 when the scenario ended and every check passed.
igb_run() {
  local series=$1 scenario=$2 log=$3
  shift 3
  local kernel
  kernel=$(igb_kernel "$series") || return 1
  local initrd
  initrd=$(mktemp /tmp/sriovd-igb-initrd.XXXXXX)
  # iproute2's ip as /bin/vfip (a name not starting with "ip": ip dispatches on its own name) (busybox's ip knows no VF settings).
  local tools
  tools=$(mktemp -d)
  cp /usr/bin/ip "$tools/vfip"
  vm_initramfs "$initrd" "$scenario" "$kernel/modules" "$(cat "$kernel/modules.list")" "$@" "$tools/vfip"
  rm -rf "$tools"
  # The QEMU monitor on a socket: the scenario's `vm_monitor` lines (set_link)
  # are played by the host below.
  local mon
  mon=$(mktemp -u /tmp/sriovd-igb-mon.XXXXXX)
  vm_log "booting $(cat "$kernel/version") on $("$IGB_QEMU/usr/bin/qemu-system-x86_64" --version | head -n 1 | awk '{print $4}') with $(basename "$scenario") (timeout ${VM_TIMEOUT}s)"
  local rc=0
  # IGB_QEMU_EXTRA: more devices (several arguments, split on spaces).
  # shellcheck disable=SC2086
  timeout --kill-after=10 "$VM_TIMEOUT" "$IGB_QEMU/usr/bin/qemu-system-x86_64" \
    -L "$IGB_QEMU/usr/share/qemu" -L "$IGB_QEMU/usr/share/seabios" \
    -accel tcg -M q35,kernel-irqchip=split -cpu max -m 1024 -smp 2 \
    -device intel-iommu,intremap=on,aw-bits=48 \
    -device pcie-root-port,id=rp1,slot=1 -device pcie-root-port,id=rp2,slot=2 \
    -netdev hubport,id=w0,hubid=0 -netdev hubport,id=w1,hubid=0 \
    -device igb,netdev=w0,bus=rp1,romfile=,mac=52:54:00:00:01:00,id=pf0 \
    -device igb,netdev=w1,bus=rp2,romfile=,mac=52:54:00:00:02:00,id=wire \
    ${IGB_QEMU_EXTRA:-} \
    -kernel "$kernel/vmlinuz" -initrd "$initrd" \
    -append "console=ttyS0 intel_iommu=on iommu=pt quiet loglevel=3 panic=-1 vmtest_watchdog=$((VM_TIMEOUT - 45))" \
    -display none -serial stdio -monitor "unix:$mon,server=on,wait=off" -no-reboot </dev/null >"$log" 2>&1 &
  local qpid=$!
  # Monitor commands the guest asks for ("VMMONITOR cmd" on the console).
  local done_lines=0 started=$SECONDS asked=0
  while kill -0 "$qpid" 2>/dev/null; do
    # Near the timeout: whether QEMU still answers and where the vCPUs are
    # (a guest that printed nothing, not even its watchdog, is stuck below
    # its userspace).
    if ((!asked && SECONDS - started >= VM_TIMEOUT - 15)); then
      asked=1
      vm_log "the guest still runs $((SECONDS - started)) s in; QEMU's monitor:"
      timeout 10 /usr/bin/python3 -c 'import socket,sys,time
s=socket.socket(socket.AF_UNIX); s.settimeout(0.5); s.connect(sys.argv[1])
def cmd(c):
    s.sendall((c+"\n").encode()); out=b""; end=time.time()+2
    while time.time()<end:
        try: b=s.recv(65536)
        except socket.timeout: break
        if not b: break
        out+=b
    return out.decode(errors="replace")
cmd("")
# The status, and the RIP of every vCPU twice, a second apart (moving or stuck).
for c in ["info status", "info registers -a", "info registers -a"]:
    for l in cmd(c).replace("\r", "").splitlines():
        if l.startswith("VM status") or l.startswith("CPU#") or l.startswith("RIP="): print("  " + l[:60])
    time.sleep(1)' "$mon" >&2 || vm_log "QEMU's monitor did not answer"
    fi
    local n
    n=$(grep -c '^VMMONITOR ' "$log" 2>/dev/null || true)
    while ((done_lines < n)); do
      done_lines=$((done_lines + 1))
      local cmd
      cmd=$(grep '^VMMONITOR ' "$log" | sed -n "${done_lines}p" | sed 's/^VMMONITOR //; s/\r$//')
      timeout 5 /usr/bin/python3 -c 'import socket,sys,time
s=socket.socket(socket.AF_UNIX); s.connect(sys.argv[1]); s.sendall((sys.argv[2]+"\n").encode()); time.sleep(0.5)' \
        "$mon" "$cmd" || vm_log "monitor: '$cmd' failed"
    done
    sleep 0.2
  done
  wait "$qpid" || rc=$?
  rm -f "$initrd" "$mon"
  vm_verdict "$log" "$rc" "$log"
}
