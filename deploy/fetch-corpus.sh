#!/usr/bin/env bash
# Builds the reference multilingual corpus from the Debian Reference packages
# (debian-reference-<lang>): downloads each language's .deb with apt-get, extracts the
# plain-text edition it ships (usr/share/debian-reference/debian-reference.<lang>.txt.gz)
# and writes <out>/<lang>.txt. Safe to re-run: languages already built from the same
# package version are skipped.
set -euo pipefail

readonly LANGS_KNOWN="en de fr es it pt pt-br id ja zh-cn zh-tw"

usage() {
  cat <<EOF
Usage: $(basename "$0") [--out DIR] [--work DIR] [--update] [--force] LANG...

Builds one UTF-8 text file per language from the Debian Reference packages.

  LANG        one or more of: ${LANGS_KNOWN}
              ("all" means every one of them)
  --out DIR   where <lang>.txt files go (default: ./corpus)
  --work DIR  where .deb files are downloaded and extracted (default: DIR/.work)
  --update    run 'apt-get update' first (needs root); do this when apt-get
              says it cannot find debian-reference-<lang>
  --force     rebuild languages that are already up to date
  -h, --help  this text

Needs apt-get, apt-cache, dpkg-deb and gzip (a Debian or Ubuntu system), and network
access to a Debian mirror. No root is needed except for --update.

Each <lang>.txt is accompanied by <lang>.txt.version, holding the package version it
came from. Next step, per site (see docs/DATA.md):
  isthmus-data build --out shards/site-a --val-fraction 0.05 --seed 1 \\
      corpus/en.txt corpus/de.txt corpus/fr.txt corpus/es.txt
EOF
}

die() {
  echo "fetch-corpus: error: $*" >&2
  exit 1
}
log() { echo "fetch-corpus: $*" >&2; }

out="corpus"
work=""
update=0
force=0
langs=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    -h | --help) usage; exit 0 ;;
    --out) [[ $# -ge 2 ]] || die "--out needs a folder"; out="$2"; shift 2 ;;
    --work) [[ $# -ge 2 ]] || die "--work needs a folder"; work="$2"; shift 2 ;;
    --update) update=1; shift ;;
    --force) force=1; shift ;;
    all) read -r -a langs <<<"${LANGS_KNOWN}"; shift ;;
    -*) die "unknown option '$1' (see --help)" ;;
    *) langs+=("$1"); shift ;;
  esac
done
[[ ${#langs[@]} -gt 0 ]] || { usage >&2; exit 2; }
for lang in "${langs[@]}"; do
  [[ " ${LANGS_KNOWN} " == *" ${lang} "* ]] ||
    die "unknown language '${lang}'; known: ${LANGS_KNOWN}"
done
for tool in apt-get apt-cache dpkg-deb gzip; do
  command -v "${tool}" >/dev/null || die "'${tool}' not found; this script needs a Debian-based system"
done

mkdir -p "${out}"
out="$(cd "${out}" && pwd)"
work="${work:-${out}/.work}"
mkdir -p "${work}"
work="$(cd "${work}" && pwd)"

if [[ ${update} -eq 1 ]]; then
  log "apt-get update"
  apt-get update -qq || die "apt-get update failed (it needs root: try sudo)"
fi

# The version apt would download now; empty when apt does not know the package.
candidate_version() {
  apt-cache show --no-all-versions "$1" 2>/dev/null | sed -n 's/^Version: //p' | head -n1
}

for lang in "${langs[@]}"; do
  pkg="debian-reference-${lang}"
  dest="${out}/${lang}.txt"
  version="$(candidate_version "${pkg}")"
  [[ -n "${version}" ]] ||
    die "apt does not know ${pkg}; run with --update (as root) or 'sudo apt-get update', and check that the 'main' component is enabled"
  if [[ ${force} -eq 0 && -s "${dest}" && -f "${dest}.version" &&
    "$(cat "${dest}.version")" == "${version}" ]]; then
    log "${lang}: up to date (${pkg} ${version})"
    continue
  fi

  # apt-get download names files <pkg>_<version with ':' as %3a>_all.deb.
  deb="${work}/${pkg}_${version//:/%3a}_all.deb"
  if [[ ! -s "${deb}" ]]; then
    log "${lang}: downloading ${pkg} ${version}"
    # apt warns that it downloads "unsandboxed" when the _apt user cannot write the
    # folder; that is harmless here, so only errors are shown.
    (cd "${work}" && apt-get download -q "${pkg}=${version}" 2>&1 | grep -E '^(E|Err):' >&2) || true
    [[ -s "${deb}" ]] || die "${lang}: apt-get download ${pkg}=${version} produced no ${deb}"
  fi

  extract="${work}/${pkg}"
  rm -rf "${extract}"
  dpkg-deb -x "${deb}" "${extract}" || die "${lang}: dpkg-deb could not extract ${deb}"
  txt_gz="${extract}/usr/share/debian-reference/debian-reference.${lang}.txt.gz"
  [[ -s "${txt_gz}" ]] ||
    die "${lang}: ${pkg} ${version} has no plain-text edition at usr/share/debian-reference/debian-reference.${lang}.txt.gz"
  gzip -dc "${txt_gz}" >"${dest}.tmp" || die "${lang}: cannot decompress ${txt_gz}"
  mv -f "${dest}.tmp" "${dest}"
  echo "${version}" >"${dest}.version"
  rm -rf "${extract}"
  log "${lang}: wrote ${dest} ($(wc -c <"${dest}") bytes, $(wc -l <"${dest}") lines)"
done
