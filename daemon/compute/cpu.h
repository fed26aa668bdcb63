/* Internal interface of the CPU backend (backend_cpu.c drives cpu_check.c,
 * cpu_norms.c and cpu_clip.c, which all take their scratch from
 * cpu_scratch.c). Outside daemon/compute it serves the CUDA
 * backend (cuda/backend/backend_int.h: its host-side rescue reuses these norms), the tests and
 * the benchmarks.
 *
 * Arithmetic: inputs are converted to f32 (bf16/f16 -> f32 is exact),
 * products are accumulated in f32 by OpenBLAS, and per-sample sums of squares
 * are accumulated in double. BLAS threading is process-wide in OpenBLAS, so it
 * is left to OPENBLAS_NUM_THREADS; the backend never changes it.
 *
 * Ownership: a dc_cpu_scratch belongs to one backend instance (one worker
 * thread); its buffers grow to the largest step seen and are reused, so a
 * steady stream of same-shaped steps does no allocation. */
#ifndef DC_CPU_H
#define DC_CPU_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "backend.h"
#include "dc_err.h"
#include "step.h"

/* A growable, 64-byte aligned block. Contents are not kept across growth. */
typedef struct dc_cpu_buf {
    void *p;
    size_t cap;
    size_t used; /* the most reserved since the last trim */
} dc_cpu_buf;

/* NULL on allocation failure (b is then unchanged). */
void *dc_cpu_buf_reserve(dc_cpu_buf *b, size_t bytes);
void dc_cpu_buf_free(dc_cpu_buf *b);

typedef struct dc_cpu_scratch {
    dc_cpu_buf in;     /* f32 copy of the current layer's float input */
    dc_cpu_buf grad;   /* f32 copy of the current layer's output grad */
    dc_cpu_buf work;   /* per-sample products: G tiles, Gram matrices, scaled g */
    dc_cpu_buf work2;  /* second Gram matrix, per-sample vectors */
    dc_cpu_buf order;  /* embedding: (index, position) sort keys */
    dc_cpu_buf out;    /* every output of a step (f32) until all are checked */
    dc_cpu_buf stats;  /* per-step [L*B] squared norms and coefficients */
    dc_cpu_buf layers; /* the step's layers with indices in daemon memory */
    dc_cpu_buf idx;    /* every embedding layer's indices, copied once */
    dc_cpu_buf scaled; /* linear: one sample's a and g scaled by powers of 2 */
    dc_cpu_buf tie;    /* tied pair: the embedding's output grad as f32 */
} dc_cpu_scratch;

void dc_cpu_scratch_free(dc_cpu_scratch *s);
/* The kernel paths whose rounding the coefficients of a CPU backend
 * instance cover (step.h DC_E_*): 0, its own, unless set. For the CUDA
 * backend's tests, which compare its results with the CPU's: with the
 * GPU's how both compute the same coefficients from the same norms. */
void dc_cpu_backend_set_clip_how(dc_backend *be, unsigned how);

/* Bytes of scratch held now (tests: an outlier's scratch is given back). */
size_t dc_cpu_scratch_bytes(const dc_cpu_scratch *s);
/* After a step: a buffer over 16 MiB that the step used less than half of
 * goes back to the system (one outlier step leaves no idle worker holding
 * its peak; steady large steps keep theirs); every buffer's use restarts. */
void dc_cpu_scratch_trim(dc_cpu_scratch *s);
/* The same for a CPU backend instance made by dc_cpu_backend_create. */
size_t dc_cpu_backend_scratch_bytes(dc_backend *be);

/* The tensor's first n elements as f32: t->data itself when it is f32, else a
 * converted copy in buf. NULL on allocation failure. */
const float *dc_cpu_as_f32(dc_cpu_buf *buf, const dc_tensor *t, size_t n);
/* Layer l's input (*x; NULL for an embedding, whose input is indices) and
 * output gradient (*g) over B samples as f32, in s->in and s->grad where
 * converted. -1 on allocation failure. */
int dc_cpu_layer_f32(dc_cpu_scratch *s, const dc_layer *l, uint32_t B, const float **x,
                     const float **g);

/* Product of a tensor's dims. */
size_t dc_cpu_numel(const dc_tensor *t);

/* --- cpu_check.c --------------------------------------------------------- */

/* Scans a layer's inputs before anything is computed: embedding indices in
 * [0, vocab) (else DC_EINVAL, field "<name>.indices"), every float finite
 * (else DC_ENONFINITE, field "<name>.activations" / ".input" /
 * ".output_grad"). Messages name the sample.
 * *safe receives the layer as the later phases must read it: for an
 * EMBEDDING its indices are copied into idx (B*T elements, daemon memory)
 * and safe->input points there (i64), so no index is read twice from client
 * memory. idx may be NULL for other kinds. */
int dc_cpu_check_layer(const dc_layer *l, uint32_t B, dc_layer *safe, int64_t *idx, dc_err *err);

/* Index of the first non-finite value among n floats of dtype t, or -1. */
int64_t dc_cpu_find_nonfinite(const void *p, dc_dtype t, size_t n);

/* --- cpu_norms.c --------------------------------------------------------- */

/* Squared per-sample gradient norms of one layer, output grads multiplied by
 * `scale`: n2[B]. Inputs must have passed dc_cpu_check_layer. */
int dc_cpu_layer_sqnorms(dc_cpu_scratch *s, const dc_layer *l, uint32_t B, float scale, double *n2,
                         dc_err *err);

/* Linear weight (+ bias) squared norms of unscaled per-sample gradients, on
 * f32 data: a [B*T, d], g [B*T, p] row-major. algo is DIRECT or GHOST (AUTO
 * resolves through the same rule as dc_linear_pick). Exposed for the
 * benchmark. */
int dc_cpu_linear_sqnorms(dc_cpu_scratch *s, const float *a, const float *g, uint32_t B, int64_t T,
                          int64_t d, int64_t p, bool has_bias, dc_algo algo, double *n2);

/* LayerNorm / RMSNorm, sample b (f32 data, x and g [B*T, d]): wg[d] = sum_t
 * g_t * x_hat_t and, when bg != NULL, bg[d] = sum_t g_t, both unscaled. */
void dc_cpu_norm_sample(const dc_layer *l, const float *x, const float *g, uint32_t b, double *wg,
                        double *bg);

/* Tied parameters (dc_layer.tie): given n2 [L*B] with every layer's
 * squared norms (the later layer of the pair, `later`, without its bias),
 * moves the later layer's weight part into the owner's and adds the cross
 * term of the two uses, so that the owner's is the shared weight's norm;
 * the later layer's becomes its bias's (0 for an embedding). Output grads
 * times `scale`, as dc_cpu_layer_sqnorms. Inputs checked as there. */
int dc_cpu_tie_sqnorms(dc_cpu_scratch *s, const dc_layer *lay, size_t later, uint32_t B,
                       float scale, double *n2, dc_err *err);

/* Embedding index at flat position i (i32 or i64 tensor). */
static inline int64_t dc_cpu_index(const dc_tensor *t, size_t i) {
    return t->dtype == DC_I32 ? (int64_t)((const int32_t *)t->data)[i]
                              : ((const int64_t *)t->data)[i];
}

/* --- cpu_clip.c ---------------------------------------------------------- */

/* Book-keeping: w = sum_b c[b] * G_b (weight, numel of weight_grad_out) and,
 * when bias != NULL, the bias sum likewise; c already includes the grad
 * scale. w and bias are f32 arrays the caller owns (overwritten). */
int dc_cpu_layer_clipped_sum(dc_cpu_scratch *s, const dc_layer *l, uint32_t B, const float *c,
                             float *w, float *bias, dc_err *err);
/* Tied parameters: adds layer l's weight part of the clipped sum (its use of
 * the shared weight) into w, which holds the owner's. */
int dc_cpu_layer_clipped_add(dc_cpu_scratch *s, const dc_layer *l, uint32_t B, const float *c,
                             float *w, dc_err *err);

#endif
