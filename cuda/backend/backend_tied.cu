/* Tied parameters in the CUDA backend (dc_layer.tie): an embedding and a
 * linear layer sharing one weight. Their norms: each layer's own kernels
 * (the later layer's without its bias), then dcc_tied_sqnorms moves the
 * later layer's part into the owner's with the cross term. Their clipped
 * sum: one staging slice, the owner's weight output, which the linear
 * layer's sum overwrites and the embedding's then adds onto
 * (tied_deferred); the noise is drawn once for it, as for any output. */
#include "backend_int.h"

namespace dcb {

void tied_offsets(cuda_backend *cb, const dc_step *s, const dcc_out *outs) {
    int oi = 0;
    for (size_t l = 0; l < s->n_layers; l++) {
        const dc_layer *ly = &s->layers[l];
        cb->woff[l] = want_out(ly, 0) ? outs[oi].off : UINT64_MAX;
        oi += (int)want_out(ly, 0) + (int)want_out(ly, 1);
    }
    for (size_t l = 0; l < s->n_layers; l++)
        if (dc_layer_tied_later(&s->layers[l])) cb->woff[l] = cb->woff[s->layers[l].tie - 1];
}

int tied_norms(cuda_backend *cb, const dc_step *s, const layout *Lo, float s2, dc_err *err) {
    const int B = (int)s->batch;
    float *n2 = (float *)(cb->ws + Lo->n2);
    for (size_t l = 0; l < s->n_layers; l++) {
        const dc_layer *ly = &s->layers[l];
        if (!dc_layer_tied_later(ly)) continue;
        size_t o = ly->tie - 1;
        const dc_layer *e = ly->kind == DC_LAYER_EMBEDDING ? ly : &s->layers[o];
        const dc_layer *n = ly->kind == DC_LAYER_LINEAR ? ly : &s->layers[o];
        dcc_embedding E = embedding_of(e, B);
        dcc_linear N = linear_of(cb, n, B, false, false);
        cudaError_t e_ = dcc_tied_sqnorms(&E, &N, ly == n && ly->has_bias, s2, n2 + o * B,
                                          n2 + l * B, (double *)(cb->ws + Lo->temp), cb->stream);
        if (e_ != cudaSuccess) return cuda_fail(cb, err, e_, ly->name);
    }
    return 0;
}

} // namespace dcb
