# Runs at install time (`cmake --install`, and cpack when it builds the .deb): writes the
# systemd units from their *.in templates with the paths of the prefix being installed to,
# which is only known then (`cmake --install --prefix DIR` and cpack's /usr both differ
# from the configured CMAKE_INSTALL_PREFIX), and installs them.
#
# Set by deploy/CMakeLists.txt: ISTHMUS_UNIT_TEMPLATES (the *.in files),
# ISTHMUS_UNIT_STAGING (a folder of the build tree), ISTHMUS_INSTALL_BINDIR and
# ISTHMUS_INSTALL_DOCDIR (relative to the prefix), ISTHMUS_SYSTEMD_UNIT_DIR (empty: the
# rule below).

set(prefix "${CMAKE_INSTALL_PREFIX}")
string(REGEX REPLACE "/+$" "" prefix "${prefix}")
if(ISTHMUS_SYSTEMD_UNIT_DIR)
  set(unit_dir "${ISTHMUS_SYSTEMD_UNIT_DIR}")
elseif(prefix STREQUAL "/usr")
  # A /usr install (the .deb): /lib/systemd/system, where Debian 12's packages put their
  # units (debhelper's dh_installsystemd; systemd's pkg-config systemdsystemunitdir says
  # the same). With the merged /usr it is /usr/lib/systemd/system, but Debian keeps
  # packages from shipping files under the aliased name until every package has moved
  # (DEP 17), which Debian 13 does.
  set(unit_dir "/lib/systemd/system")
else()
  # Any other prefix: PREFIX/lib/systemd/system. systemd reads /usr/local/lib/systemd/system
  # (the default prefix); for others (/opt/isthmus) `systemctl link` the files.
  set(unit_dir "${prefix}/lib/systemd/system")
endif()

set(ISTHMUS_BINDIR "${prefix}/${ISTHMUS_INSTALL_BINDIR}")
set(ISTHMUS_DOCDIR "${prefix}/${ISTHMUS_INSTALL_DOCDIR}")
# One staging folder per destination: the verify test's install and cpack's may run at
# the same time from one build tree.
string(MD5 staging_key "$ENV{DESTDIR}${prefix}")
set(staging "${ISTHMUS_UNIT_STAGING}/${staging_key}")
set(units "")
foreach(template IN LISTS ISTHMUS_UNIT_TEMPLATES)
  get_filename_component(name "${template}" NAME)
  string(REGEX REPLACE "\\.in$" "" name "${name}")
  configure_file("${template}" "${staging}/${name}" @ONLY)
  list(APPEND units "${staging}/${name}")
endforeach()
# file(INSTALL) adds $DESTDIR and records the files in install_manifest.txt, as the
# generated install rules do.
file(INSTALL DESTINATION "${unit_dir}" TYPE FILE PERMISSIONS OWNER_READ OWNER_WRITE
     GROUP_READ WORLD_READ FILES ${units})
