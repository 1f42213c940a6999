// SPDX-License-Identifier: Apache-2.0
/*
 * cuda_numa.c - where a context's staging memory lives: on the
 * NUMA node its GPU hangs off (PCI bus id -> sysfs numa_node -> mbind).
 */
#include <errno.h>
#include <fcntl.h>
#include <linux/mempolicy.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "cuda_internal.h"

/* ------------------------------------------------------------------------ */
/* Staging placement: the GPU's NUMA node                                   */
/* ------------------------------------------------------------------------ */

/*
 * Staging is written by the file side (NVMe DMA, or the page cache copy)
 * and read by the GPU's copy engine over PCIe.  On a machine of several
 * NUMA nodes, memory on the node the GPU hangs off keeps that traffic off
 * the inter-socket link, and with one context per GPU of a host each
 * context's staging should sit by its own GPU.  So the region is bound to
 * that node before the lanes fault it in (a policy only steers pages not
 * yet faulted).  MPOL_PREFERRED, not MPOL_BIND: a full node then costs
 * bandwidth, never the context.  All of it is best effort: no
 * cuDeviceGetPCIBusId, no sysfs file, firmware that does not say (-1),
 * one node only, or a refused mbind leave
 * the staging where the kernel puts it; phx_cuda_staging_node() says -1 and
 * PHX_CUDA_TRACE=1 prints why.  libnuma is not needed for one syscall.
 */
#define NODE_BITS 1024u		/* the mask mbind reads: the kernel's MAX_NUMNODES at most */

/*
 * The sysfs mount.  PHX_TEST_SYSFS_ROOT is a TEST HOOK, nothing else: the
 * fake-libcuda tests point it at a tree of their own to fake NUMA machines.
 */
static const char *sysfs_root(void)
{
	const char *v = getenv("PHX_TEST_SYSFS_ROOT");

	return v && *v ? v : "/sys";
}

/*
 * A bus id as CUDA spells it ("0000:1B:00.0"; some drivers give an 8-digit
 * domain) into sysfs's name (lower-case, 4-digit domain: "0000:1b:00.0").
 */
int cu_pci_sysfs_name(const char *bus_id, char *out, size_t len)
{
	unsigned int dom, bus, dev, fn;
	char extra;
	int n;

	/* hex digits and separators only: sscanf's %x would take "0x" too */
	if (bus_id[strspn(bus_id, "0123456789abcdefABCDEF:.")] ||
	    sscanf(bus_id, "%x:%x:%x.%x%c", &dom, &bus, &dev, &fn, &extra) != 4 ||
	    bus > 0xff || dev > 0x1f || fn > 7)
		return -EINVAL;
	n = snprintf(out, len, "%04x:%02x:%02x.%x", dom, bus, dev, fn);
	return n > 0 && (size_t)n < len ? 0 : -ENAMETOOLONG;
}

/* The number of nodes in a sysfs node list ("0", "0-1", "0,2-3"), or -EINVAL. */
int cu_node_list_count(const char *list)
{
	const char *p = list;
	int count = 0;

	while (*p && *p != '\n') {
		char *end;
		long lo = strtol(p, &end, 10), hi = lo;

		if (end == p || lo < 0)
			return -EINVAL;
		p = end;
		if (*p == '-') {
			hi = strtol(p + 1, &end, 10);
			if (end == p + 1 || hi < lo)
				return -EINVAL;
			p = end;
		}
		count += (int)(hi - lo + 1);
		if (*p == ',')
			p++;
		else if (*p && *p != '\n')
			return -EINVAL;
	}
	return count ? count : -EINVAL;
}

/* The first line of <root>/<rel> into @buf: 0, or -errno. */
static int sysfs_read(const char *root, const char *rel, char *buf, size_t len)
{
	char path[512];
	ssize_t n;
	int fd, err;

	if (snprintf(path, sizeof(path), "%s/%s", root, rel) >= (int)sizeof(path))
		return -ENAMETOOLONG;
	fd = open(path, O_RDONLY | O_CLOEXEC);
	if (fd < 0)
		return -errno;
	n = read(fd, buf, len - 1);
	err = n < 0 ? -errno : 0;
	close(fd);
	if (err)
		return err;
	buf[n] = 0;
	return 0;
}

/* @dev's NUMA node as sysfs has it (-1: the firmware does not say); 0 or -errno. */
static int device_node(const struct cu_driver *d, CUdevice dev, int *node)
{
	char id[64], name[64], rel[128], val[32], *end;
	long v;
	int ret;

	*node = -1;
	if (!d->DeviceGetPCIBusId)
		return -ENOSYS;
	if (d->DeviceGetPCIBusId(id, sizeof(id), dev) != CUDA_SUCCESS)
		return -EIO;
	id[sizeof(id) - 1] = 0;
	ret = cu_pci_sysfs_name(id, name, sizeof(name));
	if (ret)
		return ret;
	snprintf(rel, sizeof(rel), "bus/pci/devices/%s/numa_node", name);
	ret = sysfs_read(sysfs_root(), rel, val, sizeof(val));
	if (ret)
		return ret;
	v = strtol(val, &end, 10);
	if (end == val || (*end && *end != '\n') || v < -1 || v >= (long)NODE_BITS - 1)
		return -EINVAL;
	*node = (int)v;
	return 0;
}

/* Bind the (not yet faulted) staging region to the GPU's node: 0 or -errno. */
static int staging_bind_try(phx_cuda *c)
{
	unsigned long mask[NODE_BITS / (8 * sizeof(unsigned long))] = { 0 };
	char list[256];
	int node, nodes, ret;

	ret = device_node(c->d, c->dev, &node);
	if (ret)
		return ret;
	if (node < 0)
		return -ENOENT;
	ret = sysfs_read(sysfs_root(), "devices/system/node/online", list, sizeof(list));
	if (ret)
		return ret;
	nodes = cu_node_list_count(list);
	if (nodes < 0)
		return nodes;
	if (nodes < 2)
		return -EDOM;	/* one node: nothing to choose, leave the default */
	mask[node / (8 * sizeof(unsigned long))] |= 1UL << (node % (8 * sizeof(unsigned long)));
	if (syscall(SYS_mbind, c->stage, c->stage_len, MPOL_PREFERRED, mask, NODE_BITS, 0))
		return -errno;
	c->stage_node = node;
	return 0;
}

/* The sysfs reads and mbind fail routinely (no file, one node): keep errno. */
int cu_staging_bind(phx_cuda *c)
{
	int saved = errno, ret = staging_bind_try(c);

	errno = saved;
	return ret;
}

CU_EXPORT int phx_cuda_staging_node(const phx_cuda *c)
{
	return c->stage_node;
}

CU_EXPORT int phx_cuda_device_numa_node(int device, int *node)
{
	const struct cu_driver *d = cu_driver();
	int saved = errno;
	CUdevice dev;
	CUresult r;

	if (!node)
		return cu_err(-EINVAL, "phx_cuda_device_numa_node: NULL argument");
	*node = -1;
	if (!d)
		return -ENODEV;
	if (device < 0 || device >= d->ndev)
		return cu_err(-ENODEV, "CUDA device %d does not exist (%d present)",
			      device, d->ndev);
	r = d->DeviceGet(&dev, device);
	if (r != CUDA_SUCCESS)
		return cu_fail(d, r, "cuDeviceGet");
	device_node(d, dev, node);	/* unknown is an answer: -1 */
	errno = saved;
	return 0;
}
