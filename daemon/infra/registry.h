/* The buffer registry of one session: the shared-memory regions (and, with
 * the CUDA backend, CUDA IPC allocations) a client registered, by id.
 *
 * Isolation: each session owns its own registry and lookups never leave it,
 * so another session's id is NOT_FOUND exactly like an id that never existed.
 * Ids come from a daemon-wide counter (passed in) so they are never reused
 * within the daemon's lifetime: a stale id cannot alias a newer buffer.
 *
 * Ownership: the registry owns every mapping it holds and unmaps them on
 * release and on destroy. The session guarantees no step is in flight when it
 * releases or destroys (it runs one request at a time). */
#ifndef DC_REGISTRY_H
#define DC_REGISTRY_H

#include <stddef.h>
#include <stdint.h>

#include "dc_err.h"

typedef enum dc_buffer_kind { DC_BUFFER_SHM = 1, DC_BUFFER_CUDA = 2 } dc_buffer_kind;

typedef struct dc_buffer {
    uint64_t id;
    dc_buffer_kind kind;
    void *base;    /* host mapping (SHM) or device pointer (CUDA) */
    uint64_t size; /* bytes addressable through references */
    int device;    /* CUDA device, -1 for SHM */
} dc_buffer;

/* What all sessions' registries hold together, against the daemon-wide caps
 * (limits.max_buffers_total, limits.max_mapped_bytes): each session's own
 * cap alone let 17 sessions exhaust the kernel's map count, after which
 * every other client's registrations, and the ledger's writes, failed. The
 * server owns it and sets the caps (also on reload). */
typedef struct dc_registry_totals {
    uint64_t buffers;   /* every kind */
    uint64_t shm_bytes; /* shared memory mapped */
    uint64_t max_buffers;
    uint64_t max_shm_bytes; /* 0 = no cap */
} dc_registry_totals;

typedef struct dc_registry {
    dc_buffer *items; /* unordered; small (tens of buffers per client) */
    size_t n, cap;
    uint64_t bytes;     /* total registered bytes, for the session's quota */
    uint64_t shm_bytes; /* of which shared memory mapped (its user's share, host.h) */
    /* Bumped by every add and release: a step validated at one generation
     * names only live mappings while the generation is unchanged. */
    uint64_t gen;
    dc_registry_totals *totals; /* counted in and capped by; NULL = neither */
} dc_registry;

void dc_registry_init(dc_registry *r);
/* Unmaps everything. */
void dc_registry_destroy(dc_registry *r);

/* Checks and maps a shared-memory fd: it must be a sealed (F_SEAL_SHRINK)
 * memfd opened read-write and not sealed against writing, at least `size`
 * bytes (0 = whole object). An fd that cannot be mapped is DC_EINVAL naming
 * why; DC_ENOSPACE is the daemon out of memory or mappings. The fd
 * is not consumed (the caller closes it). On success *out is the new entry
 * (valid until the next add/release). */
int dc_registry_add_shm(dc_registry *r, uint64_t id, int fd, uint64_t size, const dc_buffer **out,
                        dc_err *err);

/* Adds an already opened region (CUDA IPC); the registry will call `unmap`
 * on it at release/destroy. Both adds refuse with DC_ENOSPACE naming the
 * daemon-wide cap that a new buffer would pass. */
typedef void (*dc_registry_unmap_fn)(dc_buffer *b);
void dc_registry_set_cuda_unmap(dc_registry_unmap_fn fn);
int dc_registry_add(dc_registry *r, const dc_buffer *b, dc_err *err);

const dc_buffer *dc_registry_find(const dc_registry *r, uint64_t id);
/* DC_ENOTFOUND if the id is not this session's. */
int dc_registry_release(dc_registry *r, uint64_t id, dc_err *err);

#endif
