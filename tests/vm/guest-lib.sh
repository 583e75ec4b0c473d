# shellcheck shell=dash disable=SC3043  # busybox ash runs it in the guest (it has local)
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
# shellcheck disable=SC2120  # its arguments (more sriovd flags) are optional
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
# SIGTERM, then its exit status; one that has not exited after 60 s is a
# failure of its own, shown with where each of its threads waits (and the
# kernel's messages: a driver's wait shows there), then SIGKILLed (124).
stop_daemon() {
  kill -TERM "$PID"
  i=0
  while [ $i -lt 600 ] && kill -0 "$PID" 2>/dev/null && ! grep -q '^State:.*Z' "/proc/$PID/status" 2>/dev/null; do
    sleep 0.1
    i=$((i + 1))
  done
  if [ $i -ge 600 ]; then
    fail "daemon-stops: sriovd $PID still running 60 s after SIGTERM"
    tail -n 40 /tmp/sriovd.log
    for t in /proc/"$PID"/task/*; do
      echo "thread $(basename "$t") $(cat "$t/comm" 2>/dev/null) wchan=$(cat "$t/wchan" 2>/dev/null)"
      cat "$t/stack" 2>/dev/null
    done
    dmesg | tail -n 30
    kill -KILL "$PID"
    wait "$PID" 2>/dev/null
    return 124
  fi
  wait "$PID"
}

# Waits up to 10 s for the guest's first network interface, brings it up
# with IP $1, and sets $dev; fails the scenario when there is none.
guest_net_up() {
  dev=
  i=0
  while [ $i -lt 100 ]; do
    for n in /sys/class/net/*; do
      # GUEST_MAC: the one with that address (a guest with several NICs)
      [ -z "${GUEST_MAC:-}" ] || [ "$(cat "$n/address")" = "$GUEST_MAC" ] || continue
      [ "${n##*/}" = lo ] || { dev=${n##*/}; break; }
    done
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
