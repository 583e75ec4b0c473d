// SPDX-License-Identifier: GPL-2.0-only OR BSD-2-Clause
// The XDP program sriovd attaches to a VF's netdev for `backend.via:
// af_xdp`: every frame received on queue q goes to the AF_XDP socket in
// slot q of sriovd_xsks (one per queue of the netdev, each bound to its
// queue); a queue with no socket passes its frames to the kernel's stack.
// sriovd_owner holds the owner sriovd wrote at load ("sriovd:<instance>
// <device>"), so that a program a crashed run left behind is found by its
// owner and removed, and a live one of another instance is left alone.
#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>

struct {
  __uint(type, BPF_MAP_TYPE_XSKMAP);
  __uint(max_entries, 64);
  __type(key, __u32);
  __type(value, __u32);
} sriovd_xsks SEC(".maps");

struct owner {
  char text[128];
};

struct {
  __uint(type, BPF_MAP_TYPE_ARRAY);
  __uint(max_entries, 1);
  __type(key, __u32);
  __type(value, struct owner);
} sriovd_owner SEC(".maps");

SEC("xdp")
int sriovd_xsk(struct xdp_md* ctx) {
  __u32 queue = ctx->rx_queue_index;
  if (queue >= 64) {
    // Past the socket map (never for the queues sriovd binds). The lookup
    // makes the owner map one of the program's own, which is how it is
    // found from the program attached to a netdev.
    __u32 zero = 0;
    if (bpf_map_lookup_elem(&sriovd_owner, &zero)) return XDP_PASS;
  }
  return bpf_redirect_map(&sriovd_xsks, queue, XDP_PASS);
}

char LICENSE[] SEC("license") = "Dual BSD/GPL";
