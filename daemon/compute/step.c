/* dc_step_result lifetime, the step's cost estimate, and the certified
 * clipping coefficients (the rounding bounds e of every kernel path). The
 * step itself (step.h) is plain data. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "step.h"

int dc_step_result_init(dc_step_result *r, uint32_t batch, size_t n_layers, bool per_layer) {
    r->batch = batch;
    r->n_layers = n_layers;
    r->compute_ns = 0;
    memset(r->phase_ns, 0, sizeof r->phase_ns);
    r->released = false;
    r->layer_coefs = NULL;
    r->norms = calloc(batch, sizeof(float));
    r->coefs = calloc(batch, sizeof(float));
    /* n_layers may be 0 for an empty step; keep a valid pointer anyway. */
    r->layer_norms = calloc(n_layers ? n_layers * (size_t)batch : 1, sizeof(float));
    if (per_layer) r->layer_coefs = calloc(n_layers ? n_layers * (size_t)batch : 1, sizeof(float));
    if (!r->norms || !r->coefs || !r->layer_norms || (per_layer && !r->layer_coefs)) {
        dc_step_result_free(r);
        return DC_ENOSPACE;
    }
    return DC_OK;
}

void dc_step_result_free(dc_step_result *r) {
    free(r->norms);
    free(r->coefs);
    free(r->layer_norms);
    free(r->layer_coefs);
    r->norms = r->coefs = r->layer_norms = r->layer_coefs = NULL;
}

static double tensor_elems(const dc_tensor *t) {
    double n = t->data ? 1.0 : 0.0;
    for (int i = 0; i < t->ndim; i++) n *= (double)t->shape[i];
    return n;
}

/* Doubles: products of client-chosen dimensions may pass 2^64, and an
 * estimate only has to be compared with a limit. */
void dc_step_cost_estimate(const dc_step *s, dc_step_cost *c) {
    double B = s->batch, L = (double)s->n_layers, LB = L * B;
    double flops = 0.0, scratch = 0.0, staged = 0.0, idx = 0.0;
    bool host = s->device < 0;
    for (size_t l = 0; l < s->n_layers; l++) {
        const dc_layer *ly = &s->layers[l];
        double T = (double)ly->T, d = (double)ly->d, p = (double)ly->p, rows = B * T;
        double f = 0.0, mem = 0.0;
        switch (ly->kind) {
        case DC_LAYER_LINEAR:
            /* norms: direct 2Tdp or ghost 2T^2(d+p) per sample; clipped sum:
             * one GEMM of 2 B T d p */
            f = (dc_linear_pick(ly) == DC_ALGO_DIRECT || ly->T == 1 ? 2.0 * T * d * p
                                                                    : 2.0 * T * T * (d + p)) *
                    B +
                2.0 * rows * d * p;
            mem = 4.0 * rows * (d + p) + (dc_linear_pick(ly) == DC_ALGO_GHOST ? 8.0 * T * T : 0.0) +
                  4.0 * rows * p; /* f32 copies, Grams, the scaled g of the sum */
            break;
        case DC_LAYER_EMBEDDING:
            f = 4.0 * rows * d;
            mem = 4.0 * rows * d + 16.0 * T + 8.0 * d;
            idx += 8.0 * rows;
            break;
        case DC_LAYER_LAYERNORM:
        case DC_LAYER_RMSNORM:
            f = 16.0 * rows * d;
            mem = 8.0 * rows * d + 32.0 * d;
            break;
        }
        if (dc_layer_tied_later(ly)) {
            /* the cross term of a tied pair: a Gram of the two uses'
             * positions per sample, and the embedding's grads as f32 */
            const dc_layer *o = &s->layers[ly->tie - 1];
            double Te = (double)(ly->kind == DC_LAYER_EMBEDDING ? ly->T : o->T);
            double Tl = (double)(ly->kind == DC_LAYER_LINEAR ? ly->T : o->T);
            f += 2.0 * B * Te * Tl * d;
            mem += 4.0 * Te * Tl + 4.0 * B * Te * d;
        }
        flops += f;
        if (mem > scratch) scratch = mem;
        staged += 4.0 * (tensor_elems(&ly->weight_grad_out) + tensor_elems(&ly->bias_grad_out));
    }
    /* tables: n2 (double), per-layer norms and coefficients, the result's
     * arrays; the reply carries norms and coefficients, and per layer when
     * asked */
    double tables = LB * (8.0 + 4.0 + 4.0 + 4.0) + B * 16.0;
    double reply = B * 8.0 + (s->want_layer_norms ? LB * 4.0 : 0.0) +
                   (s->mode == DC_CLIP_PER_LAYER ? LB * 4.0 : 0.0);
    double bytes = tables + reply + (host ? scratch + staged + idx : 0.0);
    c->samples = LB > 1.8e19 ? UINT64_MAX : (uint64_t)LB;
    c->host_bytes = bytes > 1.8e19 ? UINT64_MAX : (uint64_t)bytes;
    c->gflop = flops / 1e9;
}

/* --- certified sensitivity (step.h; docs/design.md) ------------------------
 *
 * For each layer, a factor f >= n_exact / n_computed under the model of
 * docs/design.md: every product of the kernels is exact (bf16, f16 and TF32
 * operands in f32, f32 operands in an FMA or double); every addition
 * rounds with relative error at most u; the terms of each signed sum that
 * forms a gradient entry (the direct form's sum over T, a Gram entry's over
 * d or p, a bias's or an embedding row's over T) have one sign, so that
 * each such sum is computed within gamma_K of itself (Higham, Accuracy and
 * Stability of Numerical Algorithms, 2nd ed., 3.1: a recursive sum of K
 * terms in any order has |error| <= gamma_{K-1} sum |terms|); sums of
 * squares have positive terms, so gamma of their depth bounds them. */

/* Unit roundoffs: an f32 operation rounded to nearest; one step of an
 * f32 accumulation on the CPU (an inner product of K terms, with or
 * without FMA, is within gamma_K u of the sum of |products|: Higham 3.1);
 * one on the GPU (tensor cores truncate their sums and may drop bits
 * aligning them: 4u, Fasi et al., PeerJ CS 2021); double with a factor 2. */
#define E_U32 0x1p-24
#define E_UCPU 0x1p-24
#define E_UGPU 0x1p-22
#define E_U64 0x1p-52
/* TF32 keeps 10 of f32's 23 mantissa bits, truncated toward zero: an
 * operand loses less than 2^-10 of itself. The kept per-sample gradients
 * are bf16, rounded to nearest: less than 2^-8 of each entry. */
#define E_TF32 0x1p-10
#define E_BF16 0x1p-8

/* gamma_n = n u / (1 - n u), for n u < 1/2; infinite past it (no bound). */
static double gam(double n, double u) {
    const double x = n * u;
    return x < 0.5 ? x / (1.0 - x) : INFINITY;
}

/* 1 / (1 - gamma_n): a positive quantity computed within gamma_n of itself
 * is at most this times the computed value. */
static double low(double n, double u) {
    const double g = gam(n, u);
    return g < 1.0 ? 1.0 / (1.0 - g) : INFINITY;
}

static double cdiv(double a, double b) { return ceil(a / b); }

/* GPU: the most roundings any kernel spends on a positive partial sum
 * inside a CTA (a thread's strided squares, its 64 or 128 accumulators,
 * the warp and block reductions) before its atomic add into n2[b]. */
static double gpu_cta_depth(double d, double p) { return 512.0 + (d + p) / 32.0; }

/* The LINEAR forms the CUDA backend may run for this layer. Its pick
 * (cuda/kernels/norms_linear.cu, dcc_linear_pick*) compares the two forms' work on
 * their tiles (direct 128x128 tiles over K = T in steps of 32, ghost pairs
 * of 128-row blocks over K = d and p in steps of 64) at a rate of 0.5 to
 * 1.25; a band of 0.25 to 4 keeps this bound valid should the rates move.
 * A layer whose f32 norms overflow is computed again on the host by the
 * CPU's pick (backend_diag.cu), so that form counts too. A kept layer's
 * norms run direct. T = 1 runs the rank-one formula, whose rounding the
 * direct form's bound covers. */
static void gpu_forms(const dc_layer *l, unsigned how, bool *direct, bool *ghost) {
    *direct = *ghost = false;
    if (l->T == 1 || l->algo == DC_ALGO_DIRECT || (how & DC_E_KEPT)) {
        *direct = true;
        return;
    }
    if (l->algo == DC_ALGO_GHOST) {
        *ghost = true;
        return;
    }
    const double T = (double)l->T, d = (double)l->d, p = (double)l->p;
    const double dw = cdiv(p, 128) * cdiv(d, 128) * 128.0 * 128.0 * 32.0 * cdiv(T, 32);
    const double nt = cdiv(T, 128);
    const double gw = nt * (nt + 1.0) * 0.5 * 128.0 * 128.0 * 64.0 * (cdiv(d, 64) + cdiv(p, 64));
    const bool cpu_direct = dc_linear_pick(l) == DC_ALGO_DIRECT;
    *direct = cpu_direct || dw <= 4.0 * gw;
    *ghost = !cpu_direct || dw > 0.25 * gw;
}

static double f_linear(const dc_layer *l, unsigned how) {
    const double T = (double)l->T, d = (double)l->d, p = (double)l->p;
    double f;
    if (!(how & DC_E_GPU)) { /* cpu_norms.c */
        if (l->T == 1)       /* ||a||^2 ||g||^2 and the bias's ||g||^2, in double */
            return low(d + p + 16.0, E_U64);
        if (dc_linear_pick(l) == DC_ALGO_DIRECT) /* sgemm tiles over K = T; squares in double */
            return low(T, E_UCPU) * sqrt(low(d * p + T * p + 16.0, E_U64));
        /* ssyrk Grams over K = d and K = p; their products summed in double */
        return sqrt(low(d, E_UCPU) * low(p, E_UCPU) * low(T * T + T * p + 16.0, E_U64));
    }
    bool direct, ghost;
    const double cta = gpu_cta_depth(d, p);
    gpu_forms(l, how, &direct, &ghost);
    f = 1.0;
    if (direct) {
        /* entries over K = T (the bias's column sums too); the squares'
         * atomics: one a warp of the grouped kernel's 256x128 tiles, one a
         * rank of a split 128-row TMA tile (up to 6), one a CUDA-core
         * kernel's 64x64 tile, and the spread bias sums' */
        const double at = fmax(fmax(8.0 * cdiv(p, 256) * cdiv(d, 128),
                                    6.0 * cdiv(p, 128) * cdiv(d, 128)),
                               cdiv(p, 64) * cdiv(d, 64)) +
                          2.0 * cdiv(p, 64);
        f = fmax(f, low(T, E_UGPU) * sqrt(low(cta + at, 2.0 * E_U32)));
    }
    if (ghost) {
        /* Gram entries over K = d and K = p; each pair's products summed in
         * the CTA, one atomic a warp and split rank (up to 12 x 6) of the
         * TMA form, one a CTA of 64-row pairs on CUDA cores */
        const double nt = cdiv(T, 128), nt64 = cdiv(T, 64);
        const double at = fmax(72.0 * nt * (nt + 1.0) * 0.5, nt64 * (nt64 + 1.0) * 0.5);
        f = fmax(f, sqrt(low(d, E_UGPU) * low(p, E_UGPU) * low(cta + at + 64.0, 2.0 * E_U32)));
    }
    /* The values the kernels multiply, against the inputs as given: the
     * TF32 kernels' norms are of truncated operands. Not the rank-one
     * formula's (T = 1 unless forced direct): it squares the f32 values,
     * and each truncated product g_i a_j the sum adds is at most the
     * exact one, so that norm bounds the released gradient's too. */
    const bool rank1 = l->T == 1 && l->algo != DC_ALGO_DIRECT;
    if ((how & DC_E_TF32) && !rank1 && l->input.dtype == DC_F32 && l->grad.dtype == DC_F32)
        f /= (1.0 - E_TF32) * (1.0 - E_TF32);
    if (how & DC_E_KEPT) f /= 1.0 - E_BF16;
    return f;
}

static double f_embedding(const dc_layer *l, bool gpu) {
    const double T = (double)l->T, d = (double)l->d;
    if (!gpu) /* runs of equal indices summed in double, squared in double */
        return low(T * d + d + 16.0, E_U64);
    /* a run's rows summed in f32 (at most T), a warp's squares, one atomic
     * a run (norms_other.cu) */
    return low(T, E_UGPU) * sqrt(low(gpu_cta_depth(d, 0.0) + T, 2.0 * E_U32));
}

static double f_norm_layer(const dc_layer *l, bool gpu) {
    const double T = (double)l->T, d = (double)l->d;
    if (!gpu) /* x_hat and the per-sample vectors in double (cpu_norms.c) */
        return low(T + 8.0 * d + 16.0, E_U64);
    /* the row statistics rounded to f32, x_hat's subtraction and product,
     * g x_hat summed over T in f32 chunks and atomics; then the [B, d]
     * vectors (which the clipped sum multiplies) squared in a block */
    return low(T + 8.0, E_UGPU) * low(4.0, E_U32) *
           sqrt(low(gpu_cta_depth(d, 0.0) + 4.0, 2.0 * E_U32));
}

/* A linear layer's bias alone (the later layer of a tied pair). */
static double f_bias(const dc_layer *l, bool gpu) {
    const double T = (double)l->T, p = (double)l->p;
    if (!l->has_bias || l->kind != DC_LAYER_LINEAR) return 1.0;
    if (!gpu) return low(T * p + p + 16.0, E_U64);
    return low(T, E_UGPU) * sqrt(low(gpu_cta_depth(p, 0.0) + cdiv(p, 256) + 8.0, 2.0 * E_U32));
}

/* The shared weight of a tied pair: ||G_e||^2 + ||G_l||^2 + 2 <G_e, G_l>,
 * each within its factor (the cross term's Gram over K = d in f32, then
 * double), combined in double (and stored as f32 on the GPU). */
static double f_tied_owner(const dc_step *s, const dc_layer *o, unsigned how) {
    const dc_layer *t = &s->layers[o->tie - 1];
    const dc_layer *emb = o->kind == DC_LAYER_EMBEDDING ? o : t;
    const dc_layer *lin = o->kind == DC_LAYER_LINEAR ? o : t;
    const bool gpu = (how & DC_E_GPU) != 0;
    const double fx = low((double)lin->d + 8.0, gpu ? E_UGPU : E_UCPU);
    const double f = fmax(fmax(f_linear(lin, how & ~DC_E_KEPT), f_embedding(emb, gpu)), fx);
    return gpu ? f * low(4.0, E_U32) : f;
}

double dc_clip_e(const dc_step *s, size_t l, unsigned how) {
    const dc_layer *ly = &s->layers[l];
    const bool gpu = (how & DC_E_GPU) != 0;
    double f;
    if (dc_layer_tied_later(ly)) f = f_bias(ly, gpu);
    else if (ly->tie) f = f_tied_owner(s, ly, how);
    else switch (ly->kind) {
        case DC_LAYER_LINEAR: f = f_linear(ly, how); break;
        case DC_LAYER_EMBEDDING: f = f_embedding(ly, gpu); break;
        case DC_LAYER_LAYERNORM:
        case DC_LAYER_RMSNORM: f = f_norm_layer(ly, gpu); break;
        default: return INFINITY;
        }
    /* Applying the coefficient: the CPU rounds c g once; the GPU's sums
     * rescale one accumulator from sample to sample (a rounded quotient
     * and a rounded product each, cuda/kernels/grouped_tma.cu, clipped_tf32.cu),
     * so a sample's effective multiplier is within gamma_{2B} of its
     * coefficient. Then the norm's way to the coefficient: the GPU stores
     * layer norms in f32 and adds them up (16 roundings of f32 are ample),
     * the CPU keeps them in double; the square root and the coefficient
     * are double on both. */
    const double apply = gpu ? gam(2.0 * (double)s->batch + 8.0, E_U32) : gam(1.0, E_U32);
    const double base = gpu ? gam(16.0, E_U32) : gam(16.0, E_U64);
    const double e = f * (1.0 + apply) * (1.0 + base) - 1.0;
    if (!(e >= 0.0)) return INFINITY; /* NaN: no bound */
    const double floor = gpu ? DC_E_FLOOR_GPU : DC_E_FLOOR_CPU;
    return e > floor ? e : floor;
}

int dc_clip_e_check(const dc_step *s, unsigned how, dc_err *err) {
    for (size_t l = 0; l < s->n_layers; l++) {
        const dc_layer *ly = &s->layers[l];
        if (!ly->norm_excluded && !(dc_clip_e(s, l, how) <= DBL_MAX))
            return dc_err_set(err, DC_EINVAL, ly->name,
                              "its f32 sums (T=%lld, d=%lld, p=%lld) are too long for any bound "
                              "on their rounding, so no clipping coefficient can be certified; "
                              "send shorter samples",
                              (long long)ly->T, (long long)ly->d, (long long)ly->p);
    }
    return 0;
}

double dc_clip_e_step(const dc_step *s, unsigned how) {
    double e = 0.0;
    for (size_t l = 0; l < s->n_layers; l++)
        if (!s->layers[l].norm_excluded) e = dc_clip_e_max(e, dc_clip_e(s, l, how));
    return e;
}

double dc_clip_e_phase(const dc_step *s, unsigned how, const uint8_t *kept) {
    double e = dc_clip_e_step(s, how);
    for (size_t l = 0; kept && l < s->n_layers; l++)
        if (kept[l] && !s->layers[l].norm_excluded)
            e = dc_clip_e_max(e, dc_clip_e(s, l, how | DC_E_KEPT));
    return e;
}

float dc_clip_coef(float C, double norm, double e) {
    if (!(norm >= 0.0 && norm <= DBL_MAX) || !(e >= 0.0 && e <= DBL_MAX) || !(C >= 0.0f))
        return 0.0f;
    const double c = (double)C / (norm * (1.0 + e) + 1e-6);
    float f = (float)c;
    if ((double)f > c) f = nextafterf(f, 0.0f);
    return f < 1.0f ? f : 1.0f;
}

float dc_clip_scaled(float c, float scale) {
    const double x = (double)c * (double)scale;
    float f = (float)x;
    if ((double)f > x) f = nextafterf(f, 0.0f);
    return f;
}
