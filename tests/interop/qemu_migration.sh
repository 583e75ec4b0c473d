#!/usr/bin/env bash
# Interop: live migration of a Linux guest on sriovd's vhost-user NICs
# between two QEMU 7.2 processes on this machine (-incoming, QMP migrate).
# Two sriovd daemons stand in for two hosts; each serves the guest's two
# NICs (eth0 with guest_announce on, eth1 with it off) on taps bridged to
# one wire (a bridge in a namespace this test creates, 10.89.0.1). While a
# known TCP stream flows into the guest (and a ping), QEMU copies the guest
# and sriovd logs every page it writes; the guest's checksum of the stream
# is the verdict on every byte (offloads on: the guest does not verify TCP
# checksums, so a stale page would show).
#   Round 1: A -> B. Asserts: no blocker, completed, the stream's checksum,
#            pings after, the guest announced on the destination's wire
#            (eth0: its own GARP; eth1: sriovd's RARP on QEMU's SEND_RARP),
#            the bridge has moved the guest's MAC to B's tap.
#   Round 2: B -> A', cancelled midway: the guest goes on on B, logging off.
#   Round 3: B -> A' with B's sriovd SIGKILLed and started again during the
#            copy: QEMU reconnects; the migration ends (completed, or failed
#            and then done again) and the stream arrives whole.
#   tests/interop/qemu_migration.sh BUILD_DIR
# For scripts/bench migration: MIGRATION_REPORT=FILE gets each round's
# query-migrate answer (JSON lines); MIGRATION_NIC=qemu-tap gives the guest
# QEMU's own virtio-net on taps instead (the baseline; round 1 only, its
# checks but sriovd's); MIGRATION_ROUNDS=1|2 stops after round 1|2;
# MIGRATION_RING=packed gives the NICs packed rings (split by default).
# Packed rings do not take round 3: QEMU (7.2) cannot restore a packed
# ring's position when its back-end vanishes (it has no used index in
# guest memory to read it from, and vhost-user-net uses no inflight
# buffer), so after a back-end crash it hands the new one a stale base.
set -euo pipefail
source "$(dirname "$0")/../../scripts/lib/interop.sh"
build=${1:?usage: qemu_migration.sh BUILD_DIR}
here=$(cd "$(dirname "$0")/.." && pwd)
root=$(cd "$here/.." && pwd)
# shellcheck source=../vm/vm-lib.sh
source "$here/vm/vm-lib.sh"
vm_install_tools || { echo "SKIP: QEMU tools missing and not root" >&2; exit 77; }
need_root_tun "the QEMU migration test"
ns=sriovd-mg$$
interop_workspace sriovd-migrate "$ns"
qmp() { python3 "$root/scripts/lib/qmp.py" "$@"; }
nic=${MIGRATION_NIC:-sriovd}
rounds=${MIGRATION_ROUNDS:-3}
ring=${MIGRATION_RING:-split}
[[ $ring == split || $ring == packed ]] || { echo "MIGRATION_RING is split or packed" >&2; exit 64; }
packed_on=off
[[ $ring == packed ]] && packed_on=on
[[ $nic == sriovd || $nic == qemu-tap ]] || { echo "MIGRATION_NIC is sriovd or qemu-tap" >&2; exit 64; }
[[ $nic == sriovd ]] || rounds=1
mac0=52:54:00:5d:00:01
mac1=52:54:00:5d:00:02

ip -n "$ns" link add br0 type bridge
ip -n "$ns" addr add 10.89.0.1/24 dev br0
ip -n "$ns" link set br0 up

# start_host NAME: a sriovd ("host" NAME) with the guest's two NICs on taps
# NAME0 and NAME1 joined to the wire. Sets host_pid[NAME].
declare -A host_pid
start_host() {
  local name=$1 log=${2:-$work/$1.log}
  if [[ ! -f $work/$name.yaml ]]; then
    {
      simulated_host_config "$work/$name-state" "$work/$name-control.sock" "sdmg$name$$"
      echo "virtio_devices:"
      for i in 0 1; do
        cat <<CONF
  - name: $name-net$i
    type: net
    transport: vhost-user
    socket: $work/$name-net$i.sock
    queue_size: 256
    packed: "$packed_on"
    backend: {type: tap, name: mg$name$i$$, netns: $ns}
CONF
      done
    } >"$work/$name.yaml"
  fi
  "$build/src/sriovd" --config "$work/$name.yaml" --foreground >>"$log" 2>&1 &
  host_pid[$name]=$!
  pids+=($!)
  local up=0
  for _ in $(seq 100); do
    if [[ -S $work/$name-net1.sock ]] && ip -n "$ns" link show "mg${name}1$$" >/dev/null 2>&1; then
      up=1
      break
    fi
    sleep 0.1
  done
  [[ $up -eq 1 ]] || { echo "sriovd $name did not come up:"; cat "$log"; exit 1; }
  for i in 0 1; do ip -n "$ns" link set "mg$name$i$$" master br0 up; done
}

kernel=$(vm_kernel)
initrd=$work/initrd.gz
vm_initramfs "$initrd" "$here/vm/scenarios/virtio-net-migrate.sh" "$kernel/modules" "$VM_MODULES"

# qemu_vm HOST LOG QMP-SOCKET [ARGS...]: the guest's QEMU on HOST's sockets.
qemu_vm() {
  local host=$1 log=$2 qmp_sock=$3
  shift 3
  # shellcheck disable=SC2054  # QEMU's option syntax has the commas
  local n0=(-chardev "socket,id=c0,path=$work/$host-net0.sock,reconnect=1" -netdev vhost-user,id=n0,chardev=c0)
  # shellcheck disable=SC2054  # as above
  local n1=(-chardev "socket,id=c1,path=$work/$host-net1.sock,reconnect=1" -netdev vhost-user,id=n1,chardev=c1)
  if [[ $nic == qemu-tap ]]; then  # QEMU makes the taps (here), moved to the wire below
    n0=(-netdev "tap,id=n0,ifname=mg${host}0$$,script=no,downscript=no,vhost=off")
    n1=(-netdev "tap,id=n1,ifname=mg${host}1$$,script=no,downscript=no,vhost=off")
  fi
  timeout --kill-after=10 400 qemu-system-x86_64 \
    -accel tcg -M q35 -cpu max -m 512 -smp 1 \
    -object memory-backend-memfd,id=mem,size=512M,share=on -numa node,memdev=mem \
    "${n0[@]}" -device "virtio-net-pci,netdev=n0,vectors=0,mac=$mac0,packed=$packed_on" \
    "${n1[@]}" -device "virtio-net-pci,netdev=n1,vectors=0,mac=$mac1,guest_announce=off,packed=$packed_on" \
    -kernel "$kernel/vmlinuz" -initrd "$initrd" -append "console=ttyS0 quiet loglevel=3 panic=-1" \
    -display none -serial "file:$log" -monitor none -qmp "unix:$qmp_sock,server=on,wait=off" -no-reboot "$@" \
    >>"$log.qemu" 2>&1 &
  qemu_pid=$!
  pids+=($!)
  if [[ $nic == qemu-tap ]]; then
    local i
    for i in 0 1; do
      for _ in $(seq 100); do ip link show "mg$host$i$$" >/dev/null 2>&1 && break; sleep 0.1; done
      ip link set "mg$host$i$$" netns "$ns" || fail "QEMU's tap mg$host$i$$ did not appear"
      ip -n "$ns" link set "mg$host$i$$" master br0 up
    done
  fi
}
# stop_vm PID QMP-SOCKET: a QEMU that is still there is told to quit, and waited for.
stop_vm() {
  kill -0 "$1" 2>/dev/null && { timeout 10 python3 "$root/scripts/lib/qmp.py" "$2" quit >/dev/null 2>&1 || true; }
  for _ in $(seq 100); do kill -0 "$1" 2>/dev/null || break; sleep 0.1; done
  kill -KILL "$1" 2>/dev/null || true
  wait "$1" 2>/dev/null || true
}
# until LOG has PATTERN, at most SECONDS
wait_log() {
  local log=$1 pattern=$2 seconds=$3
  for _ in $(seq $((seconds * 10))); do grep -qE "$pattern" "$log" 2>/dev/null && return 0; sleep 0.1; done
  return 1
}
# until LOG has more than N lines with PATTERN, at most SECONDS
wait_more() {
  local log=$1 pattern=$2 n=$3 seconds=$4
  for _ in $(seq $((seconds * 10))); do
    [[ $(grep -cE "$pattern" "$log" 2>/dev/null || true) -gt $n ]] && return 0
    sleep 0.1
  done
  return 1
}
count() { grep -cE "$2" "$1" 2>/dev/null || true; }
fail() {
  echo "FAIL: $*"
  for f in "$work"/*.log "$work"/*.qemu; do
    [[ -f $f ]] && { echo "--- $(basename "$f") ---"; tail -n 40 "$f"; }
  done
  exit 1
}
report() { [[ -n ${MIGRATION_REPORT:-} ]] && echo "$1" >>"$MIGRATION_REPORT"; true; }
# stream ROUND: the known stream into the guest, its MD5 in $work/stream-ROUND.md5 (background: $stream_pid).
stream() {
  rm -f "$work/go-$1"
  ip netns exec "$ns" python3 "$root/scripts/lib/stream.py" 10.89.0.2 5000 $((24 << 20)) "round$1" \
    --after "$work/go-$1" >"$work/stream-$1.md5" &
  stream_pid=$!
  pids+=($!)
}
# check_stream ROUND LOG: the guest's checksum of round ROUND is the sender's.
check_stream() {
  touch "$work/go-$1"
  # The sender ends once the guest has taken it all; a guest that died (a
  # panic on the destination) never does, and the sender's socket would
  # wait minutes: the guest's console is watched meanwhile, 120 s at most.
  for _ in $(seq 1200); do
    kill -0 "$stream_pid" 2>/dev/null || break
    grep -q "Kernel panic" "$2" && fail "round $1: the guest panicked ($(grep -m1 'Kernel panic' "$2" | tr -d '\r'))"
    sleep 0.1
  done
  kill -0 "$stream_pid" 2>/dev/null && fail "round $1: the stream's sender did not finish in 120 s"
  wait "$stream_pid" || fail "round $1: the stream's sender failed"
  wait_log "$2" "^VMTEST STREAM $1 " 120 || fail "round $1: the guest never finished reading the stream"
  local want got
  want=$(cat "$work/stream-$1.md5")
  got=$(grep "^VMTEST STREAM $1 " "$2" | tr -d '\r' | awk '{print $4}')
  [[ $got == "$want" ]] || fail "round $1: the guest read a stream with MD5 $got, $want was sent (a page the log missed)"
  echo "PASS round $1: the stream arrived whole ($want)"
}

if [[ $nic == sriovd ]]; then
  start_host A
  start_host B
fi
qemu_vm A "$work/vm-A.log" "$work/qmp-A.sock"
vm_a=$qemu_pid
wait_log "$work/vm-A.log" "^VMTEST READY" 180 || fail "the guest did not come up on A"
[[ $nic == sriovd ]] && grep -q "dirty logging" "$work/A.log" && fail "logging before any migration"

# --- Round 1: A -> B with the stream and a ping flowing in -------------------
qemu_vm B "$work/vm-B.log" "$work/qmp-B.sock" -incoming "unix:$work/mig-B.sock"
vm_b=$qemu_pid
if [[ $nic == sriovd ]]; then
  wait_log "$work/B.log" "B-net1: front-end connected" 30 || fail "the destination QEMU did not connect to B"
fi
ip netns exec "$ns" python3 "$here/interop/sniff.py" "mgB0$$,mgB1$$" "$mac0,$mac1" >"$work/sniff.out" &
pids+=($!)
wait_log "$work/sniff.out" "^ready" 10 || fail "the capture did not start"
stream 1
ip netns exec "$ns" busybox ping -i 0.05 -c 300 -W 1 10.89.0.2 >"$work/ping-1.txt" 2>&1 &
ping_pid=$!
pids+=($!)
sleep 2
qmp "$work/qmp-A.sock" migrate-set-parameters '{"max-bandwidth": 1073741824, "downtime-limit": 300}' >/dev/null
qmp "$work/qmp-A.sock" migrate "{\"uri\": \"unix:$work/mig-B.sock\"}" >/dev/null ||
  fail "QEMU refused to migrate (a migration blocker?)"
result=$(qmp "$work/qmp-A.sock" wait-migration 120) || fail "round 1: the migration did not complete: $result"
report "$result"
echo "round 1: $(echo "$result" | python3 -c 'import json,sys; r=json.load(sys.stdin); print("total", r.get("total-time"), "ms, downtime", r.get("downtime"), "ms, setup", r.get("setup-time"), "ms")')"
[[ $nic == qemu-tap ]] || grep -q "dirty logging on" "$work/A.log" || fail "sriovd A never logged"
check_stream 1 "$work/vm-B.log"
if [[ $nic == sriovd ]]; then  # the rings the destination goes on with are the layout asked for
  "$build/src/sriovctl" --socket "$work/B-control.sock" --json devices |
    RING=$ring python3 -c 'import json,os,sys; d=json.load(sys.stdin)["virtio_devices"][0]; sys.exit(0 if bool(d["features"] >> 34 & 1) == (os.environ["RING"] == "packed") else 1)' ||
    fail "round 1: B-net0's rings are not $ring"
fi
wait "$ping_pid" || true
echo "ping during round 1: $(grep -E 'packets transmitted' "$work/ping-1.txt")"
grep -qE " 0 packets received" "$work/ping-1.txt" && fail "no ping reply at all"
ip netns exec "$ns" busybox ping -c 3 -W 2 10.89.0.2 >/dev/null || fail "round 1: the guest does not answer a ping on B"
wait_log "$work/sniff.out" "^mgB1$$ 0x8035 $mac1" 10 || fail "no RARP for eth1 on B's wire (SEND_RARP)"
wait_log "$work/sniff.out" "^mgB0$$ 0x0806 $mac0" 10 || fail "eth0 did not announce itself (GUEST_ANNOUNCE) on B's wire"
[[ $nic == qemu-tap ]] || grep -q "SEND_RARP" "$work/B.log" || fail "B never got SEND_RARP"
moved=0
for _ in $(seq 50); do
  # whole, then searched: grep -q would cut the pipe, and pipefail fail the check
  grep -q "$mac0 dev mgB0$$" <<<"$(bridge -n "$ns" fdb show br br0)" && { moved=1; break; }
  sleep 0.1
done
[[ $moved -eq 1 ]] || fail "the wire still sends the guest's MAC to A: $(bridge -n "$ns" fdb show br br0 | grep "$mac0")"
echo "PASS round 1: migrated A -> B; announced (GARP on eth0, RARP on eth1); the wire follows"
stop_vm "$vm_a" "$work/qmp-A.sock"  # paused after the migration (postmigrate)
if [[ $rounds -eq 1 ]]; then
  stop_vm "$vm_b" "$work/qmp-B.sock"
  echo "PASS: one migration ($nic, $ring rings)"
  exit 0
fi

# --- Round 2: B -> A', cancelled ---------------------------------------------
n=$(count "$work/A.log" "A-net1: front-end connected")
qemu_vm A "$work/vm-A2.log" "$work/qmp-A2.sock" -incoming "unix:$work/mig-A.sock"
vm_a2=$qemu_pid
wait_more "$work/A.log" "A-net1: front-end connected" "$n" 30 || fail "the second destination QEMU did not connect to A"
stream 2
sleep 1
qmp "$work/qmp-B.sock" migrate-set-parameters '{"max-bandwidth": 4194304}' >/dev/null
qmp "$work/qmp-B.sock" migrate "{\"uri\": \"unix:$work/mig-A.sock\"}" >/dev/null || fail "round 2: migrate refused"
wait_log "$work/B.log" "B-net0: dirty logging on" 20 || fail "round 2: B did not start logging"
# What an operator sees meanwhile.
out=$("$build/src/sriovctl" --socket "$work/B-control.sock" devices)
grep -q "migrating: dirty logging" <<<"$out" || fail "round 2: sriovctl devices does not show the migration: $out"
"$build/src/sriovctl" --socket "$work/B-control.sock" --json devices |
  python3 -c 'import json,sys; m=json.load(sys.stdin)["virtio_devices"][0]["vhost_user"]["migration"]; sys.exit(0 if m["logging"] and m["log_bytes"] > 0 and m["log_missed"] == 0 else 1)' ||
  fail "round 2: the devices JSON does not show the log"
sleep 1
qmp "$work/qmp-B.sock" migrate_cancel >/dev/null
result=$(qmp "$work/qmp-B.sock" wait-migration 30) && fail "round 2: the migration was not cancelled: $result"
report "$result"
wait_log "$work/B.log" "B-net0: dirty logging off" 20 || fail "round 2: logging stayed on after the cancel"
check_stream 2 "$work/vm-B.log"
echo "PASS round 2: cancelled; the guest goes on on B, logging off"
if [[ $rounds -eq 2 ]]; then
  stop_vm "$vm_a2" "$work/qmp-A2.sock"
  stop_vm "$vm_b" "$work/qmp-B.sock"
  echo "PASS: two migrations (completed, cancelled; $ring rings)"
  exit 0
fi
# The destination of a cancelled migration exits (its incoming stream
# failed); a new one for round 3.
stop_vm "$vm_a2" "$work/qmp-A2.sock"

# --- Round 3: B -> A' with B's sriovd restarted during the copy -----------------
n=$(count "$work/A.log" "A-net1: front-end connected")
qemu_vm A "$work/vm-A3.log" "$work/qmp-A3.sock" -incoming "unix:$work/mig-A3.sock"
wait_more "$work/A.log" "A-net1: front-end connected" "$n" 30 || fail "the third destination QEMU did not connect to A"
stream 3
sleep 1
qmp "$work/qmp-B.sock" migrate "{\"uri\": \"unix:$work/mig-A3.sock\"}" >/dev/null || fail "round 3: migrate refused"
sleep 1
kill -KILL "${host_pid[B]}"
wait "${host_pid[B]}" 2>/dev/null || true
start_host B "$work/B-2.log"
wait_log "$work/B-2.log" "B-net0: front-end connected" 30 || fail "round 3: QEMU did not reconnect to B's new sriovd"
qmp "$work/qmp-B.sock" migrate-set-parameters '{"max-bandwidth": 1073741824}' >/dev/null
if result=$(qmp "$work/qmp-B.sock" wait-migration 120); then
  on=A3
else
  echo "round 3: QEMU gave up the migration across the restart ($(echo "$result" | head -c 200)); again"
  report "$result"
  qmp "$work/qmp-B.sock" migrate "{\"uri\": \"unix:$work/mig-A3.sock\"}" >/dev/null || fail "round 3: migrate refused again"
  result=$(qmp "$work/qmp-B.sock" wait-migration 120) || fail "round 3: the migration did not complete: $result"
  on=A3
fi
report "$result"
grep -q "dirty logging on" "$work/B-2.log" || fail "round 3: the restarted sriovd never logged"
check_stream 3 "$work/vm-$on.log"
echo "PASS round 3: migrated B -> A with B's sriovd restarted during the copy"

wait_log "$work/vm-$on.log" "^VMTEST END" 60 || fail "the guest did not finish"
vm_verdict "$work/vm-$on.log" 0 "$work/vm-$on.log" || fail "the guest's checks"
for f in A B B-2; do
  grep -qE "terminate|Aborted|SIGSEGV" "$work/$f.log" && fail "sriovd $f: $(grep -E 'terminate|Aborted' "$work/$f.log")"
done
echo "PASS: three migrations (completed, cancelled, across a back-end restart)"
