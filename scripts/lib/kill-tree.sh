# shellcheck shell=bash
# kill_tree PID...: ends each process and everything it started, by PID:
# SIGTERM to the whole tree (children first, so `timeout` wrappers do not
# leave their command behind), a moment, then SIGKILL to what is left, and
# reaps what this shell started.
kill_tree() {
  local all=() p
  _tree_of() {
    local q
    for q in $(pgrep -P "$1" 2>/dev/null); do _tree_of "$q"; done
    all+=("$1")
  }
  for p in "$@"; do _tree_of "$p"; done
  ((${#all[@]})) || return 0
  kill -TERM "${all[@]}" 2>/dev/null || true
  for _ in 1 2 3 4 5 6 7 8 9 10; do
    kill -0 "${all[@]}" 2>/dev/null || break
    sleep 0.1
  done
  kill -KILL "${all[@]}" 2>/dev/null || true
  for p in "$@"; do wait "$p" 2>/dev/null || true; done
}
