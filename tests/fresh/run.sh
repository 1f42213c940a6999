#!/usr/bin/env bash
# make test-fresh: the README's commands on a clean Debian 12 root, so that CI
# catches an install step the README's two commands forgot.
#
#  1. A bare bookworm root (debootstrap --variant=minbase, the Debian mirror
#     of this machine's apt sources) is kept as a tarball in $PHX_FRESH_CACHE
#     (default ~/.cache/phx-fresh) and rebuilt when older than
#     $PHX_FRESH_MAX_AGE_DAYS (7).  Every run unpacks it into a new folder:
#     no run starts from a root an earlier run installed packages into.
#  2. Into that root: this machine's apt sources, /etc/resolv.conf, its pip
#     settings and the files they name (pip reaches its index only with them).
#  3. In a private mount namespace (mounts die with it even on kill -9; a
#     trap unmounts them on exit, failure and Ctrl-C): /proc, /sys (with the
#     cgroup tree, for the kv tests' memory cgroups), /dev (loop and zram
#     nodes), /dev/pts, /dev/shm (the guest's ivshmem file) and the download
#     caches below.
#  4. chroot: the README's bootstrap line, `git clone` of a bundle of HEAD
#     (committed state only), `make bench` on a small size, `make test`.
#  5. Fails unless both pass, the bench wrote its JSON and plot, and every
#     pytest skip has a reason that no install can remove (no GPU; a test
#     that only runs inside the QEMU guest): "fio not installed" and the like
#     fail here although pytest calls them skips.
#
# Shared between runs, downloads only, never installed state:
#   - apt's archive folder (the .debs; dpkg still unpacks and configures each);
#   - pip's HTTP cache (downloaded wheels; pip still installs each, and pip's
#     cache of wheels it built itself is not shared);
#   - the guest kernel's .debs from this machine's guest cache, copied (the
#     harness only reads them): apt-get download is then skipped, but the
#     version lookup (apt-cache), dpkg-deb, depmod (kmod), the phx.ko build
#     (make, gcc, pahole), busybox, cpio and qemu all run in the root.
#
# Environment: PHX_FRESH_CACHE, PHX_FRESH_DIR (where roots are unpacked,
# default /var/tmp), PHX_FRESH_MAX_AGE_DAYS, PHX_FRESH_SOURCES (the apt
# sources file to copy), PHX_FRESH_BENCH_ARGS, PHX_FRESH_KEEP=1 (keep the
# root for a look; its mounts are gone with the namespace).
# The log of the last run (every line with seconds since start) is kept in
# $PHX_FRESH_CACHE/last-run.log.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(git -C "$HERE" rev-parse --show-toplevel)
CACHE=${PHX_FRESH_CACHE:-$HOME/.cache/phx-fresh}
DIR=${PHX_FRESH_DIR:-/var/tmp}
MAX_AGE_DAYS=${PHX_FRESH_MAX_AGE_DAYS:-7}
SOURCES=${PHX_FRESH_SOURCES:-/etc/apt/sources.list.d/debian.sources}
BENCH_ARGS=${PHX_FRESH_BENCH_ARGS:---size 64m --runtime 0.1 --repeat 1}
GUEST_CACHE=${PHX_GUEST_CACHE:-$HOME/.cache/phx-guest}
SUITE=bookworm
TARBALL=$CACHE/$SUITE-minbase.tar
# pytest skip reasons no package can remove on a machine of this kind (and
# tests that run in another job of the same make test: the seccomp one).
ALLOWED_SKIPS="no usable GPU|runs in the QEMU guest|runs in make test-seccomp|refused by make test-seccomp's filter"

log() { printf '[test-fresh] %s\n' "$*" >&2; }
die() { log "FAIL: $*"; exit 1; }

# The Debian mirror named in the apt sources (deb822 or one-line format).
mirror() {
	sed -n -e 's/^URIs:[[:space:]]*\([^[:space:]]*\).*/\1/p' \
		-e 's/^deb[[:space:]]\+\(\[[^]]*\][[:space:]]\+\)\?\([^[:space:]]*\).*/\2/p' \
		"$SOURCES" | grep -v -- '-security' | head -1
}

# The bare root tarball: made once (under a lock), reused until too old.
bare_tarball() {
	mkdir -p "$CACHE"
	exec 9>"$CACHE/.lock"
	flock 9
	if [ -f "$TARBALL" ] && [ -z "$(find "$TARBALL" -mtime +"$MAX_AGE_DAYS")" ]; then
		log "bare root: $TARBALL (from $(date -r "$TARBALL" +%F))"
		exec 9>&-
		return
	fi
	local m tmp t0=$SECONDS
	m=$(mirror)
	[ -n "$m" ] || die "no Debian mirror in $SOURCES"
	tmp=$(mktemp -d "$DIR/phx-debootstrap.XXXXXX")
	chmod 755 "$tmp"	# it becomes "/"
	log "debootstrap --variant=minbase $SUITE $tmp $m"
	if ! debootstrap --variant=minbase "$SUITE" "$tmp" "$m" >"$CACHE/debootstrap.log" 2>&1; then
		tail -20 "$CACHE/debootstrap.log" >&2
		rm -rf --one-file-system "$tmp"
		die "debootstrap failed (log: $CACHE/debootstrap.log)"
	fi
	# the .debs debootstrap used are not part of a root
	rm -f "$tmp"/var/cache/apt/archives/*.deb
	tar -C "$tmp" --numeric-owner --xattrs --xattrs-include='*' -cf "$TARBALL.tmp" .
	rm -rf --one-file-system "$tmp"
	mv "$TARBALL.tmp" "$TARBALL"
	log "bare root made in $((SECONDS - t0)) s: $TARBALL ($(du -h "$TARBALL" | cut -f1))"
	exec 9>&-
}

# ---------------------------------------------------------------------------
# outer part: the root folder's life (made, removed), outside the namespace

outer() {
	[ "$(id -u)" = 0 ] || die "needs root (debootstrap, chroot, mounts)"
	local t
	for t in debootstrap unshare chroot flock git tar; do
		command -v "$t" >/dev/null || die "$t not found (make test-fresh installs it: make deps)"
	done
	[ -f "$SOURCES" ] || die "no apt sources file $SOURCES (set PHX_FRESH_SOURCES)"
	git -C "$REPO" rev-parse -q --verify HEAD >/dev/null || die "no commit in $REPO"
	# The README's bootstrap line (what `make bench` and `make test` assume),
	# from the committed README: the test follows the README, not a copy of it.
	BOOTSTRAP=$(git -C "$REPO" show HEAD:README.md |
		grep -m1 '^apt-get update && apt-get install ' || true)
	[ -n "$BOOTSTRAP" ] || die "no 'apt-get update && apt-get install ...' line in README.md"
	export BOOTSTRAP
	bare_tarball
	ROOT=$(mktemp -d "$DIR/phx-fresh.XXXXXX")
	trap remove_root EXIT
	trap 'log interrupted; exit 130' INT
	trap 'log terminated; exit 143' TERM
	local rc=0
	unshare --mount --propagation private -- "$0" --inside "$ROOT" || rc=$?
	return $rc
}

remove_root() {
	if grep -qF " $ROOT" /proc/self/mountinfo; then
		log "something is still mounted under $ROOT: not removing it"
	elif [ "${PHX_FRESH_KEEP:-0}" = 1 ]; then
		log "kept: $ROOT"
	else
		rm -rf --one-file-system "$ROOT"
	fi
}

# ---------------------------------------------------------------------------
# inner part: in a private mount namespace

MOUNTS=()

# bind SRC DST [ro]: DST is a path inside the root
bind() {
	local dst=$ROOT$2
	if [ -d "$1" ]; then mkdir -p "$dst"; else mkdir -p "$(dirname "$dst")"; touch "$dst"; fi
	mount --bind "$1" "$dst"
	MOUNTS+=("$dst")
	if [ "${3:-}" = ro ]; then mount -o remount,bind,ro "$dst"; fi
}

unmount_all() {
	local i
	for ((i = ${#MOUNTS[@]} - 1; i >= 0; i--)); do
		umount -R "${MOUNTS[i]}" 2>/dev/null || umount -R -l "${MOUNTS[i]}" ||
			log "cannot unmount ${MOUNTS[i]}"
	done
	MOUNTS=()
}

# Paths named by pip's settings (cert, constraint, find-links, file:// index
# URLs): files are copied, folders bound read-only.  A file:// index is bound
# from its parent: its pages link to ../../files/.
pip_paths() {
	local f
	for f in /etc/pip.conf /etc/xdg/pip/pip.conf "$HOME/.config/pip/pip.conf" \
		"$HOME/.pip/pip.conf" ${PIP_CONFIG_FILE:+"$PIP_CONFIG_FILE"}; do
		if [ -f "$f" ]; then echo "$f"; grep -v '^[[:space:]]*[#;]' "$f"; fi
	done | grep -o -e 'file://[^[:space:]]*' -e '/[^[:space:]]*'
	env | sed -n 's/^PIP_[A-Z_]*=//p' | tr ' ' '\n' | grep -o -e 'file://[^[:space:]]*' -e '^/.*'
}

copy_pip_settings() {
	local p dst
	for p in $(pip_paths | sort -u); do
		case $p in
		file://*/simple | file://*/simple/) p=${p#file://}; p=$(dirname "${p%/}") ;;
		file://*) p=${p#file://} ;;
		esac
		[ -e "$p" ] || continue
		dst=$p
		# the user's own file goes to root's home, the HOME inside
		case $p in "$HOME"/*) dst=/root/${p#"$HOME"/} ;; esac
		if [ -d "$p" ]; then
			grep -qF " $ROOT$dst " /proc/self/mountinfo || bind "$p" "$dst" ro
		else
			mkdir -p "$ROOT$(dirname "$dst")"
			cp -L "$p" "$ROOT$dst"
		fi
		log "pip setting: $p -> $dst"
	done
}

prepare_root() {
	local t0=$SECONDS
	tar -C "$ROOT" --numeric-owner --xattrs --xattrs-include='*' -xpf "$TARBALL"
	chmod 755 "$ROOT"	# "/": mktemp made it 0700
	cp -L /etc/resolv.conf "$ROOT/etc/resolv.conf"
	rm -f "$ROOT/etc/apt/sources.list"
	cp "$SOURCES" "$ROOT/etc/apt/sources.list.d/"
	copy_pip_settings
	# The bundle pip's settings name is generated: once a package pulls in
	# ca-certificates, its postinst rebuilds it from Debian's CAs and the
	# local ones in /usr/local/share/ca-certificates.  This machine's local
	# CAs (its network's) go there too, or pip's HTTPS breaks mid-run.
	if [ -d /usr/local/share/ca-certificates ]; then
		mkdir -p "$ROOT/usr/local/share/ca-certificates"
		cp -rL /usr/local/share/ca-certificates/. "$ROOT/usr/local/share/ca-certificates/"
	fi
	# the repository: committed state only
	git -C "$REPO" bundle create "$ROOT/root/phx.bundle" HEAD \
		$(git -C "$REPO" symbolic-ref -q HEAD) 2>/dev/null
	# the guest kernel's downloads (see the top of this file)
	mkdir -p "$ROOT/root/.cache/phx-guest/deb"
	local d n=0
	for d in "$GUEST_CACHE"/deb/linux-{image,headers,kbuild}-*.deb; do
		[ -f "$d" ] || continue
		cp "$d" "$ROOT/root/.cache/phx-guest/deb/"
		n=$((n + 1))
	done
	log "root unpacked in $((SECONDS - t0)) s: $ROOT ($n guest kernel .debs copied)"
}

mount_all() {
	bind /proc /proc
	mkdir -p "$ROOT/sys"
	mount --rbind /sys "$ROOT/sys"
	MOUNTS+=("$ROOT/sys")
	bind /dev /dev
	bind /dev/pts /dev/pts
	bind /dev/shm /dev/shm
	# downloads only (see the top of this file)
	mkdir -p "$CACHE/apt-archives/partial" "$CACHE/pip-http" "$CACHE/pip-http-v2"
	chown "$(chroot "$ROOT" id -u _apt)" "$CACHE/apt-archives/partial"
	bind "$CACHE/apt-archives" /var/cache/apt/archives
	bind "$CACHE/pip-http" /root/.cache/pip/http
	bind "$CACHE/pip-http-v2" /root/.cache/pip/http-v2
}

# What runs in the root: the README's bootstrap, a clone, the two commands.
INSIDE_SCRIPT='
set -euo pipefail
t=$SECONDS
step() { echo "== [test-fresh] $1 done in $((SECONDS - t)) s"; t=$SECONDS; }
cd /root
echo "== [test-fresh] bootstrap: $BOOTSTRAP"
eval "$BOOTSTRAP"
step bootstrap
git clone -q phx.bundle phx
cd phx
echo "== [test-fresh] HEAD $(git log -1 --format="%h %s")"
echo "== [test-fresh] make bench BENCH_ARGS=\"$BENCH_ARGS\""
make bench BENCH_ARGS="$BENCH_ARGS"
step "make bench"
test -s results/bench-io.json && test -s results/bench-io.png ||
	{ echo "== [test-fresh] make bench wrote no results/bench-io.json and .png"; exit 1; }
echo "== [test-fresh] make test"
make test
step "make test"
'

run_inside() {
	local envs=() kv
	while IFS= read -r -d '' kv; do
		case $kv in PIP_*) envs+=("$kv") ;; esac
	done < <(env -0)
	chroot "$ROOT" /usr/bin/env -i \
		PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
		HOME=/root LANG=C.UTF-8 DEBIAN_FRONTEND=noninteractive \
		BOOTSTRAP="$BOOTSTRAP" BENCH_ARGS="$BENCH_ARGS" "${envs[@]}" \
		/bin/bash -c "$INSIDE_SCRIPT" </dev/null
}

# Skips whose reason an install could remove are failures here.
check_skips() {
	local bad
	bad=$(sed -n 's/^\[ *[0-9]*s\] SKIPPED \[[0-9]*\] //p' "$1" | grep -Ev "$ALLOWED_SKIPS" || true)
	if [ -n "$bad" ]; then
		log "pytest skipped tests for reasons an install step could remove:"
		sed 's/^/  /' <<<"$bad" >&2
		return 1
	fi
	log "pytest skips: $(grep -c '^\[ *[0-9]*s\] SKIPPED' "$1" || true) reasons, all allowed ($ALLOWED_SKIPS)"
}

inner() {
	ROOT=$1
	trap unmount_all EXIT
	trap 'exit 130' INT
	trap 'exit 143' TERM
	local t0=$SECONDS logf=$CACHE/last-run.log rc=0
	prepare_root
	mount_all
	log "running in the root (log: $logf)"
	run_inside 2>&1 | while IFS= read -r line; do
		printf '[%5ds] %s\n' $((SECONDS - t0)) "$line"
	done | tee "$logf" || rc=$?
	# skips are judged even after a failure: both point at missing installs
	check_skips "$logf" || { [ "$rc" != 0 ] || rc=1; }
	[ "$rc" = 0 ] || die "the README's commands in the fresh root failed (rc $rc; log: $logf)"
	log "PASSED in $((SECONDS - t0)) s"
}

if [ "${1:-}" = --inside ]; then
	inner "$2"
else
	outer
fi
