#!/bin/bash
# The unit as it ships (issue 24): in a Debian 12 guest booted with systemd
# as PID 1, the package installed with dpkg, sriovd started by systemctl in
# its real sandbox, and every feature the sandbox must allow exercised: an
# af_xdp backend (AF_XDP, bpf()), a macvtap backend, the device plugin's
# socket and CDI spec (their directories), metrics, a reload, the holder
# check against a VMM of another uid (CAP_SYS_PTRACE), stop and restore.
# Runs as a oneshot service (tests/vm/systemd-init); results in
# /work/results, read by the host after the guest powers off.
set -u
R=/work/results
: >"$R"
say() { echo "$*" >>"$R"; echo "$*" >/dev/ttyS0; }
pass() { say "VMTEST PASS $*"; }
fail() { say "VMTEST FAIL $*"; }
finish() {
  journalctl -u sriovd --no-pager >/work/sriovd.journal 2>&1
  say "VMTEST END"
  sync
  systemctl poweroff --no-block
  exit 0
}
check() {  # check NAME COMMAND...: PASS or FAIL by the command's status
  local name=$1
  shift
  if "$@" >/work/check.out 2>&1; then pass "$name"; else fail "$name: $(tail -n 3 /work/check.out | tr '\n' ' ')"; fi
}
wait_for() {  # wait_for SECONDS COMMAND...
  local until=$((SECONDS + $1))
  shift
  while ((SECONDS < until)); do "$@" >/dev/null 2>&1 && return 0; sleep 0.2; done
  "$@"
}
# shellcheck disable=SC2317  # called through wait_for and field
metrics() { python3 -c "import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:9808/metrics', timeout=5).read().decode())"; }
devices() { sriovctl --json devices; }
field() {  # field PY-EXPR: of `sriovctl --json devices`
  devices | python3 -c "import json, sys; d = json.load(sys.stdin); d = d.get('result', d); print($1)"
}

check "systemd-is-pid-1" test "$(cat /proc/1/comm)" = systemd
check "dpkg-i-the-package" dpkg -i /work/sriovd.deb
mkdir -p /var/lib/kubelet/device-plugins /run/cdi
cat >/etc/sriovd/sriovd.yaml <<'EOF'
version: 1
host: simulated
simulated:
  physical_functions:
    - {address: "0000:3b:00.0", netdev: simpf0, total_vfs: 8, msix_vectors_per_vf: 4}
metrics: {listen: "127.0.0.1:9808"}
physical_functions:
  - address: "0000:3b:00.0"
    num_vfs: 4
    vfs:
      - {index: 0, assign: {owner: vm1, socket: /run/sriovd/vf0.sock, msix_policy: relay}}
      - {index: 3, assign: {owner: k8s, export: none}}
virtio_devices:
  - {name: vx0, type: net, transport: vhost-user, socket: /run/sriovd/vx0.sock,
     backend: {type: vf, pf: "0000:3b:00.0", vf: 1, via: af_xdp}}
  - {name: vm0, type: net, transport: vhost-user, socket: /run/sriovd/vm0.sock,
     backend: {type: vf, pf: "0000:3b:00.0", vf: 2, via: macvtap}}
  - {name: vt0, type: net, transport: vhost-user, socket: /run/sriovd/vt0.sock,
     backend: {type: tap, name: vt0tap, netns: vmA}}
  - {name: vp0, type: net, transport: vfio-user, socket: /run/sriovd/vp0.sock,
     backend: {type: tap, name: vp0tap, netns: vmA}}
kubernetes:
  pools:
    - name: sriovd.test/vfio
      vfs: [{pf: "0000:3b:00.0", indexes: [3]}]
EOF
ip netns add vmA
ip netns add vmB
check "systemctl-start" systemctl start sriovd
check "unit-active" systemctl is-active sriovd
check "af_xdp-backend-served" wait_for 10 test "$(field "[v['state'] for v in d['virtio_devices'] if v['name'] == 'vx0'][0]")" = listening
check "macvtap-backend-served" wait_for 10 test "$(field "[v['state'] for v in d['virtio_devices'] if v['name'] == 'vm0'][0]")" = listening
check "vf-export-listening" test -S /run/sriovd/vf0.sock
check "device-plugin-socket" wait_for 10 test -S /var/lib/kubelet/device-plugins/sriovd-sriovd.test_vfio.sock
check "cdi-spec" test -f /run/cdi/sriovd-sriovd.test_vfio.json
check "metrics" wait_for 10 sh -c "$(declare -f metrics); metrics | grep -q '^sriovd_vf_info'"
check "systemctl-reload" systemctl reload sriovd
check "reloaded" wait_for 10 sh -c "$(declare -f metrics); metrics | grep -q 'sriovd_reloads_total{result=\"ok\"} 1'"
check "still-active-after-reload" systemctl is-active sriovd
check "nothing-refused-by-the-sandbox" sh -c "! journalctl -u sriovd --no-pager | grep -iE 'not permitted|permission denied|read-only file system'"

# Issue 41: a VM's NICs through an upgrade in place, a `systemctl
# restart` (systemd's fd store) and a reinstall of the package (its
# postinst upgrades in place): vt0 over vhost-user and vp0, virtio-net-pci
# over vfio-user. The project's own front-ends (a vhost-user front-end, a
# vfio-user client with its guest driver) bridge each device to a tap in
# vmB; UDP flows from vmB to each of sriovd's taps in vmA every 10 ms,
# numbered. Through each step the front-ends stay attached (their
# processes live, no reconnect), the traffic goes on, and nothing is lost;
# the longest gap in arrivals is the data path's stall.
sriovd-guest virtio-net --vhost-user /run/sriovd/vt0.sock --tap gt0 --netns vmB >/work/frontend-vt0.log 2>&1 &
FRONTEND_VT0=$!
sriovd-guest virtio-net --socket /run/sriovd/vp0.sock --tap gt1 --netns vmB >/work/frontend-vp0.log 2>&1 &
FRONTEND_VP0=$!
mark() { python3 -c 'import sys, time; print(sys.argv[1], "%.6f" % time.monotonic())' "$1" >>/work/marks.txt; }
# flow NAME SRIOVD_TAP GUEST_TAP SUBNET: addresses, neighbours and a
# numbered UDP stream from the guest's tap to sriovd's, received into
# /work/rx-NAME.txt; the sender's and receiver's PIDs in PIDS.
PIDS=()
flow() {
  local name=$1 host_tap=$2 guest_tap=$3 net=$4
  wait_for 20 ip -n vmB link show "$guest_tap" >/dev/null 2>&1
  ip -n vmA addr add "$net.1/24" dev "$host_tap"
  ip -n vmA link set "$host_tap" up
  ip -n vmB addr add "$net.2/24" dev "$guest_tap"
  ip -n vmB link set "$guest_tap" up
  # A plain FIFO in front of the front-end's tap: fq_codel would drop what
  # waits through a stall (the qdisc's choice, not the data path's loss).
  ip netns exec vmB tc qdisc replace dev "$guest_tap" root pfifo limit 100000
  # Fixed neighbours: a stall longer than ARP's probes would otherwise drop
  # what waits for an address (the kernel's, not the data path's, loss).
  ip -n vmA neigh replace "$net.2" lladdr "$(ip netns exec vmB cat "/sys/class/net/$guest_tap/address")" \
    dev "$host_tap" nud permanent
  ip -n vmB neigh replace "$net.1" lladdr "$(ip netns exec vmA cat "/sys/class/net/$host_tap/address")" \
    dev "$guest_tap" nud permanent
  ip netns exec vmA python3 -c '
import socket, sys, time
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.setsockopt(socket.SOL_SOCKET, getattr(socket, "SO_RCVBUFFORCE", 33), 64 << 20)  # what a stall lets pile up
s.bind((sys.argv[1], 7777))
open(sys.argv[2] + ".ready", "w").close()  # bound: what is sent from now on is counted
with open(sys.argv[2], "w", buffering=1) as f:
    while True:
        d, _ = s.recvfrom(64)
        f.write("%d %.6f\n" % (int(d), time.monotonic()))
' "$net.1" "/work/rx-$name.txt" &
  PIDS+=($!)
  # The sender starts once the receiver is bound (python starts slowly
  # under TCG: datagrams sent before would count as lost).
  wait_for 30 test -e "/work/rx-$name.txt.ready"
  ip netns exec vmB python3 -c '
import socket, sys, time
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
n = 0
while True:
    try:
        s.sendto(str(n).encode(), (sys.argv[1], 7777))
        n += 1
    except OSError:
        pass
    time.sleep(0.01)
' "$net.1" &
  PIDS+=($!)
}
flow vt0 vt0tap gt0 10.77.0
flow vp0 vp0tap gt1 10.78.0
# And a VF export's VMM: the project's vfio-user client with a vector of
# the simulated VF firing 500 times a second (its generator), counted.
sriovd-guest --json msix-storm --socket /run/sriovd/vf0.sock --rate 500 --no-mask --seconds 0 >/work/storm.json 2>/work/storm.err &
STORM=$!
# shellcheck disable=SC2317  # called through check
vf_delivered() { field "[e['interrupts']['delivered'] for e in d['vfio_user_exports'] if e['socket'] == '/run/sriovd/vf0.sock'][0]"; }
# shellcheck disable=SC2317  # called through check
received() { wc -l <"/work/rx-$1.txt" 2>/dev/null || echo 0; }
# shellcheck disable=SC2317  # called through check
attached() {  # both front-ends' processes live and sriovd serves their connections, the same ones
  kill -0 "$FRONTEND_VT0" && kill -0 "$FRONTEND_VP0" &&
    test "$(field "[v['state'] for v in d['virtio_devices'] if v['name'] == 'vt0'][0]")" = running &&
    test "$(field "[v['vhost_user']['connections'] for v in d['virtio_devices'] if v['name'] == 'vt0'][0]")" = 1 &&
    test "$(field "[v['state'] for v in d['virtio_devices'] if v['name'] == 'vp0'][0]")" = running &&
    test "$(field "[v['vfio_user']['connections'] for v in d['virtio_devices'] if v['name'] == 'vp0'][0]")" = 1 &&
    kill -0 "$STORM" &&
    test "$(field "[e['state'] + ' ' + str(e['vfio_user']['connections']) for e in d['vfio_user_exports'] if e['socket'] == '/run/sriovd/vf0.sock'][0]")" = "connected 1"
}
# shellcheck disable=SC2317  # called through check
flowing() {  # each count grows by 20 within 20 s
  local name from
  for name in vt0 vp0; do
    from=$(received "$name")
    wait_for 20 sh -c "test \$(wc -l </work/rx-$name.txt) -ge $((from + 20))" || return 1
  done
  # and the VF's interrupts reach its VMM (counted by this sriovd)
  from=$(vf_delivered)
  wait_for 20 sh -c "$(declare -f devices field vf_delivered); test \$(vf_delivered) -gt $((from + 100))"
}
check "traffic-flows" flowing
mainpid=$(systemctl show -p MainPID --value sriovd)
mark upgrade
check "sriovctl-upgrade" sriovctl --timeout 60 upgrade
check "upgrade-kept-the-pid" test "$(systemctl show -p MainPID --value sriovd)" = "$mainpid"
check "unit-active-after-upgrade" systemctl is-active sriovd
check "frontends-attached-after-upgrade" attached
check "traffic-after-upgrade" flowing
mark restart
check "systemctl-restart" systemctl restart sriovd
check "unit-active-after-restart" systemctl is-active sriovd
check "frontends-attached-after-restart" attached
check "traffic-after-restart" flowing
check "vhost-user-taken-over-from-the-fd-store" sh -c "journalctl -u sriovd --no-pager | grep -q 'vt0: front-end taken over from the previous sriovd'"
check "vfio-user-taken-over-from-the-fd-store" sh -c "journalctl -u sriovd --no-pager | grep -q 'vp0: client (pid [0-9]*) taken over from the previous sriovd'"
check "vf-export-taken-over-from-the-fd-store" sh -c "journalctl -u sriovd --no-pager | grep -q 'vfio-user: VF .* taken over from the previous sriovd'"
check "fd-store-emptied" test "$(systemctl show -p NFileDescriptorStore --value sriovd)" = 0
mark reinstall
check "dpkg-reinstall-upgrades-in-place" dpkg -i /work/sriovd.deb
check "frontends-attached-after-reinstall" attached
check "traffic-after-reinstall" flowing
mark end
# Before the front-ends go (their taps with them).
tap_dropped=$(ip netns exec vmB cat /sys/class/net/gt0/statistics/tx_dropped /sys/class/net/gt1/statistics/tx_dropped | paste -sd/)
kill "${PIDS[@]}"
sleep 1
kill "$FRONTEND_VT0" "$FRONTEND_VP0" "$STORM"
wait "$FRONTEND_VT0" "$FRONTEND_VP0" "$STORM" "${PIDS[@]}" 2>/dev/null
# The storm's VMM: the interrupts the VF raised reached it (relay policy:
# the engine signals once for what it read at once, as MSI-X may).
storm=$(python3 -c '
import json
j = json.load(open("/work/storm.json"))
print(j["generated"], j["signals"], j["handled"])' 2>/dev/null || echo "- - -")
read -r generated signals handled <<<"$storm"
say "VMTEST INFO VF storm through the upgrades: $generated generated, $signals signalled, $handled wakeups; $(tr '\n' ' ' </work/storm.err)"
check "vf-storm-went-on" test "${handled:-0}" -gt 1000 2>/dev/null
check "no-reconnect" sh -c "! grep -qiE 'reconnect|disconnected|closed|error' /work/frontend-vt0.log /work/frontend-vp0.log /work/storm.err"
# shellcheck disable=SC2016  # awk's fields
rcvbuf_errors=$(ip netns exec vmA awk '/^Udp:/ { n++; if (n == 2) print $6 }' /proc/net/snmp)
for name in vt0 vp0; do
  stall=$(python3 -c '
import sys
rows = [l.split() for l in open(sys.argv[1])]
seqs = sorted(int(r[0]) for r in rows)
times = [float(r[1]) for r in rows]
marks = [l.split() for l in open("/work/marks.txt")]
lost = (seqs[-1] + 1 - len(set(seqs))) if seqs else -1
steps = []
for (name, t0), (_, t1) in zip(marks, marks[1:]):
    ts = [t for t in times if float(t0) <= t <= float(t1)]
    gap = max((b - a for a, b in zip(ts, ts[1:])), default=0)
    steps.append("%s %.0f ms" % (name, gap * 1000))
missing = sorted(set(range(seqs[-1] + 1)) - set(seqs))[:8] if seqs else []
steps.append("missing seqs %s" % (",".join(map(str, missing)) or "none"))
print(len(seqs), lost, ", ".join(steps))
' "/work/rx-$name.txt")
  read -r rx_n rx_lost rx_gaps <<<"$stall"
  say "VMTEST INFO $name traffic: $rx_n datagrams, $rx_lost lost (receivers' buffer overflows $rcvbuf_errors, front-end tap drops $tap_dropped); longest gap in arrivals: $rx_gaps"
  check "nothing-lost-$name" test "$rx_lost" = 0
done
state() { systemctl show -p ActiveState --value sriovd; }
systemctl stop --no-block sriovd
# "deactivating" is not "inactive": the stop is done when the unit says so.
if ! wait_for 15 sh -c "$(declare -f state); test \"\$(state)\" = inactive"; then
  # What each of its threads waits in, for the record.
  pid=$(systemctl show -p MainPID --value sriovd)
  for t in /proc/"$pid"/task/*; do
    echo "thread $(basename "$t") $(cat "$t/comm"): $(cat "$t/wchan" 2>/dev/null) syscall $(cat "$t/syscall" 2>/dev/null)"
  done >/work/threads.txt
  fail "systemctl-stop: still $(state) after 15 s: $(tr '\n' ';' </work/threads.txt)"
  wait_for 40 sh -c "$(declare -f state); test \"\$(state)\" != deactivating"
else
  pass "systemctl-stop"
fi
check "stopped-cleanly" test "$(state)" = inactive
check "host-given-back" sriovd --pending-restore /var/lib/sriovd/state-simulated.json
check "cdi-spec-removed-at-stop" test ! -e /run/cdi/sriovd-sriovd.test_vfio.json

# The real host (the VM's SR-IOV NVMe PF): a VF exported with bar_access:
# mmap to a VMM of another uid, which keeps the VF's VFIO device fd. Root
# reads another uid's /proc/PID/fd only with CAP_SYS_PTRACE: without it in
# the unit, the holder check before an unbind is blind.
PF=$(for d in /sys/bus/pci/devices/*; do [ -e "$d/sriov_totalvfs" ] && basename "$d"; done | head -n 1)
cat >/etc/sriovd/sriovd.yaml <<CONF
version: 1
host: system
physical_functions:
  - address: "$PF"
    num_vfs: 1
    vfs:
      - index: 0
        assign: {owner: vm1, socket: /run/sriovd/nvme-vf0.sock, bar_access: mmap, msix_policy: relay,
                 access: {user: nobody, mode: "0600", allowed_uids: [65534]}}
CONF
check "systemctl-start-on-the-real-host" systemctl start sriovd
check "vf-export-on-the-real-host" wait_for 10 test -S /run/sriovd/nvme-vf0.sock
setpriv --reuid=65534 --regid=65534 --clear-groups sriovd-guest --json info --socket /run/sriovd/nvme-vf0.sock --hold 120 \
  >/work/vmm.log 2>&1 &
VMM=$!
holders() { field "d['vfio_user_exports'][0].get('device_fd_holders', '')"; }
if wait_for 15 sh -c "$(declare -f devices field holders); holders | grep -q 'pid $VMM '"; then
  pass "holder-of-another-uid-seen $(holders)"
else
  # shellcheck disable=SC2012  # a listing for a person to read (the fds' targets)
  fail "holder-of-another-uid-seen: '$(holders)' (VMM: $(tr '\n' ' ' </work/vmm.log); export: $(field "d['vfio_user_exports'][0]"); VMM fds: $(ls -l "/proc/$VMM/fd" 2>&1 | tr '\n' ' '))"
fi
kill "$VMM"
wait "$VMM" 2>/dev/null
# Issue 41 on the real kernel: a VMM with DMA mapped (its RAM in the VF's
# IOMMU) and a vector firing through VFIO keeps its VF through an upgrade
# in place - the container, group and device fds handed over, the
# mapping's address given again (VFIO_UPDATE_VADDR), MSI-X never off.
setpriv --reuid=65534 --regid=65534 --clear-groups sriovd-guest --json msix-storm --socket /run/sriovd/nvme-vf0.sock \
  --source loopback --no-mask --seconds 0 >/work/vf-storm.json 2>/work/vf-storm.err &
VF_STORM=$!
# shellcheck disable=SC2317  # called through check
nvme_delivered() { field "d['vfio_user_exports'][0]['interrupts']['delivered']"; }
# shellcheck disable=SC2317  # called through check
nvme_flowing() {
  local from
  from=$(nvme_delivered)
  wait_for 20 sh -c "$(declare -f devices field nvme_delivered); test \$(nvme_delivered) -gt $((from + 20))"
}
check "real-vf-interrupts-flow" nvme_flowing
check "sriovctl-upgrade-on-the-real-host" sriovctl --timeout 60 upgrade
real_vf=$(field "d['vfio_user_exports'][0]['vf']")
check "real-vf-taken-over" sh -c "journalctl -u sriovd --no-pager | grep -q 'vfio-user: VF $real_vf taken over from the previous sriovd'"
check "real-vf-client-kept" test "$(field "d['vfio_user_exports'][0]['state'] + ' ' + str(d['vfio_user_exports'][0]['vfio_user']['connections'])")" = "connected 1"
check "real-vf-interrupts-after-upgrade" nvme_flowing
kill "$VF_STORM"
wait "$VF_STORM" 2>/dev/null
say "VMTEST INFO real VF storm through an upgrade: $(tr '\n' ' ' </work/vf-storm.json) $(tr '\n' ' ' </work/vf-storm.err)"
check "real-vf-storm-ended-cleanly" python3 -c 'import json; j = json.load(open("/work/vf-storm.json")); assert j["handled"] > 0'
systemctl stop --no-block sriovd
if wait_for 20 sh -c "$(declare -f state); test \"\$(state)\" = inactive"; then pass "stopped-on-the-real-host"; else
  fail "stopped-on-the-real-host: $(state)"; fi
check "real-host-given-back" sriovd --pending-restore /var/lib/sriovd/state.json
check "no-vf-left" test "$(cat "/sys/bus/pci/devices/$PF/sriov_numvfs")" = 0
finish
