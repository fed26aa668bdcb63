/* The CUDA backend's memory for what outlives a step: a logical step's
 * accumulators (backend.h acc_alloc / acc_free; accum.cu folds sums into
 * them), and the keyed checksum of a tensor (tensors_hash; hash.cu), by which
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

/* Every tensor's kernel queued into one scratch array, then one copy home
 * and one wait: a step's seal costs a wait, not one per tensor. */
int cuda_tensors_hash(dc_backend *be, const dc_tensor *const *ts, size_t n, uint64_t key,
                      uint64_t *out, dc_err *err) {
    cuda_backend *cb = (cuda_backend *)be;
    cudaError_t e;
    if (n == 0) return 0;
    if ((e = cudaSetDevice(cb->device)) != cudaSuccess) return cuda_fail(cb, err, e, "a device");
    if (n > cb->hash_cap) {
        if (cb->hash_dev) {
            (void)cudaStreamSynchronize(cb->stream);
            (void)cudaFree(cb->hash_dev);
            cb->hash_dev = NULL;
            cb->hash_cap = 0;
        }
        if ((e = cudaMalloc((void **)&cb->hash_dev, n * sizeof *cb->hash_dev)) != cudaSuccess)
            return cuda_fail(cb, err, e, "the checksums' scratch");
        cb->hash_cap = n;
    }
    if ((e = cudaMemsetAsync(cb->hash_dev, 0, n * sizeof *cb->hash_dev, cb->stream)) != cudaSuccess)
        return cuda_fail(cb, err, e, "the checksums' scratch");
    for (size_t i = 0; i < n; i++) {
        uint64_t bytes = dc_dtype_size(ts[i]->dtype);
        for (int d = 0; d < ts[i]->ndim; d++) bytes *= (uint64_t)ts[i]->shape[d];
        if ((e = dcc_tensor_hash(ts[i]->data, bytes, key, cb->hash_dev + i, cb->stream)) !=
            cudaSuccess)
            return cuda_fail(cb, err, e, "a tensor's checksum");
    }
    static_assert(sizeof(unsigned long long) == sizeof(uint64_t), "a checksum is 64 bits");
    if ((e = cudaMemcpyAsync(out, cb->hash_dev, n * sizeof *out, cudaMemcpyDeviceToHost,
                             cb->stream)) != cudaSuccess ||
        (e = cudaStreamSynchronize(cb->stream)) != cudaSuccess)
        return cuda_fail(cb, err, e, "the tensors' checksums");
    return 0;
}

} // namespace dcb
