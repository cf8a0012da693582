# Shared by the shell tests of tests/deploy (sourced): a failure counter, a scratch folder
# removed at exit, and the verdict line.
#   fail MESSAGE      prints FAIL: MESSAGE and counts it
#   finish SUMMARY    exits 1 if anything failed, else prints PASS: SUMMARY
failures=0
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
