# cython: language_level=3
# Declarations of libphx/include/phx_cuda.h; nothing else belongs here.
from libc.stdint cimport int32_t, int64_t, uint32_t, uint64_t


cdef extern from "phx.h" nogil:
    ctypedef struct phx_engine:
        pass
    ctypedef struct phx_file:
        pass


cdef extern from "phx_cuda.h" nogil:
    ctypedef struct phx_cuda:
        pass

    enum:
        PHX_CUDA_NO_MEMOPS
        PHX_CUDA_NO_FIXED_BUFS
        PHX_CUDA_NO_BATCH_COPY
        PHX_CUDA_EARLY_READS
        PHX_CUDA_FEAT_MEMOPS
        PHX_CUDA_FEAT_BATCH_COPY
        PHX_CUDA_FEAT_FIXED_BUFS
        PHX_CUDA_FEAT_EARLY_READS
        PHX_CUDA_FEAT_DEAD

    const unsigned int PHX_CUDA_MAX_PINNED

    struct phx_cuda_config:
        uint32_t size
        int32_t device
        uint32_t lanes
        uint32_t bufs_per_lane
        uint32_t buf_size
        uint32_t max_io_size
        uint32_t flags

    struct phx_cuda_io:
        phx_file *file
        uint64_t devptr
        size_t len
        uint64_t offset
        uint32_t op
        uint32_t flags
        void *user_data
        int64_t result
        uint32_t paths
        uint32_t done
        uint64_t direct_bytes
        uint64_t bounce_bytes
        uint64_t buffered_bytes

    struct phx_cuda_stats_s "phx_cuda_stats":
        uint64_t reads
        uint64_t writes
        uint64_t bytes_read
        uint64_t bytes_written
        uint64_t direct_bytes
        uint64_t bounce_bytes
        uint64_t buffered_bytes
        uint64_t h2d_bytes
        uint64_t d2h_bytes
        uint64_t chunks
        uint64_t stream_ops
        uint64_t errors
        uint64_t fixed_buf_ios
        uint64_t sqes
        uint64_t staging_bytes
        uint64_t staging_fills
        uint64_t memcpy_calls
        uint64_t memcpy_batch_calls
        uint64_t file_adoptions
        uint64_t pinned_bytes
        uint64_t early_reads
        uint64_t early_misses
        uint64_t stream_released
        uint64_t stream_queue_ns
        uint64_t stream_data_ns
        uint64_t stream_gpu_ns
        uint64_t queue_waits
        uint64_t early_refused
        uint64_t bad_marks
        uint64_t bad_refusals
        uint64_t orphans
        uint64_t broken
        uint64_t ph_call_ns
        uint64_t ph_pack_ns
        uint64_t ph_submit_ns
        uint64_t ph_io_ns
        uint64_t ph_copy_ns
        uint64_t ph_buffers
        uint64_t many_calls
        uint64_t many_pieces
        uint64_t ph_done_ns

    # PHX_0.8: many small pieces of one file and one GPU buffer (issue 29)
    enum:
        PHX_CUDA_MANY_AFTER
    struct phx_cuda_many_s "phx_cuda_many":
        uint32_t size
        uint32_t op
        phx_file *file
        uint64_t devptr
        uint64_t dev_len
        size_t n
        const int64_t *file_offsets
        const int64_t *dev_offsets
        const int64_t *lens
        int64_t *results
        void *stream
        uint32_t flags
        int64_t *pending
    int phx_cuda_many_check(const phx_cuda_many_s *m)
    int64_t phx_cuda_many(phx_cuda *cu, const phx_cuda_many_s *m)
    int phx_cuda_many_async(phx_cuda *cu, const phx_cuda_many_s *m)

    int phx_cuda_available(char *why, size_t len)
    const char *phx_cuda_strerror_last()
    int phx_cuda_ptr_device(uint64_t ptr)
    void phx_cuda_config_init(phx_cuda_config *cfg)
    int phx_cuda_create(phx_engine *eng, const phx_cuda_config *cfg, phx_cuda **out)
    int phx_cuda_destroy(phx_cuda *cu)
    void phx_cuda_config_get(const phx_cuda *cu, phx_cuda_config *cfg)
    uint32_t phx_cuda_features(const phx_cuda *cu)
    int phx_cuda_staging_node(const phx_cuda *cu)
    int phx_cuda_device_numa_node(int device, int *node)
    int phx_cuda_file_register(phx_cuda *cu, phx_file *f)
    int phx_cuda_file_deregister(phx_cuda *cu, phx_file *f)
    void phx_cuda_io_prep(phx_cuda_io *io, phx_file *f, int op, uint64_t devptr,
                          size_t len, uint64_t offset)
    int64_t phx_cuda_pread(phx_cuda *cu, phx_file *f, uint64_t devptr, size_t len,
                           uint64_t offset)
    int64_t phx_cuda_pwrite(phx_cuda *cu, phx_file *f, uint64_t devptr, size_t len,
                            uint64_t offset)
    int phx_cuda_submit(phx_cuda *cu, phx_cuda_io **ios, size_t n)
    int phx_cuda_submit_after(phx_cuda *cu, phx_cuda_io **ios, size_t n, void *stream)
    int phx_cuda_wait(phx_cuda *cu, phx_cuda_io *io, int64_t timeout_ns)
    int phx_cuda_eventfd(phx_cuda *cu)
    int phx_cuda_submit_stream(phx_cuda *cu, phx_cuda_io *io, void *stream)
    int phx_cuda_read_async(phx_cuda *cu, phx_file *f, uint64_t devptr_base,
                            const size_t *size, const int64_t *file_offset,
                            const int64_t *buf_offset, int64_t *bytes_done, void *stream)
    int phx_cuda_write_async(phx_cuda *cu, phx_file *f, uint64_t devptr_base,
                             const size_t *size, const int64_t *file_offset,
                             const int64_t *buf_offset, int64_t *bytes_done, void *stream)
    void phx_cuda_stats(phx_cuda *cu, phx_cuda_stats_s *st)
    void phx_cuda_stats_get(phx_cuda *cu, phx_cuda_stats_s *st, size_t size)
    void phx_cuda_stats_reset(phx_cuda *cu)
    const char *phx_cuda_memops_why(const phx_cuda *cu)
    int phx_cuda_set_early_reads(phx_cuda *cu, int on)

    # PHX_0.7: pinned host memory and copy streams without a staging context
    ctypedef struct phx_cuda_stream:
        pass
    int phx_cuda_host_register(int device, void *ptr, size_t len)
    int phx_cuda_host_unregister(int device, void *ptr)
    int phx_cuda_stream_create(int device, phx_cuda_stream **out)
    int phx_cuda_stream_destroy(phx_cuda_stream *s)
    void *phx_cuda_stream_handle(const phx_cuda_stream *s)
    int phx_cuda_stream_after(phx_cuda_stream *s, void *producer)
    int phx_cuda_stream_h2d(phx_cuda_stream *s, uint64_t dst, const void *src, size_t len)
    int phx_cuda_stream_d2h(phx_cuda_stream *s, void *dst, uint64_t src, size_t len)
    int phx_cuda_stream_sync(phx_cuda_stream *s)
