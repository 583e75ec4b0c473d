#!/usr/bin/python3
"""A Kubernetes API-server stand-in over HTTPS for sriovd's tests.

No kube-apiserver is packaged for Debian, so the tests bring this one. It
is as strict as the API server where sriovd's client meets it: TLS only,
every request authenticated (a bearer token, or a client certificate of
the given CA) or answered 401 with a Status, JSON bodies only, creates
that name an existing object answered 409 AlreadyExists, updates and
deletes whose resourceVersion precondition is stale answered 409 Conflict,
every answer a Kubernetes object or a Status. A ResourceSlice
(resource.k8s.io/v1) written is checked against upstream's validation
rules (422 Invalid naming the field otherwise); lists take a
fieldSelector (spec.driver, spec.nodeName for slices). A ResourceClaim's
status is written only through its /status subresource (a create or an
update of the claim itself keeps the status it had), as the API server
does; a test allocates a claim that way.

    apiserver_standin.py --cert C --key K --port-file F [--token T] [--client-ca CA]
                         [--node NAME:UID]... [--hang] [--port N] [--state FILE]
                         [--rbac MANIFEST --admin-token T]

--hang: accept connections and never answer (a server that is away).
--rbac: the token's requests are authorized by the ClusterRole in
MANIFEST, as the API server's RBAC authorizer does (verb, API group,
resource and subresource; anything else 403 Forbidden); the admin token
may do anything (the test's own requests).
--state: the objects kept in FILE (read at the start, written after each
change), as etcd keeps them across an API server's restart.
The port it listens on (127.0.0.1) is written to --port-file when ready.
"""

import argparse
import http.server
import json
import os
import re
import socket
import ssl
import sys
import threading
import urllib.parse
import uuid

SLICES = "/apis/resource.k8s.io/v1/resourceslices"
DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
C_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
SEMVER = re.compile(r"^(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)(-[0-9A-Za-z.-]+)?(\+[0-9A-Za-z.-]+)?$")


def dns_subdomain(s, limit=253):
    return isinstance(s, str) and 0 < len(s) <= limit and all(DNS_LABEL.match(p) for p in s.split("."))


def slice_errors(obj, old=None):
    """Upstream's ResourceSlice validation (resource.k8s.io/v1), the rules
    a driver's slices meet: what is wrong, by field."""
    errs = []
    if obj.get("apiVersion") != "resource.k8s.io/v1" or obj.get("kind") != "ResourceSlice":
        errs.append("apiVersion/kind: must be resource.k8s.io/v1 ResourceSlice")
    meta = obj.get("metadata", {})
    if not dns_subdomain(meta.get("name")):
        errs.append(f"metadata.name: {meta.get('name')!r} is not a DNS subdomain")
    spec = obj.get("spec")
    if not isinstance(spec, dict):
        return errs + ["spec: Required value"]
    if not dns_subdomain(spec.get("driver"), 63):
        errs.append(f"spec.driver: {spec.get('driver')!r} is not a DNS subdomain of at most 63 characters")
    if old is not None and old["spec"].get("driver") != spec.get("driver"):
        errs.append("spec.driver: field is immutable")
    pool = spec.get("pool", {})
    name = pool.get("name", "")
    if not name or len(name) > 253 or not all(dns_subdomain(p) for p in name.split("/")):
        errs.append(f"spec.pool.name: {name!r} is not a pool name")
    if not isinstance(pool.get("generation"), int) or pool["generation"] < 0:
        errs.append("spec.pool.generation: must be >= 0")
    if not isinstance(pool.get("resourceSliceCount"), int) or pool["resourceSliceCount"] < 1:
        errs.append("spec.pool.resourceSliceCount: must be >= 1")
    selectors = [k for k in ("nodeName", "nodeSelector", "allNodes", "perDeviceNodeSelection") if spec.get(k)]
    if len(selectors) != 1:
        errs.append(f"spec: exactly one of nodeName, nodeSelector, allNodes, perDeviceNodeSelection ({selectors})")
    devices = spec.get("devices", [])
    if len(devices) > 128:
        errs.append(f"spec.devices: Too many: {len(devices)}: must have at most 128 items")
    seen = set()
    for i, d in enumerate(devices):
        f = f"spec.devices[{i}]"
        if not isinstance(d.get("name"), str) or len(d["name"]) > 63 or not DNS_LABEL.match(d["name"]):
            errs.append(f"{f}.name: {d.get('name')!r} is not a DNS label")
        elif d["name"] in seen:
            errs.append(f"{f}.name: Duplicate value: {d['name']!r}")
        seen.add(d.get("name"))
        attrs = d.get("attributes", {})
        if len(attrs) + len(d.get("capacity", {})) > 32:
            errs.append(f"{f}: more than 32 attributes and capacities")
        for key, value in attrs.items():
            domain, _, ident = key.rpartition("/")
            if (domain and not dns_subdomain(domain, 63)) or not C_IDENTIFIER.match(ident) or len(ident) > 32:
                errs.append(f"{f}.attributes[{key}]: not a qualified name")
            kinds = [k for k in ("int", "bool", "string", "version") if k in value]
            if len(kinds) != 1:
                errs.append(f"{f}.attributes[{key}]: exactly one of int, bool, string, version")
            elif kinds[0] == "string" and len(value["string"]) > 64:
                errs.append(f"{f}.attributes[{key}].string: Too long: may not be more than 64 bytes")
            elif kinds[0] == "version" and not SEMVER.match(value["version"]):
                errs.append(f"{f}.attributes[{key}].version: must be a semantic version")
    return errs


def field_matches(obj, selector):
    for term in filter(None, selector.split(",")):
        key, _, want = term.partition("=")
        value = obj
        for part in key.split("."):
            value = value.get(part) if isinstance(value, dict) else None
        if value != want:
            return False
    return True


def request_attributes(method, path, query):
    """The RBAC attributes of a request: (verb, API group, resource[/subresource])."""
    parts = [p for p in path.split("/") if p]
    if parts[:2] == ["api", "v1"]:
        group, rest = "", parts[2:]
    elif parts[:1] == ["apis"] and len(parts) >= 3:
        group, rest = parts[1], parts[3:]
    else:
        return None
    if len(rest) >= 2 and rest[0] == "namespaces" and len(rest) > 2:
        rest = rest[2:]
    if not rest:
        return None
    resource, name, sub = rest[0], rest[1] if len(rest) > 1 else None, rest[2] if len(rest) > 2 else None
    verb = {"GET": "get" if name else ("watch" if query.get("watch") == ["true"] else "list"),
            "POST": "create", "PUT": "update", "PATCH": "patch",
            "DELETE": "delete" if name else "deletecollection"}.get(method)
    return verb, group, resource + ("/" + sub if sub else "")


def rbac_allows(rules, attrs):
    verb, group, resource = attrs
    for r in rules:
        if (group in r.get("apiGroups", []) or "*" in r.get("apiGroups", [])) and \
                (resource in r.get("resources", []) or "*" in r.get("resources", [])) and \
                (verb in r.get("verbs", []) or "*" in r.get("verbs", [])):
            return True
    return False


def status(code, reason, message):
    return code, {"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": reason,
                  "message": message, "code": code}


class Store:
    def __init__(self):
        self.lock = threading.Lock()
        self.objects = {}  # path -> object
        self.version = 1000
        self.conflict_next = 0  # test knob: that many PUTs answered 409
        self.state_file = None

    def next_version(self):
        self.version += 1
        return str(self.version)

    def handle(self, method, target, body):
        code, obj = self.handle_locked(method, target, body)
        if self.state_file and method != "GET" and code < 300:
            with self.lock:
                with open(self.state_file + ".tmp", "w") as f:
                    json.dump({"version": self.version, "objects": self.objects}, f)
                os.rename(self.state_file + ".tmp", self.state_file)
        return code, obj

    def handle_locked(self, method, target, body):
        url = urllib.parse.urlsplit(target)
        path = url.path
        query = urllib.parse.parse_qs(url.query)
        with self.lock:
            if path == "/_test/conflict-next" and method == "POST":
                self.conflict_next += 1
                return 200, {}
            if method in ("POST", "PUT") and path.startswith(SLICES):
                old = self.objects.get(path) if method == "PUT" else None
                errs = slice_errors(body if isinstance(body, dict) else {}, old)
                if errs:
                    return status(422, "Invalid", "ResourceSlice is invalid: " + "; ".join(errs))
            if "/resourceclaims/" in path and path.endswith("/status"):
                path = path[:-len("/status")]
                if path not in self.objects:
                    return status(404, "NotFound", f"{path} not found")
                if method == "GET":
                    return 200, self.objects[path]
                if method != "PUT":
                    return status(405, "MethodNotAllowed", method + " on a status")
                meta = body.get("metadata") if isinstance(body, dict) else None
                current = self.objects[path]
                if not isinstance(meta, dict) or meta.get("resourceVersion") != current["metadata"]["resourceVersion"]:
                    return status(409, "Conflict",
                                  "the object has been modified; please apply your changes to the latest version")
                current["status"] = body.get("status", {})
                current["metadata"]["resourceVersion"] = self.next_version()
                return 200, current
            if method in ("POST", "PUT") and "/resourceclaims" in path and isinstance(body, dict):
                old = self.objects.get(path, {})
                body.pop("status", None)
                if "status" in old:
                    body["status"] = old["status"]
            if method == "GET":
                if path in self.objects:
                    return 200, self.objects[path]
                prefix = path.rstrip("/") + "/"
                selector = query.get("fieldSelector", [""])[0]
                items = [o for p, o in sorted(self.objects.items())
                         if p.startswith(prefix) and "/" not in p[len(prefix):] and field_matches(o, selector)]
                if items or path in (SLICES,):
                    return 200, {"kind": "List", "apiVersion": "v1", "items": items,
                                 "metadata": {"resourceVersion": str(self.version)}}
                return status(404, "NotFound", f"{path} not found")
            if method == "POST":
                meta = body.get("metadata") if isinstance(body, dict) else None
                if not isinstance(meta, dict) or not meta.get("name"):
                    return status(422, "Invalid", "metadata.name: Required value")
                if meta.get("resourceVersion"):
                    return status(422, "Invalid", "metadata.resourceVersion: must be empty on create")
                target = path.rstrip("/") + "/" + meta["name"]
                if target in self.objects:
                    return status(409, "AlreadyExists", f"{target} already exists")
                meta["uid"] = str(uuid.uuid4())
                meta["resourceVersion"] = self.next_version()
                self.objects[target] = body
                return 201, body
            if method == "PUT":
                if self.conflict_next:
                    self.conflict_next -= 1
                    return status(409, "Conflict", "the object has been modified (injected)")
                if path not in self.objects:
                    return status(404, "NotFound", f"{path} not found")
                meta = body.get("metadata") if isinstance(body, dict) else None
                if not isinstance(meta, dict) or meta.get("name") != path.rsplit("/", 1)[1]:
                    return status(400, "BadRequest", "the name in the body does not match the path")
                current = self.objects[path]["metadata"]
                if meta.get("resourceVersion") != current["resourceVersion"]:
                    return status(409, "Conflict",
                                  "the object has been modified; please apply your changes to the latest version")
                meta["uid"] = current["uid"]
                meta["resourceVersion"] = self.next_version()
                self.objects[path] = body
                return 200, body
            if method == "DELETE":
                if path not in self.objects:
                    return status(404, "NotFound", f"{path} not found")
                pre = (body or {}).get("preconditions", {}) if isinstance(body, dict) else {}
                rv = pre.get("resourceVersion")
                if rv is not None and rv != self.objects[path]["metadata"]["resourceVersion"]:
                    return status(409, "Conflict", "Precondition failed: resourceVersion")
                return 200, self.objects.pop(path)
            return status(405, "MethodNotAllowed", method)


def serve(args):
    store = Store()
    rules = None
    if args.rbac:
        import yaml  # python3-yaml: only for --rbac
        with open(args.rbac) as f:
            roles = [d for d in yaml.safe_load_all(f) if d and d.get("kind") == "ClusterRole"]
        if len(roles) != 1:
            sys.exit(f"{args.rbac}: expected one ClusterRole, found {len(roles)}")
        rules = roles[0].get("rules", [])
    if args.state:
        store.state_file = args.state
        if os.path.exists(args.state):
            with open(args.state) as f:
                saved = json.load(f)
            store.version, store.objects = saved["version"], saved["objects"]
    for node in args.node or []:
        name, _, uid = node.partition(":")
        store.objects[f"/api/v1/nodes/{name}"] = {"apiVersion": "v1", "kind": "Node", "metadata": {
            "name": name, "uid": uid, "resourceVersion": store.next_version()}}

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, fmt, *a):
            sys.stderr.write("apiserver: " + (fmt % a) + "\n")

        def reply(self, code, obj):
            data = json.dumps(obj).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def authenticated(self):
            """Who is asking: "admin", "driver" (the token or a client certificate), or None."""
            auth = self.headers.get("Authorization")
            if args.admin_token and auth == "Bearer " + args.admin_token:
                return "admin"
            if args.token and auth == "Bearer " + args.token:
                return "driver"
            return "driver" if args.client_ca and self.connection.getpeercert() else None

        def any(self):
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            who = self.authenticated()
            if not who:
                return self.reply(*status(401, "Unauthorized", "Unauthorized"))
            if rules is not None and who != "admin":
                url = urllib.parse.urlsplit(self.path)
                attrs = request_attributes(self.command, url.path, urllib.parse.parse_qs(url.query))
                if attrs is None or not rbac_allows(rules, attrs):
                    verb, group, resource = attrs or (self.command, "?", url.path)
                    return self.reply(*status(403, "Forbidden", f'User "system:serviceaccount:sriovd:sriovd" '
                                                                f'cannot {verb} resource "{resource}" in API group '
                                                                f'"{group}"'))
            body = None
            if raw:
                if self.headers.get("Content-Type") != "application/json":
                    return self.reply(*status(415, "UnsupportedMediaType", "not JSON"))
                try:
                    body = json.loads(raw)
                except ValueError as e:
                    return self.reply(*status(400, "BadRequest", f"the body is not JSON: {e}"))
            self.reply(*store.handle(self.command, self.path, body))

        do_GET = do_POST = do_PUT = do_DELETE = any

    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(args.cert, args.key)
    if args.client_ca:
        ctx.verify_mode = ssl.CERT_OPTIONAL
        ctx.load_verify_locations(args.client_ca)
    http.server.ThreadingHTTPServer.allow_reuse_address = True
    server = http.server.ThreadingHTTPServer(("127.0.0.1", args.port), Handler)
    server.socket = ctx.wrap_socket(server.socket, server_side=True, do_handshake_on_connect=True)
    return server


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--cert")
    p.add_argument("--key")
    p.add_argument("--port-file", required=True)
    p.add_argument("--token")
    p.add_argument("--client-ca")
    p.add_argument("--node", action="append")
    p.add_argument("--hang", action="store_true")
    p.add_argument("--rbac", help="authorize the token by the ClusterRole in this manifest")
    p.add_argument("--admin-token", help="a token that may do anything")
    p.add_argument("--state", help="keep the objects in this file across restarts")
    p.add_argument("--port", type=int, default=0, help="listen on this port (a restarted server's)")
    args = p.parse_args()
    if args.hang:
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        s.listen(16)
        port = s.getsockname()[1]
        held = []
        with open(args.port_file + ".tmp", "w") as f:
            f.write(str(port))
        os.rename(args.port_file + ".tmp", args.port_file)
        while True:
            held.append(s.accept()[0])  # never read, never answered
    server = serve(args)
    with open(args.port_file + ".tmp", "w") as f:
        f.write(str(server.server_address[1]))
    os.rename(args.port_file + ".tmp", args.port_file)
    server.serve_forever()


if __name__ == "__main__":
    main()
