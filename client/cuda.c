/* CUDA IPC registration for libdpclip.
 *
 * The library must link and run on machines without CUDA, and must use the
 * same driver (and so the same contexts) as the trainer's framework: it loads
 * libcuda.so.1 with dlopen on first use and calls the driver API, whose
 * functions act on the calling thread's current context (the primary context
 * the CUDA runtime, and PyTorch, make current).
 *
 * Registered allocations are cached per handle by (device, base): a tensor
 * inside an allocation already registered costs one cuPointerGetAttributes
 * (device, range and the driver's allocation id, unique in the process, so
 * an allocation freed and replaced at the same address is noticed), no
 * round trip. Where the driver gives no allocation id, one
 * cuMemGetAddressRange and one cuIpcGetMemHandle (whose handle differs for
 * a replaced allocation) do the same. */
#include <dlfcn.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

typedef int cl_curesult;
typedef unsigned long long cl_cudeviceptr;
#define CL_CU_POINTER_ATTRIBUTE_CONTEXT 1
#define CL_CU_POINTER_ATTRIBUTE_BUFFER_ID 7
#define CL_CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL 9
#define CL_CU_POINTER_ATTRIBUTE_RANGE_START_ADDR 11
#define CL_CU_POINTER_ATTRIBUTE_RANGE_SIZE 12

typedef struct cl_cuda_api {
    void *lib;
    cl_curesult (*mem_get_address_range)(cl_cudeviceptr *base, size_t *size, cl_cudeviceptr p);
    cl_curesult (*ipc_get_mem_handle)(void *handle64, cl_cudeviceptr p);
    cl_curesult (*pointer_get_attribute)(void *data, int attr, cl_cudeviceptr p);
    cl_curesult (*pointer_get_attributes)(unsigned n, int *attrs, void **data, cl_cudeviceptr p);
    cl_curesult (*get_error_string)(cl_curesult e, const char **s);
    cl_curesult (*device_get)(int *dev, int ordinal);
    cl_curesult (*device_get_uuid)(unsigned char uuid[16], int dev);
    /* done flags (dpclip_cuda_host_map, dpclip_cuda_wait_value) */
    cl_curesult (*mem_host_register)(void *p, size_t size, unsigned flags);
    cl_curesult (*mem_host_unregister)(void *p);
    cl_curesult (*mem_host_get_device_pointer)(cl_cudeviceptr *d, void *p, unsigned flags);
    cl_curesult (*stream_wait_value32)(void *stream, cl_cudeviceptr addr, unsigned value,
                                       unsigned flags);
    cl_curesult (*memset_d8_async)(cl_cudeviceptr d, unsigned char v, size_t n, void *stream);
    cl_curesult (*ctx_push_current)(void *ctx);
    cl_curesult (*ctx_pop_current)(void **ctx);
} cl_cuda_api;

#define CL_CU_MEMHOSTREGISTER_PORTABLE 0x01
#define CL_CU_MEMHOSTREGISTER_DEVICEMAP 0x02
#define CL_CU_STREAM_WAIT_VALUE_GEQ 0x0

/* Loaded once per process: the driver is process-wide by nature. */
static cl_cuda_api g_cu;
static int g_cu_ok;
static pthread_once_t g_cu_once = PTHREAD_ONCE_INIT;

static void cu_load(void) {
    void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!lib) return;
    *(void **)&g_cu.mem_get_address_range = dlsym(lib, "cuMemGetAddressRange_v2");
    *(void **)&g_cu.ipc_get_mem_handle = dlsym(lib, "cuIpcGetMemHandle");
    *(void **)&g_cu.pointer_get_attribute = dlsym(lib, "cuPointerGetAttribute");
    *(void **)&g_cu.pointer_get_attributes = dlsym(lib, "cuPointerGetAttributes");
    *(void **)&g_cu.get_error_string = dlsym(lib, "cuGetErrorString");
    *(void **)&g_cu.device_get = dlsym(lib, "cuDeviceGet");
    *(void **)&g_cu.device_get_uuid = dlsym(lib, "cuDeviceGetUuid_v2");
    if (!g_cu.device_get_uuid) *(void **)&g_cu.device_get_uuid = dlsym(lib, "cuDeviceGetUuid");
    *(void **)&g_cu.mem_host_register = dlsym(lib, "cuMemHostRegister_v2");
    *(void **)&g_cu.mem_host_unregister = dlsym(lib, "cuMemHostUnregister");
    *(void **)&g_cu.mem_host_get_device_pointer = dlsym(lib, "cuMemHostGetDevicePointer_v2");
    /* the v2 memory operations (CUDA 12), with the same signature */
    *(void **)&g_cu.stream_wait_value32 = dlsym(lib, "cuStreamWaitValue32_v2");
    if (!g_cu.stream_wait_value32)
        *(void **)&g_cu.stream_wait_value32 = dlsym(lib, "cuStreamWaitValue32");
    *(void **)&g_cu.memset_d8_async = dlsym(lib, "cuMemsetD8Async");
    *(void **)&g_cu.ctx_push_current = dlsym(lib, "cuCtxPushCurrent_v2");
    *(void **)&g_cu.ctx_pop_current = dlsym(lib, "cuCtxPopCurrent_v2");
    if (!g_cu.mem_get_address_range || !g_cu.ipc_get_mem_handle || !g_cu.pointer_get_attribute) {
        dlclose(lib);
        memset(&g_cu, 0, sizeof g_cu);
        return;
    }
    g_cu.lib = lib;
    g_cu_ok = 1;
}

static const char *cu_err(cl_curesult e) {
    const char *s = NULL;
    if (g_cu.get_error_string && g_cu.get_error_string(e, &s) == 0 && s) return s;
    return "CUDA driver error";
}

/* The UUID of this process's device `ordinal` into uuid[16]; 0, or -1
 * where the driver cannot say (the daemon then takes the ordinal as its
 * own, which is right only where both processes see the same GPUs). The
 * daemon is sent the UUID because ordinals follow each process's
 * CUDA_VISIBLE_DEVICES: a trainer given one GPU calls it 0 whichever it is. */
static int device_uuid(int ordinal, unsigned char uuid[16]) {
    int dev;
    pthread_once(&g_cu_once, cu_load);
    if (!g_cu_ok || !g_cu.device_get || !g_cu.device_get_uuid) return -1;
    if (g_cu.device_get(&dev, ordinal) || g_cu.device_get_uuid(uuid, dev)) return -1;
    return 0;
}

/* Sends RegisterBuffer{CUDA_IPC}; caller holds the lock. */
static int register_handle(dpclip_client *c, const void *handle, uint64_t size, int device,
                           uint64_t *id) {
    Dpclip__RegisterBuffer rb = DPCLIP__REGISTER_BUFFER__INIT;
    unsigned char uuid[16];
    rb.kind = DPCLIP__BUFFER_KIND__CUDA_IPC;
    rb.size = size;
    rb.device = device;
    if (device_uuid(device, uuid) == 0) {
        rb.device_uuid.data = uuid;
        rb.device_uuid.len = sizeof uuid;
    }
    rb.cuda_ipc_handle.data = (uint8_t *)handle;
    rb.cuda_ipc_handle.len = 64;
    return cl_register_buffer(c, &rb, -1, id);
}

/* The cached registration of an allocation the driver names by its id
 * (*cu_id: that id, 0 where the driver gives none); NULL if none. */
static cl_cuda_buf *cached(dpclip_client *c, cl_cudeviceptr p, uint64_t *cu_id) {
    int attrs[4] = {CL_CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, CL_CU_POINTER_ATTRIBUTE_BUFFER_ID,
                    CL_CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, CL_CU_POINTER_ATTRIBUTE_RANGE_SIZE};
    int device = -1;
    unsigned long long id = 0;
    cl_cudeviceptr start = 0;
    size_t size = 0;
    void *data[4] = {&device, &id, &start, &size};

    *cu_id = 0;
    /* (no error for a pointer the driver does not know: zeros instead) */
    if (!g_cu.pointer_get_attributes || g_cu.pointer_get_attributes(4, attrs, data, p) || !id ||
        !size)
        return NULL;
    *cu_id = id;
    for (size_t i = 0; i < c->cb_n; i++) {
        cl_cuda_buf *b = &c->cuda_bufs[i];
        if (b->cu_id == id && b->device == device && b->base == start && b->size == size) return b;
    }
    return NULL;
}

/* The registration of the allocation that holds p, made where none is
 * cached (unless !may_send: DPCLIP_EAGAIN, nothing sent): *out a copy of
 * its entry (the entries move as they are added). */
static int cuda_ref(dpclip_client *c, cl_cudeviceptr p, cl_cuda_buf *out, bool may_send) {
    cl_cudeviceptr base = 0;
    size_t size = 0;
    uint8_t handle[64];
    int device = -1, rc;
    uint64_t cu_id = 0, id = 0;
    cl_curesult e;
    cl_cuda_buf *hit = NULL;

    pthread_once(&g_cu_once, cu_load);
    if (!g_cu_ok)
        return cl_fail(c, DPCLIP_EUNAVAIL, "", "no CUDA driver (libcuda.so.1) in this process");
    if ((hit = cached(c, p, &cu_id))) {
        *out = *hit;
        return 0;
    }
    if (!may_send)
        return cl_fail(c, DPCLIP_EAGAIN, "",
                       "its allocation is not registered with the daemon yet (nothing was sent)");
    if ((e = g_cu.pointer_get_attribute(&device, CL_CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, p)) ||
        (e = g_cu.mem_get_address_range(&base, &size, p)))
        return cl_fail(c, DPCLIP_EARG, "", "not a CUDA device pointer: %s", cu_err(e));
    if ((e = g_cu.ipc_get_mem_handle(handle, base)))
        return cl_fail(c, DPCLIP_EARG, "",
                       "cuIpcGetMemHandle: %s (memory from cudaMalloc-style "
                       "allocators can be shared; VMM/async-pool memory cannot)",
                       cu_err(e));
    for (size_t i = 0; i < c->cb_n; i++)
        if (c->cuda_bufs[i].device == device && c->cuda_bufs[i].base == base)
            hit = &c->cuda_bufs[i];
    if (hit && hit->size == size && memcmp(hit->handle, handle, 64) == 0) {
        hit->cu_id = cu_id;
        *out = *hit;
        return 0;
    }
    if (hit) {
        /* Freed and replaced at the same address: the old registration maps
         * memory that is no longer this tensor's. */
        uint64_t old = hit->id;
        cl_cuda_forget(c, old);
        if ((rc = cl_release_buffer(c, old)) && rc != DPCLIP_ENOTFOUND) return rc;
    }
    if (c->cb_n == c->cb_capn) {
        size_t n = c->cb_capn ? 2 * c->cb_capn : 8;
        cl_cuda_buf *nb = realloc(c->cuda_bufs, n * sizeof *nb);
        if (!nb) return cl_fail(c, DPCLIP_ENOMEM, "", "out of memory");
        c->cuda_bufs = nb;
        c->cb_capn = n;
    }
    if ((rc = register_handle(c, handle, size, device, &id))) return rc;
    hit = &c->cuda_bufs[c->cb_n++];
    hit->id = id;
    hit->device = device;
    hit->base = base;
    hit->size = size;
    hit->cu_id = cu_id;
    memcpy(hit->handle, handle, 64);
    *out = *hit;
    return 0;
}

int cl_cuda_ref_locked(dpclip_client *c, uint64_t dev_ptr, uint64_t *buffer_id, uint64_t *offset) {
    cl_cuda_buf b;
    int rc = cuda_ref(c, (cl_cudeviceptr)dev_ptr, &b, true);
    if (rc) return rc;
    *buffer_id = b.id;
    *offset = dev_ptr - b.base;
    return 0;
}

DPCLIP_API int dpclip_buffer_register_cuda(dpclip_client *c, const void *dev_ptr,
                                           uint64_t *buffer_id, uint64_t *offset) {
    int rc;
    if (!c || !dev_ptr || !buffer_id || !offset) return DPCLIP_EARG;
    cl_lock(c);
    rc = cl_cuda_ref_locked(c, (uint64_t)(uintptr_t)dev_ptr, buffer_id, offset);
    cl_unlock(c);
    return rc;
}

/* The allocations one call has found already: a step's tensors lie in
 * few of the allocator's blocks, each looked up once per call (an
 * allocation cannot be replaced while the call holds it found). */
enum { CL_REFS_SEEN = 16 };

/* c's message, about ptrs[i], prefixed with what the pointer is: a
 * rebind's (pairs) layer i / 2's input or output_grad, else pointer i. */
static int refs_failed(dpclip_client *c, int rc, size_t i, bool pairs) {
    char why[sizeof c->errmsg];
    snprintf(why, sizeof why, "%s", c->errmsg); /* (cl_fail writes c->errmsg) */
    if (pairs)
        return cl_fail(c, rc, "", "layer %zu's %s: %s", i / 2, i % 2 ? "output_grad" : "input",
                       why);
    return cl_fail(c, rc, "", "pointer %zu: %s", i, why);
}

/* refs[2i], refs[2i + 1] for ptrs[i], with the lock held; an error names
 * the pointer that failed (refs_failed). may_send: register what is not. */
static int refs_locked(dpclip_client *c, size_t n, const uint64_t *ptrs, uint64_t *refs, bool pairs,
                       bool may_send) {
    cl_cuda_buf seen[CL_REFS_SEEN];
    size_t n_seen = 0, next = 0;
    int rc;
    for (size_t i = 0; i < n; i++) {
        const cl_cuda_buf *b = NULL;
        if (!ptrs[i])
            return refs_failed(c, cl_fail(c, DPCLIP_EARG, "", "a null pointer"), i, pairs);
        for (size_t k = 0; k < n_seen && !b; k++)
            if (ptrs[i] >= seen[k].base && ptrs[i] - seen[k].base < seen[k].size) b = &seen[k];
        if (!b) {
            /* the oldest found is replaced once the list is full */
            if ((rc = cuda_ref(c, (cl_cudeviceptr)ptrs[i], &seen[next], may_send)))
                return refs_failed(c, rc, i, pairs);
            b = &seen[next];
            next = (next + 1) % CL_REFS_SEEN;
            if (n_seen < CL_REFS_SEEN) n_seen++;
        }
        refs[2 * i] = b->id;
        refs[2 * i + 1] = ptrs[i] - b->base;
    }
    return 0;
}

static int refs_cuda(dpclip_client *c, size_t n, const uint64_t *ptrs, uint64_t *refs,
                     bool may_send) {
    int rc;
    if (!c || (n && (!ptrs || !refs))) return DPCLIP_EARG;
    cl_lock(c);
    rc = refs_locked(c, n, ptrs, refs, false, may_send);
    cl_unlock(c);
    return rc;
}

DPCLIP_API int dpclip_buffer_refs_cuda(dpclip_client *c, size_t n, const uint64_t *ptrs,
                                       uint64_t *refs) {
    return refs_cuda(c, n, ptrs, refs, true);
}

DPCLIP_API int dpclip_buffer_refs_cuda_cached(dpclip_client *c, size_t n, const uint64_t *ptrs,
                                              uint64_t *refs) {
    return refs_cuda(c, n, ptrs, refs, false);
}

DPCLIP_API int dpclip_step_rebind_cuda(dpclip_client *c, dpclip_step *s, size_t n,
                                       const uint64_t *ptrs) {
    uint64_t *refs = NULL;
    int rc;
    if (!c || !s || !ptrs || n != cl_step_layers(s)) return DPCLIP_EARG;
    if (n && !(refs = malloc(4 * n * sizeof *refs))) return DPCLIP_ENOMEM;
    cl_lock(c);
    rc = refs_locked(c, 2 * n, ptrs, refs, true, true);
    cl_unlock(c);
    if (!rc) rc = dpclip_step_rebind(s, n, refs);
    free(refs);
    return rc;
}

DPCLIP_API int dpclip_buffer_register_cuda_handle(dpclip_client *c, const void *ipc_handle,
                                                  uint64_t size, int device, uint64_t *buffer_id) {
    int rc;
    if (!c || !ipc_handle || !buffer_id || device < 0) return DPCLIP_EARG;
    cl_lock(c);
    rc = register_handle(c, ipc_handle, size, device, buffer_id);
    cl_unlock(c);
    return rc;
}

DPCLIP_API int dpclip_event_register_cuda(dpclip_client *c, const void *ipc_event_handle,
                                          int device, uint64_t *event_id) {
    Dpclip__Request req = DPCLIP__REQUEST__INIT;
    Dpclip__RegisterEvent re = DPCLIP__REGISTER_EVENT__INIT;
    Dpclip__Reply *r;
    unsigned char uuid[16];
    int rc;

    if (!c || !ipc_event_handle || !event_id || device < 0) return DPCLIP_EARG;
    cl_lock(c);
    re.cuda_ipc_event_handle.data = (uint8_t *)ipc_event_handle;
    re.cuda_ipc_event_handle.len = 64;
    re.device = device;
    if (device_uuid(device, uuid) == 0) {
        re.device_uuid.data = uuid;
        re.device_uuid.len = sizeof uuid;
    }
    req.body_case = DPCLIP__REQUEST__BODY_REGISTER_EVENT;
    req.register_event = &re;
    rc = cl_call(c, &req, -1, DPCLIP__REPLY__BODY_REGISTER_EVENT, -1, &r);
    if (rc == 0) {
        *event_id = r->register_event->event_id;
        dpclip__reply__free_unpacked(r, NULL);
    }
    cl_unlock(c);
    return rc;
}

/* --- done flags ------------------------------------------------------------ */

static int host_api(void) {
    pthread_once(&g_cu_once, cu_load);
    return g_cu_ok && g_cu.mem_host_register && g_cu.mem_host_unregister &&
           g_cu.mem_host_get_device_pointer && g_cu.stream_wait_value32;
}

DPCLIP_API int dpclip_cuda_host_map(void *ptr, size_t size, void **dev_ptr) {
    cl_cudeviceptr d = 0;
    if (!ptr || !size || !dev_ptr) return DPCLIP_EARG;
    if (!host_api()) return DPCLIP_EUNAVAIL;
    if (g_cu.mem_host_register(ptr, size,
                               CL_CU_MEMHOSTREGISTER_PORTABLE | CL_CU_MEMHOSTREGISTER_DEVICEMAP))
        return DPCLIP_EUNAVAIL;
    if (g_cu.mem_host_get_device_pointer(&d, ptr, 0)) {
        (void)g_cu.mem_host_unregister(ptr);
        return DPCLIP_EUNAVAIL;
    }
    *dev_ptr = (void *)(uintptr_t)d;
    return DPCLIP_OK;
}

DPCLIP_API int dpclip_cuda_host_unmap(void *ptr) {
    if (!ptr) return DPCLIP_EARG;
    if (!host_api()) return DPCLIP_EUNAVAIL;
    return g_cu.mem_host_unregister(ptr) ? DPCLIP_EUNAVAIL : DPCLIP_OK;
}

DPCLIP_API int dpclip_cuda_wait_value(void *stream, const void *dev_ptr, uint32_t value) {
    if (!dev_ptr) return DPCLIP_EARG;
    if (!host_api()) return DPCLIP_EUNAVAIL;
    return g_cu.stream_wait_value32(stream, (cl_cudeviceptr)(uintptr_t)dev_ptr, value,
                                    CL_CU_STREAM_WAIT_VALUE_GEQ)
               ? DPCLIP_EUNAVAIL
               : DPCLIP_OK;
}

/* In the context that owns dev_ptr, pushed for the call: the calling
 * thread (a watcher) may have none current. */
DPCLIP_API int dpclip_cuda_zero_async(void *stream, void *dev_ptr, size_t bytes) {
    const cl_cudeviceptr d = (cl_cudeviceptr)(uintptr_t)dev_ptr;
    void *ctx = NULL, *popped = NULL;
    if (!bytes) return DPCLIP_OK;
    if (!dev_ptr) return DPCLIP_EARG;
    if (!host_api() || !g_cu.memset_d8_async || !g_cu.pointer_get_attribute ||
        !g_cu.ctx_push_current || !g_cu.ctx_pop_current)
        return DPCLIP_EUNAVAIL;
    if (g_cu.pointer_get_attribute(&ctx, CL_CU_POINTER_ATTRIBUTE_CONTEXT, d) || !ctx)
        return DPCLIP_EARG; /* not device memory of this process */
    if (g_cu.ctx_push_current(ctx)) return DPCLIP_EUNAVAIL;
    const cl_curesult r = g_cu.memset_d8_async(d, 0, bytes, stream);
    (void)g_cu.ctx_pop_current(&popped);
    return r ? DPCLIP_EUNAVAIL : DPCLIP_OK;
}
