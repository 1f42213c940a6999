# cython: language_level=3
# Declarations of libphx/include/phx_nvme.h; nothing else belongs here.
from libc.stdint cimport int64_t, uint32_t, uint64_t


cdef extern from "phx_nvme.h" nogil:
    ctypedef struct phx_nvme:
        pass

    enum:
        PHX_NVME_FORCE
        PHX_NVME_NO_FIXED_BUFS
        PHX_NVME_NO_DSM
        PHX_NVME_READONLY
        PHX_NVME_TEST_NO_CAPACITY_CHECK
        PHX_NVME_FEAT_DSM
        PHX_NVME_FEAT_WRITE_ZEROES
        PHX_NVME_FEAT_WZ_DEALLOC
        PHX_NVME_FEAT_FIXED_BUFS
        PHX_NVME_FEAT_EXCLUSIVE

    cdef enum phx_nvme_op:
        PHX_NVME_READ
        PHX_NVME_WRITE

    struct phx_nvme_config:
        uint32_t size
        uint32_t queue_depth
        uint32_t nr_queues
        uint32_t max_transfer
        uint32_t flags
        uint64_t first_lba
        uint64_t nr_lbas

    struct phx_nvme_info:
        uint32_t size
        uint32_t nsid
        uint32_t lba_size
        uint32_t metadata_size
        uint64_t nr_lbas
        uint64_t capacity
        uint32_t mdts
        uint32_t max_transfer
        uint32_t max_segments
        uint32_t dlfeat
        uint32_t oncs
        uint32_t features
        uint64_t first_lba
        uint64_t claimed_lbas
        uint32_t queue_depth
        uint32_t nr_queues
        char model[41]
        char serial[21]
        char firmware[9]
        char block_device[33]

    struct phx_nvme_io:
        uint32_t op
        uint32_t flags
        void *buf
        uint64_t len
        uint64_t offset
        int64_t result
        uint32_t status
        uint32_t commands

    struct phx_nvme_stats:
        uint64_t reads
        uint64_t writes
        uint64_t bytes_read
        uint64_t bytes_written
        uint64_t commands
        uint64_t fixed_commands
        uint64_t submits
        uint64_t max_inflight
        uint64_t dsm_commands
        uint64_t write_zeroes_commands
        uint64_t deallocated_bytes
        uint64_t errors

    void phx_nvme_config_init(phx_nvme_config *cfg)
    int phx_nvme_open(const char *path, const phx_nvme_config *cfg, phx_nvme **out)
    int phx_nvme_close(phx_nvme *nv)
    int phx_nvme_get_info(const phx_nvme *nv, phx_nvme_info *info)
    int phx_nvme_identify(const char *path, phx_nvme_info *info)
    int phx_nvme_check(const char *path)
    int phx_nvme_buf_register(phx_nvme *nv, void *addr, size_t len)
    int phx_nvme_buf_deregister(phx_nvme *nv, void *addr)
    int phx_nvme_submit_wait(phx_nvme *nv, phx_nvme_io *ios, size_t n)
    int64_t phx_nvme_read(phx_nvme *nv, void *buf, uint64_t len, uint64_t offset)
    int64_t phx_nvme_write(phx_nvme *nv, const void *buf, uint64_t len, uint64_t offset)
    int phx_nvme_deallocate(phx_nvme *nv, uint64_t offset, uint64_t len)
    int phx_nvme_write_zeroes(phx_nvme *nv, uint64_t offset, uint64_t len)
    int phx_nvme_flush(phx_nvme *nv)
    void phx_nvme_stats_get "phx_nvme_stats"(phx_nvme *nv, phx_nvme_stats *st)
    void phx_nvme_stats_reset(phx_nvme *nv)
    const char *phx_nvme_status_str(uint32_t status)


cdef extern from "phx.h" nogil:
    const char *phx_strerror_last()
