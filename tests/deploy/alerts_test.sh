#!/usr/bin/env bash
# DeployMonitoring.AlertRules: the Prometheus alerting rules shipped for operators
# (deploy/monitoring/isthmus-alerts.yml) load in Prometheus and do what they say:
#  - `promtool check rules` accepts the file;
#  - `promtool test rules` passes deploy/monitoring/isthmus-alerts.test.yml, which holds
#    every alert firing after its `for:` and quiet on look-alikes;
#  - every alert has a `for:`, a severity label, a summary and a description, and is
#    tested both firing and not firing;
#  - every isthmus metric the rules use is one the programs serve (docs/METRICS.md lists
#    them, and tests/metrics keeps that list in step with live processes), and the scrape
#    job names the rules match are the ones docs/METRICS.md tells operators to use.
#   alerts_test.sh SOURCE_DIR
# Exit 77 (skipped) when promtool is missing (Debian: prometheus; deploy/install-deps.sh).
set -euo pipefail
# shellcheck source=tests/deploy/checks.sh
. "$(dirname "$0")/checks.sh"
usage 1 13 "$@"
src="$1"
rules="$src/deploy/monitoring/isthmus-alerts.yml"
tests="$src/deploy/monitoring/isthmus-alerts.test.yml"
metrics_doc="$src/docs/METRICS.md"
if ! command -v promtool >/dev/null; then
  echo "SKIP: promtool not found: install Debian's prometheus package (deploy/install-deps.sh does)"
  exit 77
fi

promtool check rules "$rules" || fail "promtool check rules refuses $rules"
# promtool reads the rule file relative to the test file.
promtool test rules "$tests" || fail "promtool test rules: $tests failed"

# One line per alert: NAME and the fields its block has.
mapfile -t alerts < <(awk '
  /^[[:space:]]*- alert:/ { if (name != "") print name, fields; name = $3; fields = ""; next }
  name != "" && /^[[:space:]]*for:/ { fields = fields " for" }
  name != "" && /^[[:space:]]*severity:/ { fields = fields " severity" }
  name != "" && /^[[:space:]]*summary:/ { fields = fields " summary" }
  name != "" && /^[[:space:]]*description:/ { fields = fields " description" }
  END { if (name != "") print name, fields }' "$rules")
[ "${#alerts[@]}" -ge 4 ] || fail "expected at least 4 alerts in $rules, found ${#alerts[@]}"
for line in "${alerts[@]}"; do
  read -r name fields <<<"$line"
  for f in for severity summary description; do
    grep -qw "$f" <<<"$fields" || fail "alert $name has no $f"
  done
  # Tested firing (an exp_alerts list with entries) and not firing (exp_alerts: []).
  awk -v n="$name" '
    /alertname:/ { cur = $2 }
    cur == n && /exp_alerts: \[\]/ { quiet = 1 }
    cur == n && /exp_labels:/ { fires = 1 }
    END { exit !(quiet && fires) }' "$tests" ||
    fail "alert $name is not tested both firing and not firing in $(basename "$tests")"
  echo "alert $name (${fields// /, }): tested firing and quiet"
done

# Metrics the rules use, and the scrape jobs they match, against docs/METRICS.md.
for m in $(grep -v '^[[:space:]]*#' "$rules" | grep -oE '\bisthmus_[a-z_]+' | sort -u); do
  # A row of one of the page's metric tables: | `NAME` | type | ...
  grep -qE -- "^\| \`$m\` \|" "$metrics_doc" || fail "the rules use $m, which docs/METRICS.md does not list"
done
for j in $(grep -v '^[[:space:]]*#' "$rules" | grep -oE 'job="[^"]+"' | sed 's/job="\(.*\)"/\1/' | sort -u); do
  grep -qE -- "job_name: $j\$" "$metrics_doc" ||
    fail "the rules match the scrape job $j, which docs/METRICS.md's scrape configuration does not define"
done

finish "$(basename "$rules"): ${#alerts[@]} alerts load, pass their promtool tests and use documented metrics"
