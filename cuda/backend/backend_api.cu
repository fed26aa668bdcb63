/* The CUDA backend's small C API around run_step (dc_cuda.h): the device
 * count, the cost model's choice, phase timing, interprocess events on the
 * backend's stream, and the workspace setting.
 * Each call runs on the worker thread that owns the instance. */
#include <string.h>

#include "backend_int.h"

using namespace dcb;

extern "C" int dc_cuda_device_count(void) {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
        (void)cudaGetLastError();
        return 0;
    }
    return n;
}

extern "C" dc_algo dc_cuda_linear_pick(const dc_layer *l) {
    if (l->T > INT32_MAX || l->d > INT32_MAX || l->p > INT32_MAX) return dc_linear_pick(l);
    return dcc_linear_pick((int)l->T, (int)l->d, (int)l->p, l->algo);
}

extern "C" int dc_cuda_backend_profile(dc_backend *be, int on) {
    cuda_backend *cb = (cuda_backend *)be;
    if (on && !cb->ev[0]) {
        if (cudaSetDevice(cb->device) != cudaSuccess) return DC_EUNAVAIL;
        for (int i = 0; i <= DC_CUDA_PHASES; i++)
            if (cudaEventCreate(&cb->ev[i]) != cudaSuccess) {
                (void)cudaGetLastError();
                for (int j = 0; j < i; j++) cudaEventDestroy(cb->ev[j]);
                memset(cb->ev, 0, sizeof cb->ev);
                return DC_EUNAVAIL;
            }
        if (cudaEventCreate(&cb->ev_wait) != cudaSuccess) {
            (void)cudaGetLastError();
            cb->ev_wait = NULL;
        }
    }
    cb->prof = on != 0;
    for (int i = 0; i < DC_CUDA_PHASES; i++) cb->phase_ms[i] = -1.0f;
    return 0;
}

extern "C" int dc_cuda_backend_phase_ms(const dc_backend *be, float ms[DC_CUDA_PHASES]) {
    const cuda_backend *cb = (const cuda_backend *)be;
    if (!cb->prof) return DC_EPRECOND;
    memcpy(ms, cb->phase_ms, sizeof cb->phase_ms);
    return 0;
}

extern "C" const char *dc_cuda_phase_name(int phase) {
    static const char *const names[DC_CUDA_PHASES] = {"setup",   "norms",  "coefs",
                                                      "clipped", "check",  "kept",
                                                      "noise",   "commit", "download"};
    return phase >= 0 && phase < DC_CUDA_PHASES ? names[phase] : "?";
}

extern "C" int dc_cuda_backend_wait_event(dc_backend *be, void *cuda_event) {
    cuda_backend *cb = (cuda_backend *)be;
    if (cb->prof && cb->ev_wait && !cb->broken &&
        cudaEventRecord(cb->ev_wait, cb->stream) == cudaSuccess)
        cb->waited = true;
    if (cb->broken || cudaSetDevice(cb->device) != cudaSuccess ||
        cudaStreamWaitEvent(cb->stream, (cudaEvent_t)cuda_event, 0) != cudaSuccess) {
        (void)cudaGetLastError();
        return DC_EUNAVAIL;
    }
    return 0;
}

extern "C" int dc_cuda_backend_record_event(dc_backend *be, void *cuda_event) {
    cuda_backend *cb = (cuda_backend *)be;
    if (cb->broken || cudaSetDevice(cb->device) != cudaSuccess ||
        cudaEventRecord((cudaEvent_t)cuda_event, cb->stream) != cudaSuccess) {
        (void)cudaGetLastError();
        return DC_EUNAVAIL;
    }
    return 0;
}

extern "C" int dc_cuda_backend_set_workspace(dc_backend *be, size_t initial, size_t max,
                                             dc_err *err) {
    cuda_backend *cb = (cuda_backend *)be;
    cb->ws_max = max;
    cb->ws_pre = initial;
    if (initial <= cb->ws_cap) return 0;
    if (cudaSetDevice(cb->device) != cudaSuccess) {
        (void)cudaGetLastError();
        return dc_err_set(err, DC_EUNAVAIL, "", "cannot select cuda:%d", cb->device);
    }
    if (ws_alloc(cb, initial, err))
        return dc_err_set(err, DC_ENOSPACE, "workspace",
                          "cannot preallocate gpu.workspace = %zu bytes on cuda:%d", initial,
                          cb->device);
    return 0;
}

extern "C" void dc_cuda_backend_set_sample_grads(dc_backend *be, uint64_t max) {
    cuda_backend *cb = (cuda_backend *)be;
    if (max == DC_SAMPLE_GRADS_AUTO) {
        size_t avail = 0, total = 0;
        /* the instance's device is current on its thread (create, the worker) */
        if (cudaMemGetInfo(&avail, &total) != cudaSuccess) {
            (void)cudaGetLastError();
            total = 0; /* keep none rather than guess */
        }
        max = total / DC_SAMPLE_GRADS_PARTS;
    }
    cb->sg_max = max > SIZE_MAX ? SIZE_MAX : (size_t)max;
}

extern "C" uint64_t dc_cuda_backend_sample_grads(const dc_backend *be) {
    return ((const cuda_backend *)be)->sg_max;
}

extern "C" int dc_cuda_backend_kept_layers(const dc_backend *be) {
    return ((const cuda_backend *)be)->sg_kept;
}

extern "C" size_t dc_cuda_backend_kept_bytes(const dc_backend *be) {
    return ((const cuda_backend *)be)->kept_bytes;
}

/* the workspace alone: the daemon's advice on gpu.workspace reads it (the
 * norm phases' kept stores, backend_kept.cu, are not part of it) */
extern "C" size_t dc_cuda_backend_workspace_bytes(const dc_backend *be) {
    return ((const cuda_backend *)be)->ws_cap;
}

extern "C" int dc_cuda_backend_kept_direct(const dc_backend *be) {
    return ((const cuda_backend *)be)->sg_direct;
}

extern "C" int dc_cuda_backend_direct_layers(const dc_backend *be) {
    return ((const cuda_backend *)be)->bkd_n;
}

extern "C" int dc_cuda_backend_amax_found(const dc_backend *be) {
    return ((const cuda_backend *)be)->amax_found;
}

extern "C" void dc_cuda_backend_get_options(const dc_backend *be, dcc_options *out) {
    *out = ((const cuda_backend *)be)->opt;
}

extern "C" void dc_cuda_backend_set_options(dc_backend *be, const dcc_options *o) {
    ((cuda_backend *)be)->opt = *o;
}

extern "C" int dc_cuda_backend_zero_outputs(dc_backend *be, const dc_step *s) {
    cuda_backend *cb = (cuda_backend *)be;
    bool ok = !cb->broken && cudaSetDevice(cb->device) == cudaSuccess;
    for (size_t i = 0; ok && i < dc_step_n_outputs(s); i++) {
        const dc_tensor *t = dc_step_output(s, i);
        uint64_t n;
        if (!t->data) continue;
        numel_out(t, &n);
        ok = cudaMemsetAsync(t->data, 0, n * dc_dtype_size(t->dtype), cb->stream) == cudaSuccess;
    }
    if (ok) ok = cudaStreamSynchronize(cb->stream) == cudaSuccess;
    if (!ok) (void)cudaGetLastError();
    return ok ? 0 : DC_EUNAVAIL;
}
