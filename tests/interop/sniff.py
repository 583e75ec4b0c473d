#!/usr/bin/env python3
"""Records who announces itself on some netdevs (run in their namespace):
one line per frame whose source MAC is one of MACS and whose ethertype is
ARP (0x0806), RARP (0x8035) or IPv6 (0x86dd): "NETDEV ETHERTYPE SRC-MAC".
Runs until killed; lines are flushed as they come.

  sniff.py NETDEV[,NETDEV...] MAC[,MAC...]
"""
import select
import socket
import sys

# One socket per netdev and ethertype: the kernel hands this process only
# those frames. A socket for every frame (ETH_P_ALL) would also queue the
# test's bulk TCP traffic, overflow under it and drop the very frame
# watched for (a RARP in the middle of an iperf3 run).
ETHERTYPES = (0x0806, 0x8035, 0x86DD)


def main():
    netdevs = sys.argv[1].split(",")
    macs = {m.lower() for m in sys.argv[2].split(",")}
    socks = {}
    for n in netdevs:
        for ethertype in ETHERTYPES:
            s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ethertype))
            s.bind((n, 0))  # 0: the protocol the socket was made for
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
