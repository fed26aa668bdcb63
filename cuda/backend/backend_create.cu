/* The CUDA backend's instance: made (dc_cuda_backend_create: its device,
 * stream and cuBLAS handle, and its ops table, backend.h) and destroyed.
 * Its steps run in backend_cuda.cu.
 *
 * Ownership: the instance owns its stream, cuBLAS handle, device workspace,
 * pinned host block, events, kept store and per-step tables; destroy frees
 * them all once its stream is idle. */
#include <stdlib.h>

#include "backend_int.h"

using namespace dcb;

namespace {

void cuda_destroy(dc_backend *be) {
    cuda_backend *cb = (cuda_backend *)be;
    if (!cb) return;
    cudaSetDevice(cb->device);
    if (cb->stream) cudaStreamSynchronize(cb->stream);
    kept_destroy(cb);
    pthread_mutex_destroy(&cb->kept_mu);
    if (cb->blas) cublasDestroy(cb->blas);
    if (cb->stream) cudaStreamDestroy(cb->stream);
    if (cb->ws) cudaFree(cb->ws);
    if (cb->hash_dev) cudaFree(cb->hash_dev);
    if (cb->host) cudaFreeHost(cb->host);
    (void)cudaGetLastError();
    for (int i = 0; i <= DC_CUDA_PHASES; i++)
        if (cb->ev[i]) cudaEventDestroy(cb->ev[i]);
    if (cb->ev_wait) cudaEventDestroy(cb->ev_wait);
    if (cb->ev_done) cudaEventDestroy(cb->ev_done);
    (void)cudaGetLastError();
    free(cb->lay_off);
    free(cb->bk);
    free(cb->bk_grouped);
    free(cb->nm);
    free(cb->nm_grouped);
    free(cb->safe);
    free(cb->woff);
    free(cb->sg_off);
    free(cb->sg_unstaged);
    free(cb->bk_direct);
    free(cb->bkd);
    free(cb->sg_out);
    free(cb->bk_layer);
    free(cb->sgl);
    free(cb->ovr_n2);
    free(cb->ovr);
    free(cb);
}

const dc_backend_ops cuda_ops = {"cuda",
                                 cuda_run_step,
                                 cuda_destroy,
                                 cuda_run_norms,
                                 cuda_run_clip,
                                 kept_give,
                                 dc_cuda_backend_wait_event,
                                 dc_cuda_backend_record_event,
                                 dc_cuda_backend_workspace_bytes,
                                 cuda_acc_alloc,
                                 cuda_acc_free,
                                 cuda_tensors_hash,
                                 cuda_norm_times,
                                 dc_cuda_backend_zero_outputs,
                                 cuda_release,
                                 dc_cuda_backend_kept_bytes};

} // namespace

extern "C" int dc_cuda_backend_create(int device, dc_backend **out, dc_err *err) {
    cuda_backend *cb = (cuda_backend *)calloc(1, sizeof *cb);
    cudaError_t e;
    if (!cb) return dc_err_set(err, DC_ENOSPACE, "", "out of memory");
    cb->base.ops = &cuda_ops;
    cb->device = device;
    pthread_mutex_init(&cb->kept_mu, NULL);
    if ((e = cudaSetDevice(device)) != cudaSuccess ||
        (e = cudaStreamCreateWithFlags(&cb->stream, cudaStreamNonBlocking)) != cudaSuccess) {
        (void)cudaGetLastError();
        free(cb);
        return dc_err_set(err, DC_EUNAVAIL, "", "cannot open cuda:%d: %s", device,
                          cudaGetErrorString(e));
    }
    if (cublasCreate(&cb->blas) != CUBLAS_STATUS_SUCCESS ||
        cublasSetStream(cb->blas, cb->stream) != CUBLAS_STATUS_SUCCESS ||
        cublasSetPointerMode(cb->blas, CUBLAS_POINTER_MODE_DEVICE) != CUBLAS_STATUS_SUCCESS) {
        if (cb->blas) cublasDestroy(cb->blas);
        cudaStreamDestroy(cb->stream);
        free(cb);
        return dc_err_set(err, DC_EUNAVAIL, "", "cannot create a cuBLAS handle on cuda:%d", device);
    }
    *out = &cb->base;
    /* Phase timing feeds the daemon's per-phase histograms: on unless
     * DPCLIP_CUDA_PROFILE=0 (ten event records a step, a few microseconds
     * of host time that overlap the GPU's work). */
    dc_cuda_backend_set_sample_grads(&cb->base, DC_SAMPLE_GRADS_AUTO);
    dcc_options_from_env(&cb->opt);
    if (cb->opt.profile) (void)dc_cuda_backend_profile(&cb->base, 1);
    return 0;
}
