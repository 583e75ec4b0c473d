#!/usr/bin/env python3
"""Records who announces itself on some netdevs (run in their namespace):
one line per frame whose source MAC is one of MACS and whose ethertype is
ARP (0x0806), RARP (0x8035) or IPv6 (0x86dd): "NETDEV ETHERTYPE SRC-MAC".
Runs until killed; lines are flushed as they come.

  sniff.py NETDEV[,NETDEV...] MAC[,MAC...]
"""
import ctypes
import select
import socket
import struct
import sys

ETH_P_ALL = 0x0003
SO_ATTACH_FILTER = 26
# Only these reach this process: a socket for every frame would also queue
# the test's bulk TCP traffic, overflow under it and drop the very frame
# watched for (a RARP in the middle of an iperf3 run). The sockets still
# take every protocol (ETH_P_ALL): on a bridge port that is the only way to
# see a frame before the bridge takes it.
ETHERTYPES = (0x0806, 0x8035, 0x86DD)


def keep_only(s, ethertypes):
    """A classic BPF filter: the frame's ethertype is one of ethertypes."""
    n = len(ethertypes)
    insns = [(0x28, 0, 0, 12)]  # ldh [12]
    for i, t in enumerate(ethertypes):
        insns.append((0x15, n - i, 0, t))  # jeq #t, accept
    insns.append((0x06, 0, 0, 0))  # ret #0: not for us
    insns.append((0x06, 0, 0, 0x40000))  # accept: ret #262144
    code = ctypes.create_string_buffer(b"".join(struct.pack("HBBI", *i) for i in insns))
    s.setsockopt(socket.SOL_SOCKET, SO_ATTACH_FILTER, struct.pack("HL", len(insns), ctypes.addressof(code)))


def main():
    netdevs = sys.argv[1].split(",")
    macs = {m.lower() for m in sys.argv[2].split(",")}
    socks = {}
    for n in netdevs:
        s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
        keep_only(s, ETHERTYPES)
        s.bind((n, 0))
        socks[s.fileno()] = (s, n)
    print("ready", flush=True)
    while True:
        if not socks:
            return
        ready, _, _ = select.select([s for s, _ in socks.values()], [], [])
        for s in ready:
            try:
                frame, addr = s.recvfrom(65536)
            except OSError:  # the netdev went away (its sriovd stopped)
                del socks[s.fileno()]
                continue
            if addr[2] == socket.PACKET_OUTGOING or len(frame) < 14:
                continue
            src = ":".join(f"{b:02x}" for b in frame[6:12])
            ethertype = int.from_bytes(frame[12:14], "big")
            if src in macs and ethertype in (0x0806, 0x8035, 0x86DD):
                print(f"{socks[s.fileno()][1]} 0x{ethertype:04x} {src}", flush=True)


if __name__ == "__main__":
    main()
