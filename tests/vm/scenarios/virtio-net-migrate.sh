# shellcheck shell=dash disable=SC3043  # busybox ash runs it in the guest (it has local)
# A Linux guest on two of sriovd's vhost-user NICs that QEMU migrates
# (tests/interop/qemu_migration.sh). eth0 carries the traffic; eth1 is
# there with guest_announce=off, for QEMU to ask sriovd for a RARP.
# Each round, a known TCP stream comes in while the guest is migrated;
# the reader waits a few seconds before it reads, so what the device wrote
# sits in guest memory (socket buffers) across the switch; its checksum is
# the verdict on every byte.
set -u
# shellcheck source=../guest-lib.sh
. /guest-lib.sh
guest_net_up 10.89.0.2/24
for n in /sys/class/net/*; do ip link set "${n##*/}" up; done
echo "VMTEST READY"
r=1
while [ $r -le 3 ]; do
  nc -l -p 5000 </dev/null | (sleep 3; md5sum) >/tmp/sum
  echo "VMTEST STREAM $r $(cut -d' ' -f1 /tmp/sum)"
  r=$((r + 1))
done
if ping -c 3 -W 3 10.89.0.1 >/tmp/ping.log 2>&1; then
  pass guest-pings-the-wire-after-migrations
else
  fail "guest-pings-the-wire-after-migrations: $(tail -n 2 /tmp/ping.log | tr '\n' ' ')"
fi
