#!/usr/bin/env python3
"""A numbered UDP stream for measuring a data path's stalls and losses.

  udp_probe.py send HOST PORT INTERVAL_MS     numbered datagrams until killed
  udp_probe.py recv ADDR PORT FILE            "SEQ MONOTONIC_S" per arrival, to FILE
                                              (FILE.ready once bound)
  udp_probe.py report FILE MARKS              JSON: datagrams, lost, and per window
                                              between marks ("NAME MONOTONIC_S"
                                              lines) the longest gap in arrivals (ms)
"""
import json
import socket
import sys
import time


def send(host, port, interval_ms):
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    n = 0
    period = interval_ms / 1000.0
    next_at = time.monotonic()
    while True:
        try:
            s.sendto(str(n).encode(), (host, port))
            n += 1
        except OSError:
            pass  # no route yet: the next one
        next_at += period
        time.sleep(max(0.0, next_at - time.monotonic()))


def recv(addr, port, path):
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:  # what a stall lets pile up; past rmem_max needs root
        s.setsockopt(socket.SOL_SOCKET, getattr(socket, "SO_RCVBUFFORCE", 33), 64 << 20)
    except OSError:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 20)
    s.bind((addr, port))
    open(path + ".ready", "w").close()  # bound: what is sent from now on is counted
    with open(path, "w", buffering=1) as f:
        while True:
            d, _ = s.recvfrom(64)
            f.write("%s %.6f\n" % (d.decode(), time.monotonic()))


def report(path, marks_path):
    rows = [line.split() for line in open(path) if len(line.split()) == 2]
    seqs = [int(r[0]) for r in rows]
    times = [float(r[1]) for r in rows]
    marks = [line.split() for line in open(marks_path)]
    windows = []
    for (name, t0), (_, t1) in zip(marks, marks[1:]):
        # The window's edges count: a stream that stops for good inside
        # it has a gap to its end.
        ts = [float(t0)] + [t for t in times if float(t0) <= t <= float(t1)] + [float(t1)]
        gap = max(b - a for a, b in zip(ts, ts[1:]))
        windows.append({"name": name, "longest_gap_ms": round(gap * 1000, 1), "datagrams": len(ts) - 2})
    unique = set(seqs)
    print(json.dumps({
        "datagrams": len(seqs),
        "lost": (max(seqs) + 1 - len(unique)) if seqs else None,
        "duplicated": len(seqs) - len(unique),
        "windows": windows,
    }))


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    cmd = sys.argv[1]
    if cmd == "send" and len(sys.argv) == 5:
        send(sys.argv[2], int(sys.argv[3]), float(sys.argv[4]))
    elif cmd == "recv" and len(sys.argv) == 5:
        recv(sys.argv[2], int(sys.argv[3]), sys.argv[4])
    elif cmd == "report" and len(sys.argv) == 4:
        report(sys.argv[2], sys.argv[3])
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main()
