#include "gpu.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "log.h"

/* The registry's CUDA unmap hook needs the GPU pools; the daemon has one
 * dc_gpu, set in dc_gpu_init before any session exists. */
static dc_gpu *g_gpu;

int dc_gpu_find_uuid(const dc_gpu *g, const uint8_t *uuid) {
    for (int i = 0; i < g->n; i++)
        if (g->has_uuid[i] && memcmp(g->uuids[i], uuid, DC_GPU_UUID_LEN) == 0) return i;
    return -1;
}

void dc_gpu_uuid_str(const uint8_t *u, char out[DC_GPU_UUID_STR]) {
    snprintf(out, DC_GPU_UUID_STR,
             "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", u[0], u[1],
             u[2], u[3], u[4], u[5], u[6], u[7], u[8], u[9], u[10], u[11], u[12], u[13], u[14],
             u[15]);
}

#ifdef DPCLIP_HAVE_CUDA
#include <cuda_runtime_api.h>
#include <dlfcn.h>

#include "dc_cuda.h"

/* The one driver-API call we need (the runtime has no way to ask for an
 * allocation's extent). It is looked up in the driver the runtime already
 * loaded instead of linking libcuda: a daemon built with the toolkit must
 * still start, CPU-only, on a machine without the NVIDIA driver. */
typedef int (*mem_get_address_range_fn)(unsigned long long *base, size_t *size,
                                        unsigned long long ptr);
static mem_get_address_range_fn g_mem_get_address_range;

static int load_driver_api(void) {
    void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL | RTLD_NOLOAD);
    if (!lib) lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!lib) return -1;
    *(void **)&g_mem_get_address_range = dlsym(lib, "cuMemGetAddressRange_v2");
    return g_mem_get_address_range ? 0 : -1;
}

static int cuda_fail(dc_err *err, const char *field, const char *what, cudaError_t e) {
    return dc_err_set(err, DC_EUNAVAIL, field, "%s: %s (%s)", what, cudaGetErrorString(e),
                      cudaGetErrorName(e));
}

typedef struct gpu_factory_arg {
    int device;
    uint64_t workspace, workspace_max, sample_grads_max;
} gpu_factory_arg;

static int gpu_factory(void *arg, int index, dc_backend **out, dc_err *err) {
    const gpu_factory_arg *a = arg;
    int rc;
    (void)index;
    if ((rc = dc_cuda_backend_create(a->device, out, err))) return rc;
    if ((rc = dc_cuda_backend_set_workspace(*out, (size_t)a->workspace, (size_t)a->workspace_max,
                                            err))) {
        dc_backend_destroy(*out);
        *out = NULL;
        return rc;
    }
    dc_cuda_backend_set_sample_grads(*out, a->sample_grads_max);
    if (a->sample_grads_max == DC_SAMPLE_GRADS_AUTO) /* say what auto came to */
        dc_log_info("cuda:%d keeps per-sample gradients in up to %.1f GiB of workspace "
                    "(gpu.sample_grads_max = auto: 1/%d of its memory)",
                    a->device, (double)dc_cuda_backend_sample_grads(*out) / (double)(1 << 30),
                    DC_SAMPLE_GRADS_PARTS);
    return 0;
}

/* MPS: clients find the control daemon through its pipe directory. */
static bool detect_mps(void) {
    const char *dir = getenv("CUDA_MPS_PIPE_DIRECTORY");
    char path[512];
    snprintf(path, sizeof path, "%s/control", dir && dir[0] ? dir : "/tmp/nvidia-mps");
    return access(path, F_OK) == 0;
}

static void open_work(dc_task *task, dc_backend *be) {
    dc_gpu_open_task *t = (dc_gpu_open_task *)task;
    cudaIpcMemHandle_t h;
    void *ptr = NULL;
    unsigned long long base = 0;
    size_t extent = 0;
    cudaError_t e;
    (void)be;

    memcpy(&h, t->handle, sizeof h);
    cudaSetDevice(t->device);
    e = cudaIpcOpenMemHandle(&ptr, h, cudaIpcMemLazyEnablePeerAccess);
    if (e != cudaSuccess) {
        t->rc = cuda_fail(&t->err, "register_buffer.cuda_ipc_handle", "cudaIpcOpenMemHandle", e);
        cudaGetLastError();
        return;
    }
    /* Never trust the client's size: bound it by the allocation's extent
     * as the driver sees it in our process. */
    if (g_mem_get_address_range(&base, &extent, (unsigned long long)(uintptr_t)ptr) != 0 ||
        base != (unsigned long long)(uintptr_t)ptr) {
        cudaIpcCloseMemHandle(ptr);
        t->rc = dc_err_set(&t->err, DC_EINVAL, "register_buffer.cuda_ipc_handle",
                           "cannot determine the allocation's extent");
        return;
    }
    if (t->size == 0) t->size = extent;
    if (t->size > extent) {
        cudaIpcCloseMemHandle(ptr);
        t->rc = dc_err_set(&t->err, DC_EINVAL, "register_buffer.size",
                           "size %llu exceeds the allocation's %zu bytes",
                           (unsigned long long)t->size, extent);
        return;
    }
    memset(&t->buf, 0, sizeof t->buf);
    t->buf.kind = DC_BUFFER_CUDA;
    t->buf.base = ptr;
    t->buf.size = t->size;
    t->buf.device = t->device;
    t->rc = 0;
}

static void open_done(dc_task *task) {
    dc_gpu_open_task *t = (dc_gpu_open_task *)task;
    t->done(t);
}

typedef struct close_task {
    dc_task task;
    int device;
    void *ptr;
    void *event;
} close_task;

static void close_work(dc_task *task, dc_backend *be) {
    close_task *t = (close_task *)task;
    (void)be;
    cudaSetDevice(t->device);
    if (t->ptr) cudaIpcCloseMemHandle(t->ptr);
    if (t->event) cudaEventDestroy((cudaEvent_t)t->event);
    cudaGetLastError();
}

static void close_done(dc_task *task) { free(task); }

static void post_close(dc_gpu *g, int device, void *ptr, void *event) {
    close_task *t;
    if (!g || device < 0 || device >= g->n) return;
    t = calloc(1, sizeof *t);
    if (!t) {
        dc_log_error("out of memory closing a CUDA handle; leaking it");
        return;
    }
    t->task.work = close_work;
    t->task.done = close_done;
    t->device = device;
    t->ptr = ptr;
    t->event = event;
    dc_worker_pool_submit(&g->pools[device], &t->task);
}

void dc_gpu_close_buffer(dc_gpu *g, dc_buffer *b) { post_close(g, b->device, b->base, NULL); }

static void registry_unmap(dc_buffer *b) { dc_gpu_close_buffer(g_gpu, b); }

static void event_work(dc_task *task, dc_backend *be) {
    dc_gpu_event_task *t = (dc_gpu_event_task *)task;
    cudaIpcEventHandle_t h;
    cudaEvent_t ev;
    cudaError_t e;
    (void)be;
    memcpy(&h, t->handle, sizeof h);
    cudaSetDevice(t->device);
    e = cudaIpcOpenEventHandle(&ev, h);
    if (e != cudaSuccess) {
        t->rc = cuda_fail(&t->err, "register_event.cuda_ipc_event_handle", "cudaIpcOpenEventHandle",
                          e);
        cudaGetLastError();
        return;
    }
    t->event = ev;
    t->rc = 0;
}

static void event_done(dc_task *task) {
    dc_gpu_event_task *t = (dc_gpu_event_task *)task;
    t->done(t);
}

int dc_gpu_init(dc_gpu *g, uv_loop_t *loop, bool enable, uint64_t workspace, uint64_t workspace_max,
                uint64_t sample_grads_max, dc_err *err) {
    int n, rc;
    memset(g, 0, sizeof *g);
    g_gpu = g;
    if (!enable) return 0;
    n = dc_cuda_device_count();
    if (n <= 0) {
        dc_log_info("no CUDA device found; serving with the CPU backend only");
        return 0;
    }
    if (n > DC_MAX_GPUS) {
        dc_log_warn("%d CUDA devices found; serving the first %d (DC_MAX_GPUS), the others "
                    "stay unused",
                    n, DC_MAX_GPUS);
        n = DC_MAX_GPUS;
    }
    if (load_driver_api() != 0) {
        dc_log_warn("CUDA devices found but the driver API (libcuda.so.1) cannot be loaded; "
                    "serving with the CPU backend only");
        return 0;
    }
    g->pools = calloc((size_t)n, sizeof *g->pools);
    if (!g->pools) return dc_err_set(err, DC_ENOSPACE, "", "out of memory");
    for (int i = 0; i < n; i++) {
        struct cudaDeviceProp prop;
        gpu_factory_arg fa = {i, workspace, workspace_max, sample_grads_max};
        char name[16];
        snprintf(name, sizeof name, "cuda%d", i);
        if ((rc = dc_worker_pool_init(&g->pools[i], loop, name, 1, gpu_factory, &fa, err))) {
            g->n = i; /* the ones started */
            dc_gpu_close(g);
            return rc;
        }
        g->n = i + 1;
        if (cudaGetDeviceProperties(&prop, i) == cudaSuccess) {
            snprintf(g->names[i], sizeof g->names[i], "%.63s", prop.name);
            _Static_assert(sizeof prop.uuid.bytes == DC_GPU_UUID_LEN, "a CUDA UUID is 16 bytes");
            memcpy(g->uuids[i], prop.uuid.bytes, DC_GPU_UUID_LEN);
            g->has_uuid[i] = true;
        }
    }
    dc_registry_set_cuda_unmap(registry_unmap);
    g->mps_active = detect_mps();
    if (g->mps_active) dc_log_info("%d GPU(s); CUDA MPS is active", g->n);
    else
        dc_log_warn("%d GPU(s); CUDA MPS is NOT active: each trainer<->daemon hand-off costs "
                    "two GPU context switches (~0.3 ms per step); see docs/gpu.md",
                    g->n);
    return 0;
}

int dc_gpu_open_buffer(dc_gpu *g, dc_gpu_open_task *t) {
    if (t->device < 0 || t->device >= g->n) return DC_EINVAL;
    t->task.work = open_work;
    t->task.done = open_done;
    dc_worker_pool_submit(&g->pools[t->device], &t->task);
    return 0;
}

int dc_gpu_open_event(dc_gpu *g, dc_gpu_event_task *t) {
    if (t->device < 0 || t->device >= g->n) return DC_EINVAL;
    t->task.work = event_work;
    t->task.done = event_done;
    dc_worker_pool_submit(&g->pools[t->device], &t->task);
    return 0;
}

void dc_gpu_close_event(dc_gpu *g, int device, void *event) { post_close(g, device, NULL, event); }

#else /* no CUDA in this build */

int dc_gpu_init(dc_gpu *g, uv_loop_t *loop, bool enable, uint64_t workspace, uint64_t workspace_max,
                uint64_t sample_grads_max, dc_err *err) {
    (void)loop;
    (void)enable;
    (void)workspace;
    (void)workspace_max;
    (void)sample_grads_max;
    (void)err;
    memset(g, 0, sizeof *g);
    g_gpu = g;
    return 0;
}

int dc_gpu_open_buffer(dc_gpu *g, dc_gpu_open_task *t) {
    (void)g;
    (void)t;
    return DC_EUNAVAIL;
}

int dc_gpu_open_event(dc_gpu *g, dc_gpu_event_task *t) {
    (void)g;
    (void)t;
    return DC_EUNAVAIL;
}

void dc_gpu_close_buffer(dc_gpu *g, dc_buffer *b) {
    (void)g;
    (void)b;
}

void dc_gpu_close_event(dc_gpu *g, int device, void *event) {
    (void)g;
    (void)device;
    (void)event;
}

#endif

/* Through the backend interface: the same with or without CUDA in the
 * build (a backend without a device queue refuses). */
int dc_gpu_wait_event(dc_backend *be, void *event, dc_err *err) {
    if (dc_backend_wait_event(be, event) != 0)
        return dc_err_set(err, DC_EUNAVAIL, "clip_step.wait_event",
                          "cannot make the daemon's %s stream wait on the event",
                          dc_backend_name(be));
    return 0;
}

int dc_gpu_record_event(dc_backend *be, void *event, dc_err *err) {
    if (dc_backend_record_event(be, event) != 0)
        return dc_err_set(err, DC_EUNAVAIL, "clip_step.signal_event",
                          "cannot record the event on the daemon's %s stream", dc_backend_name(be));
    return 0;
}

/* The pools' array goes only when the loop has closed every pool's handle:
 * freeing it at once left libuv finishing the close of freed memory (an
 * assertion in uv__finish_close at shutdown, seen on GPU machines). */
static void pool_closed(dc_worker_pool *p) {
    dc_gpu *g = p->closed_arg;
    if (--g->n_closing > 0) return;
    free(g->closing);
    g->closing = NULL;
}

void dc_gpu_close(dc_gpu *g) {
    if (!g->pools) return;
    if (g->n == 0) {
        free(g->pools);
        g->pools = NULL;
        return;
    }
    g->closing = g->pools;
    g->n_closing = g->n;
    for (int i = 0; i < g->n; i++) {
        g->pools[i].closed = pool_closed;
        g->pools[i].closed_arg = g;
        dc_worker_pool_close(&g->pools[i]);
    }
    g->pools = NULL;
    g->n = 0;
}

int dc_gpu_busy(const dc_gpu *g) {
    int n = 0;
    for (int i = 0; i < g->n; i++) n += dc_worker_pool_busy(&g->pools[i]);
    return n;
}
