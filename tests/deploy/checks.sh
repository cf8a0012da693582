# Shared by the shell tests of tests/deploy (sourced): a failure counter, a scratch folder
# removed at exit, and the verdict line.
#   fail MESSAGE      prints FAIL: MESSAGE and counts it
#   finish SUMMARY    exits 1 if anything failed, else prints PASS: SUMMARY
#   usage N LAST "$@" prints the script's header (lines 2..LAST) and exits: 0 for --help,
#                     2 unless the script got exactly N arguments; returns otherwise
failures=0
usage() {
  local n="$1" last="$2"
  shift 2
  if [ "${1:-}" = --help ] || [ "$#" -ne "$n" ]; then
    sed -n "2,${last}p" "$0" | sed 's/^# \{0,1\}//'
    [ "${1:-}" = --help ] && exit 0
    exit 2
  fi
}
fail() {
  echo "FAIL: $*"
  failures=$((failures + 1))
}
finish() {
  if [ "$failures" -ne 0 ]; then
    echo "$failures check(s) failed"
    exit 1
  fi
  echo "PASS: $*"
}
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
