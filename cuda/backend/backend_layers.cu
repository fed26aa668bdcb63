/* A step's layers on the CUDA backend: each layer's per-sample norms and
 * clipped sums by kind (the kernels in norms_*.cu, clip.cu, pad.cu, cuBLAS),
 * the grouped launches over many layers, and the snapshot of the
 * embeddings' indices. backend_cuda.cu drives them phase by phase. */
#include <string.h>

#include "backend_int.h"

namespace dcb {

int layer_norms(cuda_backend *cb, const dc_step *s, size_t l, const layout *Lo, float s2,
                const step_opts &opt, dc_err *err) {
    const dc_layer *ly = &s->layers[l];
    const int B = (int)s->batch;
    float *n2 = (float *)(cb->ws + Lo->n2) + l * B;
    uint32_t *flags = (uint32_t *)(cb->ws + Lo->flags) + l * B;
    cudaError_t e = cudaSuccess;
    int rc = 0;
    if (cb->ovr_active && cb->ovr[l]) /* a rescued layer: its host-computed norms */
        e = cudaMemcpyAsync(n2, cb->ovr_n2 + l * B, (size_t)B * sizeof(float),
                            cudaMemcpyHostToDevice, cb->stream);
    else switch (ly->kind) {
        case DC_LAYER_LINEAR: {
            dcc_linear x = linear_of(cb, ly, B, dc_layer_norm_bias(ly), opt.tf32);
            if (x.has_bias && Lo->bsum != SIZE_MAX) x.bias_ws = cb->ws + Lo->bsum;
            const dc_algo algo = dcc_linear_pick_for(&x, ly->algo);
            if (!dcc_pad_wanted(&x)) {
                e = dcc_linear_sqnorms(&x, algo, s2, n2, cb->stream);
                break;
            }
            /* rows not on 16 bytes: padded copies, a few samples at a time */
            const int n = dcc_pad_samples(&x, PAD_CAP);
            for (int b0 = 0; b0 < B && e == cudaSuccess; b0 += n) {
                dcc_linear c;
                e = dcc_pad_chunk(&x, b0, B - b0 < n ? B - b0 : n, cb->ws + Lo->temp, &c,
                                  cb->stream);
                if (e == cudaSuccess) e = dcc_linear_sqnorms(&c, algo, s2, n2 + b0, cb->stream);
            }
            break;
        }
        case DC_LAYER_EMBEDDING: {
            dcc_embedding x = embedding_of(ly, B);
            e = dcc_embedding_sqnorms(&x, s2, n2, flags, cb->ws + Lo->temp, Lo->temp_bytes,
                                      cb->stream);
            break;
        }
        case DC_LAYER_LAYERNORM:
        case DC_LAYER_RMSNORM: {
            dcc_norm x = norm_of(ly, B);
            e = dcc_norm_sqnorms(&x, s2, n2, flags, (float *)(cb->ws + Lo->temp),
                                 (float *)(cb->ws + cb->lay_off[l]), cb->stream);
            break;
        }
        default:
            return dc_err_set(err, DC_EINVAL, ly->name, "unknown layer kind %d", (int)ly->kind);
        }
    if (e != cudaSuccess) rc = cuda_fail(cb, err, e, ly->name);
    return rc;
}

int layer_clipped(cuda_backend *cb, const dc_step *s, size_t l, const layout *Lo,
                  const uint64_t off[2], const step_opts &opt, dc_err *err, bool add) {
    const dc_layer *ly = &s->layers[l];
    const int B = (int)s->batch;
    const float *cs = (const float *)(cb->ws + Lo->cs) + l * B;
    const float *one = (const float *)(cb->ws + Lo->up + Lo->consts) + 1;
    const float *zero = one - 1;
    float *w = off[0] != UINT64_MAX ? (float *)(cb->ws + Lo->staging) + off[0] : NULL;
    float *bias = off[1] != UINT64_MAX ? (float *)(cb->ws + Lo->staging) + off[1] : NULL;
    int rc = 0;
    switch (ly->kind) {
    case DC_LAYER_LINEAR: {
        const int T = (int)ly->T, d = (int)ly->d, p = (int)ly->p;
        cudaError_t tc = cudaErrorNotSupported;
        dcc_linear x = linear_of(cb, ly, B, ly->has_bias, opt.tf32);
        const bool pad = w && bk_per_sample(ly) && dcc_pad_wanted(&x);
        if (w && !pad) {
            if (dcc_linear_path(&x) == DCC_PATH_TF32)
                tc = dcc_linear_clipped_tf32(&x, cs, (int *)(cb->ws + Lo->perm) + l * B,
                                             (float *)(cb->ws + Lo->fac) + l * B, w, cb->stream);
            else tc = dcc_linear_clipped_tc(&x, cs, w, cb->stream);
            if (tc != cudaErrorNotSupported) CK(tc, "the clipped-sum kernel");
        }
        if (tc == cudaSuccess) {
            /* done on the tensor cores */
        } else if (pad) {
            /* per-sample GEMMs on padded copies: leading dimensions on 16
             * bytes, extents the real d and p */
            cudaDataType_t ty = ly->input.dtype == DC_BF16 ? CUDA_R_16BF : CUDA_R_16F;
            const int n = dcc_pad_samples(&x, PAD_CAP);
            for (int b0 = 0; b0 < B; b0 += n) {
                dcc_linear c;
                CK(dcc_pad_chunk(&x, b0, B - b0 < n ? B - b0 : n, cb->ws + Lo->temp, &c,
                                 cb->stream),
                   "the padded copy");
                for (int b = 0; b < c.B; b++) {
                    const char *ab = (const char *)c.a + (size_t)b * T * c.d * 2;
                    const char *gb = (const char *)c.g + (size_t)b * T * c.p * 2;
                    CKB(cublasGemmEx(cb->blas, CUBLAS_OP_N, CUBLAS_OP_T, d, p, T, cs + b0 + b, ab,
                                     ty, c.d, gb, ty, c.p, b0 + b ? one : zero, w, CUDA_R_32F, d,
                                     CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
                        "the clipped-sum GEMM");
                }
            }
        } else if (w && bk_per_sample(ly)) {
            cudaDataType_t ty = ly->input.dtype == DC_F32    ? CUDA_R_32F
                                : ly->input.dtype == DC_BF16 ? CUDA_R_16BF
                                                             : CUDA_R_16F;
            size_t esz = dc_dtype_size(ly->input.dtype);
            for (int b = 0; b < B; b++) {
                const char *ab = (const char *)ly->input.data + (size_t)b * T * d * esz;
                const char *gb = (const char *)ly->grad.data + (size_t)b * T * p * esz;
                CKB(cublasGemmEx(cb->blas, CUBLAS_OP_N, CUBLAS_OP_T, d, p, T, cs + b, ab, ty, d, gb,
                                 ty, p, b ? one : zero, w, CUDA_R_32F, d, CUBLAS_COMPUTE_32F,
                                 CUBLAS_GEMM_DEFAULT),
                    "the clipped-sum GEMM");
            }
        } else if (w) {
            int R = chunk_rows(ly, (uint32_t)B);
            float *af = (float *)(cb->ws + Lo->temp);
            float *gf = af + al((size_t)R * d * 4) / 4;
            int64_t rows = (int64_t)B * T;
            for (int64_t r0 = 0; r0 < rows; r0 += R) {
                int n = (int)(rows - r0 < R ? rows - r0 : R);
                CK(dcc_rows_to_f32(ly->input.data, ly->input.dtype, ly->grad.data, ly->grad.dtype,
                                   T, d, p, r0, n, cs, af, gf, cb->stream),
                   "the clipped-sum staging");
                CKB(cublasGemmEx(cb->blas, CUBLAS_OP_N, CUBLAS_OP_T, d, p, n, one, af, CUDA_R_32F,
                                 d, gf, CUDA_R_32F, p, r0 ? one : zero, w, CUDA_R_32F, d,
                                 CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
                    "the clipped-sum GEMM");
            }
        }
        if (bias) {
            CK(cudaMemsetAsync(bias, 0, (size_t)p * 4, cb->stream), "a memset");
            CK(dcc_bias_clipped_sum(ly->grad.data, ly->grad.dtype, B, T, p,
                                    dcc_linear_path(&x) == DCC_PATH_TF32, cs, bias, cb->stream),
               "the bias clipped sum");
        }
        break;
    }
    case DC_LAYER_EMBEDDING: {
        dcc_embedding x = embedding_of(ly, B);
        if (!add) /* add: onto the other use of a tied weight */
            CK(cudaMemsetAsync(w, 0, (size_t)ly->vocab * (size_t)ly->d * 4, cb->stream),
               "a memset");
        CK(dcc_embedding_clipped_sum(&x, cs, w, cb->stream), "the embedding clipped sum");
        break;
    }
    case DC_LAYER_LAYERNORM:
    case DC_LAYER_RMSNORM: {
        dcc_norm x = norm_of(ly, B);
        if (!w) {
            /* bias only: the weight sum goes to scratch it is never read from */
            w = (float *)(cb->ws + Lo->temp);
        }
        CK(dcc_norm_clipped_sum(&x, (const float *)(cb->ws + cb->lay_off[l]), cs, w, bias,
                                cb->stream),
           "the norm-layer clipped sum");
        break;
    }
    }
fail:
    return rc;
}

/* The grouped book-keeping launch for every LINEAR layer that qualifies and
 * wants its weight sum: its entries in cb->bk (cb->bk_n) and its marks in
 * cb->bk_grouped, so that layer_clipped skips those layers. The outputs it
 * writes whole (not a tied weight, onto which an embedding adds later) get
 * their max |.| from its epilogue (dcc_out.amax_found, set in the host
 * table before it goes up; dcc_bk_layer.amax_*). Returns how many. */
int grouped_clipped_plan(cuda_backend *cb, const dc_step *s, const layout *Lo, dcc_out *outs) {
    const int B = (int)s->batch;
    int n = 0, oi = 0, marked = 0;
    unsigned *amax = (unsigned *)(cb->ws + Lo->amax);
    float *staging = (float *)(cb->ws + Lo->staging);
    for (size_t l = 0; l < s->n_layers; l++) {
        const dc_layer *ly = &s->layers[l];
        int idx[2];
        for (int k = 0; k < 2; k++) cb->sg_out[2 * l + k] = idx[k] = want_out(ly, k) ? oi++ : -1;
        cb->bk_grouped[l] = false;
        if (ly->kind != DC_LAYER_LINEAR || cb->woff[l] == UINT64_MAX) continue;
        if (ly->tie) idx[0] = -1; /* the pair's embedding adds onto it */
        dcc_linear x = linear_of(cb, ly, B, ly->has_bias, false);
        if (!dcc_bk_grouped_ok(&x)) continue;
        cb->bk_layer[n] = (int)l;
        dcc_bk_layer *e = &cb->bk[n++];
        e->L = x;
        e->perm = (const int *)(cb->ws + Lo->perm) + l * (size_t)B;
        e->fac = (const float *)(cb->ws + Lo->fac) + l * (size_t)B;
        /* a tied layer's: its owner's; a direct one has none (oi_w, oi_b) */
        e->w = cb->bk_direct[l] ? NULL : staging + cb->woff[l];
        e->bias = idx[1] >= 0 && !cb->bk_direct[l] ? staging + outs[idx[1]].off : NULL;
        e->amax_w = e->amax_b = NULL;
        e->oi_w = cb->bk_direct[l] ? idx[0] : -1;
        e->oi_b = cb->bk_direct[l] ? idx[1] : -1;
        for (int k = 0; k < 2; k++) {
            if (idx[k] < 0) continue;
            outs[idx[k]].amax_found = 1;
            (k ? e->amax_b : e->amax_w) = amax + idx[k];
            marked++;
        }
        cb->bk_grouped[l] = true;
        /* the kept sum noises them, or the direct one (after the check) */
        if ((cb->sg_off[l] != SIZE_MAX && cb->sg_noised) || cb->bk_direct[l])
            for (int k = 0; k < 2; k++)
                if (idx[k] >= 0) {
                    outs[idx[k]].noised = 1;
                    outs[idx[k]].bound = out_bound(s, ly);
                }
    }
    cb->bk_n = n;
    return marked;
}

/* After a grouped launch that could not run every chunk: the planned
 * outputs' amax zeroed and their marks cleared on the device, so that the
 * output check scans what the per-layer sums write instead. */
static int amax_undo(cuda_backend *cb, const layout *Lo, dc_err *err) {
    int rc = 0;
    dcc_out *douts = (dcc_out *)(cb->ws + Lo->up + Lo->outs);
    const unsigned *amax0 = (const unsigned *)(cb->ws + Lo->amax);
    for (int i = 0; i < cb->bk_n; i++) {
        const dcc_bk_layer *e = &cb->bk[i];
        for (int k = 0; k < 2; k++) {
            unsigned *am = k ? e->amax_b : e->amax_w;
            if (!am) continue;
            CK(cudaMemsetAsync(am, 0, 4, cb->stream), "a memset");
            CK(cudaMemsetAsync(&douts[am - amax0].amax_found, 0, sizeof(uint32_t), cb->stream),
               "a memset");
            cb->amax_found--;
        }
    }
fail:
    return rc;
}

/* The biases' per-sample sums of kept layer l: after its weight's tiles in
 * the layer's share of the kept store (sgrad.cu's layout). */
static float *kept_bias(const cuda_backend *cb, size_t l, const dcc_linear *L) {
    return (float *)(cb->sg_base + cb->sg_off[l] + dcc_sgrad_bias_off(L));
}

/* Output oi of the step's table as the kept sum writes it (-1: none). */
static dcc_out_sink sink_of(const dcc_out *outs, int oi) {
    dcc_out_sink k;
    memset(&k, 0, sizeof k);
    if (oi >= 0) {
        k.dst = outs[oi].dst;
        k.key = outs[oi].key;
        k.step = outs[oi].step;
        k.stream = outs[oi].stream;
        k.dtype = outs[oi].dtype;
        k.nz_mod = outs[oi].nz_mod;
        k.nz_lo = outs[oi].nz_lo;
        k.nz_hi = outs[oi].nz_hi;
    }
    return k;
}

/* The planned grouped launch, and the layers whose gradients were kept
 * lined up for kept_sum (their outputs and noise keys from the step's
 * table, outs). Where the launch is not possible (e.g. no tensor-map
 * encoder) every other layer goes per layer instead. */
int grouped_clipped(cuda_backend *cb, const dc_step *s, const layout *Lo, const dcc_out *outs,
                    dc_err *err) {
    const int B = (int)s->batch;
    int rc = 0, n = 0, k = 0;
    cudaError_t e;
    cb->bkd_n = 0;
    int planned = 0; /* layers planned direct (plan_step) */
    for (size_t l = 0; l < s->n_layers; l++) planned += cb->bk_direct[l];
    if (cb->bk_n == 0 && planned == 0) return 0;
    /* the layers whose norms kept their per-sample gradients: a pass over
     * those (sgrad.cu); the direct ones' entries aside for after the output
     * check (direct_clipped); the others' moved up for the GEMM */
    for (int i = 0; i < cb->bk_n; i++) {
        const int l = cb->bk_layer[i];
        const dcc_bk_layer *b = &cb->bk[i];
        if (cb->bk_direct[l]) {
            cb->bkd[cb->bkd_n++] = *b;
            continue;
        }
        if (cb->sg_off[l] == SIZE_MAX) {
            cb->bk_layer[n] = l;
            cb->bk[n++] = *b;
            continue;
        }
        dcc_sg_layer *g = &cb->sgl[k++];
        g->sg = cb->sg_base + cb->sg_off[l];
        g->sgb = b->bias ? kept_bias(cb, l, &b->L) : NULL;
        g->cs = (const float *)(cb->ws + Lo->cs) + (size_t)l * B;
        g->w = b->w;
        g->bias = b->bias;
        g->amax_w = b->amax_w;
        g->amax_b = b->amax_b;
        g->out_w = sink_of(outs, cb->sg_out[2 * l]);
        g->out_b = sink_of(outs, cb->sg_out[2 * l + 1]);
        g->oi_w = cb->sg_out[2 * l];
        g->oi_b = cb->sg_out[2 * l + 1];
        g->unstaged = cb->sg_unstaged[l];
        g->acc_w = g->unstaged && g->oi_w >= 0 ? outs[g->oi_w].acc : NULL;
        g->acc_b = g->unstaged && g->oi_b >= 0 ? outs[g->oi_b].acc : NULL;
        g->d = b->L.d;
        g->p = b->L.p;
    }
    cb->bk_n = n;
    cb->sg_kept = k;
    /* every layer planned direct is in the launch: its outputs have no
     * staging, and the output passes leave them alone */
    if (planned != cb->bkd_n)
        return dc_err_set(err, DC_EINTERNAL, "clip_step",
                          "cuda:%d: %d layers planned to write their sums directly, %d in the "
                          "launch; nothing was written",
                          cb->device, planned, cb->bkd_n);
    if (n == 0 && cb->bkd_n == 0) return 0;
    CK(dcc_bk_order((const float *)(cb->ws + Lo->cs), (int)s->n_layers, B,
                    (int *)(cb->ws + Lo->perm), (float *)(cb->ws + Lo->fac), cb->stream),
       "the sample order");
    e = dcc_linear_clipped_grouped(cb->bk, cb->bk_n, cb->opt.grouped_layers, cb->stream);
    if (e == cudaErrorNotSupported) { /* nothing ran: those layers per layer */
        for (int i = 0; i < n; i++) cb->bk_grouped[cb->bk_layer[i]] = false;
        return amax_undo(cb, Lo, err);
    }
    CK(e, "the grouped clipped-sum kernel");
fail:
    return rc;
}

int direct_clipped(cuda_backend *cb, const layout *Lo, float noise_std, float divisor, int commit,
                   bool *refused, dc_err *err) {
    int rc = 0;
    *refused = false;
    if (cb->bkd_n == 0) return 0;
    char *ws = cb->ws;
    cudaError_t e = dcc_linear_clipped_direct(
        cb->bkd, cb->bkd_n, cb->opt.grouped_layers, (const dcc_out *)(ws + Lo->up + Lo->outs),
        noise_std, divisor, (const uint32_t *)(ws + Lo->mode), (uint32_t *)(ws + Lo->status),
        (unsigned long long *)(ws + Lo->bad), commit, cb->opt.noise, cb->stream);
    if (e == cudaErrorNotSupported && !commit) {
        *refused = true;
        return 0;
    }
    CK(e, "the direct clipped-sum kernel");
fail:
    return rc;
}

/* What a step's unstaged kept layers do with their accumulators. */
static int sg_acc(const dc_step *s) {
    switch (s->acc) {
    case DC_ACC_FIRST: return DCC_SG_ACC_STORE;
    case DC_ACC_ADD: return DCC_SG_ACC_ADD;
    case DC_ACC_COMMIT: return DCC_SG_ACC_FOLD;
    default: return DCC_SG_ACC_NONE;
    }
}

int kept_sum(cuda_backend *cb, const dc_step *s, const layout *Lo, float noise_std, float divisor,
             const uint32_t *mode, dc_err *err) {
    int rc = 0;
    if (cb->sg_kept == 0) return 0;
    CK(dcc_sgrad_sum(cb->sgl, cb->sg_kept, (int)s->batch, noise_std, divisor, mode,
                     (uint32_t *)(cb->ws + Lo->status), (unsigned long long *)(cb->ws + Lo->bad),
                     sg_acc(s), cb->opt.noise, cb->stream),
       "the kept gradients' sum");
fail:
    return rc;
}

int kept_commit(cuda_backend *cb, const dc_step *s, const layout *Lo, float noise_std,
                float divisor, const uint32_t *mode, dc_err *err) {
    int rc = 0, any = 0;
    for (int i = 0; i < cb->sg_kept; i++) any |= cb->sgl[i].unstaged;
    if (!any) return 0;
    CK(dcc_sgrad_commit(cb->sgl, cb->sg_kept, (int)s->batch, noise_std, divisor, mode,
                        (uint32_t *)(cb->ws + Lo->status), sg_acc(s), cb->opt.noise, cb->stream),
       "the kept gradients' commit");
fail:
    return rc;
}

/* No per-sample gradients kept this step after all: the norms run without
 * them, and the outputs grouped_clipped_plan marked noised (in the table
 * already uploaded) are not: the output pass draws their noise, and stages
 * those marked unstaged where their kept bytes would have been. */
static int keep_none(cuda_backend *cb, const dc_step *s, const layout *Lo, dc_err *err) {
    int rc = 0;
    dcc_out *douts = (dcc_out *)(cb->ws + Lo->up + Lo->outs);
    for (size_t l = 0; l < s->n_layers; l++) {
        if (cb->sg_off[l] == SIZE_MAX) continue;
        cb->sg_off[l] = SIZE_MAX;
        const bool unstaged = cb->sg_unstaged[l];
        cb->sg_unstaged[l] = false;
        for (int k = 0; k < 2; k++) {
            const int o = cb->sg_out[2 * l + k];
            if (o < 0) continue;
            if (cb->bk_grouped[l]) /* planned as noised */
                CK(cudaMemsetAsync(&douts[o].noised, 0, sizeof(uint32_t), cb->stream), "a memset");
            if (unstaged)
                CK(cudaMemsetAsync(&douts[o].unstaged, 0, sizeof(uint32_t), cb->stream),
                   "a memset");
        }
    }
fail:
    return rc;
}

/* The grouped norms launch for the direct-form LINEAR layers that qualify,
 * when there are enough of them to fill the GPU a few times over; marks
 * them in cb->nm_grouped so that layer_norms skips them. */
int grouped_norms(cuda_backend *cb, const dc_step *s, const layout *Lo, float s2, dc_err *err) {
    const int B = (int)s->batch;
    int n = 0, rc = 0;
    int64_t items = 0;
    for (size_t l = 0; l < s->n_layers; l++) {
        const dc_layer *ly = &s->layers[l];
        cb->nm_grouped[l] = false;
        if (ly->kind != DC_LAYER_LINEAR || (cb->ovr_active && cb->ovr[l])) continue;
        dcc_linear x = linear_of(cb, ly, B, dc_layer_norm_bias(ly), false);
        const bool kept = cb->sg_off[l] != SIZE_MAX; /* keep_bytes: the direct form */
        if (!dcc_norms_grouped_ok(&x, kept ? DC_ALGO_DIRECT
                                           : dcc_linear_pick_grouped(x.T, x.d, x.p, ly->algo)))
            continue;
        dcc_norm_layer *e = &cb->nm[n++];
        e->L = x;
        e->n2 = (float *)(cb->ws + Lo->n2) + l * (size_t)B;
        e->sg = cb->sg_off[l] == SIZE_MAX ? NULL : cb->sg_base + cb->sg_off[l];
        e->sgb = e->sg && x.has_bias ? kept_bias(cb, l, &x) : NULL;
        items += dcc_norms_grouped_items(&x);
        cb->nm_grouped[l] = true;
    }
    if (n == 0 || items < dcc_grouped_min_items(&cb->opt)) {
        memset(cb->nm_grouped, 0, s->n_layers * sizeof *cb->nm_grouped);
        return keep_none(cb, s, Lo, err);
    }
    cudaError_t e = dcc_linear_sqnorms_grouped(cb->nm, n, s2, cb->opt.grouped_layers, cb->stream);
    if (e == cudaErrorNotSupported) { /* nothing was launched: per layer instead */
        memset(cb->nm_grouped, 0, s->n_layers * sizeof *cb->nm_grouped);
        return keep_none(cb, s, Lo, err);
    }
    CK(e, "the grouped norm kernel");
fail:
    return rc;
}

/* Embedding indices decide where the kernels write, and a client can
 * rewrite its memory during the step: each embedding's indices are copied
 * into the workspace first (on the stream, after the wait on the client's
 * event), and every kernel reads that copy, so the norms, the clipped sum and
 * the range checks all see one set of values. *out is s with its layers
 * replaced by cb->safe. */
int snapshot_indices(cuda_backend *cb, const dc_step *s, const layout *Lo, dc_step *out,
                     dc_err *err) {
    size_t o = Lo->idx;
    int rc = 0;
    *out = *s;
    out->layers = cb->safe;
    for (size_t l = 0; l < s->n_layers; l++) {
        const dc_layer *ly = &s->layers[l];
        cb->safe[l] = *ly;
        if (ly->kind != DC_LAYER_EMBEDDING) continue;
        size_t bytes = (size_t)s->batch * (size_t)ly->T * dc_dtype_size(ly->input.dtype);
        CK(cudaMemcpyAsync(cb->ws + o, ly->input.data, bytes, cudaMemcpyDeviceToDevice, cb->stream),
           "the index copy");
        cb->safe[l].input.data = cb->ws + o;
        o += al(bytes);
    }
fail:
    return rc;
}

} // namespace dcb
