#!/usr/bin/env python3
"""A QMP client for the migration test and bench (QEMU's machine protocol,
JSON over a Unix socket): one command, its "return" printed as JSON.

  qmp.py SOCKET COMMAND [ARGUMENTS-JSON]
  qmp.py SOCKET wait-migration [TIMEOUT-S]   polls query-migrate until it ends;
      prints the last answer, exit 0 only when it completed
"""
import json
import socket
import sys
import time


class Qmp:
    def __init__(self, path, timeout=30.0):
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                self.sock.connect(path)
                break
            except OSError:
                self.sock.close()
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        self.sock.settimeout(timeout)
        self.buf = b""
        self._read()  # the greeting
        self.call("qmp_capabilities")

    def _read(self):
        while b"\n" not in self.buf:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise ConnectionError("QMP socket closed")
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return json.loads(line)

    def call(self, command, arguments=None):
        msg = {"execute": command}
        if arguments:
            msg["arguments"] = arguments
        self.sock.sendall(json.dumps(msg).encode() + b"\n")
        while True:
            answer = self._read()
            if "event" in answer:
                continue
            if "error" in answer:
                raise RuntimeError(f"{command}: {answer['error'].get('desc', answer['error'])}")
            return answer.get("return")


def main():
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    qmp = Qmp(sys.argv[1])
    if sys.argv[2] == "wait-migration":
        deadline = time.monotonic() + (float(sys.argv[3]) if len(sys.argv) > 3 else 120.0)
        while True:
            info = qmp.call("query-migrate")
            if info.get("status") in ("completed", "failed", "cancelled") or time.monotonic() > deadline:
                print(json.dumps(info))
                sys.exit(0 if info.get("status") == "completed" else 1)
            time.sleep(0.1)
    args = json.loads(sys.argv[3]) if len(sys.argv) > 3 else None
    try:
        print(json.dumps(qmp.call(sys.argv[2], args)))
    except RuntimeError as e:
        sys.exit(f"qmp: {e}")


if __name__ == "__main__":
    main()
