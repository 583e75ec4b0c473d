#!/usr/bin/env bash
# Interop: QEMU 11's own vfio-user client (vfio-user-pci, from Debian 13's
# backports, run in a cached Debian 13 root: tests/vm/qemu11-lib.sh) with an
# unmodified Linux 6.12 guest, against sriovd on a simulated host:
#  1. virtio-net-pci over vfio-user, two queue pairs, bridged to VF 1's
#     netdev: the guest's MSI-X interrupts arrive (QEMU keeps the table and
#     never forwards it), ping and iperf3 both ways to the wire, traffic on
#     every queue, a reload of sriovd while iperf3 runs;
#  2. a guest reboot (QEMU's system_reset: SET_IRQS off, DEVICE_RESET, DMA
#     remaps) and the same checks again;
#  3. QEMU SIGKILLed with the device running: nothing of its memory stays
#     mapped in sriovd; a new QEMU on the same socket passes the checks;
#  4. three VF exports attached too, one per MSI-X policy (adaptive,
#     direct, relay): the guest enables MSI-X on each and receives the
#     interrupt each VF raises (sriovctl simulate-interrupt), once.
#  5. (issue 41) sriovd upgraded in place - in place (sriovctl upgrade)
#     and through the service manager's fd store (systemctl restart) -
#     once each when the guest armed its VFs, then each VF's interrupt
#     reaches it once; once each again while iperf3 runs over
#     virtio-net-pci (vfio-user) and over QEMU's own vhost-user NIC and
#     one VF storms MSI-X while the other two raise one interrupt at a
#     time: QEMU keeps every connection, the guest counts every interrupt.
# sriovd runs as a service of a systemd user manager (the real one, in the
# script's own mount namespace) as the packaged unit runs it: Type=notify,
# its watchdog and fd store.
#   tests/interop/qemu_vfio_user.sh BUILD_DIR
set -euo pipefail
source "$(dirname "$0")/../../scripts/lib/interop.sh"
build=${1:?usage: qemu_vfio_user.sh BUILD_DIR}
in_private_mounts "$@"
here=$(cd "$(dirname "$0")/.." && pwd)
# shellcheck source=../vm/qemu11-lib.sh
source "$here/vm/qemu11-lib.sh"
need_root_tun "the QEMU vfio-user interop test"
q11_prepare || { echo "FAIL: QEMU 11 and its Debian 13 root could not be prepared" >&2; exit 1; }
ns=sriovd-q11w$$
interop_workspace sriovd-q11 "$ns"
chmod 0755 "$work"
rc=0
fail() { echo "FAIL: $*"; rc=1; }

{
  simulated_host_config "$work/state" "$work/control.sock" "sdq11pf$$"
  cat <<CONF
physical_functions:
  - address: "0000:3b:00.0"
    num_vfs: 4
    vfs:
      - index: 0
        assign: {owner: vm-q11, export: vfio-user, socket: $work/vf0.sock, msix_policy: adaptive}
      - index: 2
        assign: {owner: vm-q11, export: vfio-user, socket: $work/vf2.sock, msix_policy: direct}
      - index: 3
        assign: {owner: vm-q11, export: vfio-user, socket: $work/vf3.sock, msix_policy: relay}
virtio_devices:
  - name: vnet-q11
    type: net
    transport: vfio-user
    socket: $work/vnet.sock
    queues: 2
    queue_size: 256
    mac: "02:5a:00:00:07:01"
    backend: {type: vf, pf: "0000:3b:00.0", vf: 1, via: macvtap}
CONF
} >"$work/sriovd.yaml"
user_manager_start "$work/systemd" || exit 1
# The packaged unit's service settings that the handover depends on, the
# rest of its sandbox aside (a user manager's services cannot have it all).
unit=$build/host-files/sriovd.service
{
  echo "[Service]"
  grep -E '^(Type|NotifyAccess|WatchdogSec|TimeoutStopSec|FileDescriptorStoreMax)=' "$unit"
  echo "ExecStart=$build/src/sriovd --config $work/sriovd.yaml --foreground"
  echo "StandardOutput=append:$work/sriovd.log"
  echo "StandardError=inherit"
} >"$work/systemd/config/systemd/user/sriovd.service"
grep -q '^FileDescriptorStoreMax=[1-9]' "$work/systemd/config/systemd/user/sriovd.service" ||
  { echo "FAIL: $unit has no fd store (FileDescriptorStoreMax)"; exit 1; }
user_ctl start sriovd.service || { echo "sriovd.service did not start:"; cat "$work/sriovd.log"; exit 1; }
main_pid() { user_ctl show -p MainPID --value sriovd.service; }
sriovd_pid=$(main_pid)
ctl() { "$build/src/sriovctl" --socket "$work/control.sock" "$@"; }
for _ in $(seq 100); do [[ -S $work/vnet.sock ]] && break; sleep 0.1; done
[[ -S $work/vnet.sock ]] || { echo "sriovd did not come up:"; cat "$work/sriovd.log"; exit 1; }
json_get() { python3 -c "import json, sys; d = json.load(sys.stdin); print($1)"; }
netdev=$(ctl --json devices | json_get "[v['backend'].get('netdev', '') for v in d['virtio_devices'] if v['name'] == 'vnet-q11'][0]")
[[ -n $netdev ]] || { echo "vnet-q11 has no VF netdev"; ctl devices; exit 1; }
# The VF's netdev is one end of a veth (simulated host); the other is the wire.
ip link set "${netdev}p" netns "$ns"
ip -n "$ns" addr add 10.77.0.1/24 dev "${netdev}p"
ip -n "$ns" link set "${netdev}p" up
ip -n "$ns" link set lo up
ip netns exec "$ns" iperf3 -s -B 10.77.0.1 >"$work/iperf3-server.log" 2>&1 &
pids+=($!)

kernel=$(q11_kernel)
cp "$kernel/vmlinuz" "$work/vmlinuz"
q11_initramfs "$work/initrd.gz" "$here/vm/scenarios/vfio-user-net.sh" /usr/bin/iperf3

qemu_extra=()  # more QEMU arguments for start_qemu
# start_qemu LOG [INITRD PARAMS SOCKET...]: QEMU in the Debian 13 root
# with a vfio-user-pci device on each socket (by default virtio-net-pci and
# the three VF exports, and the vfio-user-net scenario); its monitor on
# $work/mon.sock. Sets $qemu_pid.
start_qemu() {
  local log=$1 initrd=${2:-$work/initrd.gz} params=${3:-GUEST_IPERF_SECONDS=3} devices=() sock
  shift $(($# < 3 ? $# : 3))
  (($# > 0)) || set -- vnet vf0 vf2 vf3
  for sock in "$@"; do
    devices+=(-device "{\"driver\":\"vfio-user-pci\",\"socket\":{\"type\":\"unix\",\"path\":\"$work/$sock.sock\"}}")
  done
  rm -f "$work/mon.sock"
  q11_qemu "$work" -accel tcg -machine q35,memory-backend=mem -cpu max -m 512 -smp 2 \
    -object memory-backend-memfd,id=mem,size=512M,share=on \
    "${devices[@]}" "${qemu_extra[@]}" \
    -kernel "$work/vmlinuz" -initrd "$initrd" \
    -append "console=ttyS0 quiet loglevel=4 panic=-1 $params" \
    -display none -nodefaults -serial "file:$log" -monitor "unix:$work/mon.sock,server=on,wait=off" \
    </dev/null >"$log.qemu" 2>&1 &
  qemu_pid=$!
  pids+=("$qemu_pid")
}
monitor() {
  python3 - "$work/mon.sock" "$1" <<'EOF'
import socket, sys, time
s = socket.socket(socket.AF_UNIX)
s.settimeout(10)
s.connect(sys.argv[1])
s.sendall(sys.argv[2].encode() + b"\n")
time.sleep(0.5)
s.close()
EOF
}
# monitor_out COMMAND: the monitor's answer to COMMAND, as text.
monitor_out() {
  python3 - "$work/mon.sock" "$1" <<'EOF'
import re, socket, sys, time
s = socket.socket(socket.AF_UNIX)
s.settimeout(10)
s.connect(sys.argv[1])
time.sleep(0.3)
s.recv(65536)  # the banner and prompt
s.sendall(sys.argv[2].encode() + b"\n")
time.sleep(1)
out = s.recv(65536).decode(errors="replace")
s.close()
out = re.sub(r"\x1b\[[0-9;]*[A-Za-z]", "", out).replace("\r", "")
print("\n".join(l for l in out.splitlines()[1:] if l.strip() and not l.startswith("(qemu)")))
EOF
}
# wait_line LOG FROM PATTERN SECONDS: the pattern in LOG after line FROM.
wait_line() {
  local deadline=$((SECONDS + $4))
  while ((SECONDS < deadline)); do
    tail -n +"$(($2 + 1))" "$1" 2>/dev/null | grep -q -- "$3" && return 0
    kill -0 "$qemu_pid" 2>/dev/null || return 1
    sleep 0.5
  done
  return 1
}
lines() { wc -l <"$1"; }
# check_boot NAME LOG FROM: one boot's checks, from line FROM of LOG on.
check_boot() {
  local name=$1 log=$2 from=$3
  vf_interrupts "$name" "$log" "$from"
  if ! wait_line "$log" "$from" "VMTEST PHASE traffic-for-reload" 240; then
    fail "$name: the guest did not get through its checks"
    tail -n +"$((from + 1))" "$log" | tail -n 40
    return
  fi
  local out
  out=$(tail -n +"$((from + 1))" "$log")
  echo "$out" | grep -E '^VMTEST (PASS|FAIL|BENCH|QUEUE|INFO)' | sed "s/^/  $name: /"
  for c in guest-has-virtio-net guest-uses-msix guest-pings-wire guest-iperf3-tx guest-iperf3-rx; do
    echo "$out" | grep -q "^VMTEST PASS $c" || fail "$name: $c did not pass"
  done
  ! echo "$out" | grep -q '^VMTEST FAIL' || fail "$name: a guest check failed"
  # Two queue pairs: each queue's vector interrupted the guest.
  local queues
  queues=$(echo "$out" | grep -c '^VMTEST QUEUE .*-[io][nu][pt]' || true)
  [[ $queues -ge 4 ]] || fail "$name: $queues queue vectors seen, 4 expected"
  if echo "$out" | grep -E '^VMTEST QUEUE' | awk '$4 == 0 {bad=1} END {exit !bad}'; then
    fail "$name: a queue's vector never interrupted"
  fi
}
# QEMU's guest RAM (its memory-backend-memfd), as sriovd maps it.
# vf_interrupts NAME LOG FROM: once the guest armed its VFs, each VF raises
# vector 0 in turn; the guest must count one more interrupt each time.
vf_interrupts() {
  local name=$1 log=$2 from=$3 k=0 vf policy
  if ! wait_line "$log" "$from" "VMTEST PHASE vf-armed 3" 240; then
    fail "$name: the guest did not arm its three VFs"
    return
  fi
  # What the caller wants done once the VFs are armed (before_vf_irqs=CMD).
  [[ -z ${before_vf_irqs:-} ]] || $before_vf_irqs
  for vf in $(ctl --json devices | json_get "' '.join(e['vf'] + '=' + e['msix_policy'] for e in d['vfio_user_exports'])"); do
    policy=${vf#*=}
    vf=${vf%=*}
    k=$((k + 1))
    ctl simulate-interrupt "$vf" 0 >/dev/null || { fail "$name: simulate-interrupt $vf refused"; continue; }
    if wait_line "$log" "$from" "VMTEST VFIRQ $k\b" 20; then
      echo "  $name: VF $vf ($policy): the guest received its MSI-X interrupt"
    else
      fail "$name: VF $vf ($policy): its interrupt did not reach the guest"
    fi
  done
  [[ $k -eq 3 ]] || fail "$name: $k VF exports listed, 3 expected"
  # Each arrived once: no more than three in all.
  wait_line "$log" "$from" "VMTEST PHASE vf-irqs-done 3\b" 70 || fail "$name: the guest did not count exactly 3 VF interrupts"
}
memfd_mappings() { grep -c 'memfd:memory-backend-memfd' "/proc/$sriovd_pid/maps" || true; }

# --- 1. first boot, a reload under traffic ---
log=$work/console-1.log
start_qemu "$log"
check_boot boot-1 "$log" 0
queue_json=$(ctl --json devices | json_get "[[q['packets'] for q in v['queues']] for v in d['virtio_devices'] if v['name'] == 'vnet-q11'][0]")
echo "  sriovd per-queue packets: $queue_json"
python3 -c "import sys; q = $queue_json; sys.exit(0 if len(q) >= 4 and all(x > 0 for x in q[:4]) else 1)" ||
  fail "not every queue of vnet-q11 carried traffic: $queue_json"
# A reload while iperf3 runs: it adds a device (a vhost-user NIC on a tap)
# and leaves the guest's two as they are - their sessions go on.
cat >>"$work/sriovd.yaml" <<CONF
  - name: vnet-added
    type: net
    transport: vhost-user
    socket: $work/added.sock
    backend: {type: tap, name: sdq11t$$, netns: $ns}
CONF
ctl reload >/dev/null || fail "the reload under traffic was refused"
ctl --json devices | json_get "[v['name'] for v in d['virtio_devices']]" | grep -q vnet-added ||
  fail "the reload did not add vnet-added"
wait_line "$log" 0 "VMTEST PHASE boot-done" 60 || fail "boot-1: the iperf3 under the reload did not end"
grep -q "^VMTEST PASS guest-iperf3-during-reload" "$log" || fail "boot-1: iperf3 failed across the reload"

# --- 2. guest reboot ---
from=$(lines "$log")
monitor system_reset
check_boot boot-2 "$log" "$from"
wait_line "$log" "$from" "VMTEST PHASE boot-done" 60 || fail "boot-2: did not finish"

# --- 3. QEMU SIGKILLed while the device runs; a new QEMU on the same socket ---
held=$(memfd_mappings)
echo "  sriovd's memfd mappings with QEMU attached: $held"
[[ $held -gt 0 ]] || fail "sriovd maps no memfd with QEMU attached (the test would prove nothing)"
kill -KILL "$qemu_pid" || fail "QEMU had already gone before the SIGKILL"
wait "$qemu_pid" 2>/dev/null || true
for _ in $(seq 100); do [[ $(memfd_mappings) -eq 0 ]] && break; sleep 0.1; done
[[ $(memfd_mappings) -eq 0 ]] || fail "sriovd still maps $(memfd_mappings) memfd window(s) of the killed QEMU"
log=$work/console-3.log
start_qemu "$log"
check_boot boot-3 "$log" 0
wait_line "$log" 0 "VMTEST PHASE boot-done" 60 || fail "boot-3: did not finish"
# QEMU 11.1 and live migration (README "Live migration"): recorded, not
# required. Its vfio-user-pci sets up no VFIO migration - no blocker, no
# DEVICE_FEATURE, no DMA logging - so a migration completes without the
# devices' state ("vfio=0 B") and without the pages they wrote: a hazard
# the README warns of. Should a QEMU start to migrate them, sriovd's log
# shows its DEVICE_FEATURE messages here.
monitor_out "migrate -d exec:cat>/dev/null" >/dev/null || true
sleep 3
migrated=$(monitor_out "info migrate" || true)
echo "  QEMU 11.1 migrating the VM: $(echo "$migrated" | grep -E '^Status' | tr -s ' \t' ' '); $(echo "$migrated" | grep -oE 'vfio=[0-9.]+ [KMG]?i?B' || echo 'no vfio channel')"
heard=$(grep -E "migration|DMA logging|DEVICE_FEATURE" "$work/sriovd.log" | head -n 5 || true)
if [[ -n $heard ]]; then
  # shellcheck disable=SC2001  # a prefix on each of several lines
  echo "$heard" | sed 's/^/  sriovd: /'
else
  echo "  sriovd heard no migration message from QEMU"
fi
monitor quit || true
wait "$qemu_pid" 2>/dev/null || true
for _ in $(seq 100); do [[ $(memfd_mappings) -eq 0 ]] && break; sleep 0.1; done
[[ $(memfd_mappings) -eq 0 ]] || fail "sriovd still maps memory of the QEMU that quit"

# --- 5. sriovd upgraded in place under the guest (issue 41) ---
# A boot with all four vfio-user devices and a virtio-net-pci of QEMU's on
# sriovd's vhost-user socket: twice once the guest has armed its VFs (MSI-X
# enabled, entry 0 unmasked), then each VF's interrupt must reach the guest
# once; twice more while iperf3 runs over both NICs, one VF storms MSI-X and
# the other two raise interrupts one at a time (the guest counts each). QEMU keeps every
# connection (the upgraded sriovd counts the ones it took over), iperf3
# ends without an error on both.
upgrade_twice() {
  ctl --timeout 60 upgrade | sed 's/^/  upgrade: /' || fail "sriovctl upgrade under QEMU 11 failed"
  sleep 1
  local t0=$SECONDS old=$sriovd_pid
  user_ctl restart sriovd.service || fail "systemctl restart under QEMU 11 failed"
  sriovd_pid=$(main_pid)
  echo "  restart: sriovd $old -> $sriovd_pid in $((SECONDS - t0)) s, the fd store's handover: $(grep -c "fd store for the next sriovd" "$work/sriovd.log") so far"
  [[ $sriovd_pid != "$old" && $sriovd_pid -gt 0 ]] || fail "systemctl restart left sriovd's main PID at $sriovd_pid"
  sleep 1
}
# The guest's second NIC: QEMU's own vhost-user front-end on vnet-added,
# whose tap (in the test's namespace) is the far end of that wire.
ip -n "$ns" addr add 10.79.0.1/24 dev "sdq11t$$"
ip -n "$ns" link set "sdq11t$$" up
ip netns exec "$ns" iperf3 -s -B 10.79.0.1 >"$work/iperf3-vhost-server.log" 2>&1 &
pids+=($!)
qemu_extra=(-chardev "socket,id=vu0,path=$work/added.sock" -netdev "vhost-user,id=nu0,chardev=vu0"
  -device "virtio-net-pci,netdev=nu0,mac=02:5a:00:00:08:01")
log=$work/console-upgrade.log
start_qemu "$log" "$work/initrd.gz" "GUEST_IPERF_SECONDS=3 GUEST_RELOAD_SECONDS=12 GUEST_VHOST_NET=10.79.0 GUEST_VF_STORM=300"
qemu_extra=()
before_vf_irqs=upgrade_twice check_boot boot-upgrade "$log" 0
upgrade_twice
wait_line "$log" 0 "VMTEST PHASE boot-done" 90 || fail "boot-upgrade: the iperf3 under the upgrades did not end"
grep -q "^VMTEST PASS guest-iperf3-during-reload" "$log" || fail "boot-upgrade: iperf3 failed across the upgrades"
grep -q "^VMTEST PASS guest-iperf3-vhost-user-during-reload" "$log" ||
  fail "boot-upgrade: iperf3 over vhost-user failed across the upgrades"
grep -E "^VMTEST (BENCH|FAIL) .*(during-reload|vf-)" "$log" | sed 's/^/  boot-upgrade: /' || true
# The VFs' interrupts through the upgrades, as the guest counted them: one
# VF storming (300/s), the others raising one at a time, each exactly once.
grep -q "^VMTEST PASS vf-one-at-a-time" "$log" || fail "boot-upgrade: a VF interrupt raised one at a time was lost or doubled"
grep -q "^VMTEST PASS vf-storm" "$log" || fail "boot-upgrade: the VF storm did not reach the guest"
conns=$(ctl --json devices | json_get "' '.join(['%s=%s' % (v['name'], v['vfio_user']['connections']) for v in d['virtio_devices'] if v['name'] == 'vnet-q11'] + ['%s=%s' % (v['name'], v['vhost_user']['connections']) for v in d['virtio_devices'] if v['name'] == 'vnet-added'] + ['%s=%s' % (e['vf'], e.get('vfio_user', e).get('connections', '?')) for e in d['vfio_user_exports']])")
echo "  connections after four upgrades: $conns"
for c in $conns; do [[ ${c#*=} == 1 ]] || fail "after the upgrades, ${c%=*} counts ${c#*=} connections (want 1: QEMU's, taken over)"; done
taken=$(grep -c "vnet-q11: client (pid [0-9]*) taken over from the previous sriovd" "$work/sriovd.log" || true)
[[ $taken -eq 4 ]] || fail "QEMU's virtio-net-pci connection was taken over $taken times, 4 expected"
taken=$(grep -c "vnet-added: front-end taken over from the previous sriovd" "$work/sriovd.log" || true)
[[ $taken -eq 4 ]] || fail "QEMU's vhost-user connection was taken over $taken times, 4 expected"
taken=$(grep -c "vfio-user: VF .* taken over from the previous sriovd" "$work/sriovd.log" || true)
[[ $taken -eq 12 ]] || fail "QEMU's VF export connections were taken over $taken times, 12 expected"
monitor quit || true
wait "$qemu_pid" 2>/dev/null || true

kill -0 "$sriovd_pid" || fail "sriovd died"
grep -E "refused|error" "$work/sriovd.log" | head -n 20 | sed 's/^/  sriovd: /' || true
if [[ $rc -ne 0 ]]; then
  # Kept for whoever reads the failure (SRIOVD_KEEP_LOGS=DIR).
  [[ -n ${SRIOVD_KEEP_LOGS:-} ]] && mkdir -p "$SRIOVD_KEEP_LOGS" && cp "$work"/*.log* "$SRIOVD_KEEP_LOGS"/
  echo "--- sriovd ---"
  tail -n 60 "$work/sriovd.log"
  for l in "$work"/console-*.log; do echo "--- $l ---"; tail -n 30 "$l"; cat "$l.qemu"; done
fi
exit $rc
