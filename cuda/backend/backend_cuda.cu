/* The CUDA backend: backend.h's run_step on tensors in GPU memory.
 *
 * A step is enqueued on the instance's stream in phases, a function each
 * (run_impl calls them in order; each layer's part in backend_layers.cu),
 * then waited for once (wait.cu); each function's comment gives backend.h's
 * steps and the part of dc_step_result.phase_ns it is timed as:
 *   1. zero the per-step counters, upload the small per-step tables
 *      (fill_tables, then phase_upload);
 *   2. phase_norms: squared norms into n2[l][b]: the direct-form bf16/f16
 *      LINEAR layers in persistent launches over many layers
 *      (grouped_tma.cu), the others per layer (norms_linear.cu,
 *      norms_tf32.cu, norms_simt.cu, norms_other.cu); flags for bad
 *      indices / values;
 *   3. phase_reduction: coefficients and the status word (clip.cu);
 *   4. phase_clipping: every requested clipped sum into f32 staging: the
 *      bf16/f16 LINEAR layers of the step in persistent tensor-core
 *      launches over many layers (weights and biases, grouped_tma.cu, which
 *      also finds the max |.| of the outputs it writes whole), f32 ones on
 *      TF32 tensor cores (or exact f32 cuBLAS), the rest through cuBLAS and
 *      small kernels;
 *   5. phase_noise: the one-pass output path (clip.cu): max |staging| per
 *      output (for the layers whose per-sample gradients were kept, and the
 *      direct grouped ones, a bound known before their sums) proves on the
 *      device that no noised value can leave its dtype; then the direct
 *      grouped sums (grouped_tma.cu), the kept layers' sums (sgrad.cu) and
 *      the others' noise, division and conversion write the outputs; a
 *      step that cannot be proved safe (or has a bad input) checks in
 *      staging and commits only if the status word stays 0;
 *   6. phase_home: one copy of n2, flags, norms, coefficients and status to
 *      pinned host memory, and the one wait; take_results reads them.
 * A norm phase (run_norms) stops after 2. (norms_home, norms_take).
 * Switches (dcc_options: read from the environment when the instance is
 * made, options.cu; tests set them with dc_cuda_backend_set_options), for
 * A/B comparisons and exactness: DPCLIP_CUDA_TF32
 * =0 keeps f32 inputs on exact f32 kernels; DPCLIP_CUDA_GROUPED=0 runs the
 * norms and the book-keeping per layer; DPCLIP_CUDA_ONE_PASS=0 always stages the outputs;
 * DPCLIP_CUDA_BK_DIRECT=0 stages the unkept grouped layers' sums (else their
 * kernel writes them after the output check: dcc_linear_clipped_direct);
 * DPCLIP_CUDA_NOISE=exact draws the noise in double as the CPU does.
 * DPCLIP_CUDA_PROFILE=0 stops timing each phase with CUDA events (on by
 * default: the daemon's per-phase histograms use it).
 * A failed step is then diagnosed on the host (which tensor, which sample),
 * with extra synchronisations on that path only, and reported exactly as the
 * CPU backend words it (backend_diag.cu). The small C API around run_step
 * (phase timing, events, workspace setting) is in backend_api.cu; the
 * step's workspace layout and its reservation in backend_plan.cu; the
 * instance's making and end in backend_create.cu.
 *
 * Ownership: the instance owns its stream, cuBLAS handle, device workspace
 * (ws, grown only when a step needs more) and pinned host block; steps only
 * borrow the client's tensors. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "backend_int.h"
#include "dc_clock.h"

using namespace dcb;

int dcb::blas_fail(cuda_backend *cb, dc_err *err, cublasStatus_t s, const char *what) {
    (void)cudaStreamSynchronize(cb->stream);
    return dc_err_set(err, DC_EINTERNAL, "", "cuBLAS error in %s on cuda:%d: %s", what, cb->device,
                      cublasGetStatusString(s));
}

namespace {

void phase_mark(cuda_backend *cb, int i) {
    if (cb->prof) (void)cudaEventRecord(cb->ev[i], cb->stream);
}

/* Which part of a step a call runs (backend.h: run_step, run_norms,
 * run_clip). The clip phase takes the step's norms and the group's totals
 * from the host, recomputing only what the clipped sums of the norm layers
 * read (their per-sample vectors). */
enum cuda_phase { CP_ALL, CP_NORMS, CP_CLIP };
struct phase_io {
    cuda_phase want;
    double *n2_out;         /* CP_NORMS: [L*B] */
    const double *n2_in;    /* CP_CLIP: [L*B] */
    const double *tot_in;   /* CP_CLIP: [B] */
    double e_min;           /* CP_CLIP: the group's or pass's bound (backend.h run_clip) */
    dc_kept **kept_out;     /* CP_NORMS: where to leave a kept store (NULL: keep none) */
    const dc_kept *kept_in; /* CP_CLIP: the norm phase's (NULL: none) */
    const size_t *kept_at;  /* CP_CLIP: each layer's place in kept_in (NULL: its own) */
};

int run_impl(dc_backend *be, const dc_step *s, dc_step_result *res, dc_err *err,
             const phase_io &io);

/* Host doubles in device memory, as they are (a pageable copy: the source
 * may go when it returns). */
int upload_f64(cuda_backend *cb, void *dst, const double *src, size_t n, dc_err *err) {
    cudaError_t e = cudaMemcpyAsync(dst, src, n * sizeof *src, cudaMemcpyHostToDevice, cb->stream);
    return e == cudaSuccess ? 0 : cuda_fail(cb, err, e, "an upload");
}

/* Host doubles as f32 in device memory (a pageable copy: the source may go
 * when it returns). */
int upload_f32(cuda_backend *cb, void *dst, const double *src, size_t n, dc_err *err) {
    float *tmp = (float *)malloc(n * sizeof *tmp + 1);
    if (!tmp) return dc_err_set(err, DC_ENOSPACE, "", "out of memory");
    for (size_t i = 0; i < n; i++) tmp[i] = (float)src[i];
    cudaError_t e = cudaMemcpyAsync(dst, tmp, n * sizeof *tmp, cudaMemcpyHostToDevice, cb->stream);
    free(tmp);
    return e == cudaSuccess ? 0 : cuda_fail(cb, err, e, "an upload");
}

/* The coefficients' bounds once the norms are queued: a layer planned to
 * keep its per-sample gradients may not have (grouped_norms: no grouped
 * launch), and then its e is the GEMM path's. *e_flat: the largest over the
 * layers the norm counts (a clip phase: the norm pass's rule, which sees no
 * kept layers either). planned: the per-layer bounds uploaded with the
 * step's tables (host copy), uploaded again to dev when one moved. */
int step_bounds(cuda_backend *cb, const dc_step *s, cuda_phase want, unsigned how,
                const double *planned, void *dev, double *e_flat, dc_err *err) {
    const size_t L = s->n_layers;
    double *now = NULL;
    *e_flat = want == CP_CLIP ? dc_clip_e_step(s, how) : 0.0;
    for (size_t l = 0; l < L; l++) {
        const double e = dc_clip_e(s, l, how | (cb->sg_off[l] != SIZE_MAX ? DC_E_KEPT : 0u));
        /* a clip phase's layers summed from a kept store add their rounding
         * (the norm pass's rule saw none kept) */
        if ((want != CP_CLIP || cb->sg_off[l] != SIZE_MAX) && !s->layers[l].norm_excluded &&
            e > *e_flat)
            *e_flat = e;
        if (e != planned[l] && !now) {
            if (!(now = (double *)malloc(L * sizeof *now)))
                return dc_err_set(err, DC_ENOSPACE, "", "out of memory");
            memcpy(now, planned, L * sizeof *now);
        }
        if (now) now[l] = e;
    }
    int rc = now && s->mode == DC_CLIP_PER_LAYER ? upload_f64(cb, dev, now, L, err) : 0;
    free(now);
    return rc;
}

/* What the parts of one call of run_impl share: the step, its layout and
 * per-step tables, and what one phase leaves for the next. */
struct step_run {
    dc_backend *be;
    cuda_backend *cb;
    const dc_step *s;    /* the step; from phase_upload on, its index snapshot (&safe) */
    const dc_step *orig; /* the step as given */
    phase_io io;
    dc_step_result *res;
    uint32_t B;
    size_t L;
    bool per_layer;
    float scale;      /* dc_step_grad_scale */
    step_opts opt;    /* the instance's; a micro-batch's without one_pass (run_impl) */
    bool accumulates; /* a micro-batch that stores or adds its sums (FIRST, ADD) */
    bool waited;      /* ev_wait is this step's (wait_event just ran) */
    uint64_t t0;
    layout Lo;
    dc_step safe;
    /* fill_tables': the per-step tables in the pinned upload block */
    char *up;
    double *layer_e; /* the per-layer bounds as planned */
    dcc_out *outs;   /* the output table */
    bool excluded;   /* some layer is left out of the norm */
    unsigned how;    /* dc_clip_e_how */
    float noise_std, divisor;
    char *ws;
    bool refused; /* phase_noise: a direct launch's tensor map refused, nothing written */
};

/* The per-step tables in the pinned upload block (phase_upload copies them
 * in one): thresholds, bounds and counts per layer, the output table; the
 * noise's std and the divisor; the grouped clipped sum planned, which marks
 * the outputs whose max |.| it finds. Fails only on dc_clip_e_check. */
int fill_tables(step_run *r, dc_err *err) {
    cuda_backend *cb = r->cb;
    const dc_step *s = r->s;
    const layout &Lo = r->Lo;
    const size_t L = r->L;
    const bool accumulates = r->accumulates;
    int rc = 0;
    /* per-step tables, uploaded in one copy */
    char *up = cb->host + al(Lo.dl_bytes);
    float *consts = (float *)(up + Lo.consts), *layer_c = (float *)(up + Lo.layer_c);
    float *count = (float *)(up + Lo.count);
    double *layer_e = (double *)(up + Lo.layer_e);
    bool excluded = false;
    dcc_out *outs = (dcc_out *)(up + Lo.outs);
    uint64_t staged = 0, chunks = 0;
    int oi = 0;
    consts[0] = 0.0f;
    consts[1] = 1.0f;
    /* The bounds on the norms' rounding (step.h), per layer as planned
     * (step_bounds takes them again once the norms are queued): every
     * GPU step's assume TF32 for f32 inputs, as a norm pass's reply
     * must, which cannot see the switch; a whole step's kept layers add
     * the bf16 rounding of what their sums add. */
    const unsigned how = dc_clip_e_how(s);
    if ((rc = dc_clip_e_check(s, how, err))) return rc;
    for (size_t l = 0; l < L; l++) {
        const dc_layer *ly = &s->layers[l];
        uint64_t kept_f = 0; /* floats of its kept bytes taken as staging */
        layer_c[l] = ly->max_grad_norm;
        layer_e[l] = dc_clip_e(s, l, how | (cb->sg_off[l] != SIZE_MAX ? DC_E_KEPT : 0u));
        count[l] = ly->norm_excluded ? 0.0f : 1.0f;
        excluded |= ly->norm_excluded;
        for (int k = 0; k < 2; k++) {
            if (!want_out(ly, k)) continue;
            const dc_tensor *t = k ? &ly->bias_grad_out : &ly->weight_grad_out;
            uint64_t n;
            numel_out(t, &n);
            outs[oi].dst = t->data;
            /* a kept layer without staging of its own: its kept bytes stand
             * in (plan_step), used only if the step keeps it after all not;
             * a direct one's sums need none (grouped_clipped_plan) */
            outs[oi].unstaged = cb->sg_unstaged[l] || cb->bk_direct[l];
            outs[oi].off = cb->sg_unstaged[l] ? (Lo.sgrad + cb->sg_off[l] - Lo.staging) / 4 + kept_f
                           : cb->bk_direct[l] ? 0
                                              : staged;
            outs[oi].n = n;
            const dc_noise_src src = dc_step_noise_src(s, ly, l, k);
            outs[oi].key = src.key;
            outs[oi].step = src.step;
            outs[oi].stream = src.stream;
            outs[oi].dtype = (int32_t)t->dtype;
            outs[oi].chunk0 = chunks;
            outs[oi].amax_found = 0; /* grouped_clipped_plan sets it */
            outs[oi].noised = 0;     /* grouped_clipped_plan sets it */
            outs[oi].acc = s->acc == DC_ACC_NONE ? NULL : k ? ly->acc_b : ly->acc_w;
            const dc_noise_span sp = dc_noise_span_of(ly, k); /* a sums step's range */
            outs[oi].nz_mod = sp.mod;
            outs[oi].nz_lo = sp.lo;
            outs[oi].nz_hi = sp.hi;
            oi++;
            if (!cb->bk_direct[l]) (cb->sg_unstaged[l] ? kept_f : staged) += al4(n);
            chunks += dcc_out_chunks(n);
        }
    }
    tied_offsets(cb, s, outs);
    /* an accumulating micro-batch's sums go to its accumulators as they
     * are: the commit noises and divides the logical batch's once */
    float noise_std, divisor;
    step_scales(s, accumulates, &noise_std, &divisor);
    char *ws = cb->ws;
    cb->bk_n = 0;
    cb->sg_kept = 0;
    cb->sg_direct = false;
    cb->amax_found = 0;
    if (r->opt.grouped && r->io.want != CP_NORMS) /* marks every layer, grouped or not */
        cb->amax_found = grouped_clipped_plan(cb, s, &Lo, outs);
    else memset(cb->bk_grouped, 0, L * sizeof *cb->bk_grouped);
    r->up = up;
    r->layer_e = layer_e;
    r->outs = outs;
    r->excluded = excluded;
    r->how = how;
    r->noise_std = noise_std;
    r->divisor = divisor;
    r->ws = ws;
    return 0;
}

/* 1. counters and tables, the index snapshot; from here on the step's
 * layers are read through r->s = &r->safe */
int phase_upload(step_run *r, dc_err *err) {
    cuda_backend *cb = r->cb;
    const layout &Lo = r->Lo;
    char *ws = r->ws;
    int rc = 0;
    phase_mark(cb, 0);
    if ((rc = snapshot_indices(cb, r->s, &Lo, &r->safe, err))) goto fail;
    r->s = &r->safe;
    CK(cudaMemsetAsync(ws, 0, Lo.norms, cb->stream), "a memset");
    CK(cudaMemsetAsync(ws + Lo.bad, 0xff, 8, cb->stream), "a memset");
    CK(cudaMemcpyAsync(ws + Lo.up, r->up, Lo.up_bytes, cudaMemcpyHostToDevice, cb->stream),
       "the table upload");
    return 0;
fail:
    return rc;
}

/* 2. norms (backend.h 1., with 2.'s flags; DC_RUN_NORMS) */
int phase_norms(step_run *r, dc_err *err) {
    cuda_backend *cb = r->cb;
    const dc_step *s = r->s;
    const layout &Lo = r->Lo;
    const uint32_t B = r->B;
    const size_t L = r->L;
    const float scale = r->scale;
    const step_opts &opt = r->opt;
    char *ws = r->ws;
    int rc = 0;
    phase_mark(cb, 1);
    if (r->io.want == CP_CLIP) {
        /* the norm phase's n2, and the norm layers' per-sample vectors
         * (which their clipped sums read) computed again */
        for (size_t l = 0; l < L; l++)
            if ((s->layers[l].kind == DC_LAYER_LAYERNORM ||
                 s->layers[l].kind == DC_LAYER_RMSNORM) &&
                (rc = layer_norms(cb, s, l, &Lo, scale * scale, opt, err)))
                goto fail;
        if ((rc = upload_f32(cb, ws + Lo.n2, r->io.n2_in, L * B, err)) ||
            (rc = upload_f64(cb, ws + Lo.tot, r->io.tot_in, B, err)))
            goto fail;
    } else {
        if (opt.grouped) {
            if ((rc = grouped_norms(cb, s, &Lo, scale * scale, err))) goto fail;
        } else {
            memset(cb->nm_grouped, 0, L * sizeof *cb->nm_grouped);
        }
        for (size_t l = 0; l < L; l++)
            if (!cb->nm_grouped[l] && (rc = layer_norms(cb, s, l, &Lo, scale * scale, opt, err)))
                goto fail;
        if ((rc = tied_norms(cb, s, &Lo, scale * scale, err))) goto fail;
    }
    return 0;
fail:
    return rc;
}

/* A phase's time as the metrics take it: ns, + 1 so that 0 means not
 * measured even under the events' resolution of about half a microsecond
 * (a negative ms: not measured) */
uint64_t ms_ns(float m) { return m >= 0.0f ? (uint64_t)((double)m * 1e6) + 1 : 0; }

/* The time between two recorded phase events (0: not measured) */
uint64_t event_ns(cudaEvent_t a, cudaEvent_t b) {
    float m = 0.0f;
    return cudaEventElapsedTime(&m, a, b) == cudaSuccess ? ms_ns(m) : 0;
}

/* A norm phase's end (CP_NORMS): n2 and the flags home, one
 * synchronisation; norms_take reads them. Its timed parts (norms, and the
 * wait for the input) go to cb->norm_ns. */
int norms_home(step_run *r, dc_err *err) {
    cuda_backend *cb = r->cb;
    int rc = 0;
    phase_mark(cb, 2);
    CK(cudaMemcpyAsync(cb->host, r->ws, r->Lo.dl_bytes, cudaMemcpyDeviceToHost, cb->stream),
       "the result copy");
    CK(cudaStreamSynchronize(cb->stream), "the norms");
    if (cb->prof) {
        cb->norm_ns[DC_RUN_NORMS] = event_ns(cb->ev[1], cb->ev[2]);
        if (r->waited) cb->norm_ns[DC_RUN_WAIT_INPUT] = event_ns(cb->ev_wait, cb->ev[0]);
        (void)cudaGetLastError();
    }
    return 0;
fail:
    return rc;
}

/* n2 into io.n2_out; a bad input fails here, as in a step */
int norms_take(step_run *r, dc_err *err) {
    cuda_backend *cb = r->cb;
    const layout &Lo = r->Lo;
    const uint32_t B = r->B;
    const size_t L = r->L;
    const float *hn2 = (const float *)(cb->host + Lo.n2);
    const uint32_t *hfl = (const uint32_t *)(cb->host + Lo.flags);
    for (size_t i = 0; i < L * B; i++)
        if (hfl[i] || !isfinite(hn2[i])) {
            uint32_t st = DCC_STATUS_INPUT;
            dc_step_result none;
            memset(&none, 0, sizeof none);
            memcpy(cb->host + Lo.status, &st, 4);
            return diagnose(cb, r->s, &Lo, &none, err);
        }
    for (size_t i = 0; i < L * B; i++) r->io.n2_out[i] = (double)hn2[i];
    return 0;
}

/* 3. coefficients (backend.h 3.; DC_RUN_REDUCTION) */
int phase_reduction(step_run *r, dc_err *err) {
    cuda_backend *cb = r->cb;
    const dc_step *s = r->s;
    const layout &Lo = r->Lo;
    const uint32_t B = r->B;
    const size_t L = r->L;
    const float scale = r->scale;
    char *ws = r->ws;
    int rc = 0;
    phase_mark(cb, 2);
    double e_flat;
    if ((rc = step_bounds(cb, s, r->io.want, r->how, r->layer_e, ws + Lo.up + Lo.layer_e, &e_flat,
                          err)))
        goto fail;
    /* a kept pass's sums steps all clip as its reply says (step_pass.c);
     * a group's members and a pass's sums steps by the bound of the whole
     * norm their totals measure (backend.h run_clip; NaN wins: coefs 0) */
    if (r->io.kept_in && r->io.kept_at && e_flat < DC_E_KEPT_FLOOR) e_flat = DC_E_KEPT_FLOOR;
    if (r->io.want == CP_CLIP) e_flat = dc_clip_e_max(e_flat, r->io.e_min);
    if (r->io.want == CP_CLIP)
        CK(dcc_coefs_tot((const float *)(ws + Lo.n2), (const uint32_t *)(ws + Lo.flags),
                         (const double *)(ws + Lo.tot), (int)L, (int)B, s->max_grad_norm, e_flat,
                         scale, (float *)(ws + Lo.norms), (float *)(ws + Lo.coefs),
                         (float *)(ws + Lo.cs), (uint32_t *)(ws + Lo.status), cb->stream),
           "the coefficients");
    else
        CK(dcc_coefs((const float *)(ws + Lo.n2), (const uint32_t *)(ws + Lo.flags),
                     r->excluded ? (const float *)(ws + Lo.up + Lo.count) : NULL, (int)L, (int)B,
                     r->per_layer, s->max_grad_norm, e_flat,
                     (const float *)(ws + Lo.up + Lo.layer_c),
                     (const double *)(ws + Lo.up + Lo.layer_e), scale, (float *)(ws + Lo.norms),
                     (float *)(ws + Lo.coefs), (float *)(ws + Lo.lcoef), (float *)(ws + Lo.cs),
                     (uint32_t *)(ws + Lo.status), cb->stream),
           "the coefficients");
    return 0;
fail:
    return rc;
}

/* 4. clipped sums (backend.h 4.; DC_RUN_CLIPPING) */
int phase_clipping(step_run *r, dc_err *err) {
    cuda_backend *cb = r->cb;
    const dc_step *s = r->s;
    const layout &Lo = r->Lo;
    const size_t L = r->L;
    const step_opts &opt = r->opt;
    const dcc_out *outs = r->outs;
    int rc = 0;
    int oi = 0;
    uint64_t off[2];
    phase_mark(cb, 3);
    if ((rc = grouped_clipped(cb, s, &Lo, outs, err))) goto fail;
    for (size_t l = 0; l < L; l++) {
        for (int k = 0; k < 2; k++)
            off[k] = want_out(&s->layers[l], k) ? outs[oi++].off : UINT64_MAX;
        off[0] = cb->woff[l];
        if (off[0] == UINT64_MAX && off[1] == UINT64_MAX) continue;
        if (cb->bk_grouped[l] || tied_deferred(&s->layers[l], off[0])) continue;
        if ((rc = layer_clipped(cb, s, l, &Lo, off, opt, err))) goto fail;
    }
    /* a tied embedding's use adds onto the linear layer's, written above */
    for (size_t l = 0; l < L; l++) {
        off[0] = cb->woff[l];
        off[1] = UINT64_MAX;
        if (tied_deferred(&s->layers[l], off[0]) &&
            (rc = layer_clipped(cb, s, l, &Lo, off, opt, err, true)))
            goto fail;
    }
    return 0;
fail:
    return rc;
}

/* 5. noise, division, checks; outputs written or gated commit (backend.h
 * 4. and 5.; DC_RUN_NOISE, but for the kept layers' sums: DC_RUN_CLIPPING) */
int phase_noise(step_run *r, dc_err *err) {
    cuda_backend *cb = r->cb;
    const dc_step *s = r->s;
    const layout &Lo = r->Lo;
    const uint32_t B = r->B;
    const step_opts &opt = r->opt;
    const float noise_std = r->noise_std, divisor = r->divisor;
    char *ws = r->ws;
    int rc = 0;
    const dcc_out *douts = (const dcc_out *)(ws + Lo.up + Lo.outs);
    float *staging = (float *)(ws + Lo.staging);
    uint32_t *status = (uint32_t *)(ws + Lo.status), *mode = (uint32_t *)(ws + Lo.mode);
    unsigned long long *bad = (unsigned long long *)(ws + Lo.bad);
    const int zero = s->zero_on_fail ? 1 : 0;
    bool refused = false; /* the commit launch's: as the first's (the same maps) */
    phase_mark(cb, 4);
    if (opt.one_pass) {
        unsigned grid;
        CK(dcc_out_grid(Lo.chunks, opt.out_blocks, &grid), "the output passes' grid");
        /* amax_found marks the outputs the kept sum writes too */
        CK(dcc_out_check(douts, Lo.n_out, grid, staging, noise_std, divisor,
                         (float *)(ws + Lo.amax), cb->amax_found < (int)Lo.n_out, status, mode,
                         cb->stream),
           "the output check");
        /* the direct and the kept layers' sums after the check: with
         * mode 1 they go straight into the outputs */
        phase_mark(cb, 5);
        if ((rc = direct_clipped(cb, &Lo, noise_std, divisor, 0, &r->refused, err))) goto fail;
        if (r->refused) return 0; /* nothing written yet: run_impl runs the step staged */
        if ((rc = kept_sum(cb, s, &Lo, noise_std, divisor, mode, err))) goto fail;
        phase_mark(cb, 6);
        CK(dcc_out_write(douts, Lo.n_out, grid, staging, noise_std, divisor, mode, status, bad,
                         opt.noise, cb->stream),
           "the noise");
        phase_mark(cb, 7);
        if ((rc = direct_clipped(cb, &Lo, noise_std, divisor, 1, &refused, err)) ||
            (rc = kept_commit(cb, s, &Lo, noise_std, divisor, mode, err)))
            goto fail;
        CK(dcc_out_commit(douts, Lo.n_out, grid, staging, mode, status, zero, cb->stream),
           "the commit");
        CK(dcc_commit(douts, 0, 0, staging, status, (const float *)(ws + Lo.norms),
                      (float *)s->norms_out.data, (const float *)(ws + Lo.coefs),
                      (float *)s->coefs_out.data, (int)B, zero, cb->stream),
           "the commit");
    } else if (r->accumulates) {
        phase_mark(cb, 5);
        if ((rc = kept_sum(cb, s, &Lo, noise_std, divisor, NULL, err))) goto fail;
        phase_mark(cb, 6);
        CK(dcc_acc_store(douts, Lo.n_out, Lo.max_n, staging, s->acc == DC_ACC_ADD, cb->stream),
           "the accumulation");
        phase_mark(cb, 7);
        CK(dcc_commit(douts, 0, 0, staging, status, (const float *)(ws + Lo.norms),
                      (float *)s->norms_out.data, (const float *)(ws + Lo.coefs),
                      (float *)s->coefs_out.data, (int)B, zero, cb->stream),
           "the commit");
    } else {
        phase_mark(cb, 5);
        /* unnoised where the output pass draws the noise (cb->sg_noised) */
        const float kept_std = cb->sg_noised ? noise_std : 0.0f;
        if ((rc = kept_sum(cb, s, &Lo, kept_std, divisor, NULL, err))) goto fail;
        if (s->acc == DC_ACC_COMMIT)
            CK(dcc_acc_fold(douts, Lo.n_out, Lo.max_n, staging, cb->stream), "the accumulation");
        phase_mark(cb, 6);
        CK(dcc_finalize(douts, Lo.n_out, Lo.max_n, staging, noise_std, divisor, status, bad,
                        opt.noise, cb->stream),
           "the noise");
        phase_mark(cb, 7);
        /* the unstaged kept layers' outputs, once every output is checked */
        if ((rc = kept_commit(cb, s, &Lo, kept_std, divisor, NULL, err))) goto fail;
        CK(dcc_commit(douts, Lo.n_out, Lo.max_n, staging, status, (const float *)(ws + Lo.norms),
                      (float *)s->norms_out.data, (const float *)(ws + Lo.coefs),
                      (float *)s->coefs_out.data, (int)B, zero, cb->stream),
           "the commit");
    }
    /* a fused group step's other members: the same norms and coefficients */
    for (size_t i = 0; i < s->n_more_outs; i++)
        CK(dcc_commit(douts, 0, 0, staging, status, (const float *)(ws + Lo.norms),
                      (float *)s->more_norms_out[i].data, (const float *)(ws + Lo.coefs),
                      (float *)s->more_coefs_out[i].data, (int)B, zero, cb->stream),
           "the commit");
    return 0;
fail:
    return rc;
}

/* 6. results home, one synchronisation; the phases' times into res */
int phase_home(step_run *r, dc_err *err) {
    cuda_backend *cb = r->cb;
    const dc_step *s = r->s;
    dc_step_result *res = r->res;
    int rc = 0;
    phase_mark(cb, 8);
    CK(cudaMemcpyAsync(cb->host, r->ws, r->Lo.dl_bytes, cudaMemcpyDeviceToHost, cb->stream),
       "the result copy");
    phase_mark(cb, 9);
    /* Everything that writes the client's memory is queued: an early
     * notice may go now, while the device works. */
    if (s->enqueued) s->enqueued(s->enqueued_arg);
    dc_step_cost cost;
    dc_step_cost_estimate(s, &cost);
    CK(wait_stream(cb, cost.gflop), "the step");
    if (cb->prof) {
        for (int i = 0; i < DC_CUDA_PHASES; i++)
            if (cudaEventElapsedTime(&cb->phase_ms[i], cb->ev[i], cb->ev[i + 1]) != cudaSuccess)
                cb->phase_ms[i] = -1.0f;
        /* the metrics' parts: norms; coefs (reduction); clipped; check,
         * noise and commit (noise) */
        const float *ms = cb->phase_ms;
        res->phase_ns[DC_RUN_NORMS] = ms_ns(ms[1]);
        res->phase_ns[DC_RUN_REDUCTION] = ms_ns(ms[2]);
        /* the kept sums are clipped sums, their noise and write
         * included */
        res->phase_ns[DC_RUN_CLIPPING] = ms_ns(ms[3]) + ms_ns(ms[5]);
        res->phase_ns[DC_RUN_NOISE] = ms_ns(ms[4]) + ms_ns(ms[6]) + ms_ns(ms[7]);
        if (r->waited) res->phase_ns[DC_RUN_WAIT_INPUT] = event_ns(cb->ev_wait, cb->ev[0]);
        (void)cudaGetLastError();
    }
    return 0;
fail:
    return rc;
}

/* The step's end on the host: a failed status diagnosed (or the step run
 * again with overflowed f32 norms from the host), else the result. */
int take_results(step_run *r, dc_err *err) {
    cuda_backend *cb = r->cb;
    const dc_step *s = r->s;
    dc_step_result *res = r->res;
    const layout &Lo = r->Lo;
    const uint32_t B = r->B;
    const size_t L = r->L;
    int rc = 0;
    {
        const char *h = cb->host;
        uint32_t status;
        memcpy(&status, h + Lo.status, 4);
        if (status) {
            /* An f32 overflow of some LINEAR layers' norms where the inputs
             * are finite: run the step again with those norms computed on
             * the host, range-scaled. Not after an early notice: the client
             * may already use the zeros that a failed step wrote. */
            if (r->io.want == CP_ALL && !cb->ovr_active && !r->orig->zero_on_fail &&
                rescue_overflow(cb, s, &Lo, r->scale)) {
                cb->ovr_active = true;
                rc = cuda_run_step(r->be, r->orig, res, err);
                cb->ovr_active = false;
                return rc;
            }
            return diagnose(cb, s, &Lo, res, err);
        }
        uint32_t mode;
        memcpy(&mode, h + Lo.mode, 4);
        cb->sg_direct = cb->sg_kept > 0 && r->opt.one_pass && mode == 1;
        const float *n2 = (const float *)(h + Lo.n2);
        memcpy(res->norms, h + Lo.norms, B * sizeof(float));
        memcpy(res->coefs, h + Lo.coefs, B * sizeof(float));
        for (size_t i = 0; i < L * B; i++) res->layer_norms[i] = (float)sqrt((double)n2[i]);
        if (r->per_layer && res->layer_coefs)
            memcpy(res->layer_coefs, h + Lo.lcoef, L * B * sizeof(float));
    }
    res->compute_ns = dc_clock_ns() - r->t0;
    return 0;
}

/* A call of run_step, run_norms or run_clip: the checks and the plan, then
 * the phases in order (a norm phase stops after the norms). A failure once
 * work is queued waits for the stream before it returns. */
int run_impl(dc_backend *be, const dc_step *s, dc_step_result *res, dc_err *err,
             const phase_io &io) {
    cuda_backend *cb = (cuda_backend *)be;
    step_run r;
    r.be = be;
    r.cb = cb;
    r.s = s;
    r.orig = s; /* r.s becomes the step with its index snapshot */
    r.io = io;
    r.res = res;
    const uint32_t B = r.B = s->batch;
    const size_t L = r.L = s->n_layers;
    const bool per_layer = r.per_layer = s->mode == DC_CLIP_PER_LAYER;
    r.scale = dc_step_grad_scale(s);
    /* a micro-batch of a logical step stages its outputs: its sums go to
     * the accumulators (accum.cu), and its commit folds them in before the
     * noise, which the one-pass path's direct writes would bypass (its
     * kept layers' sums do both themselves: sgrad.cu) */
    r.opt = cb->opt;
    if (s->acc != DC_ACC_NONE) r.opt.one_pass = false;
    r.accumulates = s->acc == DC_ACC_FIRST || s->acc == DC_ACC_ADD;
    layout &Lo = r.Lo;
    int rc = 0;
    r.waited = cb->waited; /* ev_wait is this step's (wait_event just ran) */
    cb->waited = false;

    r.t0 = dc_clock_ns();
    if (s->device < 0) /* the daemon runs host-memory steps on its CPU workers */
        return dc_err_set(err, DC_EINVAL, "clip_step",
                          "a step on host memory was given to the CUDA backend of cuda:%d",
                          cb->device);
    if (io.want != CP_ALL && per_layer)
        return dc_err_set(err, DC_EINVAL, "clip_step.clip.mode",
                          "a step in phases (a norm group) clips flat");
    if (cb->broken)
        return dc_err_set(err, DC_EUNAVAIL, "", "cuda:%d is unusable after an earlier error (%s)",
                          cb->device, cb->broken_msg);
    if (s->device != cb->device)
        return dc_err_set(err, DC_EPRECOND, "clip_step",
                          "the step's tensors are on cuda:%d but this backend serves cuda:%d",
                          s->device, cb->device);
    if (io.want != CP_NORMS &&
        (B == 0 || !res->norms || !res->coefs || !res->layer_norms ||
         (per_layer && !res->layer_coefs) || res->batch != B || res->n_layers != L))
        return dc_err_set(err, DC_EINTERNAL, "", "step result not initialised for this step");
    if (cudaSetDevice(cb->device) != cudaSuccess) {
        (void)cudaGetLastError();
        return dc_err_set(err, DC_EUNAVAIL, "", "cannot select cuda:%d", cb->device);
    }
    /* A norm phase asked to keep puts its kept area (the layout's last
     * part) in a store of its own, which outlives this call */
    const bool to_store = io.want == CP_NORMS && io.kept_out;
    const keep_mode keep = io.want == CP_ALL  ? KEEP_OUTS
                           : !to_store        ? KEEP_NONE
                           : names_outputs(s) ? KEEP_OUTS
                                              : KEEP_PASS;
    /* a whole step's kept layers need no staging (plan_step), but where
     * the instance stages every output (DPCLIP_CUDA_ONE_PASS=0) */
    const bool unstage = io.want == CP_ALL && cb->opt.one_pass;
    cuda_kept *store = NULL;
    size_t applied = 0;
    if ((rc = plan_step(cb, s, keep, unstage, &Lo, err))) return rc;
    if (to_store && Lo.sgrad_bytes) {
        if ((store = kept_take(cb, Lo.sgrad_bytes, L))) Lo.total = Lo.sgrad;
        else if ((rc = plan_step(cb, s, KEEP_NONE, unstage, &Lo, err))) return rc;
    }
    if (!store && Lo.sgrad_bytes && !keep_fits(cb, &Lo) &&
        (rc = plan_step(cb, s, KEEP_NONE, unstage, &Lo, err)))
        return rc;
    if ((rc = reserve(cb, &Lo, err))) {
        /* kept gradients are an optimisation: without them the step may fit */
        if (rc != DC_ENOSPACE || Lo.sgrad_bytes == 0) return rc;
        dc_err_clear(err);
        if (store) kept_give(be, &store->pub);
        store = NULL;
        if ((rc = plan_step(cb, s, KEEP_NONE, unstage, &Lo, err)) || (rc = reserve(cb, &Lo, err)))
            return rc;
    }
    if (io.kept_in && (rc = kept_apply(cb, s, io.kept_in, io.kept_at, &applied, err))) return rc;
    /* A pass's sums step: the kept layers' sums draw their outputs' noise
     * within its range (sgrad.cu), as the output pass would, and in one
     * pass write the outputs themselves; a step that stages every output
     * (a logical step's, whose accumulators fold in before the noise)
     * leaves their noise to the output pass, unnoised in staging */
    const bool pass_sums = io.kept_in && io.kept_at;
    cb->sg_noised = !pass_sums || r.opt.one_pass;
    cb->sg_base = store        ? store->mem
                  : io.kept_in ? ((const cuda_kept *)io.kept_in)->mem
                               : cb->ws + Lo.sgrad;

    if ((rc = fill_tables(&r, err))) goto fail;
    if ((rc = phase_upload(&r, err)) || (rc = phase_norms(&r, err))) goto fail;
    if (io.want == CP_NORMS) {
        if ((rc = norms_home(&r, err)) || (rc = norms_take(&r, err))) goto fail;
        if (store) kept_leave(cb, store, L, io.kept_out);
        return 0;
    }
    if ((rc = phase_reduction(&r, err)) || (rc = phase_clipping(&r, err))) goto fail;
    if (io.kept_in && (size_t)cb->sg_kept != applied) {
        /* a kept layer's sum would come from the client's data (a group
         * member's: unsealed) */
        rc = dc_err_set(err, DC_EINTERNAL, "clip_step",
                        "cuda:%d: %d of the %zu kept layers were summed from the store; "
                        "nothing was written",
                        cb->device, cb->sg_kept, applied);
        goto fail;
    }
    r.refused = false;
    if ((rc = phase_noise(&r, err))) goto fail;
    if (r.refused) {
        /* a tensor map of a direct layer refused (nothing written): the
         * step again, those layers staged and summed per layer */
        (void)cudaStreamSynchronize(cb->stream);
        cb->bk_direct_off = true;
        rc = run_impl(be, r.orig, res, err, io);
        cb->bk_direct_off = false;
        return rc;
    }
    if ((rc = phase_home(&r, err))) goto fail;
    return take_results(&r, err);

fail:
    (void)cudaStreamSynchronize(cb->stream);
    if (store) kept_give(be, &store->pub);
    return rc;
}

} // namespace

/* backend.h's entry points (backend_int.h), each run_impl of its phases */
int dcb::cuda_run_step(dc_backend *be, const dc_step *s, dc_step_result *res, dc_err *err) {
    return run_impl(be, s, res, err, phase_io{CP_ALL, NULL, NULL, NULL, 0.0, NULL, NULL, NULL});
}

int dcb::cuda_run_norms(dc_backend *be, const dc_step *s, double *n2, dc_kept **kept, dc_err *err) {
    memset(((cuda_backend *)be)->norm_ns, 0, sizeof((cuda_backend *)be)->norm_ns);
    return run_impl(be, s, NULL, err, phase_io{CP_NORMS, n2, NULL, NULL, 0.0, kept, NULL, NULL});
}

void dcb::cuda_norm_times(dc_backend *be, uint64_t phase_ns[DC_RUN_N]) {
    const cuda_backend *cb = (const cuda_backend *)be;
    for (int k = 0; k < DC_RUN_N; k++)
        if (cb->norm_ns[k]) phase_ns[k] = cb->norm_ns[k];
}

int dcb::cuda_run_clip(dc_backend *be, const dc_step *s, const double *n2, const double *tot,
                       double e_min, const dc_kept *kept, const size_t *kept_at,
                       dc_step_result *res, dc_err *err) {
    return run_impl(be, s, res, err, phase_io{CP_CLIP, NULL, n2, tot, e_min, NULL, kept, kept_at});
}
