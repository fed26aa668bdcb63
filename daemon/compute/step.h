/* The validated form of a ClipStep: what the loop thread hands a backend.
 *
 * Ownership: a dc_step and its layers array are owned by whoever built it
 * (validate.c builds them from a decoded request; tests build them by hand).
 * Tensor data pointers point into buffers the session keeps mapped (and
 * reference-counted) until the step completes; a dc_step never owns them.
 *
 * Every tensor here has already been checked: dtype allowed for its role,
 * shapes consistent across the layer, byte range inside its buffer (with
 * overflow-safe arithmetic). What validation cannot check without touching
 * the data (finite values, embedding indices in range) the backend checks and
 * reports with a field name. */
#ifndef DC_STEP_H
#define DC_STEP_H

#include <float.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "dc_algo.h"
#include "dc_dtype.h"
#include "dc_err.h"
#include "noise.h"

typedef struct dc_tensor {
    void *data; /* NULL: absent (optional outputs) */
    dc_dtype dtype;
    int ndim;
    int64_t shape[3];
} dc_tensor;

typedef enum dc_layer_kind {
    DC_LAYER_LINEAR = 1,
    DC_LAYER_EMBEDDING = 2,
    DC_LAYER_LAYERNORM = 3,
    DC_LAYER_RMSNORM = 4
} dc_layer_kind;

typedef enum dc_reduction { DC_REDUCTION_SUM = 1, DC_REDUCTION_MEAN = 2 } dc_reduction;

/* Which elements of an output get the step's noise (Layer.weight_noise /
 * bias_noise: a sharded model's sums step noises the rows its rank owns,
 * step_pass.c). set false: every element. dim 0: rows [begin, end), the
 * dim-0 slices; dim 1: columns [begin, end) of a 2-D output (a weight the
 * trainer keeps transposed). validate.c checks it against the output. */
typedef struct dc_noise_range {
    bool set;
    uint32_t dim;
    uint64_t begin, end;
} dc_noise_range;

/* A range as the backends test it: element i of the output is noised when
 * lo <= (mod ? i % mod : i) < hi. */
typedef struct dc_noise_span {
    uint64_t mod, lo, hi;
} dc_noise_span;
typedef enum dc_clip_mode { DC_CLIP_FLAT = 0, DC_CLIP_PER_LAYER = 1 } dc_clip_mode;

/* One layer, shapes normalized to [B, T, .]: a 2D input [B, d] has T = 1.
 *
 *            input                 grad        weight_grad_out  bias_grad_out
 * LINEAR     activations [B,T,d]   [B,T,p]     [p,d]            [p]
 * EMBEDDING  indices [B,T] i32/i64 [B,T,d]     [vocab,d]        -
 * LAYERNORM  x [B,T,d]             [B,T,d]     [d]              [d]
 * RMSNORM    x [B,T,d]             [B,T,d]     [d]              -
 *
 * For LAYERNORM/RMSNORM `input` is the layer's input x; the backend computes
 * x_hat = (x - mean) / sqrt(var + eps) (LayerNorm, biased variance) or
 * x / sqrt(mean(x^2) + eps) (RMSNorm) per row, in f32. */
typedef struct dc_layer {
    dc_layer_kind kind;
    char name[64];   /* client's name, or "layers[i]" */
    int64_t T, d, p; /* p: linear out_features, else 0 */
    int64_t vocab;   /* embedding num_embeddings, else 0 */
    dc_tensor input;
    dc_tensor grad;
    bool has_bias;        /* LINEAR, LAYERNORM: bias is a trainable param */
    dc_algo algo;         /* LINEAR: as requested (AUTO = by cost) */
    bool has_padding_idx; /* EMBEDDING */
    int64_t padding_idx;
    float eps;           /* LAYERNORM, RMSNORM */
    float max_grad_norm; /* threshold in PER_LAYER mode */
    /* Norm groups: held whole by every member (counted in the norm once,
     * by the lowest rank; noise from the group's key, stream by rep_ordinal,
     * the layer's place among the step's replicated layers) */
    bool replicated;
    uint32_t rep_ordinal;
    /* Tied parameters (Layer.tied_to): an EMBEDDING and a LINEAR whose
     * weight is one parameter. tie = 1 + the index of the other layer of
     * the pair, 0 = none. The owner (the earlier of the two) writes the
     * weight_grad_out, the clipped sum of both uses, and its layer norm
     * covers the whole shared weight, cross term included; the later one's
     * covers its bias alone (backends compute its weight part without it). */
    uint32_t tie;
    bool tie_owner;
    /* A fused group step (step_fuse.c: the group's members' steps run as
     * one): a layer another member also holds (replicated, rank > 0) is
     * left out of the per-sample norm; noise_step != 0 gives the layer its
     * member's noise step and stream index (2 * noise_index + k) instead of
     * the step's, so that every member's noise is what its own step would
     * have drawn. 0 / false everywhere else. */
    bool norm_excluded;
    uint64_t noise_step;
    uint32_t noise_index;
    dc_tensor weight_grad_out;       /* optional */
    dc_tensor bias_grad_out;         /* optional, only with has_bias */
    dc_noise_range noise_w, noise_b; /* of weight_grad_out and bias_grad_out */
    /* A micro-batch of a logical step (dc_step.acc): each output's f32
     * accumulator, as many elements as the output, in the step's memory
     * (host, or the step's device); NULL for an output the step lacks.
     * Owned by the session's logical step (step_logical.h). */
    float *acc_w, *acc_b;
} dc_layer;

/* What a step does with its clipped sums (gradient accumulation: the
 * micro-batches of one logical step). NONE: noise, divide, write the
 * outputs. FIRST, ADD: the clipped sum, without noise or division, is
 * stored into (FIRST) or added to (ADD) each output's accumulator, and no
 * output is written (norms_out and coefs_out are). COMMIT: the accumulator
 * is added to the clipped sum, which is then noised, divided and written
 * as with NONE. */
typedef enum dc_acc_mode { DC_ACC_NONE = 0, DC_ACC_FIRST, DC_ACC_ADD, DC_ACC_COMMIT } dc_acc_mode;

typedef struct dc_step {
    uint32_t batch; /* B >= 1 */
    size_t n_layers;
    dc_layer *layers;
    dc_clip_mode mode;
    float max_grad_norm; /* C (FLAT) */
    float noise_norm;    /* the C of the noise std when it is not max_grad_norm
                                * (group-wise clipping: C, with C / sqrt(size) clipping); 0 = C */
    dc_reduction reduction;
    uint32_t expected_batch; /* MEAN divisor; set to batch when the request said 0 */
    float noise_multiplier;  /* sigma >= 0 */
    /* Noise stream: Philox key and a counter base unique to this step within
     * the daemon's lifetime. Set by the daemon, never by the client. */
    uint64_t noise_key;
    uint64_t noise_step;
    /* Norm groups: the group's noise key and step, for replicated layers
     * (the same on every member); 0 outside a group. */
    uint64_t group_noise_key;
    uint64_t group_step;
    dc_tensor norms_out; /* optional [B] f32 */
    dc_tensor coefs_out; /* optional [B] f32 */
    /* A fused group step: the other members' norms_out and coefs_out
     * [n_more_outs] each (absent ones data NULL), written as these are. */
    size_t n_more_outs;
    const dc_tensor *more_norms_out, *more_coefs_out;
    bool want_layer_norms;
    dc_acc_mode acc; /* gradient accumulation; NONE outside a logical step */
    /* Where every tensor of the step lives: -1 = host memory (shared memory
     * mapped by the daemon), else the CUDA device index (validation refuses
     * steps that mix them). */
    int device;
    /* A backend that queues work on a device calls enqueued(enqueued_arg)
     * once everything that writes the client's memory is queued, before it
     * waits for the device; the callback records the client's signal event
     * and, for an early notice (ClipStep.notify_enqueued), has the loop
     * send it. With an early notice, a step that
     * fails after that point writes zeros to every output instead of
     * leaving them untouched (zero_on_fail), as the client may already
     * consume them. Synchronous backends ignore both. */
    void (*enqueued)(void *arg);
    void *enqueued_arg;
    bool zero_on_fail;
    /* ClipStep.done_flag: a u32 in the client's shared memory that the
     * daemon (not a backend) stores the step's done value into once it
     * finished (step_run.c); NULL: none. done_abandon: the flag's second
     * word where it has one ([2]), which takes the done value instead when
     * a failed step's outputs could not be zeroed; NULL: none. */
    uint32_t *done_flag;
    uint32_t *done_abandon;
} dc_step;

/* The tensors a step may write, in order: each layer's weight_grad_out and
 * bias_grad_out, then norms_out and coefs_out (data NULL: not asked for). */
static inline size_t dc_step_n_outputs(const dc_step *s) { return 2 * s->n_layers + 2; }
static inline const dc_tensor *dc_step_output(const dc_step *s, size_t i) {
    if (i < 2 * s->n_layers)
        return i % 2 ? &s->layers[i / 2].bias_grad_out : &s->layers[i / 2].weight_grad_out;
    return i == 2 * s->n_layers ? &s->norms_out : &s->coefs_out;
}

/* Parts of a backend's step, timed for the metrics (dc_step_result.phase_ns):
 * per-sample norms; their reduction over layers into total norms and
 * coefficients (and, with shard groups, across ranks); the clipped sums;
 * noise, division, checks and the write of the outputs. A GPU backend also
 * measures how long its stream waited on the client's event. */
typedef enum dc_run_phase {
    DC_RUN_WAIT_INPUT = 0, /* GPU: the stream waiting on the client's event */
    DC_RUN_NORMS,
    DC_RUN_REDUCTION,
    DC_RUN_CLIPPING,
    DC_RUN_NOISE,
    DC_RUN_N
} dc_run_phase;

/* Filled by a backend; arrays are malloc'd by dc_step_result_init and freed
 * by dc_step_result_free. */
typedef struct dc_step_result {
    uint32_t batch;
    size_t n_layers;
    float *norms;       /* [B] total per-sample norm sqrt(sum over layers) */
    float *coefs;       /* [B] flat coefficients (PER_LAYER: all 1) */
    float *layer_norms; /* [L*B] layer-major, always filled */
    float *layer_coefs; /* [L*B] PER_LAYER only, else NULL */
    uint64_t compute_ns;
    uint64_t phase_ns[DC_RUN_N]; /* 0 = not measured */
    /* A failed step that released something all the same: an output found
     * not finite once noised (where it failed depends on the noise; the
     * backend sets this), or outputs written before a later failure. Its
     * privacy spend then stands instead of being refunded. */
    bool released;
} dc_step_result;

/* What a validated step will cost the daemon, estimated before it is
 * accepted, so that one request cannot take a node's memory or its workers
 * (limits.max_step_*). samples: layers x batch. host_bytes: the per-sample
 * tables, the reply, and for a host-memory step the CPU backend's largest
 * scratch (f32 copies, Grams, staged outputs). gflop: the norms and the
 * clipped sums by the algorithm each layer will use. */
typedef struct dc_step_cost {
    uint64_t samples;
    uint64_t host_bytes;
    double gflop;
} dc_step_cost;

void dc_step_cost_estimate(const dc_step *s, dc_step_cost *c);

int dc_step_result_init(dc_step_result *r, uint32_t batch, size_t n_layers, bool per_layer);
void dc_step_result_free(dc_step_result *r);

/* Scale applied to output gradients so that norms are of per-sample
 * gradients: B for MEAN (the mean loss carried 1/B), 1 for SUM. */
static inline float dc_step_grad_scale(const dc_step *s) {
    return s->reduction == DC_REDUCTION_MEAN ? (float)s->batch : 1.0f;
}

/* Certified sensitivity (docs/design.md, "Certified sensitivity"). A
 * computed norm n can come out below the exact norm of the per-sample
 * gradient the clipped sum releases, by the rounding of the kernels that
 * computed it. So a coefficient comes from an upper bound on that norm,
 * n (1 + e), where e covers the worst case of every rounding on the way
 * (accumulation lengths, f32 sums of squares and atomics, TF32 truncation,
 * the kept bf16 gradients, the coefficient's own arithmetic and its
 * application in the sum), given that the signed sums forming each
 * gradient entry do not cancel (what is certified, exactly: see the doc).
 * e depends on the layer's kind, dimensions and dtypes, the batch, the
 * backend and the kernel path, never on the data.
 *
 * how: DC_E_GPU for the CUDA backend's kernels (else the CPU backend's);
 * DC_E_TF32: f32 LINEAR inputs may run on TF32 tensor cores (the CUDA
 * backend's default, assumed by every GPU step so that a norm pass, its
 * sums steps and a norm group's clip phase, which see only totals, agree
 * with a whole step); DC_E_KEPT: the layer's per-sample gradients are kept
 * as bf16 and summed from there (cuda/kernels/sgrad.cu; whole GPU steps only). */
#define DC_E_GPU 1u
#define DC_E_TF32 2u
#define DC_E_KEPT 4u

/* No layer's e is below its backend's floor: a step's e is then the same
 * for every subset of its layers whose bounds are within the floor, so
 * that a norm pass's reply, its sums steps (each of which sees its own
 * layers only, and clips by their e: docs/design.md) and the whole step
 * compute the same coefficients for such layers. The CPU's covers its
 * direct form up to T = 14 and its ghost form up to d + p = 28, at 1e-6 of
 * C; the GPU's its bf16 and f16 direct form up to T = 1900, at 5e-4 of C
 * (TF32 layers, whose truncation alone is 2e-3, are above it). */
#define DC_E_FLOOR_CPU 0x1p-20
#define DC_E_FLOOR_GPU 0x1p-11
/* A norm pass whose GPU backend kept per-sample gradients (backend.h
 * dc_kept): each of its sums steps clips with at least this e, whatever
 * layers it holds, so that they agree with one another and with the pass's
 * reply: twice the GPU's floor (the bf16 direct form up to T ~ 3800), with
 * the bf16 rounding of the kept values. A pass keeps only layers whose own
 * kept e is within it. */
#define DC_E_KEPT_FLOOR ((1.0 + 0x1p-10) / (1.0 - 0x1p-8) - 1.0)

/* e of layer l of step s (its tie partner's paths included for a tied
 * pair's owner), at least the floor. INFINITY where an accumulation is too
 * long for any bound (K u >= 1/2): its coefficients are then 0, and the
 * backends refuse such a step (dc_clip_e_check). */
double dc_clip_e(const dc_step *s, size_t l, unsigned how);
/* The largest dc_clip_e over the layers the step's norm counts (not
 * norm_excluded): the e of a FLAT coefficient. */
double dc_clip_e_step(const dc_step *s, unsigned how);
/* The larger of two rounding bounds, where a NaN stays a NaN whatever
 * comes after it: a bound that is no number wins, and its coefficients are
 * then 0 (dc_clip_coef). */
static inline double dc_clip_e_max(double a, double b) {
    return a != a || b <= a ? a : b; /* a != a: a is NaN */
}
/* The e a clip phase clips by when nothing else raises it (backend.h
 * run_clip): dc_clip_e_step, with DC_E_KEPT for each counted layer kept
 * (kept[l] != 0: summed from a bf16 store; kept NULL: none). A norm group's
 * member sends it with its part of the totals, and every member clips by
 * the group's largest: the totals' norm counts every member's layers, so
 * its rounding bound is the largest of theirs (group.h). */
double dc_clip_e_phase(const dc_step *s, unsigned how, const uint8_t *kept);
/* DC_EINVAL naming the first counted layer whose e is infinite. */
int dc_clip_e_check(const dc_step *s, unsigned how, dc_err *err);
/* The how of a step that only totals describe (step_pass.c, run_clip). */
static inline unsigned dc_clip_e_how(const dc_step *s) {
    return s->device >= 0 ? DC_E_GPU | DC_E_TF32 : 0u;
}

/* The clipping coefficient of a computed norm with relative error bound e:
 * c = min(1, C / (norm (1 + e) + 1e-6)), in double and rounded down to
 * f32, so that c n_exact <= C wherever n_exact <= norm (1 + e). A norm (or
 * e) that is not a finite number >= 0 gives 0, never 1: NaN compares false,
 * and "no clipping" for an unknown norm would release that sample
 * unbounded. Backends fail such a step before its coefficients are used;
 * this is the second line. One copy (step.c), so that every caller rounds
 * alike: a norm pass's reply and its sums steps agree bit for bit. */
float dc_clip_coef(float C, double norm, double e);
/* c * scale rounded down to f32 (the product of two floats is exact in
 * double): the multiplier a clipped sum applies never exceeds the
 * coefficient times the gradient scale. */
float dc_clip_scaled(float c, float scale);

/* The later layer of a tied pair: its weight's norm and clipped sum go to
 * the owner's. */
/* Where the noise of output k (0 weight, 1 bias) of layer l is drawn
 * (noise.h: key, step, stream). Replicated layers draw the group's stream,
 * alike on every member; a fused group step's layers their member's own
 * (noise_step, noise_index); the rest the step's. Both backends draw from
 * it, so they draw the same values. */
typedef struct dc_noise_src {
    uint64_t key, step;
    uint32_t stream;
} dc_noise_src;

static inline dc_noise_src dc_step_noise_src(const dc_step *s, const dc_layer *ly, size_t l,
                                             int k) {
    dc_noise_src n;
    if (ly->replicated) {
        n.key = s->group_noise_key;
        n.step = s->group_step;
        n.stream = DC_NOISE_STREAM_REPLICATED + 2 * ly->rep_ordinal + (uint32_t)k;
    } else {
        n.key = s->noise_key;
        n.step = ly->noise_step ? ly->noise_step : s->noise_step;
        n.stream = (uint32_t)(2 * (ly->noise_step ? (size_t)ly->noise_index : l) + (size_t)k);
    }
    return n;
}

/* The elements of output t (k: 0 weight, 1 bias of layer ly) that get
 * noise; every element where no range is set. */
static inline dc_noise_span dc_noise_span_of(const dc_layer *ly, int k) {
    const dc_noise_range *r = k ? &ly->noise_b : &ly->noise_w;
    const dc_tensor *t = k ? &ly->bias_grad_out : &ly->weight_grad_out;
    dc_noise_span sp = {0, 0, UINT64_MAX};
    uint64_t inner = 1;
    if (!r->set) return sp;
    for (int i = 1; i < t->ndim; i++) inner *= (uint64_t)t->shape[i];
    if (r->dim == 1) {
        sp.mod = inner;
        sp.lo = r->begin;
        sp.hi = r->end;
    } else {
        sp.lo = r->begin * inner;
        sp.hi = r->end * inner;
    }
    return sp;
}

static inline bool dc_layer_tied_later(const dc_layer *l) { return l->tie && !l->tie_owner; }

/* Whether a layer's norm kernels count its bias with its weight: not for
 * the later layer of a tied pair, whose weight part goes to the owner and
 * whose bias is counted apart. */
static inline bool dc_layer_norm_bias(const dc_layer *l) {
    return l->has_bias && !dc_layer_tied_later(l);
}

/* LINEAR cost model: direct costs 2*T*d*p flops per sample, ghost
 * 2*T^2*(d+p); pick the cheaper. */
static inline dc_algo dc_linear_pick(const dc_layer *l) {
    if (l->algo != DC_ALGO_AUTO) return l->algo;
    if (l->T == 1) return DC_ALGO_GHOST; /* the rank-1 special case: ||a||^2 ||g||^2 */
    double direct = (double)l->d * (double)l->p;
    double ghost = (double)l->T * (double)(l->d + l->p);
    return direct <= ghost ? DC_ALGO_DIRECT : DC_ALGO_GHOST;
}

#endif
