// SPDX-License-Identifier: Apache-2.0
/*
 * nvme_safety.c - what makes a namespace safe to claim, and what NVMe
 * status codes mean.
 *
 * A namespace is refused (unless forced) when its block device is mounted
 * (here: /proc/self/mountinfo; anywhere: an O_EXCL open fails), used as
 * swap, held by another driver (holders/), partitioned, or when its first
 * blocks carry a signature some other software wrote.  The signatures are
 * read with synchronous NVMe Read passthrough on the char device itself, so
 * the check works without the block device and without the page cache.
 */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <unistd.h>
#include <linux/nvme_ioctl.h>

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
/* Naming                                                                   */
/* ------------------------------------------------------------------------ */

/* "ng0n1" -> "nvme0n1" when /sys/block/nvme0n1 exists; "" otherwise. */
void nvme_block_name(const char *path, char *blk, size_t len)
{
	char real[4096], sys[320];
	const char *base;

	blk[0] = 0;
	if (!realpath(path, real))
		snprintf(real, sizeof(real), "%s", path);
	base = strrchr(real, '/');
	base = base ? base + 1 : real;
	if (strncmp(base, "ng", 2) || strlen(base) + 3 >= len)
		return;
	snprintf(sys, sizeof(sys), "/sys/block/nvme%s", base + 2);
	if (access(sys, F_OK) == 0)
		snprintf(blk, len, "nvme%s", base + 2);
}

static int read_sysfs_str(const char *path, char *buf, size_t len)
{
	FILE *f = fopen(path, "r");
	size_t n;

	if (!f)
		return -1;
	n = fread(buf, 1, len - 1, f);
	fclose(f);
	buf[n] = 0;
	while (n && (buf[n - 1] == '\n' || buf[n - 1] == ' '))
		buf[--n] = 0;
	return 0;
}

uint64_t nvme_sysfs_u64(const char *blk, const char *attr)
{
	char path[256], buf[64];

	if (!blk[0])
		return 0;
	snprintf(path, sizeof(path), "/sys/block/%s/%s", blk, attr);
	if (read_sysfs_str(path, buf, sizeof(buf)))
		return 0;
	return strtoull(buf, NULL, 10);
}

/* ------------------------------------------------------------------------ */
/* Safety checks                                                            */
/* ------------------------------------------------------------------------ */

/* The partitions of @blk ("nvme0n1p1" ...) as a list of "maj:min" too. */
static int check_partitions(const char *blk, char devs[][24], int *ndevs,
			    int maxdevs)
{
	char path[256];
	struct dirent *de;
	size_t bl = strlen(blk);
	DIR *d;
	int found = 0;
	char first[260] = "";

	snprintf(path, sizeof(path), "/sys/block/%s", blk);
	d = opendir(path);
	if (!d)
		return 0;
	while ((de = readdir(d))) {
		char p2[600];

		if (strncmp(de->d_name, blk, bl) || de->d_name[bl] != 'p')
			continue;
		if (!found)
			snprintf(first, sizeof(first), "%s", de->d_name);
		found++;
		snprintf(p2, sizeof(p2), "/sys/block/%s/%s/dev", blk, de->d_name);
		if (*ndevs < maxdevs && !read_sysfs_str(p2, devs[*ndevs], 24))
			(*ndevs)++;
	}
	closedir(d);
	if (found)
		return phx_err(-EBUSY,
			       "%s has %d partition(s) (%s ...): it is in use by a partition table; "
			       "refusing to write it (force to override)", blk, found, first);
	return 0;
}

static int check_holders(const char *blk)
{
	char path[256];
	struct dirent *de;
	DIR *d;

	snprintf(path, sizeof(path), "/sys/block/%s/holders", blk);
	d = opendir(path);
	if (!d)
		return 0;
	while ((de = readdir(d))) {
		if (de->d_name[0] == '.')
			continue;
		closedir(d);
		return phx_err(-EBUSY,
			       "%s is held by %s (device mapper, md or similar); "
			       "refusing to write it (force to override)", blk, de->d_name);
	}
	closedir(d);
	return 0;
}

static int check_mounts(const char *blk, char devs[][24], int ndevs)
{
	char line[4096];
	FILE *f = fopen("/proc/self/mountinfo", "r");
	int i;

	if (!f)
		return 0;
	while (fgets(line, sizeof(line), f)) {
		char majmin[32], mnt[2048];

		/* id parent maj:min root mountpoint ... */
		if (sscanf(line, "%*s %*s %31s %*s %2047s", majmin, mnt) != 2)
			continue;
		for (i = 0; i < ndevs; i++) {
			if (strcmp(majmin, devs[i]))
				continue;
			fclose(f);
			return phx_err(-EBUSY,
				       "%s (%s) is mounted at %s; refusing to write it "
				       "(unmount it first)", blk, majmin, mnt);
		}
	}
	fclose(f);
	f = fopen("/proc/swaps", "r");
	if (!f)
		return 0;
	while (fgets(line, sizeof(line), f)) {
		char name[256];

		if (sscanf(line, "%255s", name) == 1 && !strncmp(name, "/dev/", 5) &&
		    !strncmp(name + 5, blk, strlen(blk))) {
			fclose(f);
			return phx_err(-EBUSY, "%s is in use as swap (%s)", blk, name);
		}
	}
	fclose(f);
	return 0;
}

/*
 * Open the block device with O_EXCL: fails with EBUSY while anything has it
 * mounted or claimed, in any mount namespace.  Returns the fd (kept by
 * phx_nvme_open() so nobody mounts it meanwhile), -1 if there is no device
 * node, or -EBUSY.
 */
int nvme_claim_block(const char *blk)
{
	char path[64];
	int fd;

	if (!blk[0])
		return -1;
	snprintf(path, sizeof(path), "/dev/%s", blk);
	fd = open(path, O_RDONLY | O_EXCL | O_CLOEXEC);
	if (fd >= 0)
		return fd;
	if (errno == EBUSY)
		return phx_err(-EBUSY,
			       "%s is in exclusive use (mounted, possibly in another mount "
			       "namespace, or claimed by a driver); refusing to write it", path);
	return -1;
}

/* Synchronous NVMe Read of [off, off + len) bytes (LBA aligned) via ioctl. */
static int sync_read(int fd, uint32_t nsid, uint32_t lba_size, uint64_t off,
		     uint32_t len, void *buf)
{
	struct nvme_passthru_cmd64 c;
	uint64_t slba = off / lba_size;
	int ret;

	memset(&c, 0, sizeof(c));
	c.opcode = 0x02;
	c.nsid = nsid;
	c.addr = (uintptr_t)buf;
	c.data_len = len;
	c.cdw10 = (uint32_t)slba;
	c.cdw11 = (uint32_t)(slba >> 32);
	c.cdw12 = len / lba_size - 1;
	ret = ioctl(fd, NVME_IOCTL_IO64_CMD, &c);
	if (ret < 0)
		return -errno;
	if (ret > 0)
		return nvme_status_errno(ret);
	return 0;
}

struct sig {
	uint32_t off;
	const char *magic;
	uint32_t len;
	const char *name;
};

static const struct sig sigs[] = {
	{ 512, "EFI PART", 8, "a GPT partition table" },
	{ 4096, "EFI PART", 8, "a GPT partition table" },
	{ 0, "XFSB", 4, "an xfs filesystem" },
	{ 1080, "\x53\xef", 2, "an ext2/3/4 filesystem" },
	{ 1024, "\x10\x20\xf5\xf2", 4, "an f2fs filesystem" },
	{ 65600, "_BHRfS_M", 8, "a btrfs filesystem" },
	{ 4086, "SWAPSPACE2", 10, "a swap area" },
	{ 4086, "SWAP-SPACE", 10, "a swap area" },
	{ 0, "LUKS\xba\xbe", 6, "a LUKS header" },
	{ 0, "SKUL\xba\xbe", 6, "a LUKS2 secondary header" },
	{ 512, "LABELONE", 8, "an LVM2 physical volume" },
	{ 0, "LABELONE", 8, "an LVM2 physical volume" },
	{ 32769, "CD001", 5, "an ISO 9660 filesystem" },
	{ 3, "NTFS    ", 8, "an NTFS filesystem" },
	{ 54, "FAT1", 4, "a FAT filesystem" },
	{ 82, "FAT32   ", 8, "a FAT filesystem" },
	{ 0, "phx-nvme", 0, NULL },
};

/* An MBR: boot signature and four plausible partition entries, one in use. */
static int looks_like_mbr(const uint8_t *b)
{
	int i, used = 0;

	if (b[510] != 0x55 || b[511] != 0xaa)
		return 0;
	for (i = 0; i < 4; i++) {
		const uint8_t *e = b + 446 + 16 * i;

		if (e[0] != 0 && e[0] != 0x80)
			return 0;
		if (e[4])
			used++;
	}
	return used > 0;
}

static int check_signatures(int fd, uint32_t nsid, uint32_t lba_size,
			    uint64_t capacity, const char *what)
{
	/* the places signatures live: [0, 8K), [32K, 36K), [64K, 68K) */
	static const uint32_t windows[] = { 0, 32768, 65536 };
	uint32_t unit = lba_size > 8192 ? lba_size : 8192;
	uint8_t *buf;
	size_t w, s;
	int ret = 0;

	if (posix_memalign((void **)&buf, 4096, unit))
		return phx_err(-ENOMEM, "out of memory");
	for (w = 0; w < 3; w++) {
		uint64_t start = windows[w] / lba_size * lba_size;

		if (start + unit > capacity)
			break;
		memset(buf, 0, unit);
		ret = sync_read(fd, nsid, lba_size, start, unit, buf);
		if (ret < 0) {
			phx_err(ret, "%s: reading LBAs at byte %llu to look for signatures",
				what, (unsigned long long)start);
			break;
		}
		if (w == 0 && looks_like_mbr(buf)) {
			ret = phx_err(-EEXIST,
				      "%s holds a DOS/MBR partition table (boot signature 55aa at "
				      "byte 510); refusing to write it (force to override)", what);
			break;
		}
		for (s = 0; sigs[s].name; s++) {
			uint64_t o = sigs[s].off;

			if (o < start || o + sigs[s].len > start + unit)
				continue;
			if (memcmp(buf + (o - start), sigs[s].magic, sigs[s].len))
				continue;
			ret = phx_err(-EEXIST,
				      "%s holds %s (signature at byte %llu); refusing to write "
				      "it (force to override, or wipe it first)", what,
				      sigs[s].name, (unsigned long long)o);
			goto out;
		}
	}
out:
	free(buf);
	return ret;
}

/*
 * All checks on an open char device @fd (namespace @nsid, block device @blk
 * or ""), in the order of the cheapest certain answer.  On success returns
 * the O_EXCL fd of the block device (or -1 when there is none) in *claim.
 */
int nvme_safety_check(int fd, uint32_t nsid, uint32_t lba_size,
		      uint64_t capacity, const char *path, const char *blk,
		      int *claim)
{
	char devs[65][24];
	int ndevs = 0, ret;
	const char *what = blk[0] ? blk : path;

	*claim = -1;
	if (blk[0]) {
		char p[256];

		snprintf(p, sizeof(p), "/sys/block/%s/dev", blk);
		if (!read_sysfs_str(p, devs[0], sizeof(devs[0])))
			ndevs = 1;
		ret = check_partitions(blk, devs + ndevs, &ndevs, 64);
		if (!ret)
			ret = check_mounts(blk, devs, ndevs);
		if (ret)
			return ret;
		ret = check_holders(blk);
		if (ret)
			return ret;
		ret = nvme_claim_block(blk);
		if (ret < -1)
			return ret;
		*claim = ret;
	}
	ret = check_signatures(fd, nsid, lba_size, capacity, what);
	if (ret < 0 && *claim >= 0) {
		close(*claim);
		*claim = -1;
	}
	return ret;
}
