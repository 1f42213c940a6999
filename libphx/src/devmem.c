// SPDX-License-Identifier: Apache-2.0
/*
 * devmem.c - device memory mapped through /dev/phx (kernel/): register a
 * range with the module, mmap it, hand out the address.  Each mapping owns
 * its own /dev/phx descriptor, so closing it releases everything even if
 * the caller forgets to unregister.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <unistd.h>

#include "internal.h"
#include "phx_uapi.h"

struct phx_devmem {
	int fd;
	uint32_t handle;
	void *map;		/* the whole registered range */
	uint64_t map_len;
	uint64_t skip;		/* caller's range starts this far into it */
	uint64_t length;
	uint32_t mode;
	uint32_t status;
};

static int devmem_open(int *fd_out)
{
	struct phx_info info;
	int fd = open(PHX_DEVICE_PATH, O_RDWR | O_CLOEXEC);

	if (fd < 0) {
		int err = -errno;

		return phx_err(err, "%s: %s", PHX_DEVICE_PATH,
			       err == -ENOENT ? "phx.ko is not loaded (make insmod)" :
			       err == -EACCES ? "no permission (the device is mode 0660: join its group)" :
			       "cannot open");
	}
	memset(&info, 0, sizeof(info));
	info.abi_version = PHX_ABI_VERSION;
	if (ioctl(fd, PHX_IOC_INFO, &info)) {
		int err = -errno;

		close(fd);
		return phx_err(err, "%s: PHX_IOC_INFO failed (module ABI %u expected)",
			       PHX_DEVICE_PATH, PHX_ABI_VERSION);
	}
	*fd_out = fd;
	return 0;
}

PHX_EXPORT int phx_devmem_probe(void)
{
	int fd, saved = errno, ret = devmem_open(&fd);

	if (!ret)
		close(fd);
	errno = saved;
	return ret;
}

static int devmem_map(struct phx_register *reg, uint64_t skip, uint64_t length,
		      phx_devmem **out)
{
	struct phx_unregister unreg;
	phx_devmem *m;
	int fd, ret;

	ret = devmem_open(&fd);
	if (ret)
		return ret;
	m = calloc(1, sizeof(*m));
	if (!m) {
		ret = phx_err(-ENOMEM, "out of memory");
		goto err_close;
	}
	reg->abi_version = PHX_ABI_VERSION;
	if (ioctl(fd, PHX_IOC_REGISTER, reg)) {
		ret = phx_err(-errno, "%s: registering %llu bytes", PHX_DEVICE_PATH,
			      (unsigned long long)reg->length);
		goto err_free;
	}
	m->map = mmap(NULL, reg->length, PROT_READ | PROT_WRITE, MAP_SHARED, fd,
		      (off_t)reg->mmap_offset);
	if (m->map == MAP_FAILED) {
		ret = phx_err(-errno, "%s: mmap of %llu bytes", PHX_DEVICE_PATH,
			      (unsigned long long)reg->length);
		goto err_unregister;
	}
	m->fd = fd;
	m->handle = reg->handle;
	m->map_len = reg->length;
	m->skip = skip;
	m->length = length;
	m->mode = reg->mode;
	m->status = reg->status;
	*out = m;
	return 0;

err_unregister:
	memset(&unreg, 0, sizeof(unreg));
	unreg.abi_version = PHX_ABI_VERSION;
	unreg.handle = reg->handle;
	ioctl(fd, PHX_IOC_UNREGISTER, &unreg);
err_free:
	free(m);
err_close:
	close(fd);
	return ret;
}

PHX_EXPORT int phx_devmem_map_pci_bar(uint32_t domain, uint32_t bus,
				      uint32_t devfn, uint32_t bar,
				      uint64_t offset, uint64_t length,
				      phx_devmem **out)
{
	struct phx_register reg;
	int saved = errno, ret;

	if (!out || !length || bus > 255 || devfn > 255 || bar > 5)
		return phx_err(-EINVAL, "phx_devmem_map_pci_bar: bad argument");
	if (offset % PHX_REG_ALIGN || length % PHX_REG_ALIGN)
		return phx_err(-EINVAL, "BAR offset and length must be multiples of %llu",
			       (unsigned long long)PHX_REG_ALIGN);
	memset(&reg, 0, sizeof(reg));
	reg.provider = PHX_PROV_PCIBAR;
	reg.pci_domain = domain;
	reg.pci_bus = (uint8_t)bus;
	reg.pci_devfn = (uint8_t)devfn;
	reg.pci_bar = (uint8_t)bar;
	reg.offset = offset;
	reg.length = length;
	ret = devmem_map(&reg, 0, length, out);
	errno = saved;
	return ret;
}

PHX_EXPORT int phx_devmem_map_gpu(uint64_t gpu_va, uint64_t length,
				  phx_devmem **out)
{
	struct phx_register reg;
	uint64_t base = align_down(gpu_va, PHX_REG_ALIGN);
	int saved = errno, ret;

	if (!out || !length || gpu_va + length < gpu_va)
		return phx_err(-EINVAL, "phx_devmem_map_gpu: bad argument");
	/* The module maps whole 2 MiB units: cover the caller's range. */
	memset(&reg, 0, sizeof(reg));
	reg.provider = PHX_PROV_NVIDIA;
	reg.gpu_va = base;
	reg.length = align_up(gpu_va + length, PHX_REG_ALIGN) - base;
	ret = devmem_map(&reg, gpu_va - base, length, out);
	errno = saved;
	return ret;
}

PHX_EXPORT int phx_devmem_get_info(const phx_devmem *m,
				   struct phx_devmem_info *info)
{
	if (!m || !info)
		return phx_err(-EINVAL, "phx_devmem_get_info: NULL argument");
	memset(info, 0, sizeof(*info));
	info->addr = (char *)m->map + m->skip;
	info->length = m->length;
	info->mode = m->mode;
	info->status = m->status;
	return 0;
}

PHX_EXPORT int phx_devmem_unmap(phx_devmem *m)
{
	struct phx_unregister unreg;
	int saved = errno, ret = 0;

	if (!m)
		return phx_err(-EINVAL, "phx_devmem_unmap: NULL mapping");
	munmap(m->map, m->map_len);
	memset(&unreg, 0, sizeof(unreg));
	unreg.abi_version = PHX_ABI_VERSION;
	unreg.handle = m->handle;
	if (ioctl(m->fd, PHX_IOC_UNREGISTER, &unreg))
		ret = phx_err(-errno, "%s: unregister", PHX_DEVICE_PATH);
	close(m->fd);
	free(m);
	errno = saved;
	return ret;
}
