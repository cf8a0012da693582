#!/usr/bin/env bash
# Installs every Debian 12 package that isthmus's build, tests, benchmarks and demo use.
# Idempotent: packages already installed are skipped, and nothing runs apt-get when all
# are present. Needs root (or sudo) only when something is missing.
#
#   deploy/install-deps.sh            build + test + demo packages
#   deploy/install-deps.sh --bench    the same (kept for old callers: python3-matplotlib,
#                                     once bench/ only, is now in the default list)
set -euo pipefail

packages=(
  # toolchain
  g++ cmake ninja-build pkg-config git ca-certificates
  # libraries the build links
  libzmq3-dev cppzmq-dev libsodium-dev libflatbuffers-dev flatbuffers-compiler
  librocksdb-dev libssl-dev libgloo-dev libopenblas-dev libzstd-dev zlib1g-dev libxxhash-dev
  libcli11-dev libspdlog-dev libtoml11-dev nlohmann-json3-dev libicu-dev
  libcpp-httplib-dev
  # tests and benchmark programs; the format check (deploy/format.sh)
  googletest libgtest-dev libgmock-dev libbenchmark-dev clang-format-14
  # demo and scripts: python3 for small helpers, iproute2 for WAN emulation; strace for the
  # fsync-order tests (tests/integration/durability_test.cc)
  python3 iproute2 procps strace
  # the run report (deploy/report.py, its test) and bench/ plots
  python3-matplotlib
  # operations tests: promtool (Prometheus) checks the metrics text
  prometheus
  # deploy tests (tests/deploy): systemd-analyze verify/security and systemd-sysusers/
  # -tmpfiles (systemd), cpack's .deb (dpkg-dev's dpkg-shlibdeps, file), dpkg as another
  # user (fakeroot), the units' seccomp filters without systemd (python3-seccomp), the
  # package's Debian policy check (lintian)
  systemd dpkg-dev file fakeroot python3-seccomp lintian
  # the build: the programs' manual pages, written from their --help (deploy/man)
  help2man
  # the Python package (worker/python) and its tests, which train with PyTorch
  pybind11-dev python3-dev python3-numpy python3-torch
  # chrF of translations (deploy/chrf.py, tests/worker/translate_test.sh)
  python3-nltk
)
for arg in "$@"; do
  case "$arg" in
    --bench) ;;
    -h|--help) sed -n 2,9p "$0"; exit 0 ;;
    *) echo "install-deps.sh: unknown option '$arg' (try --help)" >&2; exit 2 ;;
  esac
done

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done
if [ ${#missing[@]} -eq 0 ]; then
  echo "install-deps: all ${#packages[@]} packages already installed"
  exit 0
fi

sudo_cmd=()
if [ "$(id -u)" -ne 0 ]; then
  if command -v sudo >/dev/null; then
    sudo_cmd=(sudo)
  else
    echo "install-deps: missing packages: ${missing[*]}" >&2
    echo "install-deps: run this script as root (or install sudo) to install them" >&2
    exit 1
  fi
fi
echo "install-deps: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
"${sudo_cmd[@]}" apt-get update -qq
"${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}"
