#!/usr/bin/env bash
# The Debian package as an operator meets it: built with scripts/package (or
# given), checked by Debian's lintian (no error or warning, pedantic tags
# shown; what is overridden says why in scripts/deb/lintian-overrides), its
# changelog's version the package's, installed with dpkg -i on this machine,
# `sriovd --version`, the man pages with `man`,
# `systemd-analyze verify` on the installed unit, the conffile, the bash
# completion; then removed and purged, leaving none of its files behind.
#   tests/integration/deb_test.sh [PACKAGE.deb]
set -euo pipefail
cd "$(dirname "$0")/../.."
if [[ $EUID -ne 0 ]]; then
  echo "SKIP: installing a package needs root" >&2
  exit 77
fi
if dpkg-query -W -f='${Status}' sriovd 2>/dev/null | grep -q "ok installed"; then
  echo "SKIP: an sriovd package is installed on this machine already; this test will not replace it" >&2
  exit 77
fi
deb=${1:-}
[[ -n $deb ]] || deb=$(scripts/package)
[[ -f $deb ]] || { echo "FAIL: no package at '$deb'" >&2; exit 1; }
installed=false
cleanup() { if $installed; then dpkg --purge sriovd >/dev/null 2>&1 || true; fi; }
trap cleanup EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }

# Debian's own lint. lintian warns when run as root; the result is the same.
if ! command -v lintian >/dev/null; then
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends lintian >&2
fi
lint=$(lintian --pedantic --fail-on error,warning "$deb" 2>&1) || fail "lintian: $lint"
lint=$(grep -v "running with root privileges" <<<"$lint" || true)
[[ -z $lint ]] || echo "lintian (pedantic, informational): $lint"
echo "PASS lintian $(basename "$deb"): no error or warning"
changelog_version=$(dpkg-parsechangelog -l scripts/deb/changelog -S Version)
[[ $changelog_version == "$(dpkg-deb -f "$deb" Version)" ]] ||
  fail "scripts/deb/changelog's version $changelog_version is not the package's $(dpkg-deb -f "$deb" Version)"

# What the package needs from Debian comes with it (dpkg -i alone does not
# fetch dependencies: apt-get install -f would; they are all present here).
dpkg -i "$deb" || fail "dpkg -i $deb"
installed=true
echo "PASS dpkg -i $(basename "$deb")"
v=$(/usr/sbin/sriovd --version) || fail "sriovd --version"
[[ $v == "sriovd $(dpkg-deb -f "$deb" Version)"* ]] || fail "sriovd --version says '$v'"
/usr/bin/sriovctl --help >/dev/null || fail "sriovctl --help"
echo "PASS $v"
unit=/usr/lib/systemd/system/sriovd.service
[[ -f $unit ]] || fail "no unit at $unit"
grep -q '^ExecStart=/usr/sbin/sriovd --config /etc/sriovd/sriovd.yaml$' "$unit" || fail "the unit does not run the installed binary: $(grep ExecStart= "$unit")"
# verify needs the files the unit names; /etc/sriovd/sriovd.yaml is the conffile.
out=$(systemd-analyze verify "$unit" 2>&1) || fail "systemd-analyze verify: $out"
if grep -i "sriovd.service" <<<"$out"; then fail "systemd-analyze verify complains: $out"; fi
echo "PASS systemd-analyze verify $unit"
dpkg-query -W -f='${Conffiles}' sriovd | grep -q '/etc/sriovd/sriovd.yaml' || fail "/etc/sriovd/sriovd.yaml is not a conffile"
/usr/sbin/sriovd --check-config /usr/share/sriovd/examples/demo.yaml >/dev/null || fail "the shipped demo config does not check"
[[ -f /usr/share/bash-completion/completions/sriovctl && -f /usr/lib/udev/rules.d/90-sriovd.rules ]] || fail "completion or udev rules missing"
grep -q '/usr/bin/sriovctl' /usr/lib/udev/rules.d/90-sriovd.rules || fail "the udev rules do not name the installed sriovctl"
echo "PASS conffile, completion, udev rules"
for page in sriovd.8 sriovctl.8 sriovd-guest.1 sriovd.yaml.5; do
  section=${page##*.}
  out=$(MANWIDTH=80 man --warnings "$section" "${page%.*}" 2>&1 >/dev/null) || fail "man $section ${page%.*}: $out"
  [[ -z $out ]] || fail "man $section ${page%.*} warns: $out"
done
zcat /usr/share/doc/sriovd/changelog.gz | grep -q "^sriovd (" || fail "no Debian changelog"
grep -q "^License: " /usr/share/doc/sriovd/copyright || fail "no copyright file"
echo "PASS man pages, copyright, changelog"

# A host not given back (the journal still records a change to undo): the
# removal stops, and says what is left.
mkdir -p /var/lib/sriovd
cat >/var/lib/sriovd/state.json <<'JSON'
{"version": 1, "next_txn": 2, "txn": null,
 "ledger": [{"key": {"kind": "numvfs", "device": "0000:3b:00.0", "vf": -1}, "original": 0}]}
JSON
if out=$(dpkg -r sriovd 2>&1); then fail "dpkg -r removed the package with the host not given back"; fi
grep -q "the host is not given back" <<<"$out" || fail "no reason given: $out"
[[ -e /usr/sbin/sriovd && -e /var/lib/sriovd/state.json ]] || fail "the refused removal took files"
echo "PASS a removal with host changes still to undo is refused: $(grep -m1 'original value' <<<"$out")"
echo '{"version": 1, "next_txn": 3, "txn": null, "ledger": []}' >/var/lib/sriovd/state.json

# An operator's edit of the conffile survives remove; purge takes it.
echo "# edited" >>/etc/sriovd/sriovd.yaml
dpkg -r sriovd >/dev/null || fail "dpkg -r"
[[ ! -e /usr/sbin/sriovd && ! -e $unit ]] || fail "dpkg -r left the binaries or the unit"
grep -q '# edited' /etc/sriovd/sriovd.yaml || fail "dpkg -r did not keep the edited conffile"
dpkg --purge sriovd >/dev/null || fail "dpkg --purge"
installed=false
[[ ! -e /etc/sriovd/sriovd.yaml ]] || fail "purge left /etc/sriovd/sriovd.yaml"
left=$(dpkg-deb -c "$deb" | awk '{print substr($6, 2)}' | while read -r f; do [[ -f $f ]] && echo "$f"; done || true)
[[ -z $left ]] || fail "files left after purge: $left"
[[ ! -e /var/lib/sriovd ]] || fail "purge left /var/lib/sriovd after a clean removal"
echo "PASS dpkg -r keeps the edited conffile, --purge leaves nothing"
echo "deb_test: all passed"
