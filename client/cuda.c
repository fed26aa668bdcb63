/* CUDA IPC registration for libdpclip.
 *
 * The library must link and run on machines without CUDA, and must use the
 * same driver (and so the same contexts) as the trainer's framework: it loads
 * libcuda.so.1 with dlopen on first use and calls the driver API, whose
 * functions act on the calling thread's current context (the primary context
 * the CUDA runtime, and PyTorch, make current).
 *
 * Registered allocations are cached per handle by (device, base): a tensor
 * inside an allocation already registered costs one cuMemGetAddressRange and
 * one cuIpcGetMemHandle (to notice an allocation freed and replaced at the
 * same address, whose handle differs), no round trip. */
#include <dlfcn.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

typedef int cl_curesult;
typedef unsigned long long cl_cudeviceptr;
#define CL_CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL 9

typedef struct cl_cuda_api {
    void *lib;
    cl_curesult (*mem_get_address_range)(cl_cudeviceptr *base, size_t *size, cl_cudeviceptr p);
    cl_curesult (*ipc_get_mem_handle)(void *handle64, cl_cudeviceptr p);
    cl_curesult (*pointer_get_attribute)(void *data, int attr, cl_cudeviceptr p);
    cl_curesult (*get_error_string)(cl_curesult e, const char **s);
    cl_curesult (*device_get)(int *dev, int ordinal);
    cl_curesult (*device_get_uuid)(unsigned char uuid[16], int dev);
} cl_cuda_api;

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
    *(void **)&g_cu.get_error_string = dlsym(lib, "cuGetErrorString");
    *(void **)&g_cu.device_get = dlsym(lib, "cuDeviceGet");
    *(void **)&g_cu.device_get_uuid = dlsym(lib, "cuDeviceGetUuid_v2");
    if (!g_cu.device_get_uuid) *(void **)&g_cu.device_get_uuid = dlsym(lib, "cuDeviceGetUuid");
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

void cl_cuda_forget(dpclip_client *c, uint64_t id) {
    for (size_t i = 0; i < c->cb_n; i++)
        if (c->cuda_bufs[i].id == id) {
            c->cuda_bufs[i] = c->cuda_bufs[--c->cb_n];
            return;
        }
}

DPCLIP_API int dpclip_buffer_register_cuda(dpclip_client *c, const void *dev_ptr,
                                           uint64_t *buffer_id, uint64_t *offset) {
    cl_cudeviceptr p = (cl_cudeviceptr)(uintptr_t)dev_ptr, base = 0;
    size_t size = 0;
    uint8_t handle[64];
    int device = -1, rc;
    cl_curesult e;
    cl_cuda_buf *hit = NULL;

    if (!c || !dev_ptr || !buffer_id || !offset) return DPCLIP_EARG;
    pthread_once(&g_cu_once, cu_load);
    cl_lock(c);
    if (!g_cu_ok) {
        rc = cl_fail(c, DPCLIP_EUNAVAIL, "", "no CUDA driver (libcuda.so.1) in this process");
        goto out;
    }
    if ((e = g_cu.pointer_get_attribute(&device, CL_CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, p)) ||
        (e = g_cu.mem_get_address_range(&base, &size, p))) {
        rc = cl_fail(c, DPCLIP_EARG, "", "not a CUDA device pointer: %s", cu_err(e));
        goto out;
    }
    if ((e = g_cu.ipc_get_mem_handle(handle, base))) {
        rc = cl_fail(c, DPCLIP_EARG, "",
                     "cuIpcGetMemHandle: %s (memory from cudaMalloc-style "
                     "allocators can be shared; VMM/async-pool memory cannot)",
                     cu_err(e));
        goto out;
    }
    for (size_t i = 0; i < c->cb_n; i++)
        if (c->cuda_bufs[i].device == device && c->cuda_bufs[i].base == base)
            hit = &c->cuda_bufs[i];
    if (hit && hit->size == size && memcmp(hit->handle, handle, 64) == 0) {
        *buffer_id = hit->id;
        *offset = p - base;
        rc = 0;
        goto out;
    }
    if (hit) {
        /* Freed and replaced at the same address: the old registration maps
         * memory that is no longer this tensor's. */
        uint64_t old = hit->id;
        cl_cuda_forget(c, old);
        if ((rc = cl_release_buffer(c, old)) && rc != DPCLIP_ENOTFOUND) goto out;
    }
    if (c->cb_n == c->cb_capn) {
        size_t n = c->cb_capn ? 2 * c->cb_capn : 8;
        cl_cuda_buf *nb = realloc(c->cuda_bufs, n * sizeof *nb);
        if (!nb) {
            rc = cl_fail(c, DPCLIP_ENOMEM, "", "out of memory");
            goto out;
        }
        c->cuda_bufs = nb;
        c->cb_capn = n;
    }
    if ((rc = register_handle(c, handle, size, device, buffer_id))) goto out;
    hit = &c->cuda_bufs[c->cb_n++];
    hit->id = *buffer_id;
    hit->device = device;
    hit->base = base;
    hit->size = size;
    memcpy(hit->handle, handle, 64);
    *offset = p - base;
out:
    cl_unlock(c);
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
