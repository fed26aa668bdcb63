/* libdpclip: buffers the daemon maps (docs/protocol.md, "Session"):
 * shared memory this library allocates (memfd, sealed) or a caller's fd,
 * registered and released; a released id is also forgotten by the CUDA
 * registrations (cuda.c keeps those in c->cuda_bufs). */
#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "internal.h"

void cl_cuda_forget(dpclip_client *c, uint64_t id) {
    for (size_t i = 0; i < c->cb_n; i++)
        if (c->cuda_bufs[i].id == id) {
            c->cuda_bufs[i] = c->cuda_bufs[--c->cb_n];
            return;
        }
}

int cl_register_buffer(dpclip_client *c, Dpclip__RegisterBuffer *rb, int pass_fd, uint64_t *id) {
    Dpclip__Request req = DPCLIP__REQUEST__INIT;
    Dpclip__Reply *r;
    int rc;

    req.body_case = DPCLIP__REQUEST__BODY_REGISTER_BUFFER;
    req.register_buffer = rb;
    if ((rc = cl_call(c, &req, pass_fd, DPCLIP__REPLY__BODY_REGISTER_BUFFER, -1, &r))) return rc;
    *id = r->register_buffer->buffer_id;
    dpclip__reply__free_unpacked(r, NULL);
    return 0;
}

static int register_fd(dpclip_client *c, int fd, size_t size, uint64_t *id) {
    Dpclip__RegisterBuffer rb = DPCLIP__REGISTER_BUFFER__INIT;
    rb.kind = DPCLIP__BUFFER_KIND__SHM_FD;
    rb.size = size;
    return cl_register_buffer(c, &rb, fd, id);
}

DPCLIP_API int dpclip_buffer_alloc(dpclip_client *c, size_t size, uint64_t *buffer_id,
                                   void **data) {
    void *addr = MAP_FAILED;
    uint64_t id = 0;
    int fd = -1, rc;

    if (!c || !buffer_id || !data) return DPCLIP_EARG;
    cl_lock(c);
    if (size == 0) {
        rc = cl_fail(c, DPCLIP_EARG, "", "buffer size 0");
        goto out;
    }
    if (c->m_len == c->m_cap) {
        size_t cap = c->m_cap ? c->m_cap * 2 : 8;
        cl_mapping *nm = realloc(c->maps, cap * sizeof *nm);
        if (!nm) {
            rc = cl_fail(c, DPCLIP_ENOMEM, "", "out of memory");
            goto out;
        }
        c->maps = nm;
        c->m_cap = cap;
    }
    /* Sealed against shrinking so that nobody can truncate the file under
     * the daemon's mapping (it would SIGBUS); against growing and further
     * sealing so that the size both sides agree on stays the size. */
    fd = memfd_create("dpclip", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    if (fd < 0) {
        rc = cl_fail(c, DPCLIP_ENOMEM, "", "memfd_create: %s", strerror(errno));
        goto out;
    }
    if (ftruncate(fd, (off_t)size) != 0) {
        rc = cl_fail(c, DPCLIP_ENOMEM, "", "ftruncate(%zu): %s", size, strerror(errno));
        goto out;
    }
    if (fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
        rc = cl_fail(c, DPCLIP_ENOMEM, "", "sealing the memfd: %s", strerror(errno));
        goto out;
    }
    addr = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (addr == MAP_FAILED) {
        rc = cl_fail(c, DPCLIP_ENOMEM, "", "mmap(%zu): %s", size, strerror(errno));
        goto out;
    }
    if ((rc = register_fd(c, fd, size, &id))) goto out;
    c->maps[c->m_len].id = id;
    c->maps[c->m_len].addr = addr;
    c->maps[c->m_len].size = size;
    c->m_len++;
    *buffer_id = id;
    *data = addr;
    addr = MAP_FAILED; /* now owned by c->maps */
out:
    if (addr != MAP_FAILED) munmap(addr, size);
    if (fd >= 0) close(fd); /* the daemon holds its own reference */
    cl_unlock(c);
    return rc;
}

DPCLIP_API int dpclip_buffer_register_fd(dpclip_client *c, int fd, size_t size,
                                         uint64_t *buffer_id) {
    int rc;
    if (!c || fd < 0 || !buffer_id) return DPCLIP_EARG;
    cl_lock(c);
    rc = register_fd(c, fd, size, buffer_id);
    cl_unlock(c);
    return rc;
}

int cl_release_buffer(dpclip_client *c, uint64_t buffer_id) {
    Dpclip__Request req = DPCLIP__REQUEST__INIT;
    Dpclip__ReleaseBuffer rb = DPCLIP__RELEASE_BUFFER__INIT;
    Dpclip__Reply *r;
    int rc;

    rb.buffer_id = buffer_id;
    req.body_case = DPCLIP__REQUEST__BODY_RELEASE_BUFFER;
    req.release_buffer = &rb;
    rc = cl_call(c, &req, -1, DPCLIP__REPLY__BODY_RELEASE_BUFFER, -1, &r);
    if (rc == 0) dpclip__reply__free_unpacked(r, NULL);
    /* Released, or the daemon is gone (which released it): unmap ours. */
    if (rc == 0 || rc == DPCLIP_EIO) {
        cl_cuda_forget(c, buffer_id);
        for (size_t i = 0; i < c->m_len; i++) {
            if (c->maps[i].id != buffer_id) continue;
            munmap(c->maps[i].addr, c->maps[i].size);
            c->maps[i] = c->maps[--c->m_len];
            break;
        }
    }
    return rc;
}

DPCLIP_API int dpclip_buffer_release(dpclip_client *c, uint64_t buffer_id) {
    int rc;
    if (!c) return DPCLIP_EARG;
    cl_lock(c);
    rc = cl_release_buffer(c, buffer_id);
    cl_unlock(c);
    return rc;
}
