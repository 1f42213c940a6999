#!/bin/sh
# SPDX-License-Identifier: Apache-2.0
# Description: `cmake --install` of the build tree BUILD into a scratch PREFIX
# gives phx.h, phx_cuda.h, phx_nvme.h, libphx.so.0 (its soname) with the
# libphx.so link, and a phx.pc with which `pkg-config --cflags --libs phx`
# builds consumer.c; the program runs on the installed library (not the build
# tree's) and does I/O.  The tree is then moved: phx.pc still points into it.
# Usage: check.sh BUILD PREFIX consumer.c [CC].  Exit 0 pass, 1 fail, 77 skip.
set -eu
build=$1 prefix=$2 src=$3 cc=${4:-cc}
command -v pkg-config >/dev/null || { echo "skip: no pkg-config"; exit 77; }
fail() { echo "FAIL: $*"; exit 1; }

rm -rf "$prefix" "$prefix.moved"
cmake --install "$build" --prefix "$prefix" >/dev/null
pc=$(find "$prefix" -name phx.pc)
[ -n "$pc" ] || fail "no phx.pc under $prefix"
libdir=$(dirname "$(dirname "$pc")")
for h in phx.h phx_cuda.h phx_nvme.h; do
	[ -f "$prefix/include/$h" ] || fail "$h not installed"
done
[ -f "$libdir/libphx.so.0" ] && [ -L "$libdir/libphx.so" ] || fail "libphx.so.0 / libphx.so missing"
readelf -d "$libdir/libphx.so.0" | grep -q 'SONAME.*\[libphx\.so\.0\]' || fail "soname is not libphx.so.0"

build_run() {   # $1: prefix the program must run from
	pcdir=$(dirname "$(find "$1" -name phx.pc)")
	flags=$(PKG_CONFIG_PATH=$pcdir pkg-config --cflags --libs phx)
	case "$flags" in *"-I$1/"*"-L$1/"*) ;; *) fail "pkg-config points outside $1: $flags";; esac
	# shellcheck disable=SC2086
	"$cc" -Wall -Werror -o "$1/consumer" "$src" $flags -ldl
	readelf -d "$1/consumer" | grep -q 'NEEDED.*\[libphx\.so\.0\]' || fail "consumer does not need libphx.so.0"
	out=$(LD_LIBRARY_PATH=$(PKG_CONFIG_PATH=$pcdir pkg-config --variable=libdir phx) \
		"$1/consumer" "$1") || fail "consumer failed: $out"
	echo "$out"
	real=$(cd "$1" && pwd -P)
	echo "$out" | grep -q "from $real/\|from $1/" || fail "not the library installed in $1"
	echo "$out" | grep -qx ok || fail "consumer did not finish"
}
build_run "$prefix"
PKG_CONFIG_PATH=$(dirname "$pc") pkg-config --modversion phx | grep -qx "$(sed -n 's/^Version: //p' "$pc")"
mv "$prefix" "$prefix.moved"
build_run "$prefix.moved"
rm -rf "$prefix.moved"
echo "all passed"
