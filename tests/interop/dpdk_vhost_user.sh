#!/usr/bin/env bash
# Interop: DPDK testpmd's net_virtio_user as the front-end ("guest driver")
# against sriovd's vhost-user back-end, with the tap backend in a network
# namespace this test creates. Traffic is checked end to end by counters:
#   testpmd txonly -> sriovd -> tap      (the tap's RX counter in the netns)
#   ping in the netns -> tap -> sriovd -> testpmd (testpmd's RX counter)
# for split and packed rings, mergeable rx buffers on and off, one and two
# queue pairs, and a second front-end after the first disconnected.
#   tests/interop/dpdk_vhost_user.sh BUILD_DIR
set -euo pipefail
source "$(dirname "$0")/../../scripts/lib/interop.sh"
build=${1:?usage: dpdk_vhost_user.sh BUILD_DIR}
sriovd=$build/src/sriovd
sriovctl=$build/src/sriovctl

need_testpmd
need_root_tun "the DPDK interop test"
ns=sriovd-io$$
tap=sdio$$
interop_workspace sriovd-interop "$ns"

passed=0
failed=0
check() {  # name condition...
  local name=$1
  shift
  if "$@"; then
    echo "PASS $name"
    passed=$((passed + 1))
  else
    echo "FAIL $name"
    failed=$((failed + 1))
  fi
}

tap_rx() { ip netns exec "$ns" cat "/sys/class/net/$tap/statistics/rx_packets"; }

# run_variant NAME QUEUES PACKED(auto|off) TESTPMD-DEVARGS [vf|vf-macvtap]
# With "vf" the backend is a simulated VF's netdev (a real veth made by the
# simulated host): the VF-to-virtio bridge; its wire end goes to the netns.
run_variant() {
  local name=$1 queues=$2 packed=$3 devargs=$4 kind=${5:-tap}
  local sock=$work/$name.sock
  local pfdev=sdpf$$
  local backend="{type: tap, name: $tap, netns: $ns, offloads: []}"
  [[ $kind == vf ]] && backend="{type: vf, pf: \"0000:3b:00.0\", vf: 0}"
  [[ $kind == vf-macvtap ]] && backend="{type: vf, pf: \"0000:3b:00.0\", vf: 0, via: macvtap}"
  [[ $kind == vf-xdp ]] && backend="{type: vf, pf: \"0000:3b:00.0\", vf: 0, via: af_xdp}"
  {
    simulated_host_config "$work/state-$name" "$work/$name-control.sock" "$pfdev"
    cat <<CONF
physical_functions:
  - {address: "0000:3b:00.0", num_vfs: 1}
virtio_devices:
  - name: $name
    type: net
    transport: vhost-user
    socket: $sock
    queues: $queues
    queue_size: 256
    packed: "$packed"
    backend: $backend
CONF
  } >"$work/$name.yaml"
  "$sriovd" --config "$work/$name.yaml" --foreground >"$work/$name-sriovd.log" 2>&1 &
  local dpid=$!
  pids+=("$dpid")
  for _ in $(seq 100); do [[ -S $sock ]] && break; sleep 0.1; done
  if [[ $kind == vf* ]]; then
    # The simulated VF's netdev is ${pfdev}v0; its wire end moves into the
    # namespace and stands where the tap stands in the other variants.
    ip link set "${pfdev}v0p" netns "$ns"
    ip netns exec "$ns" ip link set "${pfdev}v0p" name "$tap"
    ip netns exec "$ns" ip link set "$tap" up
  fi
  ip netns exec "$ns" ip addr add 10.255.0.1/24 dev "$tap"

  # Round 1 sends (txonly), round 2 receives (rxonly): two front-ends one
  # after the other on the same socket, so the reconnect is tested too.
  for round in 1 2; do
    local mode=txonly
    [[ $round -eq 2 ]] && mode=rxonly
    local before
    before=$(tap_rx)
    timeout 30 dpdk-testpmd -l 0-1 --no-huge -m 512 --no-pci --file-prefix "sdio$$-$name-$round" \
      --vdev "net_virtio_user0,path=$sock,queues=$queues,queue_size=256$devargs" -- \
      --total-num-mbufs=16384 --rxq="$queues" --txq="$queues" --forward-mode=$mode --txpkts=64 \
      --stats-period 1 >"$work/$name-testpmd-$round.log" 2>&1 &
    local tpid=$!
    pids+=("$tpid")
    # Wait (bounded) until testpmd forwards: its periodic stats appear.
    for _ in $(seq 150); do
      grep -q 'RX-packets:' "$work/$name-testpmd-$round.log" 2>/dev/null && break
      kill -0 "$tpid" 2>/dev/null || break
      sleep 0.1
    done
    # Frames from the namespace towards testpmd: a UDP datagram to each of
    # 40 neighbours makes the kernel ARP for each of them through the tap
    # (bash's /dev/udp: no ping needed).
    if [[ $round -eq 2 ]]; then
      # shellcheck disable=SC2016  # expanded by the inner bash
      ip netns exec "$ns" bash -c 'for i in $(seq 2 41); do echo x >/dev/udp/10.255.0.$i/9; done' 2>/dev/null || true
    fi
    sleep 1  # let the kernel's ARP requests and testpmd's last burst through
    if [[ $round -eq 1 && $devargs == *in_order=1* ]]; then
      # VIRTIO_F_IN_ORDER (bit 35) negotiated, as the device reports it.
      local features
      features=$("$sriovctl" --socket "$work/$name-control.sock" --json devices |
        python3 -c 'import json, sys; print(json.load(sys.stdin)["virtio_devices"][0].get("features", 0))')
      check "$name-negotiated-in-order" test $(((features >> 35) & 1)) -eq 1
    fi
    if [[ $round -eq 1 && $queues -eq 2 ]]; then
      # Both queue pairs carried TX (queues 1 and 3 of the device).
      local per_queue
      per_queue=$("$sriovctl" --socket "$work/$name-control.sock" --json devices |
        python3 -c 'import json, sys; q = json.load(sys.stdin)["virtio_devices"][0]["queues"]; print(min(q[1]["packets"], q[3]["packets"]))')
      check "$name-both-pairs-carry-tx" test "$per_queue" -gt 100
    fi
    kill -INT "$tpid" 2>/dev/null || true
    wait "$tpid" 2>/dev/null || true
    local tx rx
    tx=$(grep -o 'TX-packets: *[0-9]*' "$work/$name-testpmd-$round.log" | tail -n 1 | grep -o '[0-9]*$' || echo 0)
    rx=$(grep -o 'RX-packets: *[0-9]*' "$work/$name-testpmd-$round.log" | tail -n 1 | grep -o '[0-9]*$' || echo 0)
    echo "$name round $round ($mode): testpmd sent $tx, received $rx; tap received $(($(tap_rx) - before))"
    if [[ $round -eq 1 ]]; then
      check "$name-guest-to-tap" test "$(($(tap_rx) - before))" -gt 1000
      check "$name-tap-counted-all" test "$(($(tap_rx) - before))" -ge "$tx"
    else
      check "$name-tap-to-guest-after-reconnect" test "$rx" -ge 10
    fi
  done
  check "$name-daemon-alive" kill -0 "$dpid"
  local owned="alias sriovd:$work/state-$name $name"
  if [[ $kind == vf-macvtap ]]; then
    check "$name-macvtap-made" bash -c "ip -d link show type macvtap | grep -qF '$owned'"
  fi
  if [[ $kind == vf-xdp ]]; then
    # sriovd's program on the VF's netdev, in native mode, and the mode of
    # its sockets as `sriovctl devices` shows it (a veth: copy).
    check "$name-xdp-attached" bash -c "ip -d link show dev ${pfdev}v0 | grep -q 'prog/xdp id'"
    check "$name-xdp-mode-shown" bash -c "'$sriovctl' --socket '$work/$name-control.sock' devices | grep -q 'af_xdp (copy)'"
  fi
  kill -TERM "$dpid"
  wait "$dpid" || true
  if [[ $kind == vf-macvtap ]]; then
    check "$name-macvtap-deleted" bash -c "! ip -d link show type macvtap | grep -qF '$owned'"
  fi
  ip netns exec "$ns" ip link del "$tap" 2>/dev/null || true
}

run_variant split 1 off ",packed_vq=0,mrg_rxbuf=1"
run_variant split-nomrg 1 off ",packed_vq=0,mrg_rxbuf=0"
run_variant packed 1 auto ",packed_vq=1,mrg_rxbuf=1"
run_variant packed-nomrg 1 auto ",packed_vq=1,mrg_rxbuf=0"
run_variant split-inorder 1 off ",packed_vq=0,mrg_rxbuf=1,in_order=1"
run_variant packed-inorder 1 auto ",packed_vq=1,mrg_rxbuf=1,in_order=1"
run_variant split-2q 2 off ",packed_vq=0,mrg_rxbuf=1"
run_variant vf-bridge 1 off ",packed_vq=0,mrg_rxbuf=1" vf
run_variant vf-xdp 1 off ",packed_vq=0,mrg_rxbuf=1" vf-xdp
run_variant vf-xdp-packed 1 auto ",packed_vq=1,mrg_rxbuf=1" vf-xdp
run_variant vf-xdp-2q 2 off ",packed_vq=0,mrg_rxbuf=1" vf-xdp
run_variant vf-bridge-2q 2 off ",packed_vq=0,mrg_rxbuf=1" vf
run_variant vf-macvtap-2q 2 auto ",packed_vq=1,mrg_rxbuf=1" vf-macvtap

# The daemon restarted under a running front-end, with packed rings:
# testpmd's virtio_user listens (server=1) and keeps its rings; sriovd
# (socket_mode: client) connects, is SIGKILLed mid-traffic, starts again,
# connects again, and takes the rings up where testpmd says they stand.
restart_packed() {
  local name=packed-restart
  local sock=$work/$name.sock
  {
    simulated_host_config "$work/state-$name" "$work/$name-control.sock" "sdrp$$"
    cat <<CONF
virtio_devices:
  - name: $name
    type: net
    transport: vhost-user
    socket: $sock
    socket_mode: client
    queue_size: 256
    packed: auto
    backend: {type: tap, name: $tap, netns: $ns, offloads: []}
CONF
  } >"$work/$name.yaml"
  timeout 60 dpdk-testpmd -l 0-1 --no-huge -m 512 --no-pci --file-prefix "sdio$$-$name" \
    --vdev "net_virtio_user0,path=$sock,server=1,queues=1,queue_size=256,packed_vq=1,mrg_rxbuf=1" -- \
    --total-num-mbufs=16384 --forward-mode=txonly --txpkts=64 --stats-period 1 >"$work/$name-testpmd.log" 2>&1 &
  local tpid=$!
  pids+=("$tpid")
  for _ in $(seq 100); do [[ -S $sock ]] && break; sleep 0.1; done
  "$sriovd" --config "$work/$name.yaml" --foreground >"$work/$name-sriovd-1.log" 2>&1 &
  local d1=$!
  pids+=("$d1")
  for _ in $(seq 100); do ip -n "$ns" link show "$tap" >/dev/null 2>&1 && break; sleep 0.1; done
  ip -n "$ns" link set "$tap" up
  sleep 2
  local before_kill
  before_kill=$(tap_rx)
  check "$name-traffic-before-restart" test "$before_kill" -gt 1000
  kill -KILL "$d1"
  wait "$d1" 2>/dev/null || true
  "$sriovd" --config "$work/$name.yaml" --foreground >"$work/$name-sriovd-2.log" 2>&1 &
  local d2=$!
  pids+=("$d2")
  for _ in $(seq 100); do ip -n "$ns" link show "$tap" >/dev/null 2>&1 && break; sleep 0.1; done
  ip -n "$ns" link set "$tap" up
  local after=0
  for _ in $(seq 50); do
    after=$(tap_rx 2>/dev/null || echo 0)
    [[ $after -gt 1000 ]] && break
    sleep 0.2
  done
  echo "$name: tap received $before_kill before the SIGKILL, $after on the new tap after the restart"
  check "$name-traffic-after-restart" test "$after" -gt 1000
  check "$name-reconnected" grep -q "front-end connected" "$work/$name-sriovd-2.log"
  local state
  state=$("$sriovctl" --socket "$work/$name-control.sock" --json devices |
    python3 -c 'import json, sys; v = json.load(sys.stdin)["virtio_devices"][0]; print(v["state"], v["needs_reset"])')
  echo "$name: after the restart the device is $state (state, needs_reset)"
  check "$name-running-not-broken" test "$state" = "running False"
  kill -TERM "$d2"
  wait "$d2" || true
  kill -INT "$tpid" 2>/dev/null || true
  wait "$tpid" 2>/dev/null || true
}
restart_packed

echo "$passed passed, $failed failed"
[[ $failed -eq 0 ]]
