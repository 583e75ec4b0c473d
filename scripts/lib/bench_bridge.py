#!/usr/bin/python3
"""scripts/bench bridge: the VF <-> virtio bridge against DPDK's, in one run.

A guest (DPDK testpmd, net_virtio_user) talks vhost-user to a bridge whose
other side is a veth standing for a VF's netdev; the veth's other end is
the wire. Bridges:
  sriovd_af_packet  sriovd, backend {type: vf, via: af_packet} (TPACKET_V2)
  sriovd_af_xdp     sriovd, backend {type: vf, via: af_xdp}
  dpdk_af_packet    testpmd io forwarding net_vhost <-> net_af_packet
  dpdk_af_xdp       testpmd io forwarding net_vhost <-> net_af_xdp
Directions:
  tx  guest -> wire: the guest runs txonly; counted at the wire end
      (its rx_packets, the kernel's counter).
  rx  wire -> guest: a generator (testpmd txonly on net_af_packet) on the
      wire end; the guest runs rxonly and counts (its Rx-pps); the
      generator's own rate is reported next to it (offered_mpps).
Every figure is the median of --runs runs; the variants of one run are
measured back to back, in turn (every other run in the reverse order), so
the machine's noise and any order effect fall on all.
Ratios: sriovd_X / dpdk_X for each direction and size, of the medians;
ratios_per_run: the same for each run's back-to-back pair (the spread).

CPUs (2 here): the bridge's forwarding thread on CPU 0 (sriovd: the
device's `cpus: [0]`; testpmd: its forwarding lcore 0), the guest's on
CPU 1, the generator's on CPU 1 too (three pollers, two CPUs: the same for
every bridge).

Everything runs in a network namespace this script makes and removes;
every process it starts is ended by its PID. JSON on stdout, the rest on
stderr. Exit 1 when something could not be measured.
"""
import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUILD = os.path.join(ROOT, "build/release")
VARIANTS = ["sriovd_af_packet", "dpdk_af_packet", "sriovd_af_xdp", "dpdk_af_xdp"]


def log(msg):
    print(msg, file=sys.stderr, flush=True)


class Bench:
    def __init__(self, args):
        self.args = args
        self.ns = f"sbb{os.getpid()}"
        self.work = tempfile.mkdtemp(prefix="sriovd-bench-bridge.")
        self.procs = []  # (name, Popen), last started last
        self.seq = 0

    # --- processes, each ended by its PID ---
    def start(self, name, argv):
        self.seq += 1
        path = os.path.join(self.work, f"{self.seq:03d}-{name}.log")
        out = open(path, "w")
        p = subprocess.Popen(["ip", "netns", "exec", self.ns] + argv, stdout=out, stderr=subprocess.STDOUT,
                             stdin=subprocess.DEVNULL, start_new_session=True)
        self.procs.append((name, p, path))
        return p, path

    def stop(self, p, sig=signal.SIGINT, wait=10):
        if p.poll() is None:
            try:
                os.killpg(p.pid, sig)
            except ProcessLookupError:
                pass
            try:
                p.wait(wait)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        self.procs = [x for x in self.procs if x[1] is not p]

    def stop_all(self):
        for _, p, _ in reversed(list(self.procs)):
            self.stop(p)

    def ip(self, *args, check=True):
        r = subprocess.run(["ip", "-n", self.ns] + list(args), capture_output=True, text=True)
        if check and r.returncode != 0:
            raise RuntimeError(f"ip {' '.join(args)}: {r.stderr.strip()}")
        return r.stdout

    def setup(self):
        subprocess.run(["ip", "netns", "add", self.ns], check=True)
        for knob in ("all", "default"):
            subprocess.run(["ip", "netns", "exec", self.ns, "sysctl", "-qw", f"net.ipv6.conf.{knob}.disable_ipv6=1"],
                           check=False)
        self.ip("link", "set", "lo", "up")
        # The DPDK bridges' VF: one queue each way (their PMDs bind queue 0).
        self.ip("link", "add", "bbwire", "type", "veth", "peer", "name", "bbvf")
        for dev in ("bbwire", "bbvf"):
            self.ip("link", "set", dev, "up")

    def teardown(self):
        self.stop_all()
        subprocess.run(["ip", "netns", "del", self.ns], check=False)
        if not self.args.keep:
            subprocess.run(["rm", "-rf", self.work], check=False)

    def rx_packets(self, dev):
        stats = json.loads(self.ip("-s", "-j", "link", "show", "dev", dev))
        return stats[0]["stats64"]["rx"]["packets"]

    # --- the bridges ---
    def start_bridge(self, variant, sock):
        """Starts the bridge; returns (the VF-side netdev, the wire end)."""
        if variant.startswith("sriovd_"):
            via = variant[len("sriovd_"):]
            state = os.path.join(self.work, f"state{self.seq}")
            ctl = os.path.join(self.work, f"ctl{self.seq}.sock")
            conf = os.path.join(self.work, f"sriovd{self.seq}.yaml")
            with open(conf, "w") as f:
                f.write(f"""version: 1
host: simulated
state_dir: {state}
simulated:
  physical_functions:
    - {{address: "0000:3b:00.0", netdev: bbpf}}
control:
  socket: {ctl}
physical_functions:
  - {{address: "0000:3b:00.0", num_vfs: 1}}
virtio_devices:
  - name: bb0
    type: net
    transport: vhost-user
    socket: {sock}
    queue_size: 1024
    cpus: [0]
    backend: {{type: vf, pf: "0000:3b:00.0", vf: 0, via: {via}}}
""")
            p, path = self.start("sriovd", [os.path.join(self.args.build_dir, "src/sriovd"), "--config", conf,
                                            "--foreground"])
            self.wait_for(lambda: os.path.exists(sock), f"sriovd's socket ({path})", p)
            sriovctl = os.path.join(self.args.build_dir, "src/sriovctl")
            out = subprocess.run(["ip", "netns", "exec", self.ns, sriovctl, "--socket", ctl, "--json", "devices"],
                                 capture_output=True, text=True, check=True).stdout
            dev = json.loads(out)["virtio_devices"][0]
            if dev.get("state") == "not served":
                raise RuntimeError(f"sriovd did not serve the device: {dev.get('reason')}")
            netdev = dev["backend"]["netdev"]
            wire = netdev + "p"
            self.ip("link", "set", wire, "up")
            return netdev, wire
        pmd = {"dpdk_af_packet": "net_af_packet0,iface=bbvf,qdisc_bypass=1",
               "dpdk_af_xdp": "net_af_xdp0,iface=bbvf,start_queue=0,queue_count=1"}[variant]
        p, path = self.start("testpmd-bridge", [
            "dpdk-testpmd", "-l", "0,1", "--main-lcore", "1", "--no-huge", "-m", "1024", "--no-pci",
            "--file-prefix", f"bbb{os.getpid()}{self.seq}", "--vdev", f"net_vhost0,iface={sock},queues=1",
            "--vdev", pmd, "--", "--forward-mode=io", "--total-num-mbufs=32768", "--rxd=1024", "--txd=1024",
            "--stats-period", "1"])
        self.wait_for(lambda: os.path.exists(sock), f"testpmd's vhost socket ({path})", p)
        return "bbvf", "bbwire"

    def wait_for(self, cond, what, proc, timeout=20):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if cond():
                return
            if proc.poll() is not None:
                raise RuntimeError(f"{what}: the process ended (exit {proc.returncode})")
            time.sleep(0.05)
        raise RuntimeError(f"{what}: not there after {timeout} s")

    def testpmd(self, name, lcores, main, vdev, mode, size):
        p, path = self.start(name, [
            "dpdk-testpmd", "-l", lcores, "--main-lcore", main, "--no-huge", "-m", "512", "--no-pci",
            "--file-prefix", f"bb{name}{os.getpid()}{self.seq}", "--vdev", vdev, "--",
            f"--forward-mode={mode}", f"--txpkts={size - 4}", "--burst=32", "--total-num-mbufs=16384",
            "--rxd=1024", "--txd=1024", "--stats-period", "1"])
        self.wait_for(lambda: "Rx-pps" in open(path).read(), f"{name} forwarding ({path})", p)
        return p, path

    def generator_vdev(self, wire):
        if self.args.generator == "af_xdp":
            return f"net_af_xdp0,iface={wire},start_queue=0,queue_count=1"
        return f"net_af_packet0,iface={wire},qdisc_bypass=1"

    @staticmethod
    def pps_samples(path, key):
        return [int(x) for x in re.findall(rf"{key}:\s+(\d+)", open(path).read())]

    def measure(self, variant, direction, size):
        sock = os.path.join(self.work, f"bb{self.seq}.sock")
        started = len(self.procs)
        try:
            _, wire = self.start_bridge(variant, sock)
            guest_vdev = f"net_virtio_user0,path={sock},queues=1,queue_size=1024"
            if direction == "tx":
                self.testpmd("guest", "0,1", "0", guest_vdev, "txonly", size)
                time.sleep(self.args.warmup)
                before = self.rx_packets(wire)
                t0 = time.monotonic()
                time.sleep(self.args.seconds)
                got = self.rx_packets(wire) - before
                mpps = got / (time.monotonic() - t0) / 1e6
                return {"mpps": mpps}
            _, guest_log = self.testpmd("guest", "0,1", "0", guest_vdev, "rxonly", size)
            _, gen_log = self.testpmd("generator", "0,1", "0", self.generator_vdev(wire), "txonly", size)
            skip_rx = len(self.pps_samples(guest_log, "Rx-pps"))
            skip_tx = len(self.pps_samples(gen_log, "Tx-pps"))
            time.sleep(self.args.warmup + self.args.seconds)
            rx = self.pps_samples(guest_log, "Rx-pps")[skip_rx:]
            tx = self.pps_samples(gen_log, "Tx-pps")[skip_tx:]
            keep = max(1, int(self.args.seconds))
            rx, tx = rx[-keep:], tx[-keep:]
            if not rx or not tx:
                raise RuntimeError(f"no rate samples from the guest ({guest_log}) or generator ({gen_log})")
            return {"mpps": statistics.median(rx) / 1e6, "offered_mpps": statistics.median(tx) / 1e6}
        finally:
            for _, p, _ in reversed(self.procs[started:]):
                self.stop(p)
            if os.path.exists(sock):
                os.unlink(sock)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=4.0, help="measured window of each run")
    ap.add_argument("--warmup", type=float, default=1.5)
    ap.add_argument("--sizes", default="64,1518")
    ap.add_argument("--directions", default="tx,rx")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--generator", default="af_xdp", choices=["af_xdp", "af_packet"],
                    help="the rx direction's generator on the wire end: testpmd txonly on this PMD")
    ap.add_argument("--keep", action="store_true", help="keep the logs' directory")
    ap.add_argument("--build-dir", default=BUILD, help="where sriovd and sriovctl are built")
    args = ap.parse_args()
    if os.geteuid() != 0:
        log("bench bridge: needs root (network namespaces, XDP, vhost-user sockets)")
        return 1
    sizes = [int(s) for s in args.sizes.split(",")]
    directions = args.directions.split(",")
    variants = args.variants.split(",")
    b = Bench(args)
    samples = {}  # (variant, direction, size) -> [result]
    try:
        b.setup()
        for run in range(args.runs):
            for direction in directions:
                for size in sizes:
                    # Every other run in the reverse order: which of a
                    # back-to-back pair goes first alternates (ABBA), so an
                    # order effect falls on both bridges alike.
                    for v in variants if run % 2 == 0 else reversed(variants):
                        r = b.measure(v, direction, size)
                        samples.setdefault((v, direction, size), []).append(r)
                        extra = f" (offered {r['offered_mpps']:.3f})" if "offered_mpps" in r else ""
                        log(f"run {run + 1}: {v} {direction} {size} B: {r['mpps']:.3f} Mpps{extra}")
    except Exception as ex:  # a bench that could not measure says why and fails
        log(f"bench bridge: {ex} (logs in {b.work}; kept)")
        args.keep = True
        b.teardown()
        return 1
    b.teardown()
    out = {"runs": args.runs, "seconds": args.seconds, "cpus": os.cpu_count(), "results": {}, "ratios": {},
           "ratios_per_run": {}}
    for (v, d, s), rs in samples.items():
        key = f"{v}_{d}_{s}"
        out["results"][key + "_mpps"] = statistics.median(r["mpps"] for r in rs)
        if "offered_mpps" in rs[0]:
            out["results"][key + "_offered_mpps"] = statistics.median(r["offered_mpps"] for r in rs)
    for d in directions:
        for s in sizes:
            for via in ("af_packet", "af_xdp"):
                mine = out["results"].get(f"sriovd_{via}_{d}_{s}_mpps")
                base = out["results"].get(f"dpdk_{via}_{d}_{s}_mpps")
                if mine is not None and base:
                    out["ratios"][f"{via}_{d}_{s}"] = mine / base
                    # Each run's pair, measured back to back: the spread the
                    # medians come from (the machine's noise, run to run).
                    pairs = zip(samples[(f"sriovd_{via}", d, s)], samples[(f"dpdk_{via}", d, s)])
                    out["ratios_per_run"][f"{via}_{d}_{s}"] = [m["mpps"] / b["mpps"] if b["mpps"] else None
                                                               for m, b in pairs]
    print(json.dumps(out, indent=2, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
