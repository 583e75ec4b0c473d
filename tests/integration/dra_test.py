#!/usr/bin/python3
"""sriovd as a Kubernetes DRA driver, against a kubelet stand-in and an
API-server stand-in, on the simulated host.

No kubelet or kube-apiserver is packaged for Debian, so this script brings
both peers. The kubelet stand-in is a real gRPC peer (Debian's
python3-grpcio, the messages from the project's upstream .proto files
compiled with protoc): its plugin watcher finds the registration socket in
its registry directory, checks GetInfo as the kubelet does (type
DRAPlugin, the driver's name, a service socket under the plugins
directory, v1.DRAPlugin among the versions), answers
NotifyRegistrationStatus, then calls NodePrepareResources /
NodeUnprepareResources and watches DRAResourceHealth (v1alpha1). The API
server stand-in (tests/k8s/apiserver_standin.py) speaks HTTPS with a bearer
token, checks every ResourceSlice against upstream's validation, and serves
the ResourceClaims this script allocates (status through /status).

Scenarios: registration and re-registration after the kubelet wipes its
directory; slices for the simulated host, re-made when deleted behind the
driver's back; prepare and unprepare with every setting read back from the
host (class and claim configs in upstream's precedence); a repeated
prepare; a bad VfConfig, a claim of another driver, a missing claim and a
UID that differs, each that claim's error while the others in the same
call succeed; a reload that would take a prepared VF refused; SIGTERM and
SIGKILL between prepare and unprepare (the claim kept, an unprepare after
the restart restores); a claim deleted while sriovd was away unprepared at
its start; the API server down and back; health on PF link down; an
upgrade in place registering again with the claims kept.

    tests/integration/dra_test.py BUILD_DIR
Exit 0: all passed; 1: a check failed; 77: cannot run here (says why).
"""

import base64
import ctypes
import struct
import json
import os
import queue
import signal
import ssl
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

try:
    import grpc
except ImportError:
    print("SKIP: python3-grpcio is not installed (apt-get install python3-grpcio python3-protobuf)", file=sys.stderr)
    sys.exit(77)
if not os.path.exists("/usr/bin/openssl"):
    print("SKIP: openssl is not installed (the API server stand-in's certificates)", file=sys.stderr)
    sys.exit(77)

BUILD = os.path.abspath(sys.argv[1])
SRC = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
sys.dont_write_bytecode = True  # nothing generated in the source tree
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import standin_lib  # noqa: E402
from standin_lib import check, wait_until  # noqa: E402
SRIOVD = os.path.join(BUILD, "src", "sriovd")
SRIOVCTL = os.path.join(BUILD, "src", "sriovctl")
DRIVER = "sriovd.io"
NODE, NODE_UID = "node-a", "7d0f1a52-0c59-4f37-9d64-3b1b7a2c0a11"
TOKEN = "dra-test-token-never-logged"
ADMIN = "dra-test-admin-token"  # the test's own requests: RBAC applies to sriovd's token only
MANIFESTS = os.path.join(SRC, "config", "kubernetes")
PF = "0000:3b:00.0"

work = tempfile.mkdtemp(prefix="sriovd-dra.")
registry = os.path.join(work, "plugins_registry")
plugins = os.path.join(work, "plugins")
cdi_dir = os.path.join(work, "cdi")
for d in (registry, plugins, cdi_dir):
    os.makedirs(d)
procs = []


# --- the kubelet's APIs, from the project's upstream .proto files ---
reg, dra, health = standin_lib.protos(
    SRC, work, ["pluginregistration_v1.proto", "dra_v1.proto", "dra_health_v1alpha1.proto"])

# --- the API server stand-in, with certificates of this run ---
pki = os.path.join(work, "pki")
os.makedirs(pki)


def openssl(*args):
    subprocess.run(["openssl", *args], check=True, capture_output=True)


openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-keyout",
        f"{pki}/ca.key", "-out", f"{pki}/ca.crt", "-subj", "/CN=ca", "-days", "2")
with open(f"{pki}/server.ext", "w") as f:
    f.write("subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth\n")
openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-keyout",
        f"{pki}/server.key", "-out", f"{pki}/server.csr", "-subj", "/CN=server")
openssl("x509", "-req", "-in", f"{pki}/server.csr", "-CA", f"{pki}/ca.crt", "-CAkey", f"{pki}/ca.key",
        "-CAcreateserial", "-out", f"{pki}/server.crt", "-days", "2", "-extfile", f"{pki}/server.ext")


class ApiServer:
    def __init__(self):
        self.proc = None
        self.port = 0

    def start(self):
        port_file = os.path.join(work, "apiserver.port")
        if os.path.exists(port_file):
            os.unlink(port_file)
        log = open(os.path.join(work, "apiserver.log"), "a")
        self.proc = subprocess.Popen(
            [sys.executable, os.path.join(SRC, "tests", "k8s", "apiserver_standin.py"), "--cert",
             f"{pki}/server.crt", "--key", f"{pki}/server.key", "--port-file", port_file, "--token", TOKEN,
             "--node", f"{NODE}:{NODE_UID}", "--port", str(self.port), "--state", os.path.join(work, "etcd.json"),
             "--rbac", os.path.join(MANIFESTS, "dra-driver.yaml"), "--admin-token", ADMIN],
            stdout=log, stderr=log)
        procs.append(self.proc)
        if not wait_until(lambda: os.path.exists(port_file), 20):
            raise RuntimeError("the API server stand-in did not start")
        with open(port_file) as f:
            self.port = int(f.read())

    def stop(self):
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(10)

    def call(self, method, path, body=None, token=ADMIN):
        ctx = ssl.create_default_context(cafile=f"{pki}/ca.crt")
        req = urllib.request.Request(f"https://127.0.0.1:{self.port}{path}", method=method,
                                     data=None if body is None else json.dumps(body).encode())
        req.add_header("Authorization", "Bearer " + token)
        if body is not None:
            req.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(req, context=ctx, timeout=10) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    def slices(self):
        code, body = self.call("GET", "/apis/resource.k8s.io/v1/resourceslices")
        return [s for s in body.get("items", []) if s["spec"]["driver"] == DRIVER] if code == 200 else []

    def claim(self, ns, name, results, configs=()):
        """A ResourceClaim, allocated as the scheduler would (status through /status)."""
        path = f"/apis/resource.k8s.io/v1/namespaces/{ns}/resourceclaims"
        code, obj = self.call("POST", path, {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
                                             "metadata": {"name": name, "namespace": ns},
                                             "spec": {"devices": {"requests": [{"name": "vf"}]}}})
        assert code == 201, obj
        obj["status"] = {"allocation": {"devices": {"results": results, "config": list(configs)}}}
        code, obj = self.call("PUT", f"{path}/{name}/status", obj)
        assert code == 200, obj
        return obj["metadata"]["uid"]


def vf_config(source, params, requests=None):
    c = {"source": source, "opaque": {"driver": DRIVER, "parameters": {
        "apiVersion": "sriovd.io/v1alpha1", "kind": "VfConfig", **params}}}
    if requests is not None:
        c["requests"] = requests
    return c


def result(device, driver=DRIVER, pool=NODE, request="vf"):
    return {"request": request, "driver": driver, "pool": pool, "device": device}


# --- the kubelet stand-in ---
class Kubelet:
    """The kubelet's plugin watcher and its DRA client, as strict as the kubelet."""

    IN_CREATE, IN_MOVED_TO, IN_DELETE_SELF, IN_IGNORED = 0x100, 0x80, 0x400, 0x8000

    def __init__(self):
        self.registered = queue.Queue()
        self.libc = ctypes.CDLL(None, use_errno=True)
        self.fd = self.libc.inotify_init1(os.O_CLOEXEC)
        self.watch_dir()
        # What is there already (the watcher's first scan), then events:
        # a socket made again under the same name (an upgrade keeps the PID
        # the name carries; tmpfs reuses inode numbers) is a new plugin.
        for n in os.listdir(registry):
            self.found(n)
        threading.Thread(target=self.watch, daemon=True).start()

    def watch_dir(self):
        if self.libc.inotify_add_watch(self.fd, registry.encode(),
                                       self.IN_CREATE | self.IN_MOVED_TO | self.IN_DELETE_SELF) < 0:
            raise OSError(ctypes.get_errno(), "inotify_add_watch " + registry)

    def watch(self):
        while True:
            buf = os.read(self.fd, 65536)
            i = 0
            while i < len(buf):
                _, mask, _, length = struct.unpack_from("iIII", buf, i)
                name = buf[i + 16:i + 16 + length].rstrip(b"\0").decode()
                i += 16 + length
                if mask & (self.IN_DELETE_SELF | self.IN_IGNORED):
                    # The kubelet's directory wiped: watch the new one.
                    wait_until(lambda: os.path.isdir(registry), 30)
                    self.watch_dir()
                    for n in os.listdir(registry):
                        self.found(n)
                elif mask & (self.IN_CREATE | self.IN_MOVED_TO):
                    self.found(name)

    def found(self, name):
        if not name.endswith("-reg.sock"):
            return
        try:
            self.registered.put(self.register(os.path.join(registry, name)))
        except Exception as e:  # a refusal the test looks at
            self.registered.put({"error": str(e), "socket": name})

    def register(self, path):
        ch = grpc.insecure_channel("unix://" + path)
        info = ch.unary_unary("/pluginregistration.Registration/GetInfo", reg.InfoRequest.SerializeToString,
                              reg.PluginInfo.FromString)(reg.InfoRequest(), timeout=10)
        ok, why = True, ""
        if info.type != "DRAPlugin":
            ok, why = False, f"type {info.type!r} is not DRAPlugin"
        elif info.name != DRIVER:
            ok, why = False, f"name {info.name!r}"
        elif not info.endpoint.startswith(os.path.join(plugins, DRIVER) + "/") or not os.path.exists(info.endpoint):
            ok, why = False, f"endpoint {info.endpoint!r} is not a socket under {plugins}/{DRIVER}"
        elif "v1.DRAPlugin" not in info.supported_versions:
            ok, why = False, f"versions {list(info.supported_versions)}"
        ch.unary_unary("/pluginregistration.Registration/NotifyRegistrationStatus",
                       reg.RegistrationStatus.SerializeToString, reg.RegistrationStatusResponse.FromString)(
            reg.RegistrationStatus(plugin_registered=ok, error=why), timeout=10)
        ch.close()
        return {"ok": ok, "why": why, "endpoint": info.endpoint, "socket": os.path.basename(path),
                "versions": list(info.supported_versions)}

    def take(self, seconds=15):
        """The first registration since the last forget()."""
        try:
            return self.registered.get(timeout=seconds)
        except queue.Empty:
            return None

    def forget(self):
        """What the watcher saw so far (a socket's create and rename are two events)."""
        while not self.registered.empty():
            self.registered.get()

    def plugin(self, endpoint):
        return DraClient(endpoint)


class DraClient:
    def __init__(self, endpoint):
        self.channel = grpc.insecure_channel("unix://" + endpoint)
        m = "/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/"
        self._prepare = self.channel.unary_unary(m + "NodePrepareResources",
                                                 dra.NodePrepareResourcesRequest.SerializeToString,
                                                 dra.NodePrepareResourcesResponse.FromString)
        self._unprepare = self.channel.unary_unary(m + "NodeUnprepareResources",
                                                   dra.NodeUnprepareResourcesRequest.SerializeToString,
                                                   dra.NodeUnprepareResourcesResponse.FromString)
        self.watch_health = self.channel.unary_stream("/v1alpha1.DRAResourceHealth/NodeWatchResources",
                                                      health.NodeWatchResourcesRequest.SerializeToString,
                                                      health.NodeWatchResourcesResponse.FromString)

    def prepare(self, *claims):
        r = self._prepare(dra.NodePrepareResourcesRequest(
            claims=[dra.Claim(namespace=ns, name=name, uid=uid) for ns, name, uid in claims]), timeout=45)
        return {uid: (v.error, [(list(d.request_names), d.pool_name, d.device_name, list(d.cdi_device_ids))
                                for d in v.devices]) for uid, v in r.claims.items()}

    def unprepare(self, *claims):
        r = self._unprepare(dra.NodeUnprepareResourcesRequest(
            claims=[dra.Claim(namespace=ns, name=name, uid=uid) for ns, name, uid in claims]), timeout=45)
        return {uid: v.error for uid, v in r.claims.items()}


# --- sriovd ---
def ctl(*args):
    r = subprocess.run([SRIOVCTL, "-s", os.path.join(work, "control.sock"), "--json", *args],
                       capture_output=True, text=True, timeout=60)
    try:
        return r.returncode, json.loads(r.stdout) if r.stdout.strip() else {}, r.stderr
    except ValueError:
        return r.returncode, {}, r.stdout + r.stderr


def kubeconfig():
    with open(f"{pki}/ca.crt", "rb") as f:
        ca = base64.b64encode(f.read()).decode()
    path = os.path.join(work, "kubeconfig")
    with open(path, "w") as f:
        f.write(f"""apiVersion: v1
kind: Config
clusters: [{{name: test, cluster: {{server: "https://127.0.0.1:{api.port}", certificate-authority-data: {ca}}}}}]
users: [{{name: sriovd, user: {{token: {TOKEN}}}}}]
contexts: [{{name: test, context: {{cluster: test, user: sriovd}}}}]
current-context: test
""")
    return path


def write_config(extra_vf="", num_vfs=7, dra=True):
    with open(os.path.join(work, "sriovd.yaml"), "w") as f:
        f.write(f"""version: 1
host: simulated
state_dir: {work}/state
simulated:
  physical_functions:
    - {{address: "{PF}", netdev: drapf{os.getpid() % 100000}}}
control:
  socket: {work}/control.sock
physical_functions:
  - address: "{PF}"
    num_vfs: {num_vfs}
    vfs:
      - {{index: 0, assign: {{owner: yaml-vm, export: none}}}}
{extra_vf}
""" + ("" if not dra else f"""kubernetes:
  cdi_dir: {cdi_dir}
  dra:
    driver: {DRIVER}
    node_name: {NODE}
    kubeconfig: {os.path.join(work, "kubeconfig")}
    registry_dir: {registry}
    plugins_dir: {plugins}
"""))


daemon = None


def start_daemon(*extra):
    global daemon
    log = open(os.path.join(work, "sriovd.log"), "a")
    daemon = subprocess.Popen([SRIOVD, "--config", os.path.join(work, "sriovd.yaml"), *extra], stdout=log, stderr=log)
    procs.append(daemon)
    if not wait_until(lambda: ctl("status")[0] == 0, 30):
        raise RuntimeError("sriovd did not start: " + open(os.path.join(work, "sriovd.log")).read()[-3000:])


def stop_daemon(sig=signal.SIGTERM):
    daemon.send_signal(sig)
    daemon.wait(60)


def vf(index):
    """VF `index` of the PF as `sriovctl devices` reads it back from the host."""
    code, out, err = ctl("devices")
    for p in out.get("physical_functions", []):
        for v in p.get("vfs", []):
            if v["index"] == index:
                return v
    return {}


def safe(fn):
    try:
        return fn()
    except Exception as e:
        return e


def device_name(index):
    return "vf-" + vf(index)["address"].replace(":", "-").replace(".", "-")


def log_text():
    with open(os.path.join(work, "sriovd.log")) as f:
        return f.read()


api = ApiServer()
try:
    api.start()
    kubeconfig()
    write_config()
    kubelet = Kubelet()
    start_daemon()

    # --- registration ---
    r = kubelet.take()
    check("registers with the kubelet's plugin watcher (GetInfo checked)", r and r.get("ok"), r)
    endpoint = r["endpoint"]
    check("per-instance sockets (rolling-update naming)",
          r["socket"].startswith(DRIVER + "-") and r["socket"].endswith("-reg.sock") and
          os.path.basename(endpoint).startswith("dra-"), r)
    client = kubelet.plugin(endpoint)

    # --- the kubelet restarts: its directories wiped and made again ---
    kubelet.forget()
    subprocess.run(["rm", "-rf", registry, plugins], check=True)
    os.makedirs(registry)
    os.makedirs(plugins)
    r = kubelet.take()
    check("registers again after the kubelet wiped its directories", r and r.get("ok"), r)
    check("...with its service socket made again", r and os.path.exists(r["endpoint"]), r)

    # --- slices ---
    names = {i: device_name(i) for i in range(7)}
    slices = wait_until(lambda: [s for s in api.slices() if len(s["spec"].get("devices", [])) == 6], 15)
    check("a ResourceSlice with the 6 VFs the YAML does not list", slices, api.slices())
    if slices:
        s = slices[0]
        devs = {d["name"]: d for d in s["spec"]["devices"]}
        check("devices named after the VFs, VF 0 (the YAML's) not offered",
              sorted(devs) == sorted(names[i] for i in range(1, 7)), sorted(devs))
        a = devs.get(names[1], {}).get("attributes", {})
        check("attributes under the driver's domain",
              a.get(DRIVER + "/pciAddress", {}).get("string") == vf(1)["address"] and
              a.get(DRIVER + "/vfIndex", {}).get("int") == 1 and DRIVER + "/pfName" in a and
              DRIVER + "/vendorID" in a and DRIVER + "/numaNode" in a, a)
        check("the standard PCIe root attribute",
              a.get("resource.kubernetes.io/pcieRoot", {}).get("string") == "pci0000:00", a)
        check("pool named after the node, owned by the Node",
              s["spec"]["pool"]["name"] == NODE and s["spec"]["nodeName"] == NODE and
              s["metadata"]["ownerReferences"][0]["uid"] == NODE_UID, s["spec"]["pool"])

    # --- health ---
    health_updates = queue.Queue()
    stream = client.watch_health(health.NodeWatchResourcesRequest())

    def follow():
        try:
            for resp in stream:
                health_updates.put({d.device.device_name: d.health for d in resp.devices})
        except grpc.RpcError:
            pass
    threading.Thread(target=follow, daemon=True).start()

    def health_until(pred, seconds):
        end = time.monotonic() + seconds
        last = None
        while time.monotonic() < end:
            try:
                last = health_updates.get(timeout=max(0.01, end - time.monotonic()))
                if pred(last):
                    return True, last
            except queue.Empty:
                break
        return False, last
    HEALTHY, UNHEALTHY = health.HealthStatus.Value("HEALTHY"), health.HealthStatus.Value("UNHEALTHY")
    ok, last = health_until(lambda h: h.get(names[1]) == HEALTHY, 10)
    check("health stream: VFs Healthy", ok, last)
    time.sleep(2)  # four of the driver's health updates: the same health is no news
    check("health stream: nothing sent while nothing changes", health_updates.empty(), health_updates.qsize())

    # --- prepare with settings ---
    uid_a = api.claim("default", "vm-a", [result(names[1])], [
        vf_config("FromClass", {"mac": "02:00:00:00:0a:01", "vlan": 100, "trust": True}),
        vf_config("FromClaim", {"vlan": 200, "qos": 3, "spoofchk": False, "max_tx_rate": 500}, ["vf"])])
    out = client.prepare(("default", "vm-a", uid_a))
    err, devices = out.get(uid_a, ("missing", []))
    check("prepare: the claim prepared", err == "" and len(devices) == 1, out)
    want_cdi = f"{DRIVER}/vf={uid_a}-{names[1]}"
    check("prepare: device, pool and CDI id", devices == [(["vf"], NODE, names[1], [want_cdi])], devices)
    settings = vf(1).get("settings", {})
    check("prepare: settings read back from the host (the claim's config over the class's)",
          settings.get("mac") == "02:00:00:00:0a:01" and settings.get("vlan") == 200 and
          settings.get("qos") == 3 and settings.get("trust") is True and settings.get("spoofchk") is False and
          settings.get("max_tx_rate") == 500, settings)
    check("prepare: the VF bound to vfio-pci", vf(1).get("driver") == "vfio-pci", vf(1))
    cdi_file = os.path.join(cdi_dir, f"{DRIVER}-claim-{uid_a}.json")
    spec = json.load(open(cdi_file)) if os.path.exists(cdi_file) else {}
    nodes = [n["path"] for d in spec.get("devices", []) for n in d["containerEdits"].get("deviceNodes", [])]
    check("prepare: a CDI spec named after the claim's UID with /dev/vfio",
          spec.get("kind") == DRIVER + "/vf" and "/dev/vfio/vfio" in nodes and
          f"/dev/vfio/{vf(1).get('iommu_group')}" in nodes, spec)
    again = client.prepare(("default", "vm-a", uid_a))
    check("prepare again: the same answer", again == out, again)
    code, claims, _ = ctl("claims")
    check("sriovctl claims lists it", [c["uid"] for c in claims.get("claims", [])] == [uid_a], claims)

    # --- one claim's error never fails the others ---
    uid_bad = api.claim("default", "bad", [result(names[2])], [vf_config("FromClaim", {"vlan": 5000, "colour": 1})])
    uid_other = api.claim("default", "other", [result("gpu-0", driver="gpu.example.com")])
    uid_c = api.claim("default", "vm-c", [result(names[3])],
                      [vf_config("FromClaim", {"driver": "netdev", "mac": "02:00:00:00:0c:01", "mtu": 9000})])
    out = client.prepare(("default", "bad", uid_bad), ("default", "other", uid_other),
                         ("default", "missing", "0000-uid"), ("default", "vm-c", "not-its-uid"),
                         ("default", "vm-c", uid_c))
    e = out.get(uid_bad, ("", []))[0]
    check("a bad VfConfig: that claim's error naming claim and fields",
          "default/bad" in e and "vlan" in e and "colour" in e, out.get(uid_bad))
    check("a claim of another driver: its error",
          "no device of driver " + DRIVER in out.get(uid_other, ("", []))[0], out.get(uid_other))
    check("a missing claim: its error", "does not exist" in out.get("0000-uid", ("", []))[0], out.get("0000-uid"))
    check("a UID that differs: its error", "has UID" in out.get("not-its-uid", ("", []))[0], out.get("not-its-uid"))
    check("the good claim in the same call prepared", out.get(uid_c, ("x", []))[0] == "", out.get(uid_c))
    check("netdev: the VF on its own driver with its MAC and its netdev's MTU",
          vf(3).get("driver") not in ("vfio-pci", "") and vf(3).get("settings", {}).get("mac") == "02:00:00:00:0c:01"
          and vf(3).get("mtu") == 9000, vf(3))
    check("the bad claim changed nothing", vf(2).get("settings", {}).get("vlan", 0) == 0, vf(2))

    # --- the shipped DeviceClass and claim template, as the scheduler allocates them ---
    import yaml  # python3-yaml
    docs = {d["kind"]: d for d in yaml.safe_load_all(open(os.path.join(MANIFESTS, "dra-deviceclass.yaml")))}
    class_cfg = dict(docs["DeviceClass"]["spec"]["config"][0], source="FromClass")
    claim_cfg = dict(docs["ResourceClaimTemplate"]["spec"]["spec"]["devices"]["config"][0], source="FromClaim")
    check("the DeviceClass selects this driver's devices",
          f'device.driver == "{DRIVER}"' in docs["DeviceClass"]["spec"]["selectors"][0]["cel"]["expression"])
    uid_x = api.claim("default", "dpdk-app-vf", [result(names[6])], [class_cfg, claim_cfg])
    out = client.prepare(("default", "dpdk-app-vf", uid_x))
    want = claim_cfg["opaque"]["parameters"]
    got = vf(6).get("settings", {})
    check("the shipped examples' configs prepared and on the VF",
          out.get(uid_x, ("x",))[0] == "" and got.get("mac") == want["mac"] and got.get("vlan") == want["vlan"] and
          got.get("qos") == want["qos"] and got.get("trust") is True and got.get("spoofchk") is True and
          got.get("max_tx_rate") == want["max_tx_rate"], (out, got))
    check("...unprepared", client.unprepare(("default", "dpdk-app-vf", uid_x)) == {uid_x: ""})

    # --- the ClusterRole is all sriovd may do (and all it needs: everything above used it) ---
    code, _ = api.call("GET", "/apis/resource.k8s.io/v1/namespaces/default/resourceclaims", token=TOKEN)
    code2, _ = api.call("DELETE", "/apis/resource.k8s.io/v1/namespaces/default/resourceclaims/vm-a", token=TOKEN)
    check("RBAC: listing or deleting claims is forbidden to sriovd's account", code == 403 and code2 == 403,
          (code, code2))
    ds = [d for d in yaml.safe_load_all(open(os.path.join(MANIFESTS, "dra-driver.yaml"))) if d]
    conf = yaml.safe_load([d for d in ds if d["kind"] == "ConfigMap"][0]["data"]["sriovd.yaml"])
    host_paths = {v["hostPath"]["path"] for d in ds if d["kind"] == "DaemonSet"
                  for v in d["spec"]["template"]["spec"]["volumes"] if "hostPath" in v}
    dra_conf = conf["kubernetes"]["dra"]
    want_paths = {dra_conf["registry_dir"], dra_conf["plugins_dir"], conf["kubernetes"]["cdi_dir"], conf["state_dir"],
                  "/run/sriovd", "/dev/vfio", "/sys"}
    check("the DaemonSet mounts every directory its config names", want_paths <= host_paths, want_paths - host_paths)
    with open(os.path.join(work, "shipped.yaml"), "w") as f:
        f.write([d for d in ds if d["kind"] == "ConfigMap"][0]["data"]["sriovd.yaml"])
    r = subprocess.run([SRIOVD, "--check-config", os.path.join(work, "shipped.yaml")], capture_output=True,
                       text=True, env=dict(os.environ, KUBECONFIG=os.path.join(work, "kubeconfig")))
    check("the shipped config is valid (this host has no ens1f0 to apply it to)",
          r.returncode == 0 or "valid, but this host cannot apply it" in r.stderr, r.stdout + r.stderr)

    # --- vfio-user and virtio: sriovd serves the VF on a socket the CDI spec mounts ---
    uid_u = api.claim("default", "vm-u", [result(names[2])], [vf_config("FromClaim", {"driver": "vfio-user"})])
    uid_v = api.claim("default", "pod-v", [result(names[4])],
                      [vf_config("FromClaim", {"driver": "virtio", "mac": "02:00:00:00:0b:04", "mtu": 1400})])
    out = client.prepare(("default", "vm-u", uid_u), ("default", "pod-v", uid_v))
    check("vfio-user and virtio claims prepared", out.get(uid_u, ("x",))[0] == "" and
          out.get(uid_v, ("x",))[0] == "", out)
    claims = {c["uid"]: c for c in ctl("claims")[1].get("claims", [])}
    sock_u = claims.get(uid_u, {}).get("devices", [{}])[0].get("socket", "")
    sock_v = claims.get(uid_v, {}).get("devices", [{}])[0].get("socket", "")
    check("vfio-user: the VF exported on its socket (on vfio-pci)",
          sock_u and wait_until(lambda: os.path.exists(sock_u), 10) and vf(2).get("export") == "vfio-user" and
          vf(2).get("driver") == "vfio-pci", (sock_u, vf(2)))
    spec_u = json.load(open(os.path.join(cdi_dir, f"{DRIVER}-claim-{uid_u}.json")))
    check("vfio-user: the CDI spec mounts the socket",
          spec_u["devices"][0]["containerEdits"]["mounts"][0]["hostPath"] == sock_u, spec_u)
    virtio = [d for d in ctl("devices")[1].get("virtio_devices", []) if d.get("socket") == sock_v]
    check("virtio: a vhost-user virtio-net device bridged to the VF, the claim's MAC on the VF",
          sock_v and wait_until(lambda: os.path.exists(sock_v), 10) and virtio and
          virtio[0]["backend"].get("vf") == 4 and vf(4).get("settings", {}).get("mac") == "02:00:00:00:0b:04",
          (sock_v, virtio, vf(4)))

    # --- a reload that would take a prepared VF ---
    write_config("      - {index: 1, mac: \"02:00:00:00:ff:01\"}")
    code, out, err = ctl("reload")
    check("a reload taking a prepared VF is refused, naming the claim",
          code != 0 and "default/vm-a" in (json.dumps(out) + err), (code, out, err))
    check("...and the VF keeps the claim's settings", vf(1).get("settings", {}).get("vlan") == 200, vf(1))
    write_config()

    # --- the slices deleted behind the driver's back ---
    for s in api.slices():
        api.call("DELETE", "/apis/resource.k8s.io/v1/resourceslices/" + s["metadata"]["name"])
    check("slices deleted behind the driver's back are made again",
          wait_until(lambda: len(api.slices()) == 1, 15), api.slices())

    # --- health on PF link down ---
    ctl("simulate-link", PF, "down")
    ok, last = health_until(lambda h: h.get(names[1]) == UNHEALTHY and h.get(names[2]) == UNHEALTHY, 5)
    check("PF link down: its VFs Unhealthy", ok, last)
    ctl("simulate-link", PF, "up")
    ok, last = health_until(lambda h: h.get(names[1]) == HEALTHY, 5)
    check("PF link up: Healthy again", ok, last)
    stream.cancel()

    # --- SIGTERM keeps the claims; the restart takes them up ---
    stop_daemon(signal.SIGTERM)
    check("SIGTERM: the stop keeps the prepared claims' VFs", "of prepared DRA claims keep theirs" in log_text(),
          log_text()[-1500:])
    check("SIGTERM: the instance's sockets removed", not os.listdir(registry), os.listdir(registry))
    kubelet.forget()
    start_daemon()
    r = kubelet.take()
    check("registers again after a restart", r and r.get("ok"), r)
    client = kubelet.plugin(r["endpoint"])
    check("after the restart: the claim's settings on its VF", vf(1).get("settings", {}).get("vlan") == 200, vf(1))
    again = client.prepare(("default", "vm-a", uid_a))
    check("after the restart: prepare answers the same", again.get(uid_a) == ("", devices), again)

    # --- SIGKILL; a claim deleted while sriovd is away ---
    stop_daemon(signal.SIGKILL)
    api.call("DELETE", "/apis/resource.k8s.io/v1/namespaces/default/resourceclaims/vm-c")
    kubelet.forget()
    start_daemon()
    r = kubelet.take()
    client = kubelet.plugin(r["endpoint"])
    check("after SIGKILL: the claim's settings on its VF", vf(1).get("settings", {}).get("vlan") == 200, vf(1))
    check("a claim deleted while sriovd was away is unprepared at its start",
          wait_until(lambda: sorted(c["uid"] for c in ctl("claims")[1].get("claims", [])) ==
                     sorted([uid_a, uid_u, uid_v]), 15),
          ctl("claims")[1])
    check("...its CDI spec removed", not os.path.exists(os.path.join(cdi_dir, f"{DRIVER}-claim-{uid_c}.json")))

    # --- the API server away and back (etcd keeps its objects) ---
    slices_rv = max(int(s["metadata"]["resourceVersion"]) for s in api.slices())
    api.stop()
    # While it is away its slices go (the kubelet's start deletes a node's):
    # the driver must make them again once it answers.
    etcd = json.load(open(os.path.join(work, "etcd.json")))
    etcd["objects"] = {k: v for k, v in etcd["objects"].items() if "/resourceslices/" not in k}
    with open(os.path.join(work, "etcd.json"), "w") as f:
        json.dump(etcd, f)
    uid_d = "uid-while-away"
    out = client.prepare(("default", "vm-d", uid_d))
    check("API server away: the claim's error says so", "cannot be reached" in out.get(uid_d, ("", []))[0], out)
    again = client.prepare(("default", "vm-a", uid_a))
    check("API server away: a prepared claim still answers", again.get(uid_a) == ("", devices), again)
    api.start()
    check("API server back: the slices made again", wait_until(
        lambda: any(int(s["metadata"]["resourceVersion"]) > slices_rv for s in api.slices()), 40), api.slices())

    # --- an upgrade in place registers again, the claims kept ---
    kubelet.forget()
    code, out, err = ctl("upgrade")
    check("sriovctl upgrade", code == 0, (out, err))
    r = kubelet.take(30)
    check("the upgraded sriovd registers again", r and r.get("ok"), r)
    client = kubelet.plugin(r["endpoint"])
    again = client.prepare(("default", "vm-a", uid_a))
    check("after the upgrade: prepare answers the same", again.get(uid_a) == ("", devices), again)

    # --- SIGKILL in the middle of a prepare: the host converges after the restart ---
    stop_daemon(signal.SIGTERM)
    kubelet.forget()
    start_daemon("--test-stop-before-claim-step", "1")
    client = kubelet.plugin(kubelet.take()["endpoint"])
    uid_k = api.claim("default", "vm-k", [result(names[5])], [vf_config("FromClaim", {"vlan": 55, "trust": True})])
    late = []
    threading.Thread(target=lambda: late.append(safe(lambda: client.prepare(("default", "vm-k", uid_k)))),
                     daemon=True).start()

    def stopped():
        with open(f"/proc/{daemon.pid}/stat") as f:
            return f.read().split(") ", 1)[1].startswith("T")
    check("prepare stopped in the middle of its host transaction", wait_until(stopped, 20))
    daemon.kill()
    daemon.wait(10)
    kubelet.forget()
    start_daemon()
    client = kubelet.plugin(kubelet.take()["endpoint"])
    check("after SIGKILL mid-prepare: the host converged to the recorded claim",
          vf(5).get("settings", {}).get("vlan") == 55 and vf(5).get("settings", {}).get("trust") is True, vf(5))
    out = client.prepare(("default", "vm-k", uid_k))
    check("...and the kubelet's prepare again finishes it", out.get(uid_k, ("x",))[0] == "", out)
    out = client.unprepare(("default", "vm-k", uid_k), ("default", "vm-u", uid_u), ("default", "pod-v", uid_v))
    check("unprepare vm-k, vm-u and pod-v", out == {uid_k: "", uid_u: "", uid_v: ""}, out)
    check("...vm-k's VF restored", vf(5).get("settings", {}).get("vlan", 0) == 0, vf(5))
    check("...vm-u's socket gone, its VF back on its own driver",
          wait_until(lambda: not os.path.exists(sock_u), 10) and vf(2).get("driver") != "vfio-pci", vf(2))
    check("...pod-v's virtio device gone",
          not [d for d in ctl("devices")[1].get("virtio_devices", []) if d.get("socket") == sock_v])

    # --- unprepare restores ---
    out = client.unprepare(("default", "vm-a", uid_a))
    check("unprepare", out == {uid_a: ""}, out)
    s = vf(1).get("settings", {})
    check("unprepare: the VF's settings restored", s.get("vlan", 0) == 0 and s.get("mac") != "02:00:00:00:0a:01" and
          s.get("trust") is not True, s)
    check("unprepare: the CDI spec removed", not os.path.exists(cdi_file))
    check("unprepare again: nothing to do, no error", client.unprepare(("default", "vm-a", uid_a)) == {uid_a: ""})
    check("no claim left", ctl("claims")[1].get("claims") == [], ctl("claims")[1])

    # --- a reload that changes num_vfs republishes; one without the driver removes its slices ---
    write_config(num_vfs=8)
    code, out, err = ctl("reload")
    check("reload to 8 VFs", code == 0, (out, err))
    check("the slices follow: 7 devices",
          wait_until(lambda: [s for s in api.slices() if len(s["spec"].get("devices", [])) == 7], 15), api.slices())
    write_config(num_vfs=8, dra=False)
    code, out, err = ctl("reload")
    check("reload without kubernetes.dra", code == 0, (out, err))
    check("the driver's slices deleted", wait_until(lambda: not api.slices(), 15), api.slices())
    check("its registration socket removed", not os.listdir(registry), os.listdir(registry))
finally:
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()
    if standin_lib.failures:
        print("--- sriovd log (tail) ---")
        try:
            print(log_text()[-6000:])
        except OSError:
            pass
    subprocess.run(["rm", "-rf", work])

print(f"{standin_lib.failures} failure(s)")
sys.exit(1 if standin_lib.failures else 0)
