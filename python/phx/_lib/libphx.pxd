# cython: language_level=3
# Declarations of libphx/include/phx.h; nothing else belongs here.
from libc.stdint cimport int64_t, uint32_t, uint64_t
from posix.types cimport mode_t


cdef extern from "phx.h" nogil:
    ctypedef struct phx_engine:
        pass
    ctypedef struct phx_file:
        pass

    enum:
        PHX_ENGINE_NO_FIXED_FILES
        PHX_ENGINE_NO_FIXED_BUFS
        PHX_ENGINE_SINGLE_THREAD
        PHX_FEAT_FIXED_FILES
        PHX_FEAT_FIXED_BUFS
        PHX_FEAT_USER_BUFS
        PHX_FEAT_SUBMIT_ALL
        PHX_FEAT_SINGLE_ISSUER
        PHX_FEAT_DEFER_TASKRUN
        PHX_FEAT_REG_RING
        PHX_FILE_BUFFERED
        PHX_FILE_ALLOW_BUFFERED
        PHX_IO_NO_POLL
        PHX_PATH_DIRECT
        PHX_PATH_BOUNCE
        PHX_PATH_BUFFERED
        PHX_BACKEND_AUTO
        PHX_BACKEND_URING
        PHX_BACKEND_THREADS

    cdef enum phx_op:
        PHX_OP_READ
        PHX_OP_WRITE

    struct phx_engine_config:
        uint32_t size
        uint32_t queue_depth
        uint32_t max_io_size
        uint32_t bounce_size
        uint32_t bounce_count
        uint32_t flags
        uint32_t max_files
        uint32_t submit_batch
        uint32_t backend
        uint32_t io_threads

    struct phx_file_info:
        uint32_t size
        int fd
        int direct
        int registered
        uint32_t mem_align
        uint32_t offset_align
        int align_from_statx
        int open_flags

    struct phx_io:
        phx_file *file
        void *buf
        size_t len
        uint64_t offset
        uint32_t op
        uint32_t flags
        void *user_data
        int64_t result
        uint32_t paths
        uint32_t done

    struct phx_stats:
        uint64_t reads
        uint64_t writes
        uint64_t bytes_read
        uint64_t bytes_written
        uint64_t direct_bytes
        uint64_t bounce_bytes
        uint64_t buffered_bytes
        uint64_t bounce_ios
        uint64_t rmw_ios
        uint64_t short_ios
        uint64_t fixed_buf_ios
        uint64_t sqes
        uint64_t submits
        uint64_t errors
        uint64_t bad_marks
        uint64_t bad_refusals

    void phx_engine_config_init(phx_engine_config *cfg)
    int phx_engine_create(const phx_engine_config *cfg, phx_engine **out)
    int phx_engine_destroy(phx_engine *eng)
    void phx_engine_config_get(const phx_engine *eng, phx_engine_config *cfg)
    uint32_t phx_engine_features(const phx_engine *eng)
    const char *phx_engine_backend(const phx_engine *eng)
    const char *phx_engine_backend_reason(const phx_engine *eng)
    int phx_backend_check(uint32_t kind, const char **name, const char **desc)
    int phx_engine_eventfd(phx_engine *eng)
    void phx_engine_stats(phx_engine *eng, phx_stats *st)
    void phx_engine_stats_reset(phx_engine *eng)
    int phx_stats_publish()
    int phx_stats_path(char *buf, size_t len)
    int phx_file_check_range(const phx_file *f, uint64_t offset, uint64_t len)

    int phx_file_open(phx_engine *eng, const char *path, int flags, mode_t mode,
                      uint32_t phx_flags, phx_file **out)
    int phx_file_from_fd(phx_engine *eng, int fd, phx_file **out)
    int phx_file_close(phx_file *f)
    int phx_file_get_info(const phx_file *f, phx_file_info *info)

    int phx_buf_register(phx_engine *eng, void *addr, size_t len)
    int phx_buf_deregister(phx_engine *eng, void *addr)

    void phx_io_prep(phx_io *io, phx_file *f, phx_op op, void *buf, size_t len,
                     uint64_t offset)
    cdef struct phx_io_bytes:
        uint64_t direct
        uint64_t bounce
        uint64_t buffered
    void phx_io_bytes_by_path(const phx_io *io, phx_io_bytes *out)
    int64_t phx_pread(phx_file *f, void *buf, size_t len, uint64_t offset)
    int64_t phx_pwrite(phx_file *f, const void *buf, size_t len, uint64_t offset)
    int phx_submit_wait(phx_engine *eng, phx_io *ios, size_t n)
    int phx_submit(phx_engine *eng, phx_io **ios, size_t n)
    int phx_wait(phx_engine *eng, phx_io *io, int64_t timeout_ns)
    int phx_poll(phx_engine *eng, phx_io **done, size_t max)

    const char *phx_strerror_last()
    const char *phx_version()

    ctypedef struct phx_devmem:
        pass

    enum:
        PHX_DEVMEM_GENERIC
        PHX_DEVMEM_P2PDMA

    struct phx_devmem_info:
        void *addr
        uint64_t length
        uint32_t mode
        uint32_t status

    int phx_devmem_probe()
    int phx_devmem_map_pci_bar(uint32_t domain, uint32_t bus, uint32_t devfn,
                               uint32_t bar, uint64_t offset, uint64_t length,
                               phx_devmem **out)
    int phx_devmem_map_gpu(uint64_t gpu_va, uint64_t length, phx_devmem **out)
    int phx_devmem_get_info(const phx_devmem *m, phx_devmem_info *info)
    int phx_devmem_unmap(phx_devmem *m)
