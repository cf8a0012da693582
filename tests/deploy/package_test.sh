#!/usr/bin/env bash
# DeployPackage.Deb: builds the Debian package with cpack from the build tree, inspects it
# with dpkg-deb (name, control fields, Depends against the libraries the binaries load and
# the CPython the Python module is built for, contents: manual pages, copyright,
# changelog; maintainer scripts), runs lintian on it (any error fails; skipped, saying so,
# without lintian), installs it into a scratch root with dpkg --root and
# --force-script-chrootless (the maintainer scripts then run with DPKG_ROOT set), checks
# what landed there (files, the isthmus user in the scratch root's passwd, directories
# and their owners, no unit enabled) and that the running system was not touched, then
# purges it (the operator's enablement links go, the state stays).
#   package_test.sh BUILD_DIR VERSION HAVE_CUDA
# Needs root for dpkg; as another user it runs itself under fakeroot. Exit 77 (skipped)
# when cpack, dpkg, dpkg-deb or dpkg-shlibdeps (or, not as root, fakeroot) is missing.
set -euo pipefail
# shellcheck source=tests/deploy/checks.sh
. "$(dirname "$0")/checks.sh"
usage 3 13 "$@"
build="$1"
version="$2"
have_cuda="$3"

skip() {
  echo "SKIP: $*"
  exit 77
}
for tool in cpack dpkg dpkg-deb dpkg-shlibdeps systemd-sysusers systemd-tmpfiles; do
  command -v "$tool" >/dev/null ||
    skip "$tool not found (Debian: dpkg-dev for dpkg-shlibdeps, systemd for systemd-sysusers and systemd-tmpfiles; deploy/install-deps.sh installs them)"
done
if [ "$(id -u)" -ne 0 ]; then
  command -v fakeroot >/dev/null || skip "not root and no fakeroot: dpkg needs one of them"
  exec fakeroot -- bash "$0" "$@"
fi


# 1. Build. cpack runs the build tree's install rules with the /usr prefix into its own
# staging folder, here under $tmp; the build tree is left as it was.
start=$(date +%s)
if ! cpack --config "$build/CPackConfig.cmake" -B "$tmp/out" >"$tmp/cpack.log" 2>&1; then
  cat "$tmp/cpack.log"
  echo "FAIL: cpack"
  exit 1
fi
echo "cpack: $(($(date +%s) - start)) s"
mapfile -t debs < <(cd "$tmp/out" && ls -- *.deb)
if [ "${#debs[@]}" -ne 1 ] || [ "${debs[0]}" != "isthmus_${version}_amd64.deb" ]; then
  echo "FAIL: expected one package isthmus_${version}_amd64.deb, got: ${debs[*]:-none}"
  exit 1
fi
deb="$tmp/out/${debs[0]}"
ls -l "$deb"

# 2. Control fields.
dpkg-deb --info "$deb"
field() { dpkg-deb --field "$deb" "$1"; }
[ "$(field Package)" = isthmus ] || fail "Package is '$(field Package)'"
[ "$(field Version)" = "$version" ] || fail "Version is '$(field Version)'"
[ "$(field Architecture)" = amd64 ] || fail "Architecture is '$(field Architecture)'"
depends="$(field Depends)"
# Depends as a list of package names (alternatives split, versions dropped).
dep_names="$(printf '%s\n' "$depends" | tr ',|' '\n\n' | sed 's/(.*)//; s/ //g' | sed '/^$/d' | sort -u)"
for p in libc6 libstdc++6 libzmq5 systemd; do
  grep -qx "$p" <<<"$dep_names" || fail "Depends lacks $p: $depends"
done
grep -qE '^librocksdb[0-9.]+$' <<<"$dep_names" || fail "Depends lacks RocksDB's library: $depends"
if grep -iE 'cuda|cublas|nccl|cudart' <<<"$dep_names"; then
  fail "Depends names CUDA or NCCL, which are no Debian packages: $depends"
fi

# 3. Contents.
dpkg-deb --contents "$deb" | awk '{print $6}' | sed 's|^\./|/|; s|/$||' >"$tmp/contents"
for f in /usr/bin/isthmus-server /usr/bin/isthmusctl /usr/bin/isthmus-worker \
  /usr/bin/isthmus-data /lib/systemd/system/isthmus-server@.service \
  /lib/systemd/system/isthmus-worker@.service /lib/systemd/system/isthmus-site.target \
  /lib/systemd/system/isthmus-workers.target /usr/lib/sysusers.d/isthmus.conf \
  /usr/lib/tmpfiles.d/isthmus.conf /usr/share/doc/isthmus/README.md \
  /usr/share/doc/isthmus/DEPLOY.md /usr/share/doc/isthmus/examples/shard.toml \
  /usr/share/doc/isthmus/examples/worker.toml /usr/share/doc/isthmus/examples/worker.env; do
  grep -qx "$f" "$tmp/contents" || fail "the package lacks $f"
done
if grep -E '^/(etc|var|usr/local)(/|$)' "$tmp/contents"; then
  fail "the package ships files under /etc, /var or /usr/local"
fi
for f in /usr/share/isthmus/prometheus/isthmus-alerts.yml /usr/share/lintian/overrides/isthmus; do
  grep -qx "$f" "$tmp/contents" || fail "the package lacks $f"
done
dpkg-deb -x "$deb" "$tmp/x"

# Debian's documentation files: a manual page per program (gzip -9n, with a NAME
# section naming the program), the machine-readable copyright file, and the changelog of
# a native package (changelog.gz) whose latest entry is this version.
for prog in isthmus-server isthmusctl isthmus-worker isthmus-data; do
  page="/usr/share/man/man1/$prog.1.gz"
  if ! grep -qx "$page" "$tmp/contents"; then
    fail "the package lacks $page (the build writes it with help2man: apt-get install help2man, re-run cmake and build)"
    continue
  fi
  gzip -t "$tmp/x$page" || fail "$page is not a valid gzip file"
  # (roff escapes every hyphen: isthmus\-server \- ...)
  zcat "$tmp/x$page" | sed 's/\\-/-/g' >"$tmp/page"
  grep -qx "$prog - .*" "$tmp/page" || fail "$page has no NAME line for $prog"
done
copyright="$tmp/x/usr/share/doc/isthmus/copyright"
if [ ! -f "$copyright" ]; then
  fail "the package lacks /usr/share/doc/isthmus/copyright"
else
  head -n 1 "$copyright" | grep -qx 'Format: https://www.debian.org/doc/packaging-manuals/copyright-format/1.0/' ||
    fail "/usr/share/doc/isthmus/copyright is not machine-readable (no DEP 5 Format line)"
  grep -q '^License: ' "$copyright" || fail "/usr/share/doc/isthmus/copyright names no License"
fi
changelog="$tmp/x/usr/share/doc/isthmus/changelog.gz"
if [ ! -f "$changelog" ]; then
  fail "the package lacks /usr/share/doc/isthmus/changelog.gz"
else
  zcat "$changelog" >"$tmp/changelog"
  top="$(dpkg-parsechangelog -l "$tmp/changelog" -SVersion)"
  [ "$top" = "$version" ] ||
    fail "the changelog's latest entry is $top, not $version: add one to deploy/package/changelog (dch -v $version)"
fi
maintainer="$(field Maintainer)"
case "$maintainer" in *@localhost*) fail "Maintainer is $maintainer: set ISTHMUS_PACKAGE_MAINTAINER" ;; esac

# The Python module is built for one CPython: Depends must hold python3 to that minor
# version (the cpython-3XY tag in the module's file name), and python3-torch is suggested
# for isthmus.torch.
module="$(grep -oE '/usr/lib/python3/dist-packages/isthmus/_isthmus\.cpython-[0-9]+-[^/]*\.so$' "$tmp/contents" || true)"
if [ -n "$module" ]; then
  tag="$(sed -E 's/.*cpython-([0-9]+)-.*/\1/' <<<"$module")"
  major="${tag:0:1}" minor="${tag:1}"
  for want in "python3 (>= $major.$minor)" "python3 (<< $major.$((minor + 1)))"; do
    grep -qF "$want" <<<"$depends" || fail "the module $(basename "$module") is for CPython $major.$minor, but Depends lacks '$want': $depends"
  done
  grep -qw python3-torch <<<"$(field Suggests) $(field Recommends)" ||
    fail "the package has isthmus.torch but neither Suggests nor Recommends python3-torch"
  echo "Python module for CPython $major.$minor; Depends: python3 (>= $major.$minor), python3 (<< $major.$((minor + 1)))"
fi

# lintian: no error. Its warnings and notes are printed; each tag the package overrides
# says why in /usr/share/lintian/overrides/isthmus.
if command -v lintian >/dev/null; then
  lintian --tag-display-limit 0 --display-info --show-overrides "$deb" >"$tmp/lintian.log" 2>&1 || true
  grep -v 'running with root privileges' "$tmp/lintian.log" | grep -v '^N:' || true
  echo "lintian: $(grep -c '^E:' "$tmp/lintian.log") errors, $(grep -c '^W:' "$tmp/lintian.log") warnings, $(grep -c '^I:' "$tmp/lintian.log") notes, $(grep -c '^O:' "$tmp/lintian.log") overridden"
  if grep -q '^E:' "$tmp/lintian.log"; then
    fail "lintian reports errors (E: above)"
  fi
  if grep -qE '^(E|W|I): isthmus: unused-override' "$tmp/lintian.log"; then
    fail "deploy/package/lintian-overrides overrides a tag lintian no longer reports: remove it"
  fi
else
  echo "lintian not found: the package was not checked with it (Debian: apt-get install lintian)"
fi

# Every shared library a binary links (its NEEDED entries) that a Debian package of this
# system provides must have that package in Depends (what dpkg-shlibdeps is for);
# libraries outside packages (the CUDA and NCCL ones of a CUDA build) are listed.
: >"$tmp/unpackaged"
for bin in "$tmp"/x/usr/bin/*; do
  needed="$(objdump -p "$bin" | awk '$1 == "NEEDED" {print $2}')"
  while read -r lib path; do
    grep -qxF "$lib" <<<"$needed" || continue
    owner=""
    for candidate in "$path" "${path#/usr}" "/usr$path"; do
      owner="$(dpkg -S "$candidate" 2>/dev/null | head -n 1 | cut -d: -f1)" && [ -n "$owner" ] && break
    done
    if [ -z "$owner" ]; then
      # An alternatives link (libopenblas.so.0, libblas.so.3): the package behind it is
      # the one an alternative points at, not necessarily the one Depends names.
      real="$(dpkg -S "$(readlink -f "$path")" 2>/dev/null | head -n 1 | cut -d: -f1)" || true
      if [ -n "$real" ]; then
        echo "  $lib: through an alternative, from $real"
      else
        echo "$lib ($path)" >>"$tmp/unpackaged"
      fi
    else
      # The package, or a name it provides (libspdlog1.10 provides libspdlog1.10-fmt9).
      names="$(printf '%s\n%s\n' "$owner" \
        "$(dpkg-query -W -f='${Provides}' "$owner" 2>/dev/null | tr ',' '\n' | sed 's/(.*)//; s/ //g')")"
      if ! grep -qxFf <(sed '/^$/d' <<<"$names") <<<"$dep_names"; then
        fail "$(basename "$bin") loads $lib from Debian package $owner, which is not in Depends"
      fi
    fi
  done < <(ldd "$bin" | awk '$2 == "=>" && $3 ~ /^\// {print $1, $3}')
done
echo "libraries no Debian package provides (not in Depends):"
sort -u "$tmp/unpackaged" | sed 's/^/  /'
if [ "$have_cuda" = ON ]; then
  grep -q '^libcudart' "$tmp/unpackaged" ||
    fail "a CUDA build's isthmus-worker should load libcudart from outside Debian's packages"
fi

# Maintainer scripts and units as packaged.
dpkg-deb --control "$deb" "$tmp/control"
[ -x "$tmp/control/postinst" ] || fail "no executable postinst"
[ ! -e "$tmp/control/conffiles" ] || fail "the package has conffiles: $(cat "$tmp/control/conffiles")"
if grep -v '^[[:space:]]*#' "$tmp/control/postinst" |
  grep -nE 'enable|deb-systemd-helper|systemctl.*(start|restart)'; then
  fail "postinst enables or starts units"
fi
grep -qx 'ExecStart=/usr/bin/isthmus-server --config /etc/isthmus/%i.toml' \
  "$tmp/x/lib/systemd/system/isthmus-server@.service" ||
  fail "the packaged shard unit does not run /usr/bin/isthmus-server"

# 4. Install into a scratch root. The running system's user database must not change.
host_db_before="$(cat /etc/passwd /etc/group | sha256sum)"
host_user_before="$(getent passwd isthmus || true)"
root="$tmp/root"
# An empty system: a dpkg database with nothing installed and an /etc without users.
mkdir -p "$root/etc" "$root/var/lib/dpkg/info" "$root/var/lib/dpkg/updates"
: >"$root/var/lib/dpkg/status"
dpkg_root() {
  # --force-depends: the scratch root's database has none of the libraries installed.
  dpkg --root="$root" --force-script-chrootless --force-depends --force-not-root \
    --log="$tmp/dpkg.log" "$@"
}
if ! dpkg_root --install "$deb" >"$tmp/install.log" 2>&1; then
  cat "$tmp/install.log"
  echo "FAIL: dpkg --root --install"
  exit 1
fi
# (dpkg's complaints about the libraries missing from the scratch database left out)
grep -vE '^ isthmus depends on|^  Package .* is not installed' "$tmp/install.log"
dpkg --root="$root" --status isthmus | grep -qx 'Status: install ok installed' ||
  fail "dpkg does not list isthmus as installed in the scratch root"
for f in /usr/bin/isthmus-server /usr/bin/isthmus-worker /lib/systemd/system/isthmus-server@.service \
  /lib/systemd/system/isthmus-worker@.service /usr/share/doc/isthmus/examples/worker.env; do
  [ -e "$root$f" ] || fail "$f did not land in the scratch root"
done
# The maintainer scripts made the user, group and directories in the scratch root.
user_line="$(grep '^isthmus:' "$root/etc/passwd" || true)"
echo "scratch root passwd: $user_line"
IFS=: read -r _ _ uid gid _ home shell <<<"$user_line"
[ -n "$uid" ] || fail "no isthmus user in the scratch root's /etc/passwd"
[ "$home" = /var/lib/isthmus ] || fail "isthmus's home is '$home'"
grep -q "^isthmus:x:$gid:" "$root/etc/group" || fail "no isthmus group (gid $gid) in the scratch root's /etc/group"
[ "$uid" -lt 1000 ] || fail "isthmus is not a system user (uid $uid)"
case "$shell" in */nologin | */false) ;; *) fail "isthmus has a login shell ($shell)" ;; esac
[ "$(stat -c '%a %u %g' "$root/var/lib/isthmus")" = "750 $uid $gid" ] ||
  fail "/var/lib/isthmus is $(stat -c '%a %u %g' "$root/var/lib/isthmus"), not 750 $uid $gid"
[ "$(stat -c '%a %u %g' "$root/etc/isthmus")" = "750 0 $gid" ] ||
  fail "/etc/isthmus is $(stat -c '%a %u %g' "$root/etc/isthmus"), not 750 0 $gid"
# Installed, not enabled: no link to a unit anywhere in the scratch root's systemd dirs.
links="$(find "$root/etc" "$root/lib/systemd" -type l 2>/dev/null || true)"
[ -z "$links" ] || fail "links made by the install (units enabled?): $links"
# The running system: unchanged.
[ "$(cat /etc/passwd /etc/group | sha256sum)" = "$host_db_before" ] ||
  fail "the running system's /etc/passwd or /etc/group changed"
[ "$(getent passwd isthmus || true)" = "$host_user_before" ] || fail "the running system's isthmus user changed"

# 5. Purge: links an operator made with systemctl enable go, the state stays.
mkdir -p "$root/etc/systemd/system/isthmus-site.target.wants" "$root/var/lib/isthmus/a-0"
ln -s /lib/systemd/system/isthmus-server@.service \
  "$root/etc/systemd/system/isthmus-site.target.wants/isthmus-server@a-0.service"
if ! dpkg_root --purge isthmus >"$tmp/purge.log" 2>&1; then
  cat "$tmp/purge.log"
  echo "FAIL: dpkg --root --purge"
  exit 1
fi
[ ! -e "$root/usr/bin/isthmus-server" ] || fail "purge left /usr/bin/isthmus-server"
[ ! -L "$root/etc/systemd/system/isthmus-site.target.wants/isthmus-server@a-0.service" ] ||
  fail "purge left the enablement link of isthmus-server@a-0"
[ -d "$root/var/lib/isthmus/a-0" ] || fail "purge removed the shards' state in /var/lib/isthmus"
[ "$(cat /etc/passwd /etc/group | sha256sum)" = "$host_db_before" ] ||
  fail "the running system's /etc/passwd or /etc/group changed"

finish "$(basename "$deb") built, inspected, installed into a scratch root and purged"
