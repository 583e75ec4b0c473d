# Sourced by guest scenarios (installed as /guest-lib.sh in the initramfs).

pass() { echo "VMTEST PASS $*"; }
fail() { echo "VMTEST FAIL $*"; }
expect_eq() {  # name actual expected
  if [ "$2" = "$3" ]; then pass "$1"; else fail "$1: got [$2] want [$3]"; fi
}
# until CMD succeeds, at most N tenths of a second: wait_for N CMD...
wait_for() {
  n=$1
  shift
  i=0
  while [ $i -lt "$n" ]; do
    "$@" >/dev/null 2>&1 && return 0
    sleep 0.1
    i=$((i + 1))
  done
  return 1
}
# sriovd on $CFG in the background ($PID), with extra arguments; returns
# when its control socket answers (at most 60 s), 1 when it exits first.
start_daemon() {
  sriovd --config "$CFG" --foreground "$@" >>/tmp/sriovd.log 2>&1 &
  PID=$!
  i=0
  while [ $i -lt 600 ]; do
    sriovctl version >/dev/null 2>&1 && return 0
    kill -0 "$PID" 2>/dev/null || return 1
    sleep 0.1
    i=$((i + 1))
  done
  return 1
}
stop_daemon() {
  kill -TERM "$PID"
  wait "$PID"
}

# Waits up to 10 s for the guest's first network interface, brings it up
# with IP $1, and sets $dev; fails the scenario when there is none.
guest_net_up() {
  dev=
  i=0
  while [ $i -lt 100 ]; do
    dev=$(ls /sys/class/net | grep -v '^lo$' | head -n 1)
    [ -n "$dev" ] && break
    sleep 0.1
    i=$((i + 1))
  done
  [ -n "$dev" ] || { echo "VMTEST FAIL guest-has-virtio-net: no network interface"; exit 1; }
  echo "VMTEST PASS guest-has-virtio-net $dev"
  ip link set lo up
  ip link set "$dev" up
  ip addr add "$1" dev "$dev"
}
