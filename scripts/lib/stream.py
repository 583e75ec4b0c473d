#!/usr/bin/env python3
"""Sends a known stream over TCP and prints its MD5: SIZE bytes, block i
being SHA-256(seed, i) repeated, so the receiver's checksum shows whether
every byte arrived as sent.

  stream.py HOST PORT SIZE [SEED] [--after FILE]
      --after FILE: before the last 1/4 of the stream, wait until FILE
      exists (the migration is over: the tail is written on the destination)
"""
import hashlib
import os
import socket
import sys
import time


def main():
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    after = None
    if "--after" in sys.argv:
        after = sys.argv[sys.argv.index("--after") + 1]
        args.remove(after)
    if len(args) < 3:
        sys.exit(__doc__)
    host, port, size = args[0], int(args[1]), int(args[2])
    seed = args[3].encode() if len(args) > 3 else b"sriovd"
    deadline = time.monotonic() + 60
    while True:
        try:
            s = socket.create_connection((host, port), timeout=5)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
    s.settimeout(300)
    md5 = hashlib.md5()
    sent = 0
    i = 0
    waited = after is None
    while sent < size:
        if not waited and sent >= size * 3 // 4:
            while not os.path.exists(after):
                time.sleep(0.05)
            waited = True
        block = (hashlib.sha256(seed + i.to_bytes(8, "little")).digest() * 256)[: min(8192, size - sent)]
        s.sendall(block)
        md5.update(block)
        sent += len(block)
        i += 1
    s.close()
    print(md5.hexdigest())


if __name__ == "__main__":
    main()
