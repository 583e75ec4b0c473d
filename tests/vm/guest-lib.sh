# Sourced by guest scenarios (installed as /guest-lib.sh in the initramfs).

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
