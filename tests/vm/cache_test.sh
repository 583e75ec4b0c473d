#!/usr/bin/env bash
# vm_cache (tests/vm/vm-lib.sh): a cache is built once and kept while its
# builder is unchanged; a change to the builder, to a library function it
# calls or to a library global it reads builds it again (never used stale);
# a failed build leaves no key, so the next run builds again.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
[[ $EUID -eq 0 ]] || { echo "SKIP: vm_cache builds as root (as CI does)" >&2; exit 77; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export SRIOVD_VM_CACHE=$work/cache
# shellcheck source=vm-lib.sh
source "$here/vm-lib.sh"

passed=0 failed=0
check() {  # check NAME COMMAND...
  if "${@:2}"; then passed=$((passed + 1)); else echo "FAIL: $1" >&2; failed=$((failed + 1)); fi
}
builds() { wc -l <"$work/builds"; }

# Builders as the harness has them: in a *-lib.sh file.
write_lib() {  # HELPER_TEXT WORDS
  cat >"$work/t-lib.sh" <<EOF
T_WORDS="$2"
t_helper() { echo "$1"; }
t_unrelated() { echo "not called by a builder"; }
t_build() { echo built >>"$work/builds"; echo "\$(t_helper) \$T_WORDS \$2" >"\$1/out"; }
t_fail() { echo "half" >"\$1/out"; return 1; }
EOF
  # shellcheck source=/dev/null  # written just above
  source "$work/t-lib.sh"
}
: >"$work/builds"
c=$SRIOVD_VM_CACHE/t

write_lib "helper v1" "one two"
check "first use builds" vm_cache "$c" t_build a
check "built once" test "$(builds)" = 1
check "what it built" test "$(cat "$c/out")" = "helper v1 one two a"
check "second use keeps it" vm_cache "$c" t_build a
check "not built again" test "$(builds)" = 1

# A caller's own function is no input, even when a builder's text names it.
one() { :; }
t_unrelated() { echo "changed"; }
check "unrelated changes keep it" vm_cache "$c" t_build a
check "still one build" test "$(builds)" = 1

write_lib "helper v2" "one two"
check "a changed helper rebuilds" vm_cache "$c" t_build a
check "two builds" test "$(builds)" = 2
check "rebuilt with the new helper" test "$(cat "$c/out")" = "helper v2 one two a"

write_lib "helper v2" "one three"
check "a changed global rebuilds" vm_cache "$c" t_build a
check "three builds" test "$(builds)" = 3
check "another argument rebuilds" vm_cache "$c" t_build b
check "four builds" test "$(builds)" = 4
check "rebuilt from empty" test "$(cat "$c/out")" = "helper v2 one three b"

# A leftover of another builder's version is not kept.
touch "$c/leftover"
echo stale >"$c/.cache-key"
check "a stale key rebuilds" vm_cache "$c" t_build b
check "five builds" test "$(builds)" = 5
check "the leftover is gone" test ! -e "$c/leftover"

f=$SRIOVD_VM_CACHE/f
fails() { ! "$@"; }
check "a failing builder fails" fails vm_cache "$f" t_fail
check "and leaves no key" test ! -e "$f/.cache-key"
check "so the next use builds" vm_cache "$f" t_build c
check "six builds" test "$(builds)" = 6

echo "vm_cache: $passed passed, $failed failed"
((failed == 0))
