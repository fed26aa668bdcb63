#include "registry.h"

#include <errno.h>
#include <fcntl.h>
#include <linux/magic.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/vfs.h>
#include <unistd.h>

#ifndef F_SEAL_FUTURE_WRITE
#define F_SEAL_FUTURE_WRITE 0x0010 /* Linux 5.1; older headers lack it */
#endif

/* Set once by the CUDA backend at start-up (before any session exists). */
static dc_registry_unmap_fn g_cuda_unmap;

void dc_registry_set_cuda_unmap(dc_registry_unmap_fn fn) { g_cuda_unmap = fn; }

void dc_registry_init(dc_registry *r) { memset(r, 0, sizeof *r); }

static void registry_unmap(dc_buffer *b) {
    if (b->kind == DC_BUFFER_SHM) {
        if (b->base && b->size) munmap(b->base, (size_t)b->size);
    } else if (g_cuda_unmap) {
        g_cuda_unmap(b);
    }
    b->base = NULL;
}

/* Counts b into (add) or out of the daemon-wide totals. */
static void totals_count(dc_registry *r, const dc_buffer *b, bool add) {
    dc_registry_totals *t = r->totals;
    uint64_t bytes = b->kind == DC_BUFFER_SHM ? b->size : 0;
    if (!t) return;
    if (add) {
        t->buffers++;
        t->shm_bytes += bytes;
    } else {
        t->buffers--;
        t->shm_bytes -= bytes;
    }
}

/* Whether one more buffer (of shm_size mapped bytes) fits the caps. */
static int totals_check(const dc_registry *r, uint64_t shm_size, dc_err *err) {
    const dc_registry_totals *t = r->totals;
    if (!t) return 0;
    if (t->buffers >= t->max_buffers)
        return dc_err_set(err, DC_ENOSPACE, "limits.max_buffers_total",
                          "the daemon holds %llu buffers for all its sessions, its limit "
                          "(limits.max_buffers_total): release buffers, or raise it",
                          (unsigned long long)t->buffers);
    /* (A reload may have lowered the cap below what is mapped.) */
    if (t->max_shm_bytes && shm_size &&
        (t->shm_bytes >= t->max_shm_bytes || shm_size > t->max_shm_bytes - t->shm_bytes))
        return dc_err_set(err, DC_ENOSPACE, "limits.max_mapped_bytes",
                          "mapping %llu more bytes would take the daemon past %llu bytes of "
                          "shared memory for all its sessions (limits.max_mapped_bytes; %llu "
                          "mapped now)",
                          (unsigned long long)shm_size, (unsigned long long)t->max_shm_bytes,
                          (unsigned long long)t->shm_bytes);
    return 0;
}

void dc_registry_destroy(dc_registry *r) {
    for (size_t i = 0; i < r->n; i++) {
        totals_count(r, &r->items[i], false);
        registry_unmap(&r->items[i]);
    }
    free(r->items);
    memset(r, 0, sizeof *r);
}

int dc_registry_add(dc_registry *r, const dc_buffer *b, dc_err *err) {
    int rc;
    if ((rc = totals_check(r, b->kind == DC_BUFFER_SHM ? b->size : 0, err))) return rc;
    if (r->n == r->cap) {
        size_t cap = r->cap ? r->cap * 2 : 8;
        dc_buffer *items = realloc(r->items, cap * sizeof *items);
        if (!items) return dc_err_set(err, DC_ENOSPACE, "register_buffer", "out of memory");
        r->items = items;
        r->cap = cap;
    }
    r->items[r->n++] = *b;
    r->gen++;
    r->bytes += b->size;
    if (b->kind == DC_BUFFER_SHM) r->shm_bytes += b->size;
    totals_count(r, b, true);
    return 0;
}

/* Why mmap refused: the client's fd (INVALID_ARGUMENT, the reason named),
 * or the daemon out of memory or mappings (RESOURCE_EXHAUSTED). */
static int map_error(int errnum, int fd, uint64_t size, dc_err *err) {
    struct statfs fs;
    if (fstatfs(fd, &fs) == 0 && fs.f_type == HUGETLBFS_MAGIC)
        return dc_err_set(err, DC_EINVAL, "register_buffer",
                          "a hugetlb memfd of %llu bytes could not be mapped (%s): its size must "
                          "be a multiple of its huge page size and the node must have free huge "
                          "pages for it; use an ordinary memfd",
                          (unsigned long long)size, strerror(errnum));
    switch (errnum) {
    case EACCES:
    case EPERM:
    case EINVAL:
    case ENODEV:
    case EOVERFLOW:
        return dc_err_set(err, DC_EINVAL, "register_buffer",
                          "the shared-memory fd cannot be mapped shared and read-write: %s",
                          strerror(errnum));
    default:
        return dc_err_set(err, DC_ENOSPACE, "register_buffer",
                          "the daemon could not map %llu bytes: %s", (unsigned long long)size,
                          strerror(errnum));
    }
}

int dc_registry_add_shm(dc_registry *r, uint64_t id, int fd, uint64_t size, const dc_buffer **out,
                        dc_err *err) {
    struct stat st;
    int seals, flags, rc;
    void *base;
    dc_buffer b;

    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode))
        return dc_err_set(err, DC_EINVAL, "register_buffer",
                          "the attached descriptor is not a shared-memory file");
    /* Without F_SEAL_SHRINK the client could truncate the file under our
     * mapping and every later access would SIGBUS the whole daemon. */
    seals = fcntl(fd, F_GET_SEALS);
    if (seals < 0 || !(seals & F_SEAL_SHRINK))
        return dc_err_set(err, DC_EINVAL, "register_buffer",
                          "the shared-memory fd must be a memfd sealed with F_SEAL_SHRINK");
    /* The daemon writes the step's outputs through its mapping. */
    if (seals & (F_SEAL_WRITE | F_SEAL_FUTURE_WRITE))
        return dc_err_set(err, DC_EINVAL, "register_buffer",
                          "the shared-memory fd is sealed with %s: the daemon writes each step's "
                          "outputs into the buffer and must map it writable",
                          seals & F_SEAL_WRITE ? "F_SEAL_WRITE" : "F_SEAL_FUTURE_WRITE");
    flags = fcntl(fd, F_GETFL);
    if (flags < 0 || (flags & O_ACCMODE) != O_RDWR)
        return dc_err_set(err, DC_EINVAL, "register_buffer",
                          "the shared-memory fd must be open read-write");
    if (st.st_size <= 0)
        return dc_err_set(err, DC_EINVAL, "register_buffer.size",
                          "the shared-memory object is empty");
    if (size == 0) size = (uint64_t)st.st_size;
    if (size > (uint64_t)st.st_size)
        return dc_err_set(err, DC_EINVAL, "register_buffer.size",
                          "size %llu exceeds the object's %llu bytes", (unsigned long long)size,
                          (unsigned long long)st.st_size);
    if (size > (uint64_t)SIZE_MAX / 2)
        return dc_err_set(err, DC_EINVAL, "register_buffer.size", "size too large");
    /* Before mapping: a mapping is what the caps protect. */
    if ((rc = totals_check(r, size, err))) return rc;
    base = mmap(NULL, (size_t)size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (base == MAP_FAILED) return map_error(errno, fd, size, err);

    memset(&b, 0, sizeof b);
    b.id = id;
    b.kind = DC_BUFFER_SHM;
    b.base = base;
    b.size = size;
    b.device = -1;
    if (dc_registry_add(r, &b, err) != 0) {
        munmap(base, (size_t)size);
        return err ? (int)err->code : DC_ENOSPACE;
    }
    if (out) *out = &r->items[r->n - 1];
    return 0;
}

const dc_buffer *dc_registry_find(const dc_registry *r, uint64_t id) {
    for (size_t i = 0; i < r->n; i++)
        if (r->items[i].id == id) return &r->items[i];
    return NULL;
}

int dc_registry_release(dc_registry *r, uint64_t id, dc_err *err) {
    for (size_t i = 0; i < r->n; i++) {
        if (r->items[i].id != id) continue;
        r->bytes -= r->items[i].size;
        if (r->items[i].kind == DC_BUFFER_SHM) r->shm_bytes -= r->items[i].size;
        totals_count(r, &r->items[i], false);
        registry_unmap(&r->items[i]);
        r->items[i] = r->items[--r->n];
        r->gen++;
        return 0;
    }
    return dc_err_set(err, DC_ENOTFOUND, "release_buffer.buffer_id",
                      "buffer %llu is not registered in this session", (unsigned long long)id);
}
