#!/usr/bin/env bash
# Prints, after a failed ctest run, why each failed test failed (gtest's and the
# sanitizers' messages, a few lines each, and the end of its output), then the list of
# failed tests: a CI log that keeps only its tail still says why.
#   deploy/ctest-failures.sh BUILD_DIR [LINES]   LINES of each output's end (default 30)
set -euo pipefail
case "${1:-}" in
  ""|-h|--help) sed -n 2,5p "$0"; exit 0 ;;
esac
tmp="$1/Testing/Temporary"
lines="${2:-30}"
if [[ ! -s "$tmp/LastTestsFailed.log" ]]; then
  echo "ctest-failures.sh: no failed tests recorded under $tmp"
  exit 0
fi
awk -v lines="$lines" '
  function show(   i, k, shown) {
    print "==== why " name " failed ===="
    shown = 0
    for (i = 0; i < n && shown < 60; ++i) {
      if (out[i] ~ /Failure|[Ee]rror|ERROR|Sanitizer|Expected|Which is|timed? ?out|Timeout/) {
        for (k = i; k < n && k < i + 6 && shown < 60; ++k) { print "  " out[k]; ++shown }
        i = k - 1
      }
    }
    print "  ---- its last " lines " lines ----"
    for (i = (n > lines ? n - lines : 0); i < n; ++i) print "  " out[i]
  }
  FNR == NR { sub(/^[0-9]+:/, ""); sub(/  # GetParam.*/, ""); failed[$0] = 1; next }
  /^[0-9]+\/[0-9]+ Test: / {
    name = $0; sub(/^[0-9]+\/[0-9]+ Test: /, "", name); sub(/  # GetParam.*/, "", name); next
  }
  /^Output:$/ { getline; capture = (name in failed); n = 0; next }
  /^<end of output>$/ { if (capture) show(); capture = 0; next }
  capture { out[n++] = $0 }
' "$tmp/LastTestsFailed.log" "$tmp/LastTest.log"
echo "==== failed tests ===="
awk 1 "$tmp/LastTestsFailed.log"
