#!/usr/bin/env bash
# scripts/bench qemu: one Linux guest under QEMU 11 (TCG) with three NICs,
# the same guest measuring each in turn with iperf3 (tests/vm/scenarios/
# bench-qemu.sh): QEMU's own virtio-net on a tap (what a user would pick
# without sriovd), sriovd's vhost-user device on a tap, and sriovd's
# virtio-net-pci over vfio-user (QEMU's vfio-user client) on a tap. Each tap
# sits in a namespace of its own with an iperf3 server. Prints one JSON
# object: the medians per path and direction and sriovd's ratios to QEMU's.
#   scripts/lib/bench_qemu.sh BUILD_DIR [--runs N] [--seconds S] [--poll-us U]
# --poll-us: sriovd's control thread polls U us after work (control.poll_us)
# instead of sleeping at once: a doorbell that comes meanwhile costs no wakeup.
set -euo pipefail
here=$(cd "$(dirname "$0")/../.." && pwd)
build=${1:?usage: bench_qemu.sh BUILD_DIR [--runs N] [--seconds S]}
shift
runs=3 seconds=5 poll_us=0
while (($#)); do
  case $1 in
    --poll-us) poll_us=$2; shift 2 ;;
    --runs) runs=$2; shift 2 ;;
    --seconds) seconds=$2; shift 2 ;;
    *) echo "bench qemu: unknown argument $1" >&2; exit 64 ;;
  esac
done
source "$here/scripts/lib/interop.sh"
source "$here/tests/vm/qemu11-lib.sh"
[[ $EUID -eq 0 && -c /dev/net/tun ]] || { echo "bench qemu: needs root and /dev/net/tun" >&2; exit 1; }
q11_prepare >&2 || { echo "bench qemu: QEMU 11 could not be prepared" >&2; exit 1; }
tag=$$
ns_q=sdbq-q$tag ns_u=sdbq-u$tag ns_f=sdbq-f$tag
interop_workspace sriovd-bench-qemu "$ns_q" "$ns_u" "$ns_f"
chmod 0755 "$work"
{
  simulated_host_config "$work/state" "$work/control.sock" "sdbqpf$tag"
  cat <<CONF
virtio_devices:
  - name: bench-vu
    type: net
    transport: vhost-user
    socket: $work/vu.sock
    queue_size: 256
    mac: "02:5a:00:00:0b:02"
    backend: {type: tap, name: sdbqu$tag, netns: $ns_u}
  - name: bench-vfu
    type: net
    transport: vfio-user
    socket: $work/vfu.sock
    queue_size: 256
    mac: "02:5a:00:00:0b:03"
    backend: {type: tap, name: sdbqf$tag, netns: $ns_f}
CONF
} >"$work/sriovd.yaml"
sed -i "s|^  socket: $work/control.sock\$|&\n  poll_us: $poll_us|" "$work/sriovd.yaml"
grep -q "poll_us: $poll_us" "$work/sriovd.yaml" || { echo "bench qemu: could not set control.poll_us" >&2; exit 1; }
"$build/src/sriovd" --config "$work/sriovd.yaml" --foreground >"$work/sriovd.log" 2>&1 &
pids+=($!)
for _ in $(seq 100); do [[ -S $work/vfu.sock && -S $work/vu.sock ]] && break; sleep 0.1; done
[[ -S $work/vfu.sock ]] || { echo "bench qemu: sriovd did not come up" >&2; cat "$work/sriovd.log" >&2; exit 1; }
server() {  # server NS TAP SUBNET
  ip -n "$1" addr add "10.$3.0.1/24" dev "$2"
  ip -n "$1" link set "$2" up
  ip -n "$1" link set lo up
  ip netns exec "$1" iperf3 -s -B "10.$3.0.1" >/dev/null 2>&1 &
  pids+=($!)
}
for _ in $(seq 50); do ip -n "$ns_u" link show "sdbqu$tag" >/dev/null 2>&1 && break; sleep 0.1; done
server "$ns_u" "sdbqu$tag" 82
server "$ns_f" "sdbqf$tag" 83

cp "$(q11_kernel)/vmlinuz" "$work/vmlinuz"
q11_initramfs "$work/initrd.gz" "$here/tests/vm/scenarios/bench-qemu.sh" /usr/bin/iperf3
log=$work/console.log
# QEMU's own tap: created by QEMU (in this namespace), then moved into its own.
q11_qemu "$work" -accel tcg -machine q35,memory-backend=mem -cpu max -m 768 -smp 2 \
  -object memory-backend-memfd,id=mem,size=768M,share=on \
  -netdev "tap,id=t0,ifname=sdbqq$tag,script=no,downscript=no" -device virtio-net-pci,netdev=t0,mac=02:5a:00:00:0b:01 \
  -chardev "socket,id=c0,path=$work/vu.sock" -netdev vhost-user,id=n1,chardev=c0 \
  -device virtio-net-pci,netdev=n1,mac=02:5a:00:00:0b:02 \
  -device "{\"driver\":\"vfio-user-pci\",\"socket\":{\"type\":\"unix\",\"path\":\"$work/vfu.sock\"}}" \
  -kernel "$work/vmlinuz" -initrd "$work/initrd.gz" \
  -append "console=ttyS0 quiet loglevel=3 panic=-1 sriovd.runs=$runs sriovd.seconds=$seconds" \
  -display none -nodefaults -no-reboot -serial "file:$log" </dev/null >"$log.qemu" 2>&1 &
qemu=$!
pids+=("$qemu")
for _ in $(seq 200); do ip link show "sdbqq$tag" >/dev/null 2>&1 && break; sleep 0.1; done
ip link set "sdbqq$tag" netns "$ns_q" || { echo "bench qemu: QEMU's tap did not appear" >&2; cat "$log.qemu" >&2; exit 1; }
server "$ns_q" "sdbqq$tag" 81
guest_bench_wait "$log" bench-qemu "$qemu" $((300 + runs * 6 * (seconds + 5))) "" || exit 1
# Where sriovd's time goes: per device, packets, the driver's kicks and
# the device's interrupts (notifies) over the whole run, and vfio-user
# messages (every doorbell of QEMU's client is one).
"$build/src/sriovctl" --socket "$work/control.sock" --json devices >"$work/devices.json"
# CPU seconds of sriovd's control thread, of each session thread (the one
# a vfio-user device is given serves every message of its client: the
# doorbells of QEMU's client) and of the whole daemon, over the run.
sriovd_pid=${pids[0]}
hz=$(getconf CLK_TCK)
cpu_of() { awk -v hz="$hz" '{sub(/.*\) /, ""); print ($12 + $13) / hz}' "$1"; }
control_cpu=$(cpu_of "/proc/$sriovd_pid/task/$sriovd_pid/stat")
daemon_cpu=$(cpu_of "/proc/$sriovd_pid/stat")
session_cpu=""
for task in /proc/"$sriovd_pid"/task/*; do
  comm=$(cat "$task/comm" 2>/dev/null) || continue
  [[ $comm == sriovd-sess* ]] && session_cpu+="${comm#sriovd-sess} $(cpu_of "$task/stat");"
done
sed -n 's/^VMTEST BENCH \([a-z_]*\) \(tx\|rx\) \([0-9.e+]*\).*/\1 \2 \3/p' "$log" | tr -d '\r' |
  DEVICES="$work/devices.json" CONTROL_CPU="$control_cpu" DAEMON_CPU="$daemon_cpu" SESSION_CPU="$session_cpu" \
  POLL_US="$poll_us" python3 -c '
import json, statistics, sys
runs = {}
for line in sys.stdin:
    path, d, bps = line.split()
    runs.setdefault(f"{path}_{d}", []).append(float(bps) / 1e9)
out = {k + "_gbps": round(statistics.median(v), 3) for k, v in sorted(runs.items())}
for d in ("tx", "rx"):
    base = out.get(f"qemu_tap_{d}_gbps")
    for p in ("vhost_user", "vfio_user"):
        v = out.get(f"{p}_{d}_gbps")
        out[f"{p}_vs_qemu_{d}"] = round(v / base, 3) if base and v is not None else None
# Each run measured the three paths back to back: its own ratios, and
# their median (a machine that changes speed between runs moves both).
for d in ("tx", "rx"):
    base = runs.get(f"qemu_tap_{d}", [])
    for p in ("vhost_user", "vfio_user"):
        mine = runs.get(f"{p}_{d}", [])
        pairs = [m / b for m, b in zip(mine, base) if b > 0]
        out[f"{p}_vs_qemu_{d}_paired"] = round(statistics.median(pairs), 3) if pairs else None
out["runs"] = len(runs.get("qemu_tap_tx", []))
out["control_poll_us"] = int(__import__("os").environ["POLL_US"])
out["per_run_gbps"] = {k: [round(x, 3) for x in v] for k, v in sorted(runs.items())}
devs = json.load(open(__import__("os").environ["DEVICES"]))["virtio_devices"]
for name, path in (("bench-vu", "vhost_user"), ("bench-vfu", "vfio_user")):
    d = next((v for v in devs if v["name"] == name), None)
    if d is None:
        continue
    q = d.get("queues", [])
    pk = sum(x["packets"] for x in q) or 1
    c = {"packets": pk, "kicks_per_packet": round(sum(x["kicks"] for x in q) / pk, 4),
         "notifies_per_packet": round(sum(x["notifies"] for x in q) / pk, 4)}
    if "vfio_user" in d:
        c["messages_per_packet"] = round(d["vfio_user"]["messages"] / pk, 4)
        env = __import__("os").environ
        c["control_thread_cpu_s"] = float(env["CONTROL_CPU"])
        c["control_thread_us_per_message"] = round(float(env["CONTROL_CPU"]) * 1e6 / max(d["vfio_user"]["messages"], 1), 2)
        sessions = dict(x.split() for x in env.get("SESSION_CPU", "").split(";") if x.strip())
        t = str(d.get("session_thread", ""))
        if t in sessions:
            c["session_thread"] = int(t)
            c["session_thread_cpu_s"] = float(sessions[t])
            c["session_thread_us_per_message"] = round(float(sessions[t]) * 1e6 / max(d["vfio_user"]["messages"], 1), 2)
    out[f"{path}_counters"] = c
out["sriovd_cpu_s"] = float(__import__("os").environ["DAEMON_CPU"])
out["guest"] = "Linux 6.12 (Debian 13), QEMU 11.1 TCG, 2 vCPUs; tx: guest -> host, rx: host -> guest"
print(json.dumps(out))
'
