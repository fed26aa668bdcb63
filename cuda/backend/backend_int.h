/* Internal to the CUDA backend (backend_*.cu, wait.cu): the instance, the
 * per-step workspace layout and the helpers its files share.
 * Not for the daemon (dc_cuda.h is its interface). C++ only. */
#ifndef DC_CUDA_BACKEND_INT_H
#define DC_CUDA_BACKEND_INT_H

#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>

#include <cublas_v2.h>

#include "dc_cuda.h"
#include "dcc.h"
#include "dcc_out.cuh"
extern "C" {
#include "cpu.h" /* the host-side rescue reuses the CPU backend's norms */
}

namespace dcb {

/* Ownership: the instance owns its stream, cuBLAS handle, device workspace
 * (ws, grown only when a step needs more), pinned host block and host-side
 * tables; steps only borrow the client's tensors. */
struct cuda_backend {
    dc_backend base; /* first: the worker pool sees a dc_backend * */
    int device;
    cudaStream_t stream;
    cublasHandle_t blas;
    char *ws;
    size_t ws_cap;
    size_t ws_max; /* gpu.workspace_max; 0 = no cap */
    size_t ws_pre; /* gpu.workspace: what cuda_release shrinks it back to */
    size_t sg_max; /* gpu.sample_grads_max: most workspace for kept per-sample
                           gradients (sgrad.cu); 0 = none kept */
    char *host;    /* pinned: download block, then upload block */
    size_t host_cap;
    /* host-side per-step tables, grown like the workspace */
    size_t *lay_off; /* [L] per-sample buffers of norm layers, SIZE_MAX = none */
    size_t lay_cap;
    dcc_bk_layer *bk;   /* [lay_cap] the grouped book-keeping's layers */
    bool *bk_grouped;   /* [lay_cap] layer l's outputs come from the grouped launch */
    dcc_norm_layer *nm; /* [lay_cap] the grouped norms' layers */
    bool *nm_grouped;   /* [lay_cap] layer l's norms come from the grouped launch */
    /* [lay_cap] the step's layers as the kernels read them: an embedding's
     * indices point at the workspace copy (layout.idx), made once per step */
    dc_layer *safe;
    /* [lay_cap] the staging offset of each layer's weight sum (UINT64_MAX:
     * none); a tied pair's later layer has its owner's (tied_offsets) */
    uint64_t *woff;
    /* [lay_cap] where layer l's kept per-sample gradients go, from sg_base
     * (plan_step; SIZE_MAX: not kept), the layer of each entry of
     * bk, and the kept layers' clipped sums (grouped_clipped) */
    size_t *sg_off;
    /* [lay_cap] a kept layer whose outputs have no staging of their own
     * (plan_step, a one-pass whole step): their staging, which only a step
     * that ends up not keeping them uses, lies in their kept bytes (the
     * kept sum checks and writes them itself: dcc_out.unstaged) */
    bool *sg_unstaged;
    /* [lay_cap] a grouped book-keeping layer whose sums go straight into
     * its outputs, noised, with no staging (plan_step, a one-pass whole
     * step: dcc_linear_clipped_direct after the output check); its
     * outputs are noised and unstaged in the table, with a bound */
    bool *bk_direct;
    dcc_bk_layer *bkd; /* [lay_cap] their entries (grouped_clipped), bkd_n of them */
    int bkd_n;
    bool bk_direct_off; /* a step run again without them (a refused tensor map) */
    /* where sg_off counts from: the workspace's kept area (a whole step's),
     * or a norm phase's kept store (backend_kept.cu) */
    char *sg_base;
    /* the kept layers' sum draws their outputs' noise (else the output
     * pass does: a sums step's ranges) */
    bool sg_noised;
    int *sg_out; /* [2 * lay_cap] layer l's weight and bias output index, -1 none */
    int *bk_layer;
    dcc_sg_layer *sgl;
    int sg_kept;    /* layers the last step kept (dc_cuda_backend_kept_layers) */
    bool sg_direct; /* their sums went straight into the outputs (mode 1) */
    /* A step retried after an f32 overflow of some LINEAR layers' norms
     * (rescue_overflow): their n2 [lay_cap * B], computed on the host with
     * range scaling, replace the kernels'. NULL = none. */
    float *ovr_n2;
    bool *ovr;
    size_t ovr_cap;
    bool ovr_active; /* this run uses them */
    /* phase timing (dc_cuda_backend_profile): events recorded between phases */
    bool prof;
    cudaEvent_t ev[DC_CUDA_PHASES + 1];
    float phase_ms[DC_CUDA_PHASES];
    /* recorded before the stream waits on a client's event: up to ev[0] is
     * the GPU's wait for the client's input */
    cudaEvent_t ev_wait;
    bool waited;
    /* the last norm phase's timed parts (backend ops norm_times): a norm
     * phase has no step result to put them in */
    uint64_t norm_ns[DC_RUN_N];
    /* wait_stream (wait.cu): the end of a step's work (blocking sync), and
     * the recent steps' wait per unit of estimated cost (ns; 0 = none yet) */
    cudaEvent_t ev_done;
    double ns_per_cost;
    /* Kept stores of norm phases (backend_kept.cu): those given back, for
     * reuse (kept_mu: given back from any thread), and the bytes of every
     * store made, given back or not (at most sg_max). */
    pthread_mutex_t kept_mu;
    struct cuda_kept *kept_free;
    size_t kept_bytes;
    unsigned long long *hash_dev; /* device scratch of cuda_tensors_hash (backend_accum.cu) */
    size_t hash_cap;              /* its checksums */
    int bk_n;                     /* entries of bk the step's grouped clipped sum takes */
    int amax_found;               /* outputs of the last step whose max |.| the grouped
                       clipped sum found (dcc_out.amax_found) */
    /* the DPCLIP_CUDA_* switches, read when the instance was made
     * (dc_cuda_backend_set_options replaces them) */
    dcc_options opt;
    bool broken;
    char broken_msg[256];
};

inline size_t al(size_t x) { return (x + 255) & ~(size_t)255; }

/* Layout of one step in the workspace. The download block comes first so
 * that one copy brings everything the host needs. */
struct layout {
    size_t status, mode, bad, n2, flags, amax, norms, coefs, lcoef, dl_bytes;
    size_t cs, perm, fac, up, up_bytes, consts, layer_c, count, layer_e, outs;
    size_t staging, per_sample, tot, idx, temp, temp_bytes, bsum, sgrad, sgrad_bytes, total;
    int n_out;
    uint64_t max_n, staged, chunks;
};

/* Staging offsets stay 16-byte aligned, so that kernels may store pairs. */
inline uint64_t al4(uint64_t n) { return (n + 3) & ~(uint64_t)3; }

inline int numel_out(const dc_tensor *t, uint64_t *n) {
    uint64_t v = 1;
    for (int i = 0; i < t->ndim; i++) v *= (uint64_t)t->shape[i];
    *n = v;
    return 0;
}

/* Layer ly of a B-sample step as the kernels see it (the one place that maps
 * dc_layer onto the kernels' descriptors). has_bias: whether the kernel
 * counts a bias (the norms count dc_layer_norm_bias, the sums has_bias, a
 * size query neither); tf32: whether f32 inputs may use TF32. */
inline dcc_linear linear_of(const cuda_backend *cb, const dc_layer *ly, int B, bool has_bias,
                            bool tf32) {
    return dcc_linear{ly->input.data, ly->grad.data, ly->input.dtype, ly->grad.dtype, B,
                      (int)ly->T,     (int)ly->d,    (int)ly->p,      has_bias,       tf32,
                      &cb->opt,       nullptr};
}
inline dcc_embedding embedding_of(const dc_layer *ly, int B) {
    return dcc_embedding{ly->input.data,
                         ly->input.dtype,
                         ly->grad.data,
                         ly->grad.dtype,
                         B,
                         (int)ly->T,
                         (int)ly->d,
                         ly->vocab,
                         ly->has_padding_idx ? ly->padding_idx : -1};
}
inline dcc_norm norm_of(const dc_layer *ly, int B) {
    return dcc_norm{ly->input.data,
                    ly->grad.data,
                    ly->input.dtype,
                    ly->grad.dtype,
                    B,
                    (int)ly->T,
                    (int)ly->d,
                    ly->kind == DC_LAYER_RMSNORM,
                    ly->has_bias,
                    ly->eps};
}

inline bool want_out(const dc_layer *l, int k) {
    return k == 0 ? l->weight_grad_out.data != NULL : (l->has_bias && l->bias_grad_out.data);
}

/* A bound on |.| of any element of a layer's clipped sums, known before
 * they are made: each sample's clipped gradient has norm c_b n_b <= C (its
 * layer's C when clipping per layer, else the flat one, over a total that
 * counts this layer), so no element of the B samples' sum exceeds B C.
 * Twice that covers the f32 roundings of the norms, the coefficients and
 * the sum many times over. 0 (none known) for a layer that another member
 * of a fused group step counts. The output check takes it for the outputs
 * whose sums come after it (dcc_out.bound). */
inline float out_bound(const dc_step *s, const dc_layer *ly) {
    if (ly->norm_excluded) return 0.0f;
    const double C = s->mode == DC_CLIP_PER_LAYER ? ly->max_grad_norm : s->max_grad_norm;
    const double b = 2.0 * (double)s->batch * C;
    return b > 0.0 && b < 3e38 ? (float)b : 0.0f;
}

/* The std of a step's noise and the divisor of its outputs (a micro-batch
 * that accumulates: none, 1: the commit noises and divides once). */
inline void step_scales(const dc_step *s, bool accumulates, float *std, float *divisor) {
    double c2 = 0.0;
    for (size_t l = 0; l < s->n_layers; l++)
        c2 += (double)s->layers[l].max_grad_norm * s->layers[l].max_grad_norm;
    *std = accumulates ? 0.0f
                       : s->noise_multiplier * (s->mode == DC_CLIP_PER_LAYER ? (float)sqrt(c2)
                                                : s->noise_norm > 0.0f       ? s->noise_norm
                                                                             : s->max_grad_norm);
    *divisor = accumulates ? 1.0f
               : s->reduction == DC_REDUCTION_MEAN
                   ? (float)(s->expected_batch ? s->expected_batch : s->batch)
                   : 1.0f;
}

/* Whether no value of an output of dtype whose sums are bounded by `bound`
 * (0: none known) can leave the dtype once noised and divided: the output
 * check's test, made on the host. */
inline bool bound_fits(float bound, int dtype, float std, float divisor) {
    return bound > 0.0f && dcc_fits_dtype(bound, dtype, std, divisor);
}

/* A step's workspace (backend_plan.cu). ws_alloc: holds `want` bytes of
 * device workspace in cb->ws (contents not kept); DC_ENOSPACE if the
 * allocation fails. plan_step: step s's layout in *Lo (the host-side
 * per-layer tables grown to its layers), per-sample gradients kept where
 * keep and the cap allow, and with unstage (a one-pass whole step) the
 * kept layers' outputs left out of the staging area (cb->sg_unstaged);
 * keep_fits: whether a layout that keeps them
 * leaves the GPU a tenth of its memory free; reserve: the workspace and the
 * pinned host block grown to hold the layout (DC_ENOSPACE past
 * gpu.workspace_max or when an allocation fails). */
int ws_alloc(cuda_backend *cb, size_t want, dc_err *err);
enum keep_mode {
    KEEP_NONE,
    KEEP_OUTS, /* the layers whose weight sum the step wants (a whole step, a member's norms) */
    KEEP_PASS  /* a norm pass's (it names no outputs): those its sums steps may want */
};
int plan_step(cuda_backend *cb, const dc_step *s, keep_mode keep, bool unstage, layout *Lo,
              dc_err *err);
bool keep_fits(cuda_backend *cb, const layout *Lo);
int reserve(cuda_backend *cb, const layout *Lo, dc_err *err);

/* Fails the step with a CUDA error; marks the instance broken when the
 * context is left unusable (a sticky error). */
int cuda_fail(cuda_backend *cb, dc_err *err, cudaError_t e, const char *what);

/* A step whose status word is not 0, after its synchronisation: finds the
 * tensor, sample and position (extra synchronisations on this path only)
 * and words the error as the CPU backend does. */
int diagnose(cuda_backend *cb, const dc_step *s, const layout *Lo, dc_step_result *res,
             dc_err *err);

/* After a failed step without an early notice: when every failure is a
 * LINEAR layer's squared norm that left f32 (|a| ~ 1e19 overflows the ghost
 * Gram) while its inputs are finite, computes those layers' norms on the
 * host, range-scaled in double as the CPU backend does (cpu_norms.c), into
 * cb->ovr_n2 and marks them in cb->ovr; returns true if the step should run
 * again with them. False (nothing marked) otherwise. */
bool rescue_overflow(cuda_backend *cb, const dc_step *s, const layout *Lo, float grad_scale);

/* Tied pairs (backend_tied.cu). tied_offsets: cb->woff from the step's
 * output table. tied_norms: after every layer's norms, the owner's becomes
 * the shared weight's (cross term included) and the later layer's its
 * bias's. tied_deferred: a tied embedding with a weight sum, which runs
 * after the pair's linear layer wrote it (it adds onto it). */
void tied_offsets(cuda_backend *cb, const dc_step *s, const dcc_out *outs);
int tied_norms(cuda_backend *cb, const dc_step *s, const layout *Lo, float s2, dc_err *err);
inline bool tied_deferred(const dc_layer *l, uint64_t woff) {
    return l->tie && l->kind == DC_LAYER_EMBEDDING && woff != UINT64_MAX;
}

/* --- what the step's parts share (backend_cuda.cu, backend_layers.cu) ------ */

/* LINEAR clipped sums outside the grouped launch (grouped_clipped):
 * TF32 tensor cores for f32 inputs (dcc_linear_clipped_tf32); the per-layer
 * fused tensor-core kernel where it applies (dcc_linear_clipped_tc:
 * bf16/f16, sm_90a, T >= 64); padded copies for 16-bit layers whose widths
 * are not multiples of 8 (pad.cu); else per-sample cuBLAS GEMMs (exact f32
 * accumulation with the coefficient as a device-side alpha) when samples
 * have at least BK_MIN_T rows; below it, chunks of rows converted to f32 and
 * scaled, one SGEMM each. Measured on an H100 the per-sample GEMMs were
 * launch-bound for small layers and re-read the f32 sum once per sample for
 * large ones, hence the fused kernel. */
constexpr int BK_MIN_T = 32;
/* Workspace for padded copies of unaligned 16-bit layers (pad.cu), a few
 * samples at a time: GPT-2's lm_head takes 100 MiB a sample at T = 1024. */
constexpr size_t PAD_CAP = (size_t)256 << 20;
constexpr size_t BK_CHUNK_BYTES = (size_t)32 << 20;

/* The switches a step follows: the instance's (cuda_backend.opt). */
typedef dcc_options step_opts;

/* Rows of a LINEAR layer converted to f32 per chunk of the fallback sum. */
inline int chunk_rows(const dc_layer *l, uint32_t B) {
    int64_t per = (l->d + l->p) * (int64_t)sizeof(float);
    int64_t r = (int64_t)BK_CHUNK_BYTES / (per > 0 ? per : 1);
    int64_t rows = (int64_t)B * l->T;
    if (r < 1) r = 1;
    return (int)(r < rows ? r : rows);
}

inline bool bk_per_sample(const dc_layer *l) {
    return l->input.dtype == l->grad.dtype && l->T >= BK_MIN_T;
}

int blas_fail(cuda_backend *cb, dc_err *err, cublasStatus_t s, const char *what);

/* In a function with `int rc`, `cb`, `err` and a `fail:` label. */
#define CK(call, what)                                                                             \
    do {                                                                                           \
        cudaError_t e_ = (call);                                                                   \
        if (e_ != cudaSuccess) {                                                                   \
            rc = cuda_fail(cb, err, e_, what);                                                     \
            goto fail;                                                                             \
        }                                                                                          \
    } while (0)

#define CKB(call, what)                                                                            \
    do {                                                                                           \
        cublasStatus_t s_ = (call);                                                                \
        if (s_ != CUBLAS_STATUS_SUCCESS) {                                                         \
            rc = blas_fail(cb, err, s_, what);                                                     \
            goto fail;                                                                             \
        }                                                                                          \
    } while (0)

/* A step's layers, one at a time or grouped (backend_layers.cu): the
 * per-sample squared norms of layer l into the workspace's n2; its clipped
 * sums at the staging offsets off[0] (weight) and off[1] (bias), UINT64_MAX
 * none (add: onto what a tied pair's linear layer wrote); the grouped
 * launches, which mark the layers they did (cb->bk_grouped, nm_grouped);
 * the grouped clipped sum is planned (grouped_clipped_plan) before the
 * step's tables go up, since it marks the outputs whose amax it finds;
 * the embeddings' indices copied once into the workspace (*out: s reading
 * them there). */
int layer_norms(cuda_backend *cb, const dc_step *s, size_t l, const layout *Lo, float s2,
                const step_opts &opt, dc_err *err);
int layer_clipped(cuda_backend *cb, const dc_step *s, size_t l, const layout *Lo,
                  const uint64_t off[2], const step_opts &opt, dc_err *err, bool add = false);
int grouped_clipped_plan(cuda_backend *cb, const dc_step *s, const layout *Lo, dcc_out *outs);
int grouped_clipped(cuda_backend *cb, const dc_step *s, const layout *Lo, const dcc_out *outs,
                    dc_err *err);
/* The kept layers' sums that grouped_clipped lined up (cb->sgl, sg_kept),
 * after the output check: into the outputs with mode 1 (mode: the check's,
 * or NULL for staging); in mode 0 the unstaged layers' checked only, and
 * written by kept_commit once every output is checked (dcc_sgrad_commit). */
int kept_sum(cuda_backend *cb, const dc_step *s, const layout *Lo, float noise_std, float divisor,
             const uint32_t *mode, dc_err *err);
int kept_commit(cuda_backend *cb, const dc_step *s, const layout *Lo, float noise_std,
                float divisor, const uint32_t *mode, dc_err *err);
/* The direct layers' sums that grouped_clipped set aside (cb->bkd, bkd_n),
 * after the output check: written with mode 1, checked only in mode 0;
 * commit: the launch that writes them in mode 0 once every other output
 * is checked (dcc_linear_clipped_direct). *refused: the driver refused a
 * tensor map and nothing ran (the step is then run again staged). */
int direct_clipped(cuda_backend *cb, const layout *Lo, float noise_std, float divisor, int commit,
                   bool *refused, dc_err *err);
int grouped_norms(cuda_backend *cb, const dc_step *s, const layout *Lo, float s2, dc_err *err);
int snapshot_indices(cuda_backend *cb, const dc_step *s, const layout *Lo, dc_step *out,
                     dc_err *err);

/* Waits for everything queued on cb->stream (wait.cu): naps until the
 * predicted end of a step of this estimated cost (dc_step_cost.gflop),
 * spins around it, sleeps on a blocking-sync event past it. */
cudaError_t wait_stream(cuda_backend *cb, double cost);

/* backend_kept.cu: a norm group member's norm phase keeps its per-sample
 * gradients for its clip phase, a later task, so not in the workspace,
 * which the steps between reuse: in a store of their own. kept_take: a
 * store of at least `bytes` with room for L layers' marks (one given back
 * earlier where it fits), NULL where gpu.sample_grads_max or the GPU's
 * free memory (a tenth kept free, as keep_fits) has no room. kept_give
 * (backend.h kept_free): back to this instance, any thread. kept_destroy:
 * frees every store given back (the instance's end, cuda_release). */
struct cuda_kept {
    dc_kept pub; /* first: what the daemon holds */
    cuda_kept *next;
    char *mem;
    size_t cap;
    size_t *off; /* [lay_cap] layer l's place in mem (SIZE_MAX: not kept) */
    size_t lay_cap;
};
cuda_kept *kept_take(cuda_backend *cb, size_t bytes, size_t L);
void kept_give(dc_backend *be, dc_kept *k);
void kept_destroy(cuda_backend *cb);
/* A norm phase's end (kept_leave: what it kept into *out, or the store
 * back) and a clip phase's start (kept_apply: cb->sg_off from the store,
 * at: each layer's place in it, NULL its own; *n the layers applied);
 * names_outputs: whether a step names any output (a norm pass none). */
void kept_leave(cuda_backend *cb, cuda_kept *k, size_t L, dc_kept **out);
int kept_apply(cuda_backend *cb, const dc_step *s, const dc_kept *pub, const size_t *at, size_t *n,
               dc_err *err);
bool names_outputs(const dc_step *s);

/* backend_cuda.cu: backend.h's run_step, run_norms, run_clip and
 * norm_times (backend_create.cu's ops table) */
int cuda_run_step(dc_backend *be, const dc_step *s, dc_step_result *res, dc_err *err);
int cuda_run_norms(dc_backend *be, const dc_step *s, double *n2, dc_kept **kept, dc_err *err);
int cuda_run_clip(dc_backend *be, const dc_step *s, const double *n2, const double *tot,
                  double e_min, const dc_kept *kept, const size_t *kept_at, dc_step_result *res,
                  dc_err *err);
void cuda_norm_times(dc_backend *be, uint64_t phase_ns[DC_RUN_N]);
/* backend.h release (backend_plan.cu): the stores given back freed, the
 * workspace back to gpu.workspace. */
void cuda_release(dc_backend *be);

/* backend_accum.cu: logical steps' accumulators (backend.h acc_alloc,
 * acc_free) and the keyed checksums of tensors (tensors_hash). */
float *cuda_acc_alloc(dc_backend *be, size_t n);
void cuda_acc_free(dc_backend *be, float *p);
int cuda_tensors_hash(dc_backend *be, const dc_tensor *const *ts, size_t n, uint64_t key,
                      uint64_t *out, dc_err *err);

} // namespace dcb

#endif
