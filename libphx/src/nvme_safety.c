// SPDX-License-Identifier: Apache-2.0
/*
 * nvme_safety.c - what makes a namespace safe to claim, and what NVMe
 * status codes mean.
 *
 * The namespace's block device is found from the device number of the node
 * the caller opened (never from its name), and the namespace is refused
 * (unless forced) when that block device cannot be found or has no device
 * node, is partitioned, mounted (/proc/self/mountinfo) or used as swap, is
 * held by another driver (holders/), cannot be opened with O_EXCL (for any
 * reason: mounted in another mount namespace, claimed, no permission), or
 * carries a signature libblkid recognises.  Every doubt refuses: these
 * checks guard a raw write of someone's disk.
 */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>
#ifdef PHX_HAVE_BLKID
#include <blkid.h>
#endif

#include "internal.h"
#include "nvme_internal.h"

/* ------------------------------------------------------------------------ */
/* Status codes                                                             */
/* ------------------------------------------------------------------------ */

struct status_name {
	uint16_t code;		/* SCT << 8 | SC */
	int err;		/* errno libphx returns for it */
	const char *text;
};

static const struct status_name status_names[] = {
	{ 0x000, 0, "Successful Completion" },
	{ 0x001, EOPNOTSUPP, "Invalid Command Opcode" },
	{ 0x002, EINVAL, "Invalid Field in Command" },
	{ 0x003, EIO, "Command ID Conflict" },
	{ 0x004, EIO, "Data Transfer Error" },
	{ 0x005, EIO, "Commands Aborted due to Power Loss Notification" },
	{ 0x006, EIO, "Internal Error" },
	{ 0x007, ECANCELED, "Command Abort Requested" },
	{ 0x008, ECANCELED, "Command Aborted due to SQ Deletion" },
	{ 0x009, EIO, "Command Aborted due to Failed Fused Command" },
	{ 0x00a, EIO, "Command Aborted due to Missing Fused Command" },
	{ 0x00b, ENODEV, "Invalid Namespace or Format" },
	{ 0x00c, EIO, "Command Sequence Error" },
	{ 0x00d, EINVAL, "Invalid SGL Segment Descriptor" },
	{ 0x00e, EINVAL, "Invalid Number of SGL Descriptors" },
	{ 0x00f, EINVAL, "Data SGL Length Invalid" },
	{ 0x010, EINVAL, "Metadata SGL Length Invalid" },
	{ 0x011, EINVAL, "SGL Descriptor Type Invalid" },
	{ 0x015, EINVAL, "Invalid PRP Offset" },
	{ 0x01a, ENODEV, "Namespace is Write Protected" },
	{ 0x01c, EIO, "Transient Transport Error" },
	{ 0x080, ERANGE, "LBA Out of Range" },
	{ 0x081, ENOSPC, "Capacity Exceeded" },
	{ 0x082, EAGAIN, "Namespace Not Ready" },
	{ 0x083, EBADE, "Reservation Conflict" },
	{ 0x084, EAGAIN, "Format In Progress" },
	{ 0x180, EINVAL, "Conflicting Attributes" },
	{ 0x181, EINVAL, "Invalid Protection Information" },
	{ 0x182, EROFS, "Attempted Write to Read Only Range" },
	{ 0x183, EINVAL, "Command Size Limit Exceeded" },
	{ 0x280, EIO, "Write Fault" },
	{ 0x281, EIO, "Unrecovered Read Error" },
	{ 0x282, EILSEQ, "End-to-end Guard Check Error" },
	{ 0x283, EILSEQ, "End-to-end Application Tag Check Error" },
	{ 0x284, EILSEQ, "End-to-end Reference Tag Check Error" },
	{ 0x285, EIO, "Compare Failure" },
	{ 0x286, EACCES, "Access Denied" },
	{ 0x287, EIO, "Deallocated or Unwritten Logical Block" },
	{ 0x300, EIO, "Internal Path Error" },
	{ 0x301, EIO, "Asymmetric Access Persistent Loss" },
	{ 0x302, EAGAIN, "Asymmetric Access Inaccessible" },
	{ 0x303, EAGAIN, "Asymmetric Access Transition" },
	{ 0x360, EIO, "Controller Pathing Error" },
	{ 0x370, EIO, "Host Pathing Error" },
	{ 0x371, ECANCELED, "Command Aborted By Host" },
};

static const struct status_name *status_find(uint32_t status)
{
	size_t i;

	for (i = 0; i < sizeof(status_names) / sizeof(status_names[0]); i++)
		if (status_names[i].code == (status & 0x7ff))
			return &status_names[i];
	return NULL;
}

PHX_EXPORT const char *phx_nvme_status_str(uint32_t status)
{
	const struct status_name *s = status_find(status);

	if (s)
		return s->text;
	switch ((status >> 8) & 7) {
	case 0: return "Generic Command Status (unknown code)";
	case 1: return "Command Specific Status (unknown code)";
	case 2: return "Media and Data Integrity Error (unknown code)";
	case 3: return "Path Related Status (unknown code)";
	case 7: return "Vendor Specific Status";
	default: return "Reserved Status Code Type";
	}
}

int nvme_status_errno(uint32_t status)
{
	const struct status_name *s = status_find(status);

	return s && s->err ? -s->err : -EIO;
}

/* ------------------------------------------------------------------------ */
/* Naming: from a node's device number to the namespace's block device      */
/* ------------------------------------------------------------------------ */

/*
 * A namespace's char device can be reached through any node: a mknod under
 * another name, a symlink, a container's renamed device.  Its name says
 * nothing; its device number does.  /sys/dev/char/MAJ:MIN is the generic
 * char device's sysfs node, its "device" link is its parent (the controller
 * nvmeX; for a multipath head it should be the subsystem, not seen here),
 * and the namespace's block device is the parent's child in class "block"
 * whose "nsid" is the namespace's (seen in the guest on Debian's 6.12:
 * .../nvme/nvme0/{ng0n1,nvme0n1}, with ng0n1/device -> ../../nvme0; the
 * char device has no nsid of its own).
 */

/* Fill @why (if any) and return @err. */
static int because(char *why, size_t len, int err, const char *fmt, ...)
	__attribute__((format(printf, 4, 5)));

static int because(char *why, size_t len, int err, const char *fmt, ...)
{
	va_list ap;

	if (why && len) {
		va_start(ap, fmt);
		vsnprintf(why, len, fmt, ap);
		va_end(ap);
	}
	return err;
}

/* Sysfs attribute @dir/@attr into @buf, trailing newline cut; 0 or -errno. */
static int sysfs_read(const char *dir, const char *attr, char *buf, size_t len)
{
	char path[600];
	FILE *f;
	size_t n;

	snprintf(path, sizeof(path), "%s/%s", dir, attr);
	f = fopen(path, "r");
	if (!f)
		return -errno;
	n = fread(buf, 1, len - 1, f);
	fclose(f);
	buf[n] = 0;
	while (n && buf[n - 1] == '\n')
		buf[--n] = 0;
	return 0;
}

static bool sysfs_has(const char *dir, const char *attr)
{
	char path[600];

	snprintf(path, sizeof(path), "%s/%s", dir, attr);
	return !access(path, F_OK);
}

uint64_t nvme_sysfs_u64(const char *blk, const char *attr)
{
	char dir[80], buf[64];

	if (!blk[0])
		return 0;
	snprintf(dir, sizeof(dir), "/sys/block/%s", blk);
	if (sysfs_read(dir, attr, buf, sizeof(buf)))
		return 0;
	return strtoull(buf, NULL, 10);
}

/* Whether symlink @dir/@link ends in "/@want" (a sysfs class or bus). */
static bool link_is(const char *dir, const char *link, const char *want)
{
	char path[600], target[600];
	const char *base;
	ssize_t n;

	snprintf(path, sizeof(path), "%s/%s", dir, link);
	n = readlink(path, target, sizeof(target) - 1);
	if (n <= 0)
		return false;
	target[n] = 0;
	base = strrchr(target, '/');
	return !strcmp(base ? base + 1 : target, want);
}

/* "259:0" in @dir/dev as a dev_t; 0 or -errno. */
static int sysfs_devt(const char *dir, dev_t *devt)
{
	unsigned int ma, mi;
	char buf[32];
	int ret = sysfs_read(dir, "dev", buf, sizeof(buf));

	if (ret)
		return ret;
	if (sscanf(buf, "%u:%u", &ma, &mi) != 2)
		return -EINVAL;
	*devt = makedev(ma, mi);
	return 0;
}

static bool sysfs_is(const char *dir, const char *attr, unsigned long want)
{
	char buf[32];

	return !sysfs_read(dir, attr, buf, sizeof(buf)) &&
	       strtoul(buf, NULL, 10) == want;
}

/* @path given as a block device: it must be a whole, visible NVMe disk. */
static int block_itself(dev_t rdev, uint32_t nsid, struct nvme_blkdev *b,
			char *why, size_t len)
{
	char sys[64], real[600];
	const char *base;

	snprintf(sys, sizeof(sys), "/sys/dev/block/%u:%u", major(rdev), minor(rdev));
	if (!realpath(sys, real))
		return because(why, len, -ENODEV, "block device %u:%u is not in sysfs (%s)",
			       major(rdev), minor(rdev), sys);
	base = strrchr(real, '/') + 1;
	if (sysfs_has(sys, "partition"))
		return because(why, len, -ENOTTY, "block device %s (%u:%u) is a partition, "
			       "not a namespace", base, major(rdev), minor(rdev));
	if (!sysfs_is(sys, "nsid", nsid))
		return because(why, len, -ENODEV, "block device %u:%u has no nsid %u in sysfs",
			       major(rdev), minor(rdev), nsid);
	if (strlen(base) >= sizeof(b->name))
		return because(why, len, -ENAMETOOLONG, "block device name %s", base);
	snprintf(b->name, sizeof(b->name), "%s", base);
	b->devt = rdev;
	return 0;
}

/* @path given as the generic char device: its parent's disk with our nsid. */
static int block_of_char(dev_t rdev, uint32_t nsid, struct nvme_blkdev *b,
			 char *why, size_t len)
{
	char sys[64], parent[80], hidden[64] = "";
	struct dirent *de;
	DIR *d;
	int ret = -ENODEV;

	snprintf(sys, sizeof(sys), "/sys/dev/char/%u:%u", major(rdev), minor(rdev));
	if (access(sys, F_OK))
		return because(why, len, -ENODEV, "char device %u:%u is not in sysfs (%s: %s)",
			       major(rdev), minor(rdev), sys, strerror(errno));
	if (!link_is(sys, "subsystem", "nvme-generic"))
		return because(why, len, -ENOTTY, "char device %u:%u is not an NVMe generic "
			       "char device in sysfs (%s/subsystem is not nvme-generic)",
			       major(rdev), minor(rdev), sys);
	snprintf(parent, sizeof(parent), "%s/device", sys);
	d = opendir(parent);
	if (!d)
		return because(why, len, -ENODEV, "cannot list %s (%s)", parent,
			       strerror(errno));
	while ((de = readdir(d))) {
		char p[400];

		if (de->d_name[0] == '.' || strlen(de->d_name) >= sizeof(b->name))
			continue;
		snprintf(p, sizeof(p), "%s/%s", parent, de->d_name);
		if (!link_is(p, "subsystem", "block") || !sysfs_is(p, "nsid", nsid))
			continue;
		if (sysfs_is(p, "hidden", 1)) {	/* a path of a multipath namespace */
			snprintf(hidden, sizeof(hidden), "%s", de->d_name);
			continue;
		}
		if (sysfs_devt(p, &b->devt))
			continue;
		snprintf(b->name, sizeof(b->name), "%s", de->d_name);
		ret = 0;
		break;
	}
	closedir(d);
	if (ret && hidden[0])
		return because(why, len, -ENODEV, "namespace %u's only block device here is %s, "
			       "a hidden path of a multipath namespace: use the namespace's "
			       "head (/dev/ngXnY of the subsystem)", nsid, hidden);
	if (ret)
		return because(why, len, -ENODEV, "no block device with nsid %u under %s "
			       "(char device %u:%u)", nsid, parent, major(rdev), minor(rdev));
	return 0;
}

int nvme_find_block(int fd, uint32_t nsid, struct nvme_blkdev *b, char *why,
		    size_t len)
{
	struct stat st;

	memset(b, 0, sizeof(*b));
	if (fstat(fd, &st))
		return because(why, len, -errno, "fstat: %s", strerror(errno));
	if (S_ISBLK(st.st_mode))
		return block_itself(st.st_rdev, nsid, b, why, len);
	if (S_ISCHR(st.st_mode))
		return block_of_char(st.st_rdev, nsid, b, why, len);
	return because(why, len, -ENOTTY, "not a device node");
}

/*
 * The /dev node of @b: the DEVNAME its uevent names, accepted only if that
 * node is a block device with @b's number (never a node picked by name).
 */
static int block_node(const struct nvme_blkdev *b, char *node, size_t len,
		      char *why, size_t wlen)
{
	char sys[64], ev[512], *name;
	struct stat st;

	snprintf(sys, sizeof(sys), "/sys/dev/block/%u:%u", major(b->devt), minor(b->devt));
	if (sysfs_read(sys, "uevent", ev, sizeof(ev)) < 0)
		return because(why, wlen, -ENODEV, "%s/uevent cannot be read", sys);
	name = !strncmp(ev, "DEVNAME=", 8) ? ev : strstr(ev, "\nDEVNAME=");
	if (name && *name == '\n')
		name++;
	if (!name)
		return because(why, wlen, -ENODEV, "%s/uevent has no DEVNAME", sys);
	name += 8;
	name[strcspn(name, "\n")] = 0;
	snprintf(node, len, "/dev/%s", name);
	if (stat(node, &st))
		return because(why, wlen, -errno, "no device node %s for block device %s "
			       "(%u:%u)", node, b->name, major(b->devt), minor(b->devt));
	if (!S_ISBLK(st.st_mode) || st.st_rdev != b->devt)
		return because(why, wlen, -ENOENT, "%s is not block device %s (%u:%u): it is "
			       "%s %u:%u", node, b->name, major(b->devt), minor(b->devt),
			       S_ISBLK(st.st_mode) ? "block device" : "not even a block device",
			       major(st.st_rdev), minor(st.st_rdev));
	return 0;
}

/* ------------------------------------------------------------------------ */
/* Safety checks                                                            */
/* ------------------------------------------------------------------------ */

#define MAX_DEVS 65	/* the disk and up to 64 partitions */

/* Refuse a partitioned disk; add its partitions' numbers to @devs. */
static int check_partitions(const char *sys, const char *what, dev_t *devs,
			    int *ndevs)
{
	char first[256] = "";
	struct dirent *de;
	int found = 0;
	DIR *d = opendir(sys);

	if (!d)
		return phx_err(-ENODEV, "%s: cannot list %s; refusing to claim it (force to "
			       "override)", what, sys);
	while ((de = readdir(d))) {
		char p[400];

		if (de->d_name[0] == '.')
			continue;
		snprintf(p, sizeof(p), "%s/%s", sys, de->d_name);
		if (!sysfs_has(p, "partition"))
			continue;
		if (!found++)
			snprintf(first, sizeof(first), "%s", de->d_name);
		if (*ndevs < MAX_DEVS && !sysfs_devt(p, &devs[*ndevs]))
			(*ndevs)++;
	}
	closedir(d);
	if (found)
		return phx_err(-EBUSY, "%s has %d partition(s) (%s ...): it is in use by a "
			       "partition table; refusing to write it (force to override)",
			       what, found, first);
	return 0;
}

static int check_holders(const char *sys, const char *what)
{
	char path[128];
	struct dirent *de;
	DIR *d;

	snprintf(path, sizeof(path), "%s/holders", sys);
	d = opendir(path);
	if (!d)
		return 0;
	while ((de = readdir(d))) {
		if (de->d_name[0] == '.')
			continue;
		closedir(d);
		return phx_err(-EBUSY, "%s is held by %s (device mapper, md or similar); "
			       "refusing to write it (force to override)", what, de->d_name);
	}
	closedir(d);
	return 0;
}

static bool devt_in(dev_t dev, const dev_t *devs, int ndevs)
{
	int i;

	for (i = 0; i < ndevs; i++)
		if (devs[i] == dev)
			return true;
	return false;
}

/* Mounted here (by device number: any name), or swap. */
static int check_mounts(const char *what, const dev_t *devs, int ndevs)
{
	char line[4096];
	FILE *f = fopen("/proc/self/mountinfo", "r");

	if (f) {
		while (fgets(line, sizeof(line), f)) {
			unsigned int ma, mi;
			char mnt[2048];

			/* id parent maj:min root mountpoint ... */
			if (sscanf(line, "%*s %*s %u:%u %*s %2047s", &ma, &mi, mnt) != 3 ||
			    !devt_in(makedev(ma, mi), devs, ndevs))
				continue;
			fclose(f);
			return phx_err(-EBUSY, "%s (%u:%u) is mounted at %s; refusing to write "
				       "it (unmount it first)", what, ma, mi, mnt);
		}
		fclose(f);
	}
	f = fopen("/proc/swaps", "r");
	if (!f)
		return 0;
	while (fgets(line, sizeof(line), f)) {
		char name[256];
		struct stat st;

		if (sscanf(line, "%255s", name) != 1 || stat(name, &st) ||
		    !S_ISBLK(st.st_mode) || !devt_in(st.st_rdev, devs, ndevs))
			continue;
		fclose(f);
		return phx_err(-EBUSY, "%s is in use as swap (%s)", what, name);
	}
	fclose(f);
	return 0;
}

static const char *claim_hint(int err)
{
	switch (err) {
	case EBUSY:
		return " (it is mounted, possibly in another mount namespace, or claimed by "
		       "a driver or another process)";
	case EACCES:
	case EPERM:
		return " (this process may open the char device but not the block device: "
		       "give it access to the block device too)";
	default:
		return "";
	}
}

/*
 * Open the block device with O_EXCL: it fails while anything has it
 * mounted or claimed, in any mount namespace, and once it succeeds nothing
 * can mount (or mkfs) it until the fd is closed.  Any failure refuses.
 */
static int claim_block(const char *node, dev_t devt, const char *what, int *claim)
{
	struct stat st;
	int fd, err;

	fd = open(node, O_RDONLY | O_EXCL | O_CLOEXEC);
	if (fd < 0) {
		err = errno;
		return phx_err(-err, "%s: cannot claim it exclusively (open with O_EXCL)%s; "
			       "refusing to write the namespace (force to override)", what,
			       claim_hint(err));
	}
	if (fstat(fd, &st) || !S_ISBLK(st.st_mode) || st.st_rdev != devt) {
		close(fd);
		return phx_err(-ENOENT, "%s was replaced by another node while being claimed; "
			       "refusing to write the namespace (force to override)", what);
	}
	*claim = fd;
	return 0;
}

#ifdef PHX_HAVE_BLKID
/* "ext4 at byte 1080" into @out (appended, comma separated). */
static void describe(blkid_probe pr, char *out, size_t len)
{
	const char *type = NULL, *off = NULL, *kind = "";
	size_t n = strlen(out);

	if (!blkid_probe_lookup_value(pr, "TYPE", &type, NULL)) {
		blkid_probe_lookup_value(pr, "SBMAGIC_OFFSET", &off, NULL);
	} else if (!blkid_probe_lookup_value(pr, "PTTYPE", &type, NULL)) {
		blkid_probe_lookup_value(pr, "PTMAGIC_OFFSET", &off, NULL);
		kind = " partition table";
	}
	if (n + 2 >= len)
		return;
	snprintf(out + n, len - n, "%s%s%s%s%s", n ? ", " : "", type ? type : "a signature",
		 kind, off ? " at byte " : "", off ? off : "");
}

/*
 * Every signature libblkid knows (filesystems, RAID and LVM members, LUKS,
 * swap, partition tables: the superblocks and partitions chains), each
 * probing function in turn, with bad checksums accepted: a damaged
 * superblock still says someone else's data lives here.
 */
static int check_signatures(int bfd, const char *what)
{
	char found[200] = "";
	blkid_probe pr;
	int rc, count = 0, ret = 0;

	/*
	 * libblkid reads through the block device's page cache, which NVMe
	 * passthrough writes (ours, nvme-cli's) do not update: drop what is
	 * cached (clean pages; nothing else can have it open O_EXCL) so that
	 * it reads the namespace itself.
	 */
	posix_fadvise(bfd, 0, 0, POSIX_FADV_DONTNEED);
	pr = blkid_new_probe();
	if (!pr)
		return phx_err(-ENOMEM, "%s: libblkid: cannot allocate a probe", what);
	if (blkid_probe_set_device(pr, bfd, 0, 0)) {
		ret = phx_err(-EIO, "%s: libblkid cannot probe it, so it cannot be checked for "
			      "signatures; refusing (force to override)", what);
		goto out;
	}
	blkid_probe_enable_superblocks(pr, 1);
	blkid_probe_set_superblocks_flags(pr, BLKID_SUBLKS_TYPE | BLKID_SUBLKS_USAGE |
					  BLKID_SUBLKS_MAGIC | BLKID_SUBLKS_BADCSUM);
	blkid_probe_enable_partitions(pr, 1);
	blkid_probe_set_partitions_flags(pr, BLKID_PARTS_FORCE_GPT | BLKID_PARTS_MAGIC);
	while ((rc = blkid_do_probe(pr)) == 0) {
		describe(pr, found, sizeof(found));
		count++;
	}
	if (rc < 0)
		ret = phx_err(-EIO, "%s: libblkid failed while looking for signatures; "
			      "refusing (force to override)", what);
	else if (count)
		ret = phx_err(-EEXIST, "%s holds %s (libblkid); refusing to write it (force to "
			      "override, or wipe it first)", what, found);
out:
	blkid_free_probe(pr);
	posix_fadvise(bfd, 0, 0, POSIX_FADV_DONTNEED);	/* leave no stale pages behind */
	return ret;
}
#else
static int check_signatures(int bfd, const char *what)
{
	return phx_err(-ENOSYS, "%s: libphx was built without libblkid: cannot check "
		       "signatures; refusing (pass force, or rebuild with libblkid-dev)", what);
}
#endif

int nvme_safety_check(int fd, uint32_t nsid, const char *path, int *claim)
{
	struct nvme_blkdev b;
	char why[320], node[300], what[640], sys[64];
	dev_t devs[MAX_DEVS];
	int ndevs = 1, ret;

	*claim = -1;
	ret = nvme_find_block(fd, nsid, &b, why, sizeof(why));
	if (ret)
		return phx_err(ret, "%s: cannot find the namespace's block device (%s), so "
			       "cannot tell whether it is in use; refusing to claim it (force to "
			       "override)", path, why);
	ret = block_node(&b, node, sizeof(node), why, sizeof(why));
	if (ret)
		return phx_err(ret, "%s: %s, so the namespace cannot be claimed exclusively; "
			       "refusing (force to override)", path, why);
	if (strcmp(node, path))
		snprintf(what, sizeof(what), "%s (the block device of %s)", node, path);
	else
		snprintf(what, sizeof(what), "%s", node);
	snprintf(sys, sizeof(sys), "/sys/dev/block/%u:%u", major(b.devt), minor(b.devt));
	devs[0] = b.devt;
	ret = check_partitions(sys, what, devs, &ndevs);
	if (!ret)
		ret = check_mounts(what, devs, ndevs);
	if (!ret)
		ret = check_holders(sys, what);
	if (!ret)
		ret = claim_block(node, b.devt, what, claim);
	if (!ret)
		ret = check_signatures(*claim, what);
	if (ret && *claim >= 0) {
		close(*claim);
		*claim = -1;
	}
	return ret;
}
