#!/usr/bin/python3
"""A Kubernetes API-server stand-in over HTTPS for sriovd's tests.

No kube-apiserver is packaged for Debian, so the tests bring this one. It
is as strict as the API server where sriovd's client meets it: TLS only,
every request authenticated (a bearer token, or a client certificate of
the given CA) or answered 401 with a Status, JSON bodies only, creates
that name an existing object answered 409 AlreadyExists, updates and
deletes whose resourceVersion precondition is stale answered 409 Conflict,
every answer a Kubernetes object or a Status.

    apiserver_standin.py --cert C --key K --port-file F [--token T] [--client-ca CA] [--hang]

--hang: accept connections and never answer (a server that is away).
The port it listens on (127.0.0.1) is written to --port-file when ready.
"""

import argparse
import http.server
import json
import os
import socket
import ssl
import sys
import threading
import uuid


def status(code, reason, message):
    return code, {"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": reason,
                  "message": message, "code": code}


class Store:
    def __init__(self):
        self.lock = threading.Lock()
        self.objects = {}  # path -> object
        self.version = 1000

    def next_version(self):
        self.version += 1
        return str(self.version)

    def handle(self, method, path, body):
        with self.lock:
            if method == "GET":
                if path in self.objects:
                    return 200, self.objects[path]
                prefix = path.rstrip("/") + "/"
                items = [o for p, o in sorted(self.objects.items())
                         if p.startswith(prefix) and "/" not in p[len(prefix):]]
                if items:
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
            if args.token and self.headers.get("Authorization") == "Bearer " + args.token:
                return True
            return bool(args.client_ca and self.connection.getpeercert())

        def any(self):
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            if not self.authenticated():
                return self.reply(*status(401, "Unauthorized", "Unauthorized"))
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
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.socket = ctx.wrap_socket(server.socket, server_side=True, do_handshake_on_connect=True)
    return server


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--cert")
    p.add_argument("--key")
    p.add_argument("--port-file", required=True)
    p.add_argument("--token")
    p.add_argument("--client-ca")
    p.add_argument("--hang", action="store_true")
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
