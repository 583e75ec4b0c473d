# shellcheck shell=bash
# What the interop tests and iperf-validate share: the checks that decide
# whether they can run, a work directory and network namespaces that are
# removed with every process started (by PID) however the script ends, and
# the head of a config for sriovd on a simulated host.
#   source scripts/lib/interop.sh   (after set -euo pipefail)
source "$(dirname "${BASH_SOURCE[0]}")/kill-tree.sh"

# need_root_tun WHO: root and /dev/net/tun, or exit 77 (ctest's skip) saying why.
need_root_tun() {
  if [[ $EUID -ne 0 || ! -c /dev/net/tun ]]; then
    echo "SKIP: $1 needs root and /dev/net/tun (taps, network namespaces)" >&2
    exit 77
  fi
}

# need_testpmd: DPDK's testpmd, installed from Debian when this is root;
# otherwise exit 77 saying so.
need_testpmd() {
  command -v dpdk-testpmd >/dev/null && return 0
  if [[ $EUID -eq 0 ]]; then
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends dpdk dpdk-dev >&2
  else
    echo "SKIP: dpdk-testpmd is not installed and this is not root (apt-get install dpdk dpdk-dev)" >&2
    exit 77
  fi
}

# interop_workspace PREFIX NS...: $work (a fresh directory), pids=() for
# every process the script starts, and the namespaces NS... created; all of
# it goes at exit.
interop_workspace() {
  local prefix=$1
  shift
  work=$(mktemp -d "/tmp/$prefix.XXXXXX")
  pids=()
  interop_namespaces=("$@")
  trap _interop_cleanup EXIT
  local ns
  for ns in "${interop_namespaces[@]}"; do ip netns add "$ns"; done
}
_interop_cleanup() {
  kill_tree "${pids[@]}"
  local ns
  for ns in "${interop_namespaces[@]}"; do ip netns del "$ns" 2>/dev/null || true; done
  rm -rf "$work"
}

# in_private_mounts ARGS...: re-runs the calling script (with ARGS) in a
# mount namespace of its own, once: what it mounts goes with it.
in_private_mounts() {
  [[ -n ${SRIOVD_TEST_MOUNTNS:-} ]] && return 0
  SRIOVD_TEST_MOUNTNS=1 exec unshare -m --propagation private "$0" "$@"
}

# user_manager_start DIR: a systemd user manager (systemd --user, the real
# one: its notify socket, fd store and jobs, as the system manager has
# them) for the test's units, which go in DIR/config/systemd/user; talk to
# it with user_ctl. Needs in_private_mounts: it runs where this namespace's
# /run/systemd says the machine was booted with systemd (a container's is
# not), which nothing outside sees.
user_manager_start() {
  user_manager_dir=$1
  mkdir -p /run/systemd
  mount -t tmpfs tmpfs /run/systemd
  mkdir -p /run/systemd/system "$user_manager_dir/runtime" "$user_manager_dir/config/systemd/user"
  chmod 0700 "$user_manager_dir/runtime"
  XDG_RUNTIME_DIR=$user_manager_dir/runtime XDG_CONFIG_HOME=$user_manager_dir/config \
    /lib/systemd/systemd --user >"$user_manager_dir/manager.log" 2>&1 &
  pids+=($!)
  local _
  for _ in $(seq 100); do
    [[ -S $user_manager_dir/runtime/systemd/private ]] && return 0
    kill -0 "${pids[-1]}" 2>/dev/null || break
    sleep 0.1
  done
  echo "systemd --user did not come up:" >&2
  cat "$user_manager_dir/manager.log" >&2
  return 1
}
user_ctl() { XDG_RUNTIME_DIR=$user_manager_dir/runtime systemctl --user "$@"; }

# simulated_host_config STATE_DIR CONTROL_SOCKET PF_NETDEV: the top of a
# sriovd config on a simulated host with one PF (0000:3b:00.0); the caller
# appends its virtio_devices.
simulated_host_config() {
  cat <<CONF
version: 1
host: simulated
state_dir: $1
simulated:
  physical_functions:
    - {address: "0000:3b:00.0", netdev: $3}
control:
  socket: $2
CONF
}

# guest_bench_wait LOG SCENARIO QEMU_PID TIMEOUT PREFIX: waits (up to
# TIMEOUT s, or until QEMU exits) for the guest's scenario to say PASS or
# FAIL on its console LOG, shows its INFO/BENCH/FAIL lines on stderr after
# PREFIX, and fails with the console's end when it did not pass.
guest_bench_wait() {
  local log=$1 scenario=$2 qemu=$3 timeout=$4 prefix=$5
  for _ in $(seq "$timeout"); do
    grep -q "^VMTEST \(PASS\|FAIL\) $scenario" "$log" 2>/dev/null && break
    kill -0 "$qemu" 2>/dev/null || break
    sleep 1
  done
  grep -E '^VMTEST (INFO|BENCH|FAIL)' "$log" | sed "s/^/  $prefix/" >&2
  if ! grep -q "^VMTEST PASS $scenario" "$log" || grep -q '^VMTEST FAIL' "$log"; then
    echo "$scenario: the guest's run failed; console:" >&2
    tail -n 40 "$log" >&2
    cat "$log.qemu" >&2
    return 1
  fi
}
