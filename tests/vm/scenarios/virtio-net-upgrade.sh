# shellcheck shell=dash disable=SC3043  # busybox ash runs it in the guest (it has local)
# A Linux guest whose vhost-user back-end (sriovd) is upgraded in place
# (sriovctl upgrade, twice) while the guest sends TCP with iperf3: the
# transfer goes on and ends without an error, the link never drops, and
# the driver reports nothing. The host upgrades when it sees
# phase-upgrade-ready.
set -u
# shellcheck source=../guest-lib.sh
. /guest-lib.sh
guest_net_up 10.88.0.2/24
if ! ping -c 3 -W 3 10.88.0.1 >/dev/null 2>&1; then echo "VMTEST FAIL guest-pings-before-upgrade"; fi
carrier_before=$(cat "/sys/class/net/$dev/carrier_changes" 2>/dev/null || echo 0)
iperf3 -c 10.88.0.1 -t "${GUEST_IPERF_SECONDS:-12}" --connect-timeout 3000 >/tmp/iperf.log 2>&1 &
iperf=$!
sleep 2
echo "VMTEST INFO phase-upgrade-ready"
if wait "$iperf"; then
  echo "VMTEST BENCH iperf3-through-upgrades $(grep receiver /tmp/iperf.log | tail -n 1)"
  echo "VMTEST PASS guest-iperf3-through-upgrades"
else
  echo "VMTEST FAIL guest-iperf3-through-upgrades: $(tail -n 3 /tmp/iperf.log | tr '\n' ' ')"
fi
carrier_after=$(cat "/sys/class/net/$dev/carrier_changes" 2>/dev/null || echo 0)
if [ "$carrier_before" = "$carrier_after" ]; then echo "VMTEST PASS link-never-dropped"; else
  echo "VMTEST FAIL link-never-dropped: carrier changes $carrier_before -> $carrier_after"; fi
if dmesg | grep -iE 'virtio_net|virtio-net|tx timeout|NETDEV WATCHDOG' | grep -iE 'error|timeout|fail'; then
  echo "VMTEST FAIL guest-driver-quiet"
else
  echo "VMTEST PASS guest-driver-quiet"
fi
if ping -c 3 -W 3 10.88.0.1 >/dev/null 2>&1; then echo "VMTEST PASS guest-pings-after-upgrade"; else
  echo "VMTEST FAIL guest-pings-after-upgrade"; fi
