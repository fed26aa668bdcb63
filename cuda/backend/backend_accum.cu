/* The CUDA backend's memory for what outlives a step: a logical step's
 * accumulators (backend.h acc_alloc / acc_free; accum.cu folds sums into
 * them), and the keyed checksum of a tensor (tensor_hash; hash.cu), by which
 * a norm group checks that its members' replicated layers hold one copy. */
#include "backend_int.h"

namespace dcb {

float *cuda_acc_alloc(dc_backend *be, size_t n) {
    cuda_backend *cb = (cuda_backend *)be;
    void *p = NULL;
    /* cudaMalloc: no pool holds them past the session that owns them */
    if (cudaSetDevice(cb->device) != cudaSuccess ||
        cudaMalloc(&p, (n ? n : 1) * sizeof(float)) != cudaSuccess) {
        (void)cudaGetLastError();
        return NULL;
    }
    return (float *)p;
}

void cuda_acc_free(dc_backend *be, float *p) {
    cuda_backend *cb = (cuda_backend *)be;
    if (!p || cudaSetDevice(cb->device) != cudaSuccess) return;
    /* the backend's stream may still read it: the stream's work first */
    (void)cudaStreamSynchronize(cb->stream);
    (void)cudaFree(p);
}

int cuda_tensor_hash(dc_backend *be, const dc_tensor *t, uint64_t key, uint64_t *out, dc_err *err) {
    cuda_backend *cb = (cuda_backend *)be;
    uint64_t n = dc_dtype_size(t->dtype);
    cudaError_t e;
    for (int i = 0; i < t->ndim; i++) n *= (uint64_t)t->shape[i];
    if ((e = cudaSetDevice(cb->device)) != cudaSuccess) return cuda_fail(cb, err, e, "a device");
    if (!cb->hash_dev &&
        (e = cudaMalloc((void **)&cb->hash_dev, sizeof *cb->hash_dev)) != cudaSuccess)
        return cuda_fail(cb, err, e, "the checksum's scratch");
    unsigned long long h = 0;
    if ((e = cudaMemsetAsync(cb->hash_dev, 0, sizeof *cb->hash_dev, cb->stream)) != cudaSuccess ||
        (e = dcc_tensor_hash(t->data, n, key, cb->hash_dev, cb->stream)) != cudaSuccess ||
        (e = cudaMemcpyAsync(&h, cb->hash_dev, sizeof h, cudaMemcpyDeviceToHost, cb->stream)) !=
            cudaSuccess ||
        (e = cudaStreamSynchronize(cb->stream)) != cudaSuccess)
        return cuda_fail(cb, err, e, "a tensor's checksum");
    *out = (uint64_t)h;
    return 0;
}

} // namespace dcb
