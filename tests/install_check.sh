#!/bin/sh
# What a trainer's build and an operator see of `cmake --install`: an install
# into a scratch DESTDIR with a prefix other than the configured one puts
# every file under that prefix (the config, the units and dpclip.pc too, and
# they name the paths there); examples/train_mlp.c (the trainer README.md
# runs) builds against the installed libdpclip with pkg-config and with
# find_package(dpclip), and trains through the installed dpclipd; that
# dpclipd reads the config installed beside it.
#   tests/install_check.sh CMAKE BUILD_DIR SOURCE_DIR CC LIBDIR [CFLAGS]
# LIBDIR: CMAKE_INSTALL_LIBDIR; CFLAGS: what the library was built with that
# its users need too (the sanitizers).
set -u
cmake=$1 build=$2 src=$3 cc=$4 libdir=$5 cflags=${6:-}
prefix=/dpclip-prefix
tmp=$(mktemp -d "${TMPDIR:-/tmp}/dpclip-install.XXXXXX") || exit 1
root=$tmp/root
pfx=$root$prefix
pid=
cleanup() {
    [ -n "$pid" ] && kill "$pid" 2>/dev/null && wait "$pid" 2>/dev/null
    rm -rf "$tmp"
}
trap cleanup EXIT
fail() {
    echo "FAIL: $*"
    exit 1
}

# --- the install ------------------------------------------------------------
DESTDIR=$root "$cmake" --install "$build" --prefix "$prefix" >"$tmp/install.log" 2>&1 ||
    { cat "$tmp/install.log"; fail "cmake --install --prefix $prefix"; }
outside=$(find "$root" ! -type d | grep -v "^$pfx/")
[ -z "$outside" ] || fail "installed outside the prefix $prefix: $outside"
for f in sbin/dpclipd etc/dpclip/dpclipd.conf include/dpclip.h "$libdir/pkgconfig/dpclip.pc" \
         "$libdir/cmake/dpclip/dpclipConfig.cmake" lib/systemd/system/dpclipd.service; do
    [ -f "$pfx/$f" ] || fail "not installed: $prefix/$f"
done
grep -qx "ExecStart=$prefix/sbin/dpclipd --config $prefix/etc/dpclip/dpclipd.conf" \
    "$pfx/lib/systemd/system/dpclipd.service" ||
    fail "dpclipd.service does not start $prefix/sbin/dpclipd with $prefix's config:
$(grep ExecStart= "$pfx/lib/systemd/system/dpclipd.service")"
# the daemon installed there reads the config installed there
"$pfx/sbin/dpclipd" --check-config >"$tmp/check.out" 2>&1 ||
    { cat "$tmp/check.out"; fail "$prefix/sbin/dpclipd --check-config"; }
grep -qx "# dpclipd effective configuration from $pfx/etc/dpclip/dpclipd.conf" "$tmp/check.out" ||
    fail "$prefix/sbin/dpclipd does not read $prefix/etc/dpclip/dpclipd.conf: $(head -n 1 "$tmp/check.out")"

# --- a trainer built against it: pkg-config ------------------------------------
# pkgconf puts the DESTDIR (its sysroot) in front of the prefix the .pc names.
pc=$(PKG_CONFIG_PATH=$pfx/$libdir/pkgconfig PKG_CONFIG_SYSROOT_DIR=$root \
     pkg-config --cflags --libs dpclip) || fail "pkg-config --cflags --libs dpclip"
case $pc in *"-I$pfx/include"*"-L$pfx/$libdir"*" -ldpclip"*) ;;
    *) fail "pkg-config: '$pc'" ;; esac
# shellcheck disable=SC2086
"$cc" $cflags -o "$tmp/train_pc" "$src/examples/train_mlp.c" $pc -lm ||
    fail "$cc examples/train_mlp.c \$(pkg-config --cflags --libs dpclip)"
# outside /usr the program finds the library by itself (its RUNPATH: the
# prefix's libdir as installed, without the DESTDIR)
libs=$(PKG_CONFIG_PATH=$pfx/$libdir/pkgconfig pkg-config --libs dpclip) ||
    fail "pkg-config --libs dpclip"
case $libs in *"-Wl,-rpath,$prefix/$libdir"*) ;;
    *) fail "pkg-config --libs names no RUNPATH for $prefix/$libdir: '$libs'" ;; esac

# --- a trainer built against it: CMake ---------------------------------------
mkdir -p "$tmp/proj"
cp "$src/examples/train_mlp.c" "$tmp/proj/"
cat >"$tmp/proj/CMakeLists.txt" <<'EOF'
cmake_minimum_required(VERSION 3.20)
project(trainer C)
find_package(dpclip 0.1 REQUIRED)
add_executable(train_mlp train_mlp.c)
target_link_libraries(train_mlp PRIVATE dpclip::dpclip m)
EOF
"$cmake" -S "$tmp/proj" -B "$tmp/proj/build" -DCMAKE_PREFIX_PATH="$pfx" \
    -DCMAKE_C_COMPILER="$cc" -DCMAKE_C_FLAGS="$cflags" >"$tmp/proj.log" 2>&1 &&
    "$cmake" --build "$tmp/proj/build" >>"$tmp/proj.log" 2>&1 ||
    { cat "$tmp/proj.log"; fail "find_package(dpclip) + target_link_libraries(dpclip::dpclip)"; }

# --- both train through the installed daemon -----------------------------------
"$pfx/sbin/dpclipd" --config /dev/null --socket "$tmp/d.sock" --ledger-dir '' --workers 1 \
    --log-level warn --insecure-fixed-seed 1 &
pid=$!
i=0
while [ ! -S "$tmp/d.sock" ] && [ $i -lt 200 ]; do
    kill -0 "$pid" 2>/dev/null || fail "the installed dpclipd exited"
    sleep 0.1
    i=$((i + 1))
done
[ -S "$tmp/d.sock" ] || fail "the installed dpclipd made no socket in 20 s"
for t in "$tmp/train_pc" "$tmp/proj/build/train_mlp"; do
    out=$(LD_LIBRARY_PATH=$pfx/$libdir "$t" --socket "$tmp/d.sock" --epochs 1 2>&1) ||
        { echo "$out"; fail "$t"; }
    echo "$out" | grep -q "final accuracy" || { echo "$out"; fail "$t printed no accuracy"; }
    LD_LIBRARY_PATH=$pfx/$libdir ldd "$t" | grep -q "$pfx/$libdir/libdpclip.so" ||
        fail "$t does not load the installed libdpclip"
done
kill "$pid"
wait "$pid" || fail "the installed dpclipd did not exit 0 on SIGTERM"
pid=
echo "install_check: --prefix $prefix: every file under it; train_mlp built with pkg-config" \
     "and with find_package(dpclip) trained through the installed dpclipd"
