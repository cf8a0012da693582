#!/usr/bin/env bash
# Writes the manual page of one isthmus program from its --help (help2man), gzipped as
# Debian wants them (gzip -9n: no name or time stamp inside). Run by the build
# (deploy/CMakeLists.txt, target isthmus-man) for isthmus-server, isthmusctl,
# isthmus-worker and isthmus-data, so the pages always say what the programs do. For a
# program with subcommands (isthmusctl, isthmus-worker, isthmus-data) the page has a
# COMMANDS section with every subcommand's --help, nested ones included.
#   make-manpage.sh PROGRAM VERSION "ONE-LINE DESCRIPTION" INCLUDE.h2m OUT.1.gz
# PROGRAM is the built program's path; it is run by its name alone, found on PATH, so the
# page names `isthmusctl`, not the build folder. Exit 0 written, 1 help2man or the
# program failed (its message above), 2 bad usage.
set -euo pipefail
if [ "${1:-}" = --help ]; then
  sed -n '2,11p' "$0" | sed 's/^# \{0,1\}//'
  exit 0
fi
if [ "$#" -ne 5 ]; then
  echo "make-manpage.sh: expected PROGRAM VERSION DESCRIPTION INCLUDE OUT (try --help)" >&2
  exit 2
fi
program="$1"
version="$2"
description="$3"
include="$4"
out="$5"
if ! command -v help2man >/dev/null; then
  echo "make-manpage.sh: help2man not found (Debian: apt-get install help2man; deploy/install-deps.sh installs it)" >&2
  exit 1
fi
name="$(basename "$program")"
page="${out%.gz}"
mkdir -p "$(dirname "$out")"
# OMP_WAIT_POLICY: isthmus-worker would re-execute itself to set it. A sanitizer build's
# leak report at exit is not the page's business.
export PATH="$(cd "$(dirname "$program")" && pwd):$PATH" OMP_WAIT_POLICY=PASSIVE
export ASAN_OPTIONS="${ASAN_OPTIONS:-}:detect_leaks=0"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

# The subcommands a CLI11 --help lists (the names under "Subcommands:").
subcommands() {
  awk '/^Subcommands:/ { on = 1; next } on && /^$/ { exit } on && /^  [^ ]/ { print $1 }'
}
# One subcommand's --help as roff: its description, then its options and positionals as
# tagged paragraphs (CLI11 puts the option in a 30-column field, or alone on its line
# with the description on the next). The program-wide exit code line is left to the top.
to_roff() {
  awk '
    function esc(s) { gsub(/\\/, "\\e", s); sub(/^[.\x27]/, "\\\\\\&&", s); return s }
    function opt(s) { s = esc(s); gsub(/-/, "\\-", s); return "\\fB" s "\\fR" }
    /^Exit codes:/ { next }
    /^Usage: / { print ".PP"; print "Usage: " opt(substr($0, 8)); next }
    /^(Options|Positionals|Subcommands):$/ { print ".PP"; print "\\fI" $0 "\\fR"; next }
    /^$/ { next }
    /^                              / { sub(/^ +/, ""); print esc($0); next }
    /^  [^ ]/ {
      if (length($0) > 30 && substr($0, 30, 2) ~ /^ [^ ]/) {
        o = substr($0, 3, 27); sub(/ +$/, "", o)
        print ".TP"; print opt(o); print esc(substr($0, 31))
      } else {
        o = substr($0, 3); sub(/ +$/, "", o)
        print ".TP"; print opt(o)
      }
      next
    }
    { print ".PP"; print esc($0) }'
}
# Walks the subcommands, depth first: one .SS per command that has no subcommands of its
# own, headed by its full name.
walk() {
  local help sub
  help="$("$name" "$@" --help 2>&1)"
  mapfile -t subs < <(subcommands <<<"$help")
  if [ "$#" -gt 0 ] && [ "${#subs[@]}" -eq 0 ]; then
    printf '.SS "%s"\n' "$name $*"
    to_roff <<<"$help"
  fi
  for sub in "${subs[@]}"; do
    walk "$@" "$sub"
  done
}
cp "$include" "$tmp/include.h2m"
if [ -n "$("$name" --help 2>&1 | subcommands)" ]; then
  {
    echo "[COMMANDS]"
    echo "Each command's own help, as \`$name COMMAND --help\` prints it."
    walk
  } >>"$tmp/include.h2m"
fi

if ! help2man --no-info --no-discard-stderr --version-string="$version" --name="$description" \
  --include="$tmp/include.h2m" --output="$page" "$name"; then
  echo "make-manpage.sh: help2man could not write the page of $name from '$name --help'" >&2
  exit 1
fi
gzip -9nf "$page"
