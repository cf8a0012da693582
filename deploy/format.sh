#!/usr/bin/env bash
# Checks that every C++ and CUDA source follows .clang-format (clang-format 14, Debian's
# clang-format-14): prints the files that differ and exits 1. --fix rewrites them instead.
#   deploy/format.sh          check (CI runs this from deploy/check.sh)
#   deploy/format.sh --fix    format in place
set -euo pipefail
cd "$(dirname "$0")/.."
fix=0
case "${1:-}" in
  --fix) fix=1 ;;
  "") ;;
  -h|--help) sed -n 2,6p "$0"; exit 0 ;;
  *) echo "format.sh: unknown option '$1' (try --help)" >&2; exit 2 ;;
esac
cf=$(command -v clang-format-14 || command -v clang-format || true)
if [ -z "$cf" ]; then
  echo "format.sh: clang-format-14 is not installed (deploy/install-deps.sh installs it)" >&2
  exit 2
fi
mapfile -t files < <(git ls-files '*.cc' '*.h' '*.cu' '*.cuh' | grep -v '^schemas/')
if [ "$fix" -eq 1 ]; then
  "$cf" -i "${files[@]}"
  echo "format.sh: formatted ${#files[@]} files"
  exit 0
fi
bad=()
for f in "${files[@]}"; do
  "$cf" --dry-run -Werror "$f" >/dev/null 2>&1 || bad+=("$f")
done
if [ ${#bad[@]} -gt 0 ]; then
  echo "format.sh: ${#bad[@]} of ${#files[@]} files differ from .clang-format:" >&2
  printf '  %s\n' "${bad[@]}" >&2
  echo "format.sh: run deploy/format.sh --fix" >&2
  exit 1
fi
echo "format.sh: ${#files[@]} files follow .clang-format"
