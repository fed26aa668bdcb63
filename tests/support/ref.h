/* The naive double-precision reference every backend is checked against, and
 * random test data. The reference builds each per-sample gradient explicitly
 * (G_b = scale * g_b^T a_b for a Linear, and so on) and takes its norm in
 * double: no ghost trick, no BLAS, nothing shared with the code under test
 * except the dc_layer/dc_step description and the dtype conversions.
 *
 * Ownership: tensors from dc_test_tensor_new own their data (free with
 * dc_test_tensor_free); everything else writes into caller arrays. */
#ifndef DC_TEST_REF_H
#define DC_TEST_REF_H

#include <stdint.h>

#include "step.h"

/* A test binary that cannot run here (no GPU, a library the build lacks)
 * exits with this; ctest's SKIP_RETURN_CODE reports it as skipped, never
 * passed. */
#define DC_TEST_SKIP 77

/* --- random data -------------------------------------------------------- */

typedef struct dc_test_rng {
    uint64_t s[2];
} dc_test_rng;

void dc_test_rng_seed(dc_test_rng *r, uint64_t seed);
uint64_t dc_test_next(dc_test_rng *r);
double dc_test_uniform(dc_test_rng *r);                        /* [0, 1) */
double dc_test_normal(dc_test_rng *r);                         /* N(0, 1) */
int64_t dc_test_range(dc_test_rng *r, int64_t lo, int64_t hi); /* [lo, hi] */

/* A heap tensor of `dtype` and shape (ndim 1..3; unused dims ignored). */
dc_tensor dc_test_tensor_new(dc_dtype dtype, int ndim, int64_t s0, int64_t s1, int64_t s2);
void dc_test_tensor_free(dc_tensor *t);
int64_t dc_test_tensor_numel(const dc_tensor *t);
/* Float tensors: N(0, scale^2) rounded to the dtype. Integer tensors: uniform
 * in [0, (int64_t)scale). */
void dc_test_tensor_fill(dc_tensor *t, dc_test_rng *r, double scale);

/* A random layer of `kind` with data (owned by the layer's tensors; free with
 * dc_test_layer_free). dims: B, T (T == 0: 2D input, T = 1), d, p (linear
 * out features; for embedding the vocabulary size). in_dtype applies to the
 * float inputs. with_outputs: allocate f32 weight/bias_grad_out. */
typedef struct dc_test_layer_spec {
    dc_layer_kind kind;
    uint32_t B;
    int64_t T;    /* 0 = 2D input */
    int64_t d, p; /* p: linear out features or embedding vocab */
    dc_dtype dtype;
    int has_bias;
    dc_algo algo;
    int with_outputs;
    int distinct_indices; /* embedding: 1 = all indices in a sample distinct */
} dc_test_layer_spec;
void dc_test_layer_make(dc_layer *l, const dc_test_layer_spec *spec, dc_test_rng *r);
void dc_test_layer_free(dc_layer *l);

/* A tied pair, as a language model's input embedding and output projection
 * share a weight: an embedding (indices [B, Te] from a small vocabulary V,
 * so tokens repeat, and a padding index at random) and a linear layer
 * [B, Tl, d] -> [B, Tl, V] (with a bias when has_bias), inputs of dtype dt.
 * They go at ls[0] and ls[1], layers `at` and `at + 1` of a step, the
 * embedding first when embedding_first; tie and tie_owner are set as
 * validation sets them, the owner (ls[0]) has an f32 weight_grad_out and
 * the later one none (its bias one, if any). Free with dc_test_layer_free. */
void dc_test_tied_pair(dc_layer *ls, size_t at, uint32_t B, int64_t Te, int64_t Tl, int64_t d,
                       int64_t V, dc_dtype dt, int has_bias, int embedding_first, dc_test_rng *r);

/* --- the reference -------------------------------------------------------- */

/* Squared norm of each sample's full per-sample gradient of layer l (all its
 * trainable params: weight, plus bias when has_bias), output grads multiplied
 * by `scale`. out[B]. */
void dc_ref_layer_sqnorms(const dc_layer *l, uint32_t B, double scale, double *out);

/* Sample b's per-sample gradient of layer l, output grads times scale:
 * gw [numel of weight_grad_out's shape], gb [bias numel] (NULL: not
 * wanted; unused without a bias). */
void dc_ref_layer_sample_grad(const dc_layer *l, uint32_t b, double scale, double *gw, double *gb);

/* sum_b coef[b] * scale * G_b for the weight (w_out, numel of
 * weight_grad_out's shape: [p,d] linear, [vocab,d] embedding, [d] norms) and
 * the bias (b_out, may be NULL). No noise, no division. */
void dc_ref_layer_clipped_sum(const dc_layer *l, uint32_t B, double scale, const double *coef,
                              double *w_out, double *b_out);

/* The whole step with noise_multiplier treated as 0 (tied pairs: the
 * owner's layer norm is that of both uses' per-sample gradients summed, the
 * later layer's its bias's; the owner's weight output both uses' sum):
 * norms[B], coefs[B]
 * (FLAT: min(1, C/(n+1e-6)); PER_LAYER: 1), layer_sq[L*B] squared layer
 * norms, layer_coefs[L*B] (PER_LAYER, else may be NULL). Then, for every layer
 * with weight/bias_grad_out set, the expected output values (divided by
 * expected_batch for MEAN) in w_exp[l] / b_exp[l] (arrays the caller sizes
 * by numel; entries for layers without outputs are left untouched; pass NULL
 * to skip). */
void dc_ref_step(const dc_step *s, double *norms, double *coefs, double *layer_sq,
                 double *layer_coefs, double **w_exp, double **b_exp);

/* max |got - want| / (atol + rtol*|want|) over n values: <= 1 means within. */
double dc_test_max_relerr_f(const float *got, const double *want, int64_t n, double rtol,
                            double atol);

/* Tolerances for comparing a backend's f32 results with the reference for
 * inputs of dtype t (inputs are already rounded to t, so only accumulation
 * error remains). */
double dc_test_rtol(dc_dtype t);

#endif
