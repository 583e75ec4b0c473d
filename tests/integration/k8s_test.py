#!/usr/bin/python3
"""sriovd's kubelet device plugin against a kubelet stand-in.

No kubelet is packaged for Debian 12, so this script plays it: a real gRPC
peer (Debian's python3-grpcio, messages from the project's own .proto
compiled with protoc) that serves Registration on kubelet.sock and drives
each registered plugin as the kubelet does: GetDevicePluginOptions,
ListAndWatch, GetPreferredAllocation, Allocate. Then the kubelet restarts
(its socket deleted and made again, the plugins' sockets removed) and the
plugins register again; a VF that leaves the simulated host, or whose PF loses its link, is Unhealthy
within 1 s and Healthy when it is back; a pooled virtio device's socket is
mounted; a reload moves a VF between pools;
malformed and unknown requests get gRPC errors naming what is wrong.

    tests/integration/k8s_test.py BUILD_DIR
Exit 0: all passed; 1: a check failed; 77: cannot run here (says why).
"""

import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent import futures

try:
    import grpc
except ImportError:
    print("SKIP: python3-grpcio is not installed (apt-get install python3-grpcio python3-protobuf)", file=sys.stderr)
    sys.exit(77)

if os.geteuid() != 0 or not os.path.exists("/dev/net/tun"):
    print("SKIP: needs root and /dev/net/tun (the pooled virtio device's tap)", file=sys.stderr)
    sys.exit(77)

BUILD = os.path.abspath(sys.argv[1])
SRC = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
sys.dont_write_bytecode = True  # nothing generated in the source tree
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import standin_lib  # noqa: E402
from standin_lib import check, wait_until  # noqa: E402
SRIOVD = os.path.join(BUILD, "src", "sriovd")
SRIOVCTL = os.path.join(BUILD, "src", "sriovctl")
POOL_A, POOL_B, POOL_C = "sriovd.test/vfio_a", "sriovd.test/vfio_b", "sriovd.test/vnet"

work = tempfile.mkdtemp(prefix="sriovd-k8s.")
plugin_dir = os.path.join(work, "device-plugins")
cdi_dir = os.path.join(work, "cdi")
os.makedirs(plugin_dir)
procs = []


# --- the API's messages, from the project's .proto ---
(api,) = standin_lib.protos(SRC, work, ["deviceplugin_v1beta1.proto"])


# --- the kubelet stand-in: Registration on kubelet.sock ---
class Kubelet:
    def __init__(self):
        self.registrations = queue.Queue()
        self.server = None

    def start(self):
        def register(request, context):
            self.registrations.put(request)
            return api.Empty()
        handler = grpc.method_handlers_generic_handler("v1beta1.Registration", {
            "Register": grpc.unary_unary_rpc_method_handler(
                register, request_deserializer=api.RegisterRequest.FromString,
                response_serializer=api.Empty.SerializeToString)})
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        self.server.add_generic_rpc_handlers((handler,))
        self.server.add_insecure_port("unix://" + os.path.join(plugin_dir, "kubelet.sock"))
        self.server.start()

    def stop(self):
        self.server.stop(0).wait()
        try:
            os.unlink(os.path.join(plugin_dir, "kubelet.sock"))
        except FileNotFoundError:
            pass

    def take(self, n, seconds=10):
        got = {}
        end = time.monotonic() + seconds
        while len(got) < n and time.monotonic() < end:
            try:
                r = self.registrations.get(timeout=max(0.01, end - time.monotonic()))
                got[r.resource_name] = r
            except queue.Empty:
                break
        return got


class Plugin:
    """The kubelet's client of one registered plugin."""

    def __init__(self, endpoint):
        self.channel = grpc.insecure_channel("unix://" + os.path.join(plugin_dir, endpoint))
        m = "/v1beta1.DevicePlugin/"
        self.options = self.channel.unary_unary(m + "GetDevicePluginOptions", api.Empty.SerializeToString,
                                                api.DevicePluginOptions.FromString)
        self.list_and_watch = self.channel.unary_stream(m + "ListAndWatch", api.Empty.SerializeToString,
                                                        api.ListAndWatchResponse.FromString)
        self.preferred = self.channel.unary_unary(m + "GetPreferredAllocation",
                                                  api.PreferredAllocationRequest.SerializeToString,
                                                  api.PreferredAllocationResponse.FromString)
        self.allocate = self.channel.unary_unary(m + "Allocate", api.AllocateRequest.SerializeToString,
                                                 api.AllocateResponse.FromString)
        self.raw_allocate = self.channel.unary_unary(m + "Allocate", lambda b: b, api.AllocateResponse.FromString)
        self.lists = queue.Queue()
        self.stream = None

    def watch(self):
        self.stream = self.list_and_watch(api.Empty())

        def run():
            try:
                for resp in self.stream:
                    self.lists.put({d.ID: (d.health, [n.ID for n in d.topology.nodes]) for d in resp.devices})
            except grpc.RpcError:
                pass
        threading.Thread(target=run, daemon=True).start()

    def next_list(self, pred, seconds):
        """The first list streamed within `seconds` for which pred holds."""
        end = time.monotonic() + seconds
        last = None
        while time.monotonic() < end:
            try:
                last = self.lists.get(timeout=max(0.01, end - time.monotonic()))
                if pred(last):
                    return last, True
            except queue.Empty:
                break
        return last, False


def ctl(*args):
    return subprocess.run([SRIOVCTL, "-s", os.path.join(work, "control.sock"), *args],
                          capture_output=True, text=True, timeout=30)


def write_config(pool_a_indexes):
    vfs = "\n".join(
        f"      - {{index: {i}, assign: {{owner: {'k8s-b' if i == 2 else 'k8s'}, export: none}}}}" for i in range(4))
    with open(os.path.join(work, "sriovd.yaml"), "w") as f:
        f.write(f"""version: 1
host: simulated
state_dir: {work}/state
simulated:
  physical_functions:
    - {{address: "0000:3b:00.0", netdev: k8pf{os.getpid() % 100000}}}
control:
  socket: {work}/control.sock
physical_functions:
  - address: "0000:3b:00.0"
    num_vfs: 4
    vfs:
{vfs}
virtio_devices:
  - name: vnet0
    type: net
    transport: vhost-user
    socket: {work}/vnet0.sock
    backend: {{type: tap, name: k8tap{os.getpid() % 100000}}}
kubernetes:
  device_plugin_dir: {plugin_dir}
  cdi_dir: {cdi_dir}
  pools:
    - name: {POOL_A}
      vfs: [{{pf: "0000:3b:00.0", indexes: {json.dumps(pool_a_indexes)}}}]
    - name: {POOL_B}
      selector: {{owner: k8s-b}}
      vfs: [{{pf: "0000:3b:00.0", indexes: {json.dumps([i for i in (0, 1, 3) if i not in pool_a_indexes])}}}]
    - name: {POOL_C}
      virtio_devices: [vnet0]
""")


def main():
    kubelet = Kubelet()
    kubelet.start()
    write_config([0, 1])
    log = open(os.path.join(work, "sriovd.log"), "w")
    daemon = subprocess.Popen([SRIOVD, "--config", os.path.join(work, "sriovd.yaml"), "--foreground"],
                              stdout=log, stderr=subprocess.STDOUT)
    procs.append(daemon)

    regs = kubelet.take(3)
    check("the three pools register with the kubelet", set(regs) == {POOL_A, POOL_B, POOL_C}, list(regs))
    if set(regs) != {POOL_A, POOL_B, POOL_C}:
        return
    for r in regs.values():
        check(f"{r.resource_name}: version v1beta1, endpoint in the directory, preferred allocation offered",
              r.version == "v1beta1" and os.path.exists(os.path.join(plugin_dir, r.endpoint))
              and r.options.get_preferred_allocation_available, r)
    a = Plugin(regs[POOL_A].endpoint)
    b = Plugin(regs[POOL_B].endpoint)
    check("GetDevicePluginOptions", a.options(api.Empty(), timeout=5).get_preferred_allocation_available)
    a.watch()
    b.watch()
    va0, va1, vb2, vb3 = "0000:3b:02.0", "0000:3b:02.1", "0000:3b:02.2", "0000:3b:02.3"
    first, ok = a.next_list(lambda l: l.get(va0, ("",))[0] == "Healthy" and l.get(va1, ("",))[0] == "Healthy", 5)
    check("ListAndWatch: pool A lists VFs 0 and 1, Healthy, with their NUMA node", ok and set(first) == {va0, va1}
          and all(len(v[1]) <= 1 for v in first.values()), first)
    bl, ok = b.next_list(lambda l: set(l) == {vb2, vb3}, 5)
    check("ListAndWatch: pool B (a selector and a list) lists VFs 2 and 3", ok, bl)

    pref = a.preferred(api.PreferredAllocationRequest(container_requests=[api.ContainerPreferredAllocationRequest(
        available_deviceIDs=[va1, va0], must_include_deviceIDs=[va1], allocation_size=2)]), timeout=5)
    ids = list(pref.container_responses[0].deviceIDs)
    check("GetPreferredAllocation: the must-include device first, then packed", ids == [va1, va0], ids)

    resp = a.allocate(api.AllocateRequest(container_requests=[api.ContainerAllocateRequest(devices_ids=[va0])]),
                      timeout=5)
    c = resp.container_responses[0]
    paths = {d.host_path: d.permissions for d in c.devices}
    groups = [p for p in paths if p.startswith("/dev/vfio/") and p != "/dev/vfio/vfio"]
    check("Allocate: /dev/vfio/vfio and the VF's group, rw", paths.get("/dev/vfio/vfio") == "rw" and len(groups) == 1
          and paths[groups[0]] == "rw", paths)
    env = dict(c.envs)
    check("Allocate: PCIDEVICE_SRIOVD_TEST_VFIO_A and PCI_RESOURCE_SRIOVD_TEST_VFIO_A",
          env.get("PCIDEVICE_SRIOVD_TEST_VFIO_A") == va0 and env.get("PCI_RESOURCE_SRIOVD_TEST_VFIO_A") == va0, env)
    info = json.loads(env.get("PCIDEVICE_SRIOVD_TEST_VFIO_A_INFO", "{}"))
    check("Allocate: the _INFO JSON names the VFIO group", info.get(va0, {}).get("vfio", {}).get("dev-mount") == groups[0]
          if groups else False, info)
    check("Allocate: the CDI device name", [d.name for d in c.cdi_devices] == [POOL_A + "=" + va0], c.cdi_devices)
    spec_path = os.path.join(cdi_dir, "sriovd-sriovd.test_vfio_a.json")
    spec = json.load(open(spec_path)) if os.path.exists(spec_path) else {}
    check("the CDI spec: kind and devices", spec.get("kind") == POOL_A
          and {d["name"] for d in spec.get("devices", [])} == {va0, va1}, spec)

    # A virtio device: its vhost-user socket is the resource, mounted.
    c_plugin = Plugin(regs[POOL_C].endpoint)
    c_plugin.watch()
    got, ok = c_plugin.next_list(lambda l: l.get("vnet0", ("",))[0] == "Healthy", 5)
    check("ListAndWatch: the virtio device, Healthy while sriovd serves its socket", ok, got)
    resp = c_plugin.allocate(api.AllocateRequest(container_requests=[api.ContainerAllocateRequest(
        devices_ids=["vnet0"])]), timeout=5)
    mounts = [(m.host_path, m.container_path) for m in resp.container_responses[0].mounts]
    sock = os.path.join(work, "vnet0.sock")
    check("Allocate: the virtio device's socket as a mount", mounts == [(sock, sock)]
          and resp.container_responses[0].envs.get("SRIOVD_VIRTIO_SOCKET_SRIOVD_TEST_VNET") == sock, resp)

    # Bad requests: the plugin answers with an error naming it and goes on.
    for name, req, want in [
            ("an unknown device id", api.AllocateRequest(container_requests=[api.ContainerAllocateRequest(
                devices_ids=["0000:ff:00.0"])]), "0000:ff:00.0"),
            ("a device of the other pool", api.AllocateRequest(container_requests=[api.ContainerAllocateRequest(
                devices_ids=[vb2])]), vb2)]:
        try:
            a.allocate(req, timeout=5)
            check("Allocate refuses " + name, False, "no error")
        except grpc.RpcError as e:
            check("Allocate refuses " + name, e.code() == grpc.StatusCode.INVALID_ARGUMENT and want in e.details(),
                  (e.code(), e.details()))
    try:
        a.raw_allocate(b"\xff\xff\xff\xff", timeout=5)
        check("a malformed Allocate is an error", False, "no error")
    except grpc.RpcError as e:
        check("a malformed Allocate is an error, not a crash", e.code() != grpc.StatusCode.OK, e.code())
    check("the daemon lives after the bad requests", daemon.poll() is None)

    # A VF leaves the host (its sysfs node goes, udev says so): Unhealthy in <= 1 s; back: Healthy.
    sysfs = os.path.join(work, "state", "simulated-sysfs", "bus", "pci", "devices")
    moved = os.path.join(work, "vf1-away")
    os.rename(os.path.join(sysfs, va1), moved)
    t0 = time.monotonic()
    ctl("udev-event", "remove", va1, "--pf", "0000:3b:00.0")
    got, ok = a.next_list(lambda l: l.get(va1, ("",))[0] == "Unhealthy", 1.0)
    took = time.monotonic() - t0
    check(f"a removed VF is Unhealthy within 1 s ({took * 1000:.0f} ms after the udev event was sent)", ok, got)
    try:
        a.allocate(api.AllocateRequest(container_requests=[api.ContainerAllocateRequest(devices_ids=[va1])]), timeout=5)
        check("Allocate refuses an unhealthy VF", False, "no error")
    except grpc.RpcError as e:
        check("Allocate refuses an unhealthy VF, naming it", e.code() == grpc.StatusCode.FAILED_PRECONDITION
              and va1 in e.details(), (e.code(), e.details()))
    os.rename(moved, os.path.join(sysfs, va1))
    t0 = time.monotonic()
    ctl("udev-event", "add", va1)
    got, ok = a.next_list(lambda l: l.get(va1, ("",))[0] == "Healthy", 1.0)
    took = time.monotonic() - t0
    check(f"the VF back is Healthy within 1 s ({took * 1000:.0f} ms after the udev event was sent)", ok, got)

    # The PF's link goes down (its cable, its switch port): every VF on it
    # is Unhealthy within 1 s; the link back, Healthy again (issue 25).
    t0 = time.monotonic()
    ctl("simulate-link", "0000:3b:00.0", "down")
    got, ok = a.next_list(lambda l: l.get(va0, ("",))[0] == "Unhealthy" and l.get(va1, ("",))[0] == "Unhealthy", 1.0)
    took = time.monotonic() - t0
    check(f"the PF's link down makes its VFs Unhealthy within 1 s ({took * 1000:.0f} ms)", ok, got)
    ctl("simulate-link", "0000:3b:00.0", "up")
    got, ok = a.next_list(lambda l: l.get(va0, ("",))[0] == "Healthy" and l.get(va1, ("",))[0] == "Healthy", 1.0)
    check("the link back makes them Healthy", ok, got)

    # The kubelet restarts: its socket goes and comes back, the plugins'
    # sockets are removed as a starting kubelet does; both register again.
    kubelet.stop()
    for f in os.listdir(plugin_dir):
        os.unlink(os.path.join(plugin_dir, f))
    kubelet = Kubelet()
    kubelet.start()
    regs = kubelet.take(3)
    check("after a kubelet restart every pool registers again", set(regs) == {POOL_A, POOL_B, POOL_C}, list(regs))
    check("their sockets are there again", all(os.path.exists(os.path.join(plugin_dir, r.endpoint))
                                               for r in regs.values()))
    a = Plugin(regs[POOL_A].endpoint)
    a.watch()
    b = Plugin(regs[POOL_B].endpoint)
    b.watch()
    got, ok = a.next_list(lambda l: set(l) == {va0, va1}, 5)
    check("ListAndWatch works on the new sockets", ok, got)

    # A reload moves VF 1 from pool A to pool B.
    write_config([0])
    r = ctl("reload")
    check("reload", r.returncode == 0, r.stdout + r.stderr)
    got, ok = a.next_list(lambda l: set(l) == {va0}, 2)
    check("after the reload pool A lists VF 0 alone", ok, got)
    got, ok = b.next_list(lambda l: set(l) == {va1, vb2, vb3}, 2)
    check("and pool B has VF 1 too", ok, got)
    st = json.loads(ctl("--json", "status").stdout)
    check("sriovctl status shows the pools", {p["resource"] for p in st.get("kubernetes") or []} == {POOL_A, POOL_B, POOL_C},
          st.get("kubernetes"))
    kubelet.stop()


try:
    main()
finally:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    if standin_lib.failures:
        print("--- sriovd log", file=sys.stderr)
        with open(os.path.join(work, "sriovd.log")) as f:
            print("".join(f.readlines()[-30:]), file=sys.stderr)
    shutil.rmtree(work, ignore_errors=True)
print("k8s_test: " + ("all passed" if not standin_lib.failures else f"{standin_lib.failures} failed"))
sys.exit(1 if standin_lib.failures else 0)
