#!/usr/bin/env bash
# The shipped unit in a Debian 12 guest booted with systemd (issue 24): the
# package built with scripts/package (or given), installed and started by
# systemctl inside the guest (tests/vm/scenarios/unit-systemd.sh).
#   tests/vm/unit_systemd.sh [PACKAGE.deb]
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
cd "$here/../.."
# shellcheck source=systemd-lib.sh
source "$here/systemd-lib.sh"
# systemd's boot, the package's install and two daemon runs under TCG.
VM_TIMEOUT=${SRIOVD_VM_TIMEOUT:-600}
if [[ $EUID -ne 0 ]]; then
  echo "SKIP: the guest's root is debootstrapped and QEMU passes it through 9p as root" >&2
  exit 77
fi
vm_install_tools || exit 1
deb=${1:-}
[[ -n $deb ]] || deb=$(scripts/package)
[[ -f $deb ]] || { echo "FAIL: no package at '$deb'" >&2; exit 1; }
work=$(mktemp -d /tmp/sriovd-unit-vm.XXXXXX)
log=$work.console.log
if sd_run "$deb" "$here/scenarios/unit-systemd.sh" "$work" "$log"; then
  echo "unit_systemd: passed (console: $log)" >&2
  rm -rf "$work"
  exit 0
fi
echo "unit_systemd: FAILED; console and the daemon's journal follow" >&2
tail -n 80 "$log" >&2
[[ -f $work/sriovd.journal ]] && tail -n 60 "$work/sriovd.journal" >&2
exit 1
