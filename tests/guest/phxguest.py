#!/usr/bin/env python3
"""phxguest: boot a QEMU (TCG) guest on a Debian 6.12 kernel and run a test suite.

Reusable by every guest test of phx.  What it does:

* fetches (``apt-get download``) and unpacks Debian's linux-image and
  linux-headers 6.12 into a cache outside the repository
  (``$PHX_GUEST_CACHE``, default ``~/.cache/phx-guest``); or, with
  ``--kernel p2pdma``, builds a kernel with CONFIG_PCI_P2PDMA from Debian's
  ``linux-source-6.12`` (cached);
* builds ``kernel/`` (phx.ko) against that kernel, and the C test programs
  (``tests/guest/*.c``) for the host;
* builds a busybox initramfs holding the modules the guest needs;
* boots ``qemu-system-x86_64 -accel tcg`` with emulated NVMe controllers
  (size, LBA size, MDTS configurable), an ``ivshmem-plain`` device backed by a
  file in /dev/shm, and the host's ``/`` shared read-only over 9p; the guest
  chroots into the host tree and runs a suite script (bash) there;
* judges the run only by what the guest printed: every ``PHX-EXPECT`` name of
  the suite must have a ``PHX-PASS name`` line, no ``PHX-FAIL`` line may appear,
  the guest must reach ``PHX-GUEST-DONE``, and the log must hold no ``Oops``,
  ``BUG``, ``WARNING`` or ``Call Trace``.  On failure the guest log is printed.
  One exception: a kernel that dies before the initramfs's init prints
  ``PHX-GUEST-BOOTED`` has run none of phx's code (seen twice: Debian 7.3 under
  TCG, an ``int3`` Oops in ``sched_clock_cpu`` at 1.7 s, text patching racing
  the timer interrupt; then again in the next run's first boot); the harness
  says so and boots again, three boots at most.

Suite scripts (``tests/guest/suite_*.sh``) declare what must pass with
``# PHX-EXPECT: name ...`` lines and get, in the environment: PHX_REPO,
PHX_KO (phx.ko built for the booted kernel), PHX_BIN (host-built test
binaries), PHX_KVER, PHX_KERNEL (debian|p2pdma), PHX_IVSHMEM_BDF,
PHX_IVSHMEM_SIZE, PHX_NVME (space-separated /dev/nvmeXn1 names, in --nvme
order), every PHX_SUITE_* variable of the host environment (spaces become
commas) and a writable tmpfs at /tmp.  A line ``PHX-HOSTCHECK off len seed``
asks the host to compare the ivshmem backing file after the guest exits.

Exit status: 0 pass, 1 fail, 77 cannot run here (no qemu and no apt).
"""

import argparse
import fcntl
import hashlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
CACHE = Path(os.environ.get("PHX_GUEST_CACHE", Path.home() / ".cache" / "phx-guest"))

# The one package list is APT_PACKAGES in the top Makefile, which exports it:
# run the harness through make (make test-guest), which installs it first.
HOST_PACKAGES = os.environ.get("PHX_APT_PACKAGES", "").split()
P2PDMA_PACKAGES = HOST_PACKAGES

# Modules the guest needs from a Debian kernel (dependencies are added).
# Crypto first: libcrc32c (xfs, ext4) needs a crc32c provider when it loads.
GUEST_MODULES = ["crc32c_generic", "crc32c-intel", "crc32_generic", "libcrc32c", "nvme",
                 "9p", "9pnet_virtio", "ext4", "xfs", "virtio_pci", "loop",
                 # device-mapper: I/O errors from a real block device (test_guest_dm.py)
                 "dm_mod", "dm_flakey"]

# Boots per run when the kernel dies before its init (see the module docstring):
# such a death takes 2 s, and two 7.3 boots in a row died so (2026-12-06).
BOOT_TRIES = 3
BAD_PATTERNS = re.compile(r"Oops|\bBUG\b|WARNING|Call Trace|Kernel panic")
# pytest's last line: "3 passed, 1 skipped in 0.52s", "no tests ran in 0.01s" (-q or -v)
PYTEST_SUMMARY = re.compile(
    r"^=*\s*(?:(?:\d+ (?:passed|failed|skipped|errors?|xfailed|xpassed|deselected|"
    r"warnings?)(?:, )?)+|no tests ran) in [\d.]+s\b.*$", re.M)


def log(msg):
    print(f"[phxguest] {msg}", flush=True)


def run(cmd, **kw):
    kw.setdefault("check", True)
    return subprocess.run(cmd, **kw)


def sh_out(cmd):
    return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout


# --------------------------------------------------------------------------
# host packages


def apt_install(pkgs):
    missing = [p for p in pkgs
               if subprocess.run(["dpkg", "-s", p], capture_output=True).returncode]
    if not missing:
        return
    log(f"apt-get install {' '.join(missing)}")
    sudo = [] if os.geteuid() == 0 else ["sudo"]
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    run(sudo + ["apt-get", "update", "-qq"], env=env)
    run(sudo + ["apt-get", "install", "-y", "-qq", "--no-install-recommends"] + missing,
        env=env)


def apt_download(pkgs, dest):
    dest.mkdir(parents=True, exist_ok=True)
    todo = [p for p in pkgs if not list(dest.glob(f"{p}_*.deb"))]
    if todo:
        log(f"apt-get download {' '.join(todo)}")
        # apt's sandbox user cannot write into root's cache: download as root.
        run(["apt-get", "download", "-o", "APT::Sandbox::User=root"] + todo, cwd=dest,
            stdout=subprocess.DEVNULL)
    return [next(dest.glob(f"{p}_*.deb")) for p in pkgs]


# --------------------------------------------------------------------------
# kernels


class Kernel:
    """What a run needs from a kernel: image, build tree, modules."""

    def __init__(self, name, kver, vmlinuz, kdir, moddir, make_args=()):
        self.name, self.kver = name, kver
        self.vmlinuz, self.kdir, self.moddir = vmlinuz, kdir, moddir
        self.make_args = make_args      # extra make arguments for module builds


def debian_version():
    """The ABI name of bookworm's current 6.12 kernel, e.g. 6.12.117+deb12."""
    if os.environ.get("PHX_GUEST_KVER"):
        return os.environ["PHX_GUEST_KVER"]
    for attempt in (0, 1, 2):
        try:
            out = sh_out(["apt-cache", "depends", "linux-image-6.12-amd64"])
            m = re.search(r"Depends: linux-image-(6\.12\.\S+)-amd64", out)
            if m:
                return m.group(1)
        except subprocess.CalledProcessError:
            pass
        if attempt == 1:
            # bookworm-security carries 6.12; without it, bookworm-backports does
            src = Path("/etc/apt/sources.list.d/phx-bookworm-backports.list")
            log(f"no 6.12 kernel in the apt sources: adding {src}")
            src.write_text("deb http://deb.debian.org/debian bookworm-backports main\n")
        if attempt < 2:
            run(["apt-get", "update", "-qq"])
    raise SystemExit("no linux-image-6.12-amd64 in the apt sources "
                     "(bookworm-security or bookworm-backports needed)")


def debian_kernel():
    ver = debian_version()
    root = CACHE / f"k-{ver}"
    hdr = root / "usr/src" / f"linux-headers-{ver}-amd64"
    stamp = root / ".unpacked"
    if not stamp.exists():
        debs = apt_download([f"linux-image-{ver}-amd64", f"linux-headers-{ver}-amd64",
                             f"linux-headers-{ver}-common", f"linux-kbuild-{ver}"],
                            CACHE / "deb")
        shutil.rmtree(root, ignore_errors=True)
        root.mkdir(parents=True)
        for deb in debs:
            run(["dpkg-deb", "-x", str(deb), str(root)])
        # the headers' Makefile includes an absolute /usr/src path
        mk = hdr / "Makefile"
        mk.write_text(mk.read_text().replace("include /usr/src/", f"include {root}/usr/src/"))
        # the package leaves modules.dep to its postinst: make it here
        run(["depmod", "-b", str(root), f"{ver}-amd64"])
        stamp.touch()
    return Kernel("debian", f"{ver}-amd64", root / "boot" / f"vmlinuz-{ver}-amd64", hdr,
                  root / "lib/modules" / f"{ver}-amd64")


# A newer Debian kernel (>= 6.15: the new ZONE_DEVICE refcount rules, and
# CONFIG_PCI_P2PDMA=y in Debian's 7.x), from trixie-backports.  apt runs on
# a private sources list and state under the cache, so the host's apt
# configuration is not touched.
NEXT_SUITE = os.environ.get("PHX_GUEST_NEXT_SUITE", "trixie-backports")


def apt_private_opts():
    d = CACHE / f"apt-{NEXT_SUITE}"
    (d / "lists" / "partial").mkdir(parents=True, exist_ok=True)
    (d / "cache" / "archives" / "partial").mkdir(parents=True, exist_ok=True)
    src = d / "sources.list"
    src.write_text("deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] "
                   f"http://deb.debian.org/debian {NEXT_SUITE} main\n")
    opts = ["-o", f"Dir::Etc::SourceList={src}", "-o", "Dir::Etc::SourceParts=/dev/null",
            "-o", f"Dir::State::Lists={d / 'lists'}", "-o", f"Dir::Cache={d / 'cache'}",
            "-o", "APT::Sandbox::User=root"]
    stamp = d / ".updated"
    if not stamp.exists() or time.time() - stamp.stat().st_mtime > 7 * 86400:
        run(["apt-get"] + opts + ["update", "-qq"])
        stamp.touch()
    return opts


def next_version(opts):
    """ABI name of the suite's newest kernel, e.g. 7.3.4+deb13."""
    if os.environ.get("PHX_GUEST_NEXT_KVER"):
        return os.environ["PHX_GUEST_NEXT_KVER"]
    out = sh_out(["apt-cache"] + opts + ["depends", "linux-image-amd64"])
    m = re.search(r"Depends: linux-image-(\S+)-amd64", out)
    if not m:
        raise SystemExit(f"no linux-image-amd64 in {NEXT_SUITE}")
    return m.group(1)


def debian_next_kernel(jobs):
    """Debian's image, modules and headers of the newer kernel.  Its kbuild
    tools are linked against a newer glibc and its config names gcc-14, so
    the module build tree is prepared from the same version's linux-source
    with the host's gcc (modules_prepare, ~10 s), Debian's .config and
    Module.symvers; the vermagic matches the Debian kernel's."""
    opts = apt_private_opts()
    ver = next_version(opts)
    root = CACHE / f"k-{ver}"
    kver = f"{ver}-amd64"
    mm = ".".join(ver.split(".")[:2])
    hdr = root / "usr/src" / f"linux-headers-{kver}"
    out = root / "build"
    stamp = root / ".prepared"
    if not stamp.exists():
        deb = CACHE / "deb"
        deb.mkdir(parents=True, exist_ok=True)
        pkgs = [f"linux-binary-{kver}", f"linux-modules-{kver}", f"linux-headers-{kver}",
                f"linux-headers-{ver}-common", f"linux-kbuild-{ver}", f"linux-source-{mm}"]
        todo = [p for p in pkgs if not list(deb.glob(f"{p}_*.deb"))]
        if todo:
            log(f"apt-get download ({NEXT_SUITE}) {' '.join(todo)}")
            run(["apt-get"] + opts + ["download"] + todo, cwd=deb, stdout=subprocess.DEVNULL)
        debs = [next(deb.glob(f"{p}_*.deb")) for p in pkgs]
        shutil.rmtree(root, ignore_errors=True)
        root.mkdir(parents=True)
        for d in debs[:-1]:
            run(["dpkg-deb", "-x", str(d), str(root)])
        log(f"unpacking linux-source-{mm}")
        run(f"dpkg-deb --fsys-tarfile '{debs[-1]}' | tar -xO ./usr/src/linux-source-{mm}.tar.xz"
            f" | xz -dc -T0 | tar -x -C '{root}'", shell=True)
        src = root / f"linux-source-{mm}"
        out.mkdir()
        shutil.copy(hdr / ".config", out / ".config")
        local = kver[len(ver.split("+")[0]):]          # "+deb13-amd64"
        mk = ["make", "-s", "-C", str(src), f"O={out}", "CC=gcc", f"LOCALVERSION={local}"]
        run(mk + ["olddefconfig"], stdout=subprocess.DEVNULL)
        run(mk + [f"-j{jobs}", "modules_prepare"])
        shutil.copy(hdr / "Module.symvers", out / "Module.symvers")
        rel = (out / "include/config/kernel.release").read_text().strip()
        if rel != kver:
            raise SystemExit(f"prepared tree says {rel}, the kernel is {kver}")
        # merged /usr: modules live in usr/lib/modules
        run(["depmod", "-b", str(root / "usr"), kver])
        stamp.touch()
    moddir = root / "usr/lib/modules" / kver
    return Kernel("debian-next", kver, moddir / "vmlinuz", out, moddir, make_args=("CC=gcc",))


P2PDMA_ENABLE = ["MODULES", "MODULE_UNLOAD", "MEMORY_HOTPLUG", "MEMORY_HOTREMOVE",
                 "SPARSEMEM_VMEMMAP", "ZONE_DEVICE", "PCI_P2PDMA", "BLK_DEV_NVME",
                 "NVME_CORE", "IO_URING", "NET_9P", "NET_9P_VIRTIO", "9P_FS",
                 "9P_FS_POSIX_ACL", "EXT4_FS", "XFS_FS", "KPROBES", "KALLSYMS",
                 "DEVTMPFS", "DEVTMPFS_MOUNT", "BLK_DEV_INITRD", "RD_GZIP", "PCI",
                 "VIRTIO_PCI", "IKCONFIG", "IKCONFIG_PROC", "DEBUG_INFO_NONE",
                 "HOTPLUG_PCI_PCIE", "PCIEPORTBUS"]
P2PDMA_DISABLE = ["DRM", "SOUND", "USB_SUPPORT", "WLAN", "WIRELESS", "CFG80211", "HID",
                  "NETFILTER", "DEBUG_INFO", "DEBUG_INFO_DWARF_TOOLCHAIN_DEFAULT", "AGP",
                  "FB", "MODULE_SIG"]


# The debug variant of the P2PDMA kernel: the same plus KASAN, lockdep and
# VM debugging (their reports are WARN/BUG lines, which fail a run).
DEBUG_ENABLE = ["KASAN", "KASAN_GENERIC", "KASAN_OUTLINE", "PROVE_LOCKING",
                "DEBUG_VM", "DEBUG_ATOMIC_SLEEP"]


def p2pdma_kernel(jobs, name="p2pdma", extra=()):
    """defconfig + kvm_guest.config + P2PDMA (+ @extra), built from
    linux-source-6.12, cached per config in $CACHE/@name."""
    apt_install(P2PDMA_PACKAGES)
    src = CACHE / "src" / "linux-source-6.12"
    if not (src / "Makefile").exists():
        (deb,) = apt_download(["linux-source-6.12"], CACHE / "deb")
        (CACHE / "src").mkdir(parents=True, exist_ok=True)
        log("unpacking linux-source-6.12")
        run(f"dpkg-deb --fsys-tarfile '{deb}' | tar -xO ./usr/src/linux-source-6.12.tar.xz"
            f" | xz -dc -T0 | tar -x -C '{CACHE / 'src'}'", shell=True)
    enable = P2PDMA_ENABLE + list(extra)
    cfg_id = hashlib.sha256(" ".join(enable + ["-"] + P2PDMA_DISABLE).encode())
    cfg_id = cfg_id.hexdigest()[:10]
    out = CACHE / name / "build"
    stamp = CACHE / name / f".built-{cfg_id}"
    image = out / "arch/x86/boot/bzImage"
    if not stamp.exists() or not image.exists():
        out.mkdir(parents=True, exist_ok=True)
        log(f"configuring the P2PDMA kernel in {out}")
        run(["make", "-s", "-C", str(src), f"O={out}", "x86_64_defconfig",
             "kvm_guest.config"], stdout=subprocess.DEVNULL)
        args = []
        for o in enable:
            args += ["-e", o]
        for o in P2PDMA_DISABLE:
            args += ["-d", o]
        run([str(src / "scripts/config"), "--file", str(out / ".config")] + args)
        run(["make", "-s", "-C", str(src), f"O={out}", "olddefconfig"])
        cfg = (out / ".config").read_text()
        for o in ["PCI_P2PDMA"] + list(extra):
            if f"CONFIG_{o}=y" not in cfg and o != "KASAN_OUTLINE":
                raise SystemExit(f"CONFIG_{o} did not stick in the kernel config")
        log(f"building the {name} kernel (-j{jobs}; ~15 min on 2 cores, more with "
            f"KASAN; cached after)")
        t0 = time.time()
        run(["make", "-s", "-C", str(out), f"-j{jobs}", "bzImage", "modules"])
        log(f"kernel built in {time.time() - t0:.0f} s")
        stamp.touch()
    kver = sh_out(["make", "-s", "-C", str(out), "kernelrelease"]).strip()
    return Kernel(name, kver, image, out, None)


# --------------------------------------------------------------------------
# phx.ko and test programs


def _kbuild(kern, mdir, extra=()):
    r = run(["make", "-C", str(kern.kdir), f"M={mdir}"] + list(kern.make_args) +
            list(extra) + ["modules"], capture_output=True, text=True, check=False)
    if r.returncode:
        print(r.stdout, r.stderr)
        raise SystemExit(f"{mdir.name} did not build")
    for ln in (r.stdout + r.stderr).splitlines():
        if "warning:" in ln:
            log(f"build warning: {ln}")


def build_module(kern):
    """Build the NVIDIA stub, then kernel/ (phx.ko, and phx_nv.ko against the
    stub's Module.symvers, as against the real driver's), in copies under the
    cache (the tree stays clean).  Returns {name: path of the .ko}."""
    root = CACHE / "phx-build" / kern.name
    if root.exists():
        shutil.rmtree(root)
    ignore = shutil.ignore_patterns("*.o", "*.ko", "*.cmd", "*.mod*", "*.order",
                                    "*.symvers", ".*")
    kdir = root / "kernel"
    stub = root / "nv_p2p_stub"
    shutil.copytree(REPO / "kernel", kdir, ignore=ignore)
    shutil.copytree(HERE / "nv_p2p_stub", stub, ignore=ignore)
    # the stub includes kernel/phx_nv_p2p.h: point it at the copy
    kb = stub / "Kbuild"
    kb.write_text(kb.read_text().replace("$(src)/../../../kernel", str(kdir)))
    # the stub's API variants (see its Kbuild), each built in its own copy
    variants = {"cap": "STUB_API=cap", "none": "STUB_API=none", "nvidia": "STUB_LICENSE=nvidia"}
    for v in variants:
        shutil.copytree(stub, root / f"nv_p2p_stub_{v}")
    _kbuild(kern, stub)
    for v, arg in variants.items():
        _kbuild(kern, root / f"nv_p2p_stub_{v}", [arg])
    _kbuild(kern, kdir, ["CONFIG_PHX_NV=m",
                         f"KBUILD_EXTRA_SYMBOLS={stub / 'Module.symvers'}"])
    return {"phx": kdir / "phx.ko", "phx_nv": kdir / "phx_nv.ko",
            "nv_p2p_stub": stub / "nv_p2p_stub.ko",
            **{f"nv_p2p_stub_{v}": root / f"nv_p2p_stub_{v}" / "nv_p2p_stub.ko"
               for v in variants}}


def build_programs():
    out = CACHE / "bin"
    out.mkdir(parents=True, exist_ok=True)
    for src in sorted(HERE.glob("*.c")):
        exe = out / src.stem
        if exe.exists() and exe.stat().st_mtime >= src.stat().st_mtime and \
                exe.stat().st_mtime >= (REPO / "kernel/include/uapi/phx_uapi.h").stat().st_mtime:
            continue
        run(["gcc", "-O2", "-g", "-Wall", "-Wextra", "-o", str(exe), str(src),
             "-luring", "-lpthread"])
    return out


# --------------------------------------------------------------------------
# initramfs

INIT = r"""#!/bin/busybox sh
/bin/busybox --install -s /bin
export PATH=/bin:/sbin
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
echo "PHX-GUEST-BOOTED $(uname -r)"
for m in $(cat /modules.load); do insmod /lib/modules/$m 2>/dev/null; done
arg() { sed -n "s/.*phx\.$1=\([^ ]*\).*/\1/p" /proc/cmdline; }
RUN=$(arg run)
mkdir -p /host
if ! mount -t 9p -o trans=virtio,version=9p2000.L,msize=262144,cache=loose,ro host /host; then
    echo "PHX-FAIL guest: cannot mount the host tree over 9p"
    poweroff -f
fi
mount -t proc proc /host/proc
mount -t sysfs sys /host/sys
mount -t devtmpfs dev /host/dev
# The guest's /tmp is its own tmpfs; a repository that lives under the
# host's /tmp (a CI clone, say) stays visible through a bind mount.
mkdir -p /hosttmp
mount --bind /host/tmp /hosttmp
mount -t tmpfs -o size=512m tmp /host/tmp
REPO=$(tr ' ' '\n' < /host$RUN/env | sed -n 's/^PHX_REPO=//p')
case "$REPO" in
/tmp/?*)
    mkdir -p "/host$REPO"
    mount --bind "/hosttmp/${REPO#/tmp/}" "/host$REPO"
    ;;
esac
mkdir -p /host/dev/shm /host/dev/pts
mount -t tmpfs shm /host/dev/shm
# ivshmem-plain: vendor 1af4 device 1110
BDF=
for d in /sys/bus/pci/devices/*; do
    if [ "$(cat $d/vendor)" = 0x1af4 ] && [ "$(cat $d/device)" = 0x1110 ]; then
        BDF=${d##*/}
    fi
done
# namespaces in --nvme order: the harness gives controller i the serial phx000i
NV=$(for c in /sys/class/nvme/nvme*; do [ -e $c/serial ] && echo "$(cat $c/serial) ${c##*/}"; done |
     sort | while read -r _ c; do printf ' /dev/%sn1' $c; done)
echo "guest: ivshmem at $BDF, nvme:$NV"
env -i PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/root \
    PHX_IVSHMEM_BDF=$BDF PHX_NVME="$NV" $(cat /host$RUN/env) \
    chroot /host /bin/bash $(cat /host$RUN/script) </dev/null 2>&1
echo "PHX-GUEST-DONE rc=$?"
echo "PHX-DMESG-BEGIN"
dmesg
echo "PHX-DMESG-END"
sync
poweroff -f
"""


def module_closure(moddir, names):
    """Paths (relative to moddir) of @names and their dependencies, load order."""
    deps = {}
    for line in (moddir / "modules.dep").read_text().splitlines():
        mod, _, rest = line.partition(":")
        deps[mod] = rest.split()
    byname = {}
    for mod in deps:
        base = Path(mod).name.split(".ko")[0]
        byname[base] = mod
        byname[base.replace("-", "_")] = mod
    order, seen = [], set()

    def visit(mod):
        if mod in seen:
            return
        seen.add(mod)
        for d in deps.get(mod, []):
            visit(d)
        order.append(mod)

    for n in names:
        mod = byname.get(n) or byname.get(n.replace("-", "_"))
        if mod:
            visit(mod)
    return order


def build_initramfs(kern):
    out = CACHE / f"initramfs-{kern.kver}.cpio.gz"
    init_hash = hashlib.sha256((INIT + " ".join(GUEST_MODULES)).encode()).hexdigest()[:10]
    stamp = CACHE / f".initramfs-{kern.kver}-{init_hash}"
    if out.exists() and stamp.exists():
        return out
    busybox = shutil.which("busybox") or "/bin/busybox"
    with tempfile.TemporaryDirectory() as td:
        root = Path(td)
        for d in ("bin", "sbin", "proc", "sys", "dev", "host", "lib/modules", "tmp"):
            (root / d).mkdir(parents=True, exist_ok=True)
        shutil.copy(busybox, root / "bin/busybox")
        (root / "init").write_text(INIT)
        (root / "init").chmod(0o755)
        load = []
        if kern.moddir:
            for mod in module_closure(kern.moddir, GUEST_MODULES):
                src = kern.moddir / mod
                name = Path(mod).name
                data = src.read_bytes()
                if name.endswith(".xz"):
                    data = subprocess.run(["xz", "-dc"], input=data, check=True,
                                          capture_output=True).stdout
                    name = name[:-3]
                (root / "lib/modules" / name).write_bytes(data)
                load.append(name)
        (root / "modules.load").write_text("\n".join(load) + "\n")
        run(f"cd '{root}' && find . | cpio -o -H newc --quiet | gzip -1 > '{out}.tmp'",
            shell=True)
    os.replace(f"{out}.tmp", out)
    for old in CACHE.glob(f".initramfs-{kern.kver}-*"):
        old.unlink()
    stamp.touch()
    return out


# --------------------------------------------------------------------------
# the run


def parse_size(s):
    m = re.fullmatch(r"(\d+)([KMG]?)", s.strip().upper())
    if not m:
        raise argparse.ArgumentTypeError(f"bad size {s!r}")
    return int(m.group(1)) << {"": 0, "K": 10, "M": 20, "G": 30}[m.group(2)]


def parse_nvme(spec):
    """size=256M,lba=4096,mdts=5 -> dict (mdts 0 = QEMU's default)."""
    d = {"size": 512 << 20, "lba": 4096, "mdts": 7}
    for item in filter(None, spec.split(",")):
        k, _, v = item.partition("=")
        if k == "size":
            d["size"] = parse_size(v)
        elif k in ("lba", "mdts"):
            d[k] = int(v)
        else:
            raise argparse.ArgumentTypeError(f"unknown nvme option {k}")
    if d["lba"] not in (512, 4096):
        raise argparse.ArgumentTypeError("lba must be 512 or 4096")
    return d


def qemu_cmd(a, kern, initrd, rundir, shm):
    cmd = ["qemu-system-x86_64", "-accel", "tcg", "-machine", "q35", "-cpu", "max",
           "-m", a.mem, "-smp", str(a.smp), "-nographic", "-no-reboot",
           "-kernel", str(kern.vmlinuz), "-initrd", str(initrd),
           # debug kernel: 4-level paging (-cpu max offers LA57, and KASAN reported
           # a wild access in rcu_is_watching() from an interrupt during early boot
           # with it once, which tainted the kernel and turned lockdep off for the run)
           "-append", f"console=ttyS0 loglevel=4 panic=-1 phx.run={rundir}"
                      + (" no5lvl" if kern.name == "debug" else ""),
           "-virtfs", "local,path=/,mount_tag=host,security_model=none,readonly=on,"
                      "multidevs=remap",
           # a PCIe switch: the NVMe and the ivshmem device are peers below it,
           # the topology upstream P2PDMA accepts without a whitelisted host bridge
           "-device", "pcie-root-port,id=rp0,chassis=1,slot=1",
           "-device", "x3130-upstream,id=up0,bus=rp0"]
    slot = 0
    cmd += ["-device", f"xio3130-downstream,id=dn{slot},bus=up0,chassis={10 + slot},slot={slot}",
            "-object", f"memory-backend-file,id=shm0,share=on,mem-path={shm},"
                       f"size={a.ivshmem_size}",
            "-device", f"ivshmem-plain,memdev=shm0,bus=dn{slot}"]
    for i, nv in enumerate(a.nvme):
        slot += 1
        img = rundir / f"nvme{i}.img"
        with open(img, "wb") as f:
            f.truncate(nv["size"])
        cmd += ["-device", f"xio3130-downstream,id=dn{slot},bus=up0,chassis={10 + slot},"
                           f"slot={slot}",
                "-drive", f"file={img},if=none,id=nvm{i},format=raw,cache=unsafe,discard=unmap",
                "-device", f"nvme,id=nvme{i},serial=phx{i:04d},mdts={nv['mdts']},"
                           f"bus=dn{slot}",
                "-device", f"nvme-ns,drive=nvm{i},bus=nvme{i},nsid=1,"
                           f"logical_block_size={nv['lba']},"
                           f"physical_block_size={nv['lba']}"]
    return cmd


def boot(cmd, logf, timeout):
    """Run the guest, its console into @logf; True if it ran past @timeout."""
    with open(logf, "wb") as out:
        p = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out,
                             stderr=subprocess.STDOUT, start_new_session=True)
        try:
            p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            return True
    return False


def died_before_init(text):
    """The kernel's first trouble line when the guest never reached its
    init (no ``PHX-GUEST-BOOTED``); None otherwise."""
    if "PHX-GUEST-BOOTED" in text:
        return None
    bad = [ln.strip() for ln in text.splitlines() if BAD_PATTERNS.search(ln)]
    return bad[0] if bad else None


def judge(text, expects):
    """(ok, reasons) from the guest's console output."""
    reasons = []
    passed = set(re.findall(r"^PHX-PASS (\S+)", text, re.M))
    for f in re.findall(r"^PHX-FAIL .*$", text, re.M):
        reasons.append(f"guest reported: {f}")
    for e in expects:
        if not any(p == e or p.startswith(e + "/") for p in passed):
            reasons.append(f"missing: PHX-PASS {e}")
    # A pytest run in the guest that passed nothing (all skipped, none
    # collected) is not a pass, whatever the suite printed for it.
    for summary in PYTEST_SUMMARY.findall(text):
        if not re.search(r"\b[1-9]\d* passed", summary):
            reasons.append(f"a pytest run in the guest passed no test: {summary.strip(' =')}")
    if "PHX-GUEST-DONE" not in text:
        reasons.append("the guest did not finish (no PHX-GUEST-DONE)")
    if "PHX-DMESG-END" not in text:
        reasons.append("no complete dmesg from the guest")
    for ln in text.splitlines():
        if BAD_PATTERNS.search(ln) and not ln.startswith(("PHX-PASS", "+ ")):
            reasons.append(f"kernel trouble: {ln.strip()}")
            break
    return not reasons, reasons


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("suite", type=Path, help="bash script run in the guest (chroot)")
    ap.add_argument("--kernel", choices=["debian", "debian-next", "p2pdma", "debug"], default="debian")
    ap.add_argument("--nvme", type=parse_nvme, action="append",
                    help="add an NVMe: size=512M,lba=4096,mdts=7 (repeatable)")
    ap.add_argument("--ivshmem-size", type=parse_size, default=parse_size("128M"))
    ap.add_argument("--mem", default="2G")
    ap.add_argument("--smp", type=int, default=2)
    ap.add_argument("--timeout", type=int, default=1200, help="seconds for the guest")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--keep", action="store_true", help="keep the run folder")
    ap.add_argument("--prepare-only", action="store_true")
    a = ap.parse_args()
    a.nvme = a.nvme or [parse_nvme("")]
    suite = a.suite.resolve()

    if not shutil.which("apt-get") and not shutil.which("qemu-system-x86_64"):
        print("PHX-SKIP no apt and no qemu here")
        return 77
    t0 = time.time()
    CACHE.mkdir(parents=True, exist_ok=True)
    runs = CACHE / "runs"
    runs.mkdir(exist_ok=True)
    rundir = Path(tempfile.mkdtemp(prefix=f"{suite.stem}-{a.kernel}-", dir=runs))
    # Several harness runs may share the cache: prepare under a lock, then
    # give this run its own copies of what the guest uses.
    with open(CACHE / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        apt_install(HOST_PACKAGES)
        kern = {"debian": debian_kernel, "debian-next": lambda: debian_next_kernel(a.jobs),
                "p2pdma": lambda: p2pdma_kernel(a.jobs),
                "debug": lambda: p2pdma_kernel(a.jobs, "debug", DEBUG_ENABLE)}[a.kernel]()
        kos = {n: Path(shutil.copy(p, rundir / f"{n}.ko"))
               for n, p in build_module(kern).items()}
        ko = kos["phx"]
        bindir = shutil.copytree(build_programs(), rundir / "bin")
        initrd = shutil.copy(build_initramfs(kern), rundir / "initrd.cpio.gz")
    log(f"prepared in {time.time() - t0:.0f} s: kernel {kern.kver}, {ko}")
    if a.prepare_only:
        shutil.rmtree(rundir, ignore_errors=True)
        return 0
    ko, bindir, initrd = Path(ko), Path(bindir), Path(initrd)
    shm = Path(f"/dev/shm/phx-guest-{os.getpid()}")
    try:
        st = os.statvfs("/dev/shm")
        if st.f_bavail * st.f_frsize < a.ivshmem_size * 2:
            raise OSError("small")
    except OSError:  # no or small /dev/shm (containers): any shared file works
        shm = rundir / "ivshmem.bin"
        log(f"/dev/shm too small: the ivshmem memory is backed by {shm}")
    with open(shm, "wb") as f:
        f.truncate(a.ivshmem_size)
    env = {"PHX_REPO": str(REPO), "PHX_KO": str(ko), "PHX_NV_KO": str(kos["phx_nv"]),
           "PHX_STUB_KO": str(kos["nv_p2p_stub"]), "PHX_BIN": str(bindir),
           # PHX_STUB_CAP_KO, PHX_STUB_NONE_KO, PHX_STUB_NVIDIA_KO: the stub's variants
           **{f"PHX_STUB_{n[12:].upper()}_KO": str(p) for n, p in kos.items()
              if n.startswith("nv_p2p_stub_")},
           "PHX_KVER": kern.kver, "PHX_KERNEL": a.kernel,
           "PHX_IVSHMEM_SIZE": str(a.ivshmem_size)}
    # knobs for suites: PHX_SUITE_* from the host environment (no spaces kept)
    env.update({k: v.replace(" ", ",") for k, v in os.environ.items()
                if k.startswith("PHX_SUITE_")})
    (rundir / "env").write_text(" ".join(f"{k}={v}" for k, v in env.items()))
    # the guest's /tmp is its own tmpfs: run a copy kept in the run folder
    shutil.copy(suite, rundir / suite.name)
    (rundir / "script").write_text(str(rundir / suite.name))
    expects = []
    for ln in suite.read_text().splitlines():
        if ln.startswith("# PHX-EXPECT:"):
            expects += ln.split(":", 1)[1].split()

    # suite hook on the host before boot: lines "# PHX-HOSTFILL: off len seed"
    for ln in suite.read_text().splitlines():
        if ln.startswith("# PHX-HOSTFILL:"):
            off, ln_, seed = ln.split(":", 1)[1].split()
            run([str(bindir / "phx_io_test"), "hostfill", str(shm), off, ln_, seed])

    cmd = qemu_cmd(a, kern, initrd, rundir, shm)
    (rundir / "qemu.cmd").write_text(" ".join(cmd) + "\n")
    logf = rundir / "console.log"
    for attempt in range(1, BOOT_TRIES + 1):
        log(f"booting {kern.kver} (TCG), suite {suite.name}, log {logf}")
        t1 = time.time()
        timed_out = boot(cmd, logf, a.timeout)
        wall = time.time() - t1
        text = logf.read_bytes().decode("utf-8", "replace").replace("\r", "")
        died = died_before_init(text)
        if attempt < BOOT_TRIES and died and not timed_out:
            logf.rename(rundir / f"console-boot{attempt}.log")
            log(f"the guest kernel died before its init ran, so before any of phx's code: "
                f"{died}; booting again (that console in console-boot{attempt}.log)")
            continue
        break
    ok, reasons = judge(text, expects)
    if timed_out:
        ok = False
        reasons.insert(0, f"timed out after {a.timeout} s")

    # host-side checks of the ivshmem backing file
    for off, ln_, seed in re.findall(r"^PHX-HOSTCHECK (\d+) (\d+) (\d+)", text, re.M):
        r = run([str(bindir / "phx_io_test"), "hostcheck", str(shm), off, ln_, seed],
                check=False, capture_output=True, text=True)
        print(r.stdout, end="")
        if r.returncode:
            ok = False
            reasons.append(f"host check of {off}+{ln_} failed")
    shm.unlink(missing_ok=True)

    info = re.compile(r"^(PHX-PASS|PHX-FAIL|PHX-SKIP|PHX-INFO|suite:|phx info|unreg:|"
                      r"garbage \(seed|fixedbuf:|p2pdma:)")
    for ln in text.splitlines():
        if info.match(ln):
            print(ln)
    if not ok:
        print("=" * 30 + " guest log " + "=" * 30)
        print(text)
        print("=" * 71)
        for r in reasons:
            log(f"FAIL: {r}")
        log(f"suite {suite.name} on {kern.kver}: FAILED ({wall:.0f} s in the guest); "
            f"run folder {rundir}")
        return 1
    log(f"suite {suite.name} on {kern.kver}: PASSED, {len(expects)} expected results, "
        f"{wall:.0f} s in the guest, {time.time() - t0:.0f} s in all")
    if not a.keep:
        shutil.rmtree(rundir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
