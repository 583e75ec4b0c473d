# shellcheck shell=dash disable=SC3043  # busybox ash runs it in the guest (it has local)
# scripts/bench vduse's guest (scripts/lib/bench_vduse.sh puts RUNS and
# SECS in front): one sriovd, two virtio-net devices on taps of their own -
# vd0 over VDUSE (virtio_vdpa: this kernel's netdev), vu0 over vhost-user
# (sriovd-guest as the front-end, its tap in netns g) - and iperf3 through
# each both ways, alternated run by run. One "VMTEST BENCH {json}" line.
set -u
: "${RUNS:=3}" "${SECS:=5}"
CFG=/etc/sriovd/sriovd.yaml
PID=
# shellcheck source=../guest-lib.sh
. /guest-lib.sh
mkdir -p /run/netns /etc/sriovd /var/lib/sriovd
for ns in t u g; do vfip netns add $ns; vfip -n $ns link set lo up; done
cat >"$CFG" <<CONF
version: 1
host: system
state_dir: /var/lib/sriovd
virtio_devices:
  - name: vd0
    type: net
    transport: vduse
    backend: {type: tap, name: vdtap0, netns: t, offloads: [csum, tso4, tso6]}
  - name: vu0
    type: net
    transport: vhost-user
    socket: /run/sriovd/vu0.sock
    backend: {type: tap, name: vutap0, netns: u, offloads: [csum, tso4, tso6]}
CONF
start_daemon || { fail "daemon-starts: $(tail -n 20 /tmp/sriovd.log)"; exit 0; }
ND=
for n in /sys/bus/vdpa/devices/vd0/virtio*/net/*; do [ -e "$n" ] && ND=${n##*/}; done
[ -n "$ND" ] || { fail "vd0-netdev"; exit 0; }
vfip addr add 10.20.0.1/24 dev "$ND"
vfip link set "$ND" up
vfip -n t addr add 10.20.0.2/24 dev vdtap0
vfip -n t link set vdtap0 up
sriovd-guest virtio-net --vhost-user /run/sriovd/vu0.sock --tap g0 --netns g >/tmp/guest.log 2>&1 &
GPID=$!
wait_for 100 vfip -n g link show g0 || { fail "guest-tap: $(cat /tmp/guest.log)"; exit 0; }
vfip -n g addr add 10.21.0.1/24 dev g0
vfip -n g link set g0 up
vfip -n u addr add 10.21.0.2/24 dev vutap0
vfip -n u link set vutap0 up
wait_for 100 ping -c 1 -W 1 10.20.0.2 >/dev/null || { fail "vduse-path"; exit 0; }
wait_for 100 vfip netns exec g ping -c 1 -W 1 10.21.0.2 >/dev/null || { fail "vhost-user-path"; exit 0; }

# mbps SERVER_NS CLIENT_NS(- for here) TO [-R]: the receiver's Mbit/s.
mbps() {
  local sns=$1 cns=$2 to=$3 out
  shift 3
  vfip netns exec "$sns" iperf3 -s -D -1 >/dev/null 2>&1
  sleep 0.3
  if [ "$cns" = - ]; then out=$(iperf3 -c "$to" -t "$SECS" -J --connect-timeout 3000 "$@" 2>&1)
  else out=$(vfip netns exec "$cns" iperf3 -c "$to" -t "$SECS" -J --connect-timeout 3000 "$@" 2>&1); fi
  echo "$out" | awk '/"sum_received"/ {r = 1} r && /"bits_per_second"/ {gsub(/[,]/, "", $2); printf "%.1f\n", $2 / 1e6; exit}'
}
vd_tx='' vd_rx='' vu_tx='' vu_rx=''
i=0
while [ $i -lt "$RUNS" ]; do
  vd_tx="$vd_tx $(mbps t - 10.20.0.2)"
  vu_tx="$vu_tx $(mbps u g 10.21.0.2)"
  vd_rx="$vd_rx $(mbps t - 10.20.0.2 -R)"
  vu_rx="$vu_rx $(mbps u g 10.21.0.2 -R)"
  i=$((i + 1))
done
kill "$GPID"
wait "$GPID" 2>/dev/null
stop_daemon >/dev/null 2>&1
# The JSON: lists, medians, ratios (awk: busybox's).
echo "$vd_tx|$vd_rx|$vu_tx|$vu_rx" | awk -F'|' -v runs="$RUNS" -v secs="$SECS" '
function median(s,   a, n, i, j, t) {
  n = split(s, a, " ")
  for (i = 1; i <= n; i++) for (j = i + 1; j <= n; j++) if (a[j] + 0 < a[i] + 0) { t = a[i]; a[i] = a[j]; a[j] = t }
  if (n == 0) return 0
  return n % 2 ? a[(n + 1) / 2] : (a[n / 2] + a[n / 2 + 1]) / 2
}
function list(s,   a, n, i, out) {
  n = split(s, a, " "); out = ""
  for (i = 1; i <= n; i++) out = out (i > 1 ? ", " : "") a[i]
  return "[" out "]"
}
{
  mt = median($1); mr = median($2); ut = median($3); ur = median($4)
  printf "VMTEST BENCH {\"bench\": \"vduse\", \"kernel\": \"6.12\", \"runs\": %d, \"seconds\": %d, ", runs, secs
  printf "\"vduse\": {\"to_tap_mbps\": %s, \"from_tap_mbps\": %s, \"to_tap_median\": %.1f, \"from_tap_median\": %.1f}, ", list($1), list($2), mt, mr
  printf "\"vhost_user\": {\"to_tap_mbps\": %s, \"from_tap_mbps\": %s, \"to_tap_median\": %.1f, \"from_tap_median\": %.1f}, ", list($3), list($4), ut, ur
  printf "\"ratio_vduse_to_vhost_user\": {\"to_tap\": %.2f, \"from_tap\": %.2f}}\n", (ut > 0 ? mt / ut : 0), (ur > 0 ? mr / ur : 0)
}'
pass "bench-ran"
