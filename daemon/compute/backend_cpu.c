/* The CPU backend: the reference implementation of backend.h's run_step,
 * and the default where no GPU is found.
 *
 * A step runs in phases so that a failure writes nothing, one function
 * each (run_phases calls them; in brackets backend.h's numbers and the
 * part of dc_step_result.phase_ns each is timed as):
 *   1. phase_checks: every layer's data (cpu_check.c) [2.];
 *   2. phase_norms: squared norms per layer and sample (cpu_norms.c)
 *      [1., NORMS]; phase_reduction: then coefficients [3., REDUCTION];
 *   3. per layer, phase_clipping: every requested output into scratch
 *      (cpu_clip.c) [4., CLIPPING], and phase_noise: plus noise, divided for
 *      MEAN, and checked finite in its output dtype [4., NOISE];
 *   4. phase_commit: only then copy into the output tensors, norms_out and
 *      coefs_out [4., 5.; NOISE].
 * Because inputs are only read before phase 4, outputs may even alias inputs.
 *
 * Threads: BLAS threading in OpenBLAS is global to the process; it is taken
 * from OPENBLAS_NUM_THREADS and the `threads` argument is only recorded. */
#include <limits.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"
#include "cpu.h"
#include "dc_clock.h"
#include "dc_hash.h"
#include "noise.h"

typedef struct cpu_backend {
    dc_backend base; /* first: the worker pool sees a dc_backend * */
    int threads;
    unsigned clip_how; /* dc_cpu_backend_set_clip_how; 0: the CPU's paths */
    dc_cpu_scratch s;
} cpu_backend;

/* --- run_step -------------------------------------------------------------- */

/* First element of v[n] that is not finite once stored as dtype t, or -1:
 * f16 overflows above 65504, so finite f32 is not enough. */
static int64_t find_bad_out(const float *v, size_t n, dc_dtype t) {
    for (size_t i = 0; i < n; i++) {
        if (!isfinite(v[i])) return (int64_t)i;
        if (t == DC_F16 && (dc_f32_to_f16(v[i]) & 0x7c00u) == 0x7c00u) return (int64_t)i;
        if (t == DC_BF16 && (dc_f32_to_bf16(v[i]) & 0x7f80u) == 0x7f80u) return (int64_t)i;
    }
    return -1;
}

static void store_out(const dc_tensor *t, const float *v, size_t n) {
    if (t->dtype == DC_F32) {
        memcpy(t->data, v, n * sizeof(float));
        return;
    }
    for (size_t i = 0; i < n; i++) dc_store_f32(t->data, t->dtype, i, v[i]);
}

/* Shape limits that come from BLAS's int arguments, checked up front. */
/* A logical step's accumulator and one output's clipped sum v[n] (before
 * noise): stored or added, true (the output is not written); or, for the
 * commit, added into v, false (noise and the write follow). */
static bool accumulate(dc_acc_mode mode, float *acc, float *v, size_t n) {
    switch (mode) {
    case DC_ACC_FIRST: memcpy(acc, v, n * sizeof *v); return true;
    case DC_ACC_ADD:
        for (size_t i = 0; i < n; i++) acc[i] += v[i];
        return true;
    case DC_ACC_COMMIT:
        for (size_t i = 0; i < n; i++) v[i] += acc[i];
        return false;
    case DC_ACC_NONE: break;
    }
    return false;
}

/* v[n] += std * z_i for the elements i the span takes (all of them where
 * no range is set), each with the draw a whole step makes for element i:
 * a sums step noises the rows (or columns) its rank owns, and no others. */
static void add_noise(dc_noise_src src, dc_noise_span sp, float std, float *v, size_t n) {
    if (sp.mod == 0) {
        uint64_t lo = sp.lo < n ? sp.lo : n, hi = sp.hi < n ? sp.hi : n;
        if (hi > lo)
            dc_noise_add_normal_at(src.key, src.step, src.stream, std, v + lo, lo, hi - lo);
        return;
    }
    for (uint64_t r = 0; r + sp.lo < n && sp.hi > sp.lo; r += sp.mod) {
        uint64_t hi = r + sp.hi < n ? r + sp.hi : n;
        dc_noise_add_normal_at(src.key, src.step, src.stream, std, v + r + sp.lo, r + sp.lo,
                               hi - (r + sp.lo));
    }
}

static int check_dims(const dc_layer *l, uint32_t B, dc_err *err) {
    if (l->kind != DC_LAYER_LINEAR) return 0;
    if (l->T > INT_MAX || l->d > INT_MAX || l->p > INT_MAX ||
        (uint64_t)B * (uint64_t)l->T > (uint64_t)INT_MAX)
        return dc_err_set(err, DC_EINVAL, l->name,
                          "dimensions beyond %d are not supported by the CPU backend", INT_MAX);
    return 0;
}

/* Per-step arrays, carved out of one scratch block. */
typedef struct step_stats {
    double *n2;   /* [L*B] squared layer norms */
    size_t *off;  /* [2L] offsets into the output scratch; SIZE_MAX = none */
    float *norms; /* [B] */
    float *coefs; /* [B] */
    float *lcoef; /* [L*B] PER_LAYER */
    float *cvec;  /* [B] coefficient * grad scale for the layer at hand */
} step_stats;

static int stats_carve(dc_cpu_scratch *s, size_t L, uint32_t B, step_stats *st) {
    size_t LB = L * B;
    size_t bytes = LB * sizeof(double) + 2 * L * sizeof(size_t) +
                   (2 * (size_t)B + LB + B) * sizeof(float);
    char *p = dc_cpu_buf_reserve(&s->stats, bytes);
    if (!p) return DC_ENOSPACE;
    st->n2 = (double *)p;
    p += LB * sizeof(double);
    st->off = (size_t *)p;
    p += 2 * L * sizeof(size_t);
    st->norms = (float *)p;
    st->coefs = st->norms + B;
    st->lcoef = st->coefs + B;
    st->cvec = st->lcoef + LB;
    return 0;
}

/* What the phases of one step share (run_phases): the step, the layers
 * as phase_checks gave them, the per-step arrays, and what one phase
 * leaves for the next. */
typedef struct phase_ctx {
    cpu_backend *cb;
    const dc_step *step;
    const dc_layer *lay; /* the layers the phases read: embedding indices in daemon memory */
    uint32_t B;
    size_t L;
    bool per_layer;
    float scale; /* dc_step_grad_scale */
    step_stats st;
    float noise_std; /* phase_reduction's */
    float *outs;     /* plan_outputs': the outputs' scratch, st.off into it */
    float divisor;   /* plan_outputs': MEAN's expected batch, else 1 */
} phase_ctx;

/* backend.h 2., before any arithmetic, over the whole step: dimensions,
 * finite floats, and every embedding's indices copied into daemon memory
 * and checked there. c->lay receives the layers the later phases read
 * (scratch, valid until the next step). */
static int phase_checks(phase_ctx *c, dc_err *err) {
    dc_cpu_scratch *s = &c->cb->s;
    const dc_step *step = c->step;
    size_t L = step->n_layers, n_idx = 0;
    uint32_t B = step->batch;
    int rc;
    for (size_t l = 0; l < L; l++)
        if (step->layers[l].kind == DC_LAYER_EMBEDDING)
            n_idx += (size_t)B * (size_t)step->layers[l].T;
    dc_layer *safe = dc_cpu_buf_reserve(&s->layers, L * sizeof *safe);
    int64_t *idx = n_idx ? dc_cpu_buf_reserve(&s->idx, n_idx * sizeof *idx) : NULL;
    if (!safe || (n_idx && !idx))
        return dc_err_set(err, DC_ENOSPACE, "", "out of memory for the CPU backend's scratch");
    for (size_t l = 0; l < L; l++) {
        const dc_layer *ly = &step->layers[l];
        if ((rc = check_dims(ly, B, err))) return rc;
        if ((rc = dc_cpu_check_layer(ly, B, &safe[l], idx, err))) return rc;
        if (ly->kind == DC_LAYER_EMBEDDING) idx += (size_t)B * (size_t)ly->T;
    }
    c->lay = safe;
    return 0;
}

/* A norm that is not finite cannot be clipped: it fails the step, naming the
 * layer and sample, before any coefficient exists. Inputs were checked
 * finite and the products are range-scaled (cpu_norms.c), so this means the
 * client changed its data during the step, or a sum left double's range. */
static int check_norms(const dc_layer *lay, size_t L, uint32_t B, const double *n2, dc_err *err) {
    for (size_t l = 0; l < L; l++)
        for (uint32_t b = 0; b < B; b++)
            if (!isfinite(n2[l * B + b]))
                return dc_err_set(err, DC_ENONFINITE, lay[l].name,
                                  "the gradient norm of sample %u is not finite (its inputs "
                                  "changed during the step, or overflowed); nothing was "
                                  "written",
                                  b);
    return 0;
}

/* The step's phases. want: PHASE_NORMS stops after the norms (copied to
 * n2_out); PHASE_CLIP takes this step's norms from n2_in and the group's
 * per-sample totals from tot instead of computing them (the data are
 * checked again: the clip phase may run on another worker, after other
 * steps used its scratch); PHASE_ALL is a whole step. */
enum run_phases { PHASE_ALL, PHASE_NORMS, PHASE_CLIP };

/* backend.h 1. (DC_RUN_NORMS): n2[l][b] into c->st.n2, tied pairs' shared
 * weight included, each checked finite; PHASE_CLIP's are n2_in. */
static int phase_norms(phase_ctx *c, enum run_phases want, const double *n2_in, dc_err *err) {
    dc_cpu_scratch *s = &c->cb->s;
    const dc_layer *lay = c->lay;
    uint32_t B = c->B;
    size_t L = c->L;
    int rc;
    if (want == PHASE_CLIP) {
        memcpy(c->st.n2, n2_in, L * B * sizeof *c->st.n2);
    } else {
        for (size_t l = 0; l < L; l++)
            if ((rc = dc_cpu_layer_sqnorms(s, &lay[l], B, c->scale, c->st.n2 + l * B, err)))
                return rc;
        for (size_t l = 0; l < L; l++) /* tied pairs: the shared weight's norm */
            if (dc_layer_tied_later(&lay[l]) &&
                (rc = dc_cpu_tie_sqnorms(s, lay, l, B, c->scale, c->st.n2, err)))
                return rc;
        if ((rc = check_norms(lay, L, B, c->st.n2, err))) return rc;
    }
    return 0;
}

/* backend.h 3. (DC_RUN_REDUCTION): the norms n[b] and the coefficients
 * (FLAT: coefs[b]; PER_LAYER: lcoef[l][b]) from the squared norms, or from
 * the group's per-sample totals tot_in, clipped with at least e_min (a
 * group's or a pass's bound: backend.h run_clip); c->noise_std. */
static int phase_reduction(phase_ctx *c, const double *tot_in, double e_min, dc_err *err) {
    const dc_step *step = c->step;
    const dc_layer *lay = c->lay;
    uint32_t B = c->B;
    size_t L = c->L;
    bool per_layer = c->per_layer;
    step_stats *st = &c->st;
    int rc;
    double noise_c2 = 0.0; /* PER_LAYER noise uses sqrt(sum_l C_l^2) */
    /* Coefficients from an upper bound on each norm, n (1 + e) (step.h);
     * the reply keeps the computed norms. The e of a FLAT step is the
     * largest over its layers; totals that count other layers too (a norm
     * group's, a pass's) come with the largest over all of them, e_min. */
    if ((rc = dc_clip_e_check(step, c->cb->clip_how, err))) return rc;
    const double e_flat = per_layer ? 0.0
                                    : dc_clip_e_max(dc_clip_e_step(step, c->cb->clip_how), e_min);
    for (uint32_t b = 0; b < B; b++) {
        double tot = 0.0;
        if (tot_in) {
            tot = tot_in[b]; /* the group's: every member's layers */
        } else {
            for (size_t l = 0; l < L; l++) {
                double v = st->n2[l * B + b];
                /* a layer left out (step.h: fused group steps) still fails
                 * the step when its norm is not finite */
                tot += !lay[l].norm_excluded ? v : isfinite(v) ? 0.0 : v;
            }
        }
        if (!isfinite(tot))
            return dc_err_set(err, DC_ENONFINITE, "clip_step",
                              "the gradient norm of sample %u is not finite; nothing was written",
                              b);
        st->norms[b] = (float)sqrt(tot);
        st->coefs[b] = per_layer ? 1.0f : dc_clip_coef(step->max_grad_norm, sqrt(tot), e_flat);
    }
    if (per_layer)
        for (size_t l = 0; l < L; l++) {
            float Cl = lay[l].max_grad_norm;
            const double el = dc_clip_e(step, l, c->cb->clip_how);
            noise_c2 += (double)Cl * Cl;
            for (uint32_t b = 0; b < B; b++)
                st->lcoef[l * B + b] = dc_clip_coef(Cl, sqrt(st->n2[l * B + b]), el);
        }
    c->noise_std = step->noise_multiplier * (per_layer                 ? (float)sqrt(noise_c2)
                                             : step->noise_norm > 0.0f ? step->noise_norm
                                                                       : step->max_grad_norm);
    return 0;
}

/* backend.h 4., before the layers' sums: each requested output's offset in
 * the scratch (st.off), the scratch (c->outs) and MEAN's divisor. */
static int plan_outputs(phase_ctx *c, dc_err *err) {
    dc_cpu_scratch *s = &c->cb->s;
    const dc_step *step = c->step;
    const dc_layer *lay = c->lay;
    step_stats *st = &c->st;
    size_t total = 0;
    for (size_t l = 0; l < c->L; l++) {
        const dc_layer *ly = &lay[l];
        const dc_tensor *o[2] = {&ly->weight_grad_out, &ly->bias_grad_out};
        for (int k = 0; k < 2; k++) {
            st->off[2 * l + k] = SIZE_MAX;
            if (!o[k]->data || (k == 1 && !ly->has_bias)) continue;
            size_t n = dc_cpu_numel(o[k]);
            if ((uint64_t)n > DC_NOISE_MAX_N) {
                char f[128];
                snprintf(f, sizeof f, "%s.%s", ly->name, k ? "bias_grad_out" : "weight_grad_out");
                return dc_err_set(err, DC_EINVAL, f, "more than %llu elements",
                                  (unsigned long long)DC_NOISE_MAX_N);
            }
            st->off[2 * l + k] = total;
            total += n;
        }
    }
    c->outs = NULL;
    if (total) {
        c->outs = dc_cpu_buf_reserve(&s->out, total * sizeof(float));
        if (!c->outs)
            return dc_err_set(err, DC_ENOSPACE, "", "out of memory for %zu output values", total);
    }
    c->divisor = step->reduction == DC_REDUCTION_MEAN
                     ? (float)(step->expected_batch ? step->expected_batch : c->B)
                     : 1.0f;
    return 0;
}

/* backend.h 4. (DC_RUN_CLIPPING) for layer l: its clipped sums into the
 * scratch, a tied pair's other use of the shared weight added. */
static int phase_clipping(phase_ctx *c, size_t l, dc_err *err) {
    dc_cpu_scratch *s = &c->cb->s;
    const dc_layer *lay = c->lay;
    const dc_layer *ly = &lay[l];
    step_stats *st = &c->st;
    uint32_t B = c->B;
    size_t ow = st->off[2 * l], ob = st->off[2 * l + 1];
    int rc;
    for (uint32_t b = 0; b < B; b++)
        st->cvec[b] = dc_clip_scaled(c->per_layer ? st->lcoef[l * B + b] : st->coefs[b], c->scale);
    rc = dc_cpu_layer_clipped_sum(s, ly, B, st->cvec, ow == SIZE_MAX ? NULL : c->outs + ow,
                                  ob == SIZE_MAX ? NULL : c->outs + ob, err);
    if (rc) return rc;
    if (ly->tie_owner && ow != SIZE_MAX && /* the other use of the shared weight */
        (rc = dc_cpu_layer_clipped_add(s, &lay[ly->tie - 1], B, st->cvec, c->outs + ow, err)))
        return rc;
    return 0;
}

/* backend.h 4. (DC_RUN_NOISE) for layer l's outputs in the scratch: a
 * micro-batch's accumulation, else the noise, the division and the check
 * that each value is finite in its output's dtype. */
static int phase_noise(phase_ctx *c, size_t l, dc_step_result *res, dc_err *err) {
    const dc_step *step = c->step;
    const dc_layer *ly = &c->lay[l];
    for (int k = 0; k < 2; k++) {
        size_t off = c->st.off[2 * l + k];
        if (off == SIZE_MAX) continue;
        const dc_tensor *t = k ? &ly->bias_grad_out : &ly->weight_grad_out;
        size_t n = dc_cpu_numel(t);
        float *v = c->outs + off;
        if (accumulate(step->acc, k ? ly->acc_b : ly->acc_w, v, n)) continue;
        add_noise(dc_step_noise_src(step, ly, l, k), dc_noise_span_of(ly, k), c->noise_std, v, n);
        if (c->divisor != 1.0f)
            for (size_t i = 0; i < n; i++) v[i] /= c->divisor;
        int64_t bad = find_bad_out(v, n, t->dtype);
        if (bad >= 0) {
            char f[128];
            res->released = true; /* where it failed depends on the noise */
            snprintf(f, sizeof f, "%s.%s", ly->name, k ? "bias_grad_out" : "weight_grad_out");
            /* no value in the message: it is noised, and a failed
             * step releases nothing */
            return dc_err_set(err, DC_ENONFINITE, f,
                              "clipped sum element %lld is not finite as %s (overflow); "
                              "nothing was written",
                              (long long)bad, dc_dtype_name(t->dtype));
        }
    }
    return 0;
}

/* backend.h 4.'s write and 5.: the outputs, norms_out and coefs_out (a
 * fused group step's other members' too) and the result. Nothing can fail
 * from here on (a micro-batch that accumulates writes no output). */
static void phase_commit(phase_ctx *c, dc_step_result *res) {
    const dc_step *step = c->step;
    const dc_layer *lay = c->lay;
    const step_stats *st = &c->st;
    uint32_t B = c->B;
    size_t L = c->L;
    for (size_t l = 0; l < L; l++)
        for (int k = 0; k < 2; k++) {
            size_t off = st->off[2 * l + k];
            const dc_layer *ly = &lay[l];
            if (off != SIZE_MAX && (step->acc == DC_ACC_NONE || step->acc == DC_ACC_COMMIT))
                store_out(k ? &ly->bias_grad_out : &ly->weight_grad_out, c->outs + off,
                          dc_cpu_numel(k ? &ly->bias_grad_out : &ly->weight_grad_out));
        }
    if (step->norms_out.data) memcpy(step->norms_out.data, st->norms, B * sizeof(float));
    if (step->coefs_out.data) memcpy(step->coefs_out.data, st->coefs, B * sizeof(float));
    for (size_t i = 0; i < step->n_more_outs; i++) {
        if (step->more_norms_out[i].data)
            memcpy(step->more_norms_out[i].data, st->norms, B * sizeof(float));
        if (step->more_coefs_out[i].data)
            memcpy(step->more_coefs_out[i].data, st->coefs, B * sizeof(float));
    }
    memcpy(res->norms, st->norms, B * sizeof(float));
    memcpy(res->coefs, st->coefs, B * sizeof(float));
    for (size_t i = 0; i < L * B; i++) res->layer_norms[i] = (float)sqrt(st->n2[i]);
    if (c->per_layer && res->layer_coefs)
        memcpy(res->layer_coefs, st->lcoef, L * B * sizeof(float));
}

/* The phases in order, each timed as its part of res->phase_ns. */
static int run_phases(dc_backend *be, const dc_step *step, enum run_phases want, double *n2_out,
                      const double *n2_in, const double *tot_in, double e_min, dc_step_result *res,
                      dc_err *err) {
    phase_ctx c = {.cb = (cpu_backend *)be,
                   .step = step,
                   .B = step->batch,
                   .L = step->n_layers,
                   .per_layer = step->mode == DC_CLIP_PER_LAYER,
                   .scale = dc_step_grad_scale(step)};
    uint64_t t0, t1;
    const uint32_t B = c.B;
    const size_t L = c.L;
    int rc;

    t0 = dc_clock_ns();
    if (step->device >= 0)
        return dc_err_set(err, DC_EPRECOND, "clip_step",
                          "the CPU backend cannot read tensors in GPU memory (cuda:%d)",
                          step->device);
    if (want != PHASE_NORMS &&
        (B == 0 || !res->norms || !res->coefs || !res->layer_norms ||
         (c.per_layer && !res->layer_coefs) || res->batch != B || res->n_layers != L))
        return dc_err_set(err, DC_EINTERNAL, "", "step result not initialised for this step");

    /* data checks, before any arithmetic; from here on the layers are read
     * through c.lay, whose embedding indices are daemon-memory copies */
    if ((rc = phase_checks(&c, err))) return rc;
    if (stats_carve(&c.cb->s, L, B, &c.st))
        return dc_err_set(err, DC_ENOSPACE, "", "out of memory for the CPU backend's scratch");

    uint64_t tp = dc_clock_ns(), tq;
    if ((rc = phase_norms(&c, want, n2_in, err))) return rc;
    if (want == PHASE_NORMS) {
        memcpy(n2_out, c.st.n2, L * B * sizeof *n2_out);
        return 0;
    }
    /* Clipping and noise are summed over layers below: start them at 0
     * even if the caller reuses a result. */
    res->phase_ns[DC_RUN_CLIPPING] = res->phase_ns[DC_RUN_NOISE] = 0;
    tq = dc_clock_ns();
    res->phase_ns[DC_RUN_NORMS] = tq - tp + 1; /* + 1: measured, even if under 1 ns */
    tp = tq;
    if ((rc = phase_reduction(&c, tot_in, e_min, err))) return rc;
    tq = dc_clock_ns();
    res->phase_ns[DC_RUN_REDUCTION] = tq - tp + 1;
    tp = tq;

    /* outputs into scratch: clipping and noise alternate per layer, timed
     * apart */
    if ((rc = plan_outputs(&c, err))) return rc;
    for (size_t l = 0; l < L; l++) {
        if (c.st.off[2 * l] == SIZE_MAX && c.st.off[2 * l + 1] == SIZE_MAX) continue;
        if ((rc = phase_clipping(&c, l, err))) return rc;
        tq = dc_clock_ns();
        res->phase_ns[DC_RUN_CLIPPING] += tq - tp;
        tp = tq;
        if ((rc = phase_noise(&c, l, res, err))) return rc;
        tq = dc_clock_ns();
        res->phase_ns[DC_RUN_NOISE] += tq - tp;
        tp = tq;
    }

    phase_commit(&c, res);
    t1 = dc_clock_ns();
    res->phase_ns[DC_RUN_NOISE] += t1 - tp;
    res->phase_ns[DC_RUN_CLIPPING] += 1;
    res->phase_ns[DC_RUN_NOISE] += 1;
    res->compute_ns = t1 - t0;
    return 0;
}

static int cpu_run_step(dc_backend *be, const dc_step *step, dc_step_result *res, dc_err *err) {
    int rc = run_phases(be, step, PHASE_ALL, NULL, NULL, NULL, 0.0, res, err);
    dc_cpu_scratch_trim(&((cpu_backend *)be)->s);
    return rc;
}

/* The CPU backend keeps nothing (kept is NULL: no kept_free) */
static int cpu_run_norms(dc_backend *be, const dc_step *step, double *n2, dc_kept **kept,
                         dc_err *err) {
    (void)kept;
    int rc = run_phases(be, step, PHASE_NORMS, n2, NULL, NULL, 0.0, NULL, err);
    dc_cpu_scratch_trim(&((cpu_backend *)be)->s);
    return rc;
}

static int cpu_run_clip(dc_backend *be, const dc_step *step, const double *n2, const double *tot,
                        double e_min, const dc_kept *kept, const size_t *kept_at,
                        dc_step_result *res, dc_err *err) {
    (void)kept;
    (void)kept_at;
    int rc = run_phases(be, step, PHASE_CLIP, NULL, n2, tot, e_min, res, err);
    dc_cpu_scratch_trim(&((cpu_backend *)be)->s);
    return rc;
}

void dc_cpu_backend_set_clip_how(dc_backend *be, unsigned how) {
    ((cpu_backend *)be)->clip_how = how;
}

size_t dc_cpu_backend_scratch_bytes(dc_backend *be) {
    return dc_cpu_scratch_bytes(&((cpu_backend *)be)->s);
}

static float *cpu_acc_alloc(dc_backend *be, size_t n) {
    (void)be;
    return malloc((n ? n : 1) * sizeof(float));
}

static void cpu_acc_free(dc_backend *be, float *p) {
    (void)be;
    free(p);
}

static int cpu_tensors_hash(dc_backend *be, const dc_tensor *const *ts, size_t n, uint64_t key,
                            uint64_t *out, dc_err *err) {
    (void)be;
    (void)err;
    for (size_t i = 0; i < n; i++)
        out[i] = dc_hash_bytes(ts[i]->data, dc_cpu_numel(ts[i]) * dc_dtype_size(ts[i]->dtype), key);
    return 0;
}

static void cpu_destroy(dc_backend *be) {
    cpu_backend *cb = (cpu_backend *)be;
    if (!cb) return;
    dc_cpu_scratch_free(&cb->s);
    free(cb);
}

/* The outputs are host memory, written in place. */
static int cpu_zero_outputs(dc_backend *be, const dc_step *s) {
    (void)be;
    for (size_t i = 0; i < dc_step_n_outputs(s); i++) {
        const dc_tensor *t = dc_step_output(s, i);
        if (t->data) memset(t->data, 0, dc_cpu_numel(t) * dc_dtype_size(t->dtype));
    }
    return 0;
}

/* No device queue: no events, no workspace. */
static const dc_backend_ops cpu_ops = {
    .name = "cpu",
    .run_step = cpu_run_step,
    .destroy = cpu_destroy,
    .run_norms = cpu_run_norms,
    .run_clip = cpu_run_clip,
    .acc_alloc = cpu_acc_alloc,
    .acc_free = cpu_acc_free,
    .tensors_hash = cpu_tensors_hash,
    .zero_outputs = cpu_zero_outputs,
};

int dc_cpu_backend_create(int threads, dc_backend **out, dc_err *err) {
    cpu_backend *cb = calloc(1, sizeof *cb);
    if (!cb) return dc_err_set(err, DC_ENOSPACE, "", "out of memory");
    cb->base.ops = &cpu_ops;
    cb->threads = threads > 0 ? threads : 1;
    *out = &cb->base;
    return 0;
}
