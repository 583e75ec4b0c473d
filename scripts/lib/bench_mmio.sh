#!/usr/bin/env bash
# scripts/bench mmio: the seed's experiment, reproduced. The virtio-mmio
# proposal this project grew from measured TCP_RR transactions/s for
# virtio-pci (9.5-9.9 k), plain virtio-mmio (6.9-7.1 k) and virtio-mmio with
# MSI (9.3-9.7 k): mmio/pci 0.72. Here: a Linux 6.12 guest under QEMU 11
# (TCG) with sriovd's vhost-user virtio-net on a tap, booted twice - as
# virtio-net-pci on q35 (MSI-X), and as a virtio-mmio device on QEMU's
# microvm machine (a level-triggered IOAPIC line: the guest reads the
# device's InterruptStatus and writes InterruptACK per interrupt) - and
# sockperf ping-pong over TCP against a server behind the tap
# (tests/vm/scenarios/bench-mmio.sh). Prints one JSON object: the median
# transactions/s of each, mmio/pci beside the seed's 0.72, the guest's
# interrupts per transaction and sriovd's notifies per transaction.
#   scripts/lib/bench_mmio.sh BUILD_DIR [--runs N] [--seconds S]
set -euo pipefail
here=$(cd "$(dirname "$0")/../.." && pwd)
build=${1:?usage: bench_mmio.sh BUILD_DIR [--runs N] [--seconds S]}
shift
runs=3 seconds=5
while (($#)); do
  case $1 in
    --runs) runs=$2; shift 2 ;;
    --seconds) seconds=$2; shift 2 ;;
    *) echo "bench mmio: unknown argument $1" >&2; exit 64 ;;
  esac
done
source "$here/scripts/lib/interop.sh"
source "$here/tests/vm/qemu11-lib.sh"
[[ $EUID -eq 0 && -c /dev/net/tun ]] || { echo "bench mmio: needs root and /dev/net/tun" >&2; exit 1; }
command -v sockperf >/dev/null || apt-get install -y sockperf >&2 ||
  { echo "bench mmio: sockperf could not be installed" >&2; exit 1; }
q11_prepare >&2 || { echo "bench mmio: QEMU 11 could not be prepared" >&2; exit 1; }
tag=$$
ns=sdbm-$tag
interop_workspace sriovd-bench-mmio "$ns"
chmod 0755 "$work"
{
  simulated_host_config "$work/state" "$work/control.sock" "sdbmpf$tag"
  cat <<CONF
virtio_devices:
  - name: bench-rr
    type: net
    transport: vhost-user
    socket: $work/vu.sock
    queue_size: 256
    mac: "02:5a:00:00:0c:01"
    backend: {type: tap, name: sdbm$tag, netns: $ns}
CONF
} >"$work/sriovd.yaml"
"$build/src/sriovd" --config "$work/sriovd.yaml" --foreground >"$work/sriovd.log" 2>&1 &
pids+=($!)
for _ in $(seq 100); do [[ -S $work/vu.sock ]] && break; sleep 0.1; done
[[ -S $work/vu.sock ]] || { echo "bench mmio: sriovd did not come up" >&2; cat "$work/sriovd.log" >&2; exit 1; }
for _ in $(seq 50); do ip -n "$ns" link show "sdbm$tag" >/dev/null 2>&1 && break; sleep 0.1; done
ip -n "$ns" addr add 10.84.0.1/24 dev "sdbm$tag"
ip -n "$ns" link set "sdbm$tag" up
ip -n "$ns" link set lo up
ip netns exec "$ns" sockperf server --tcp -i 10.84.0.1 -p 11111 >"$work/sockperf.log" 2>&1 &
pids+=($!)

cp "$(q11_kernel)/vmlinuz" "$work/vmlinuz"
q11_initramfs "$work/initrd.gz" "$here/tests/vm/scenarios/bench-mmio.sh" "$(command -v sockperf)"
notifies() {
  "$build/src/sriovctl" --socket "$work/control.sock" --json devices |
    python3 -c 'import json,sys; d=[v for v in json.load(sys.stdin)["virtio_devices"] if v["name"]=="bench-rr"][0]; print(sum(q["notifies"] for q in d.get("queues", [])), sum(q["kicks"] for q in d.get("queues", [])))'
}
# boot TRANSPORT MACHINE DEVICE: one guest, its console in $work/TRANSPORT.log.
boot() {
  local transport=$1 machine=$2 device=$3 log=$work/$1.log
  q11_qemu "$work" -accel tcg -machine "$machine,memory-backend=mem" -cpu max -m 512 -smp 2 \
    -object memory-backend-memfd,id=mem,size=512M,share=on \
    -chardev "socket,id=c0,path=$work/vu.sock" -netdev vhost-user,id=n0,chardev=c0 \
    -device "$device,netdev=n0,mac=02:5a:00:00:0c:01" \
    -kernel "$work/vmlinuz" -initrd "$work/initrd.gz" \
    -append "console=ttyS0 quiet loglevel=3 panic=-1 sriovd.runs=$runs sriovd.seconds=$seconds" \
    -display none -nodefaults -no-reboot -serial "file:$log" </dev/null >"$log.qemu" 2>&1 &
  local qemu=$!
  pids+=("$qemu")
  guest_bench_wait "$log" bench-mmio "$qemu" $((300 + runs * (seconds + 5))) "$transport: " || return 1
  kill "$qemu" 2>/dev/null || true
  wait "$qemu" 2>/dev/null || true
}
read -r n0 k0 < <(notifies)
boot pci q35 virtio-net-pci
read -r n1 k1 < <(notifies)
# microvm: no PCI; the virtio-mmio device is described in its ACPI tables
# and wired to an IOAPIC pin (level-triggered).
boot mmio microvm virtio-net-device
read -r n2 k2 < <(notifies)
cat "$work/pci.log" "$work/mmio.log" | sed -n 's/^VMTEST BENCH \(pci\|mmio\) \([a-z]*\) \(.*\)/\1 \2 \3/p' | tr -d '\r' |
  NOTIFIES="$((n1 - n0)) $((n2 - n1))" KICKS="$((k1 - k0)) $((k2 - k1))" SECONDS_PER_RUN="$seconds" python3 -c '
import json, os, statistics, sys
tps = {"pci": [], "mmio": []}
lat = {"pci": [], "mmio": []}
irqs = {}
for line in sys.stdin:
    f = line.split()
    if f[1] == "rr":
        tps[f[0]].append(float(f[2]))
        lat[f[0]].append(float(f[3]))
    elif f[1] == "interrupts":
        irqs[f[0]] = int(f[2])
out = {}
for t in ("pci", "mmio"):
    if not tps[t]:
        sys.exit(f"bench mmio: no {t} results")
    out[f"{t}_transactions_per_sec"] = round(statistics.median(tps[t]), 1)
    out[f"{t}_latency_us"] = round(statistics.median(lat[t]), 1)
    out[f"{t}_per_run"] = tps[t]
notifies = dict(zip(("pci", "mmio"), map(int, os.environ["NOTIFIES"].split())))
kicks = dict(zip(("pci", "mmio"), map(int, os.environ["KICKS"].split())))
secs = float(os.environ["SECONDS_PER_RUN"])
for t in ("pci", "mmio"):
    # Per transaction, over the runs (the boot and ping add a few).
    n = sum(tps[t]) * secs
    out[f"{t}_guest_interrupts_per_transaction"] = round(irqs.get(t, 0) / n, 3)
    out[f"{t}_device_notifies_per_transaction"] = round(notifies[t] / n, 3)
    out[f"{t}_driver_kicks_per_transaction"] = round(kicks[t] / n, 3)
out["mmio_over_pci"] = round(out["mmio_transactions_per_sec"] / out["pci_transactions_per_sec"], 3)
out["seed_mmio_over_pci"] = round(7.0 / 9.7, 2)
out["guest"] = "Linux 6.12 (Debian 13), QEMU 11.1 TCG, 2 vCPUs; sockperf ping-pong TCP 64 B"
print(json.dumps(out))
'
