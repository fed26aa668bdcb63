/* One interface, two implementations: the CPU backend (the reference, always
 * present) and the CUDA backend (cuda/, when built with CUDA and a GPU is
 * found). A backend instance is used by one worker thread at a time; the
 * worker pool creates one instance per worker (per GPU for CUDA).
 *
 * run_step semantics (every backend must match the CPU backend):
 *  1. For each layer l and sample b, the squared norm of the per-sample
 *     gradient of every trainable parameter of l, with output grads scaled by
 *     dc_step_grad_scale(): n2[l][b].
 *  2. Inputs are checked: a non-finite value in a layer's input or grad fails
 *     the step with DC_ENONFINITE naming the layer, tensor and sample;
 *     embedding indices outside [0, vocab) fail with DC_EINVAL naming the
 *     field and sample.
 *  3. FLAT: n[b] = sqrt(sum_l n2[l][b]), c[b] = dc_clip_coef(C, n[b], e),
 *     e = dc_clip_e_step(step, how) for the backend's kernel paths (step.h:
 *     a bound on the norm's rounding, so that c[b] times the exact norm of
 *     what the sum releases stays within C). PER_LAYER: c[l][b] =
 *     dc_clip_coef(C_l, sqrt(n2[l][b]), dc_clip_e(step, l, how)), n[b] as
 *     above, coefs[b] = 1, and the noise std uses C = sqrt(sum_l C_l^2) (as
 *     Opacus). A clipped sum multiplies by dc_clip_scaled(c, grad scale).
 *     The reply's norms are the computed ones.
 *  4. For each requested output: sum_b c[b] * scale * (per-sample grad of b),
 *     plus N(0, (sigma*C)^2) per element, divided by expected_batch for MEAN.
 *     Outputs are written only if the whole step succeeds and every value is
 *     finite; otherwise nothing is written (the step fails DC_ENONFINITE).
 *     A failure found once noise was added sets res->released: it depends
 *     on the noise, so the step is charged (and its message is replaced).
 *  5. norms_out / coefs_out (when present) receive n[b] and coefs[b].
 *  With step->acc (a micro-batch of a logical step, step.h dc_acc_mode):
 *     FIRST / ADD store / add 4.'s clipped sums (no noise, no division)
 *     into each output's accumulator and write no output; COMMIT adds the
 *     accumulator to the clipped sum before the noise.
 */
#ifndef DC_BACKEND_H
#define DC_BACKEND_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "step.h"

/* gpu.sample_grads_max = auto, its default: each GPU backend may keep
 * per-sample gradients (cuda/backend/dc_cuda.h) in up to 1/DC_SAMPLE_GRADS_PARTS of
 * its device's memory, so that the cap scales with the GPU (10 GiB of an
 * 80 GB H100, 17 of an H200, 3 of a 24 GB card) where a fixed size would
 * be too much on a small one or leave a large one's last layers unkept.
 * Here, where both the configuration (built without CUDA too) and the CUDA
 * backend see it. */
#define DC_SAMPLE_GRADS_AUTO UINT64_MAX
#define DC_SAMPLE_GRADS_PARTS 8

typedef struct dc_backend dc_backend;

/* What a norm phase kept for its clip phase: the per-sample gradients of
 * some layers (a GPU backend's, cuda/backend/backend_kept.cu), whose clipped
 * sums the clip phase then makes from them and not from the client's
 * tensors. layer[l] is 1 for those. Made by run_norms where the caller asks
 * (kept non-NULL) and the backend chooses to; passed to run_clip of the
 * same step (a group member's: step_run.h's seal leaves those layers out,
 * so every one of them must come from the store, or run_clip refuses), or
 * of a norm pass's sums steps (kept_at: each of their layers' index in the
 * pass; those layers stay sealed, and a sums step may leave some kept
 * layers unsummed); given back with dc_backend_kept_free. A norm pass
 * names no outputs: it keeps the layers that could be kept (its sums steps
 * name their outputs); a step with outputs keeps only the layers whose
 * weight sum it wants. */
typedef struct dc_kept {
    size_t n_layers;
    uint8_t *layer; /* [n_layers] */
} dc_kept;

/* Whether k (NULL: none) kept layer l. */
static inline bool dc_kept_has(const dc_kept *k, size_t l) {
    return k && l < k->n_layers && k->layer[l];
}

typedef struct dc_backend_ops {
    const char *name; /* "cpu", "cuda" */
    int (*run_step)(dc_backend *be, const dc_step *step, dc_step_result *res, dc_err *err);
    void (*destroy)(dc_backend *be);
    /* The two halves of run_step, for norm groups (group.c sums the
     * members' per-sample squared norms between them). run_norms: the data
     * checks (2.) and n2[L*B] (1.), the step's own squared layer norms.
     * run_clip: steps 3.-5. with the coefficients taken from the group's
     * per-sample totals tot[B] (n2 as run_norms gave it, for the per-layer
     * results); it checks the data again. Its e is the larger of
     * dc_clip_e_phase(step, dc_clip_e_how(step), the layers it sums from
     * kept) and e_min: a group's largest over its members, a norm pass's
     * e (step_pass.c), so that every part of one sample's sum clips by
     * the bound of the whole norm. NULL: this backend cannot serve grouped
     * steps. */
    int (*run_norms)(dc_backend *be, const dc_step *step, double *n2, dc_kept **kept, dc_err *err);
    int (*run_clip)(dc_backend *be, const dc_step *step, const double *n2, const double *tot,
                    double e_min, const dc_kept *kept, const size_t *kept_at, dc_step_result *res,
                    dc_err *err);
    /* A norm phase's kept per-sample gradients (run_norms' *kept) back to
     * the backend that made them. Any thread: no task uses them any more,
     * and the backend's own queue orders their reuse. NULL where run_norms
     * never keeps. */
    void (*kept_free)(dc_backend *be, dc_kept *kept);
    /* A backend that queues work on a device: its queue waits for a
     * client's interprocess event (the step's inputs), records one after
     * the work queued so far (its outputs), and the device workspace it
     * holds (bytes). NULL where the backend has no device queue (CPU). */
    int (*wait_event)(dc_backend *be, void *event);
    int (*record_event)(dc_backend *be, void *event);
    size_t (*workspace_bytes)(const dc_backend *be);
    /* Accumulators of logical steps (dc_layer.acc_w / acc_b): n floats in
     * the memory the backend's steps use (host; the GPU's), uninitialised
     * (a logical step's first micro-batch stores, DC_ACC_FIRST); NULL out of
     * memory. Called on the backend's worker thread. */
    float *(*acc_alloc)(dc_backend *be, size_t n);
    void (*acc_free)(dc_backend *be, float *p);
    /* The keyed checksums (common/dc_hash.h) of n tensors' bytes in the
     * memory the backend's steps use, out[i] of ts[i], with one wait for
     * the device: whether two copies hold the same data (a norm group's
     * replicated layers), or data is what an earlier task measured (a step
     * in phases: step_run.h's seal). Worker thread. */
    int (*tensors_hash)(dc_backend *be, const dc_tensor *const *ts, size_t n, uint64_t key,
                        uint64_t *out, dc_err *err);
    /* The parts of the last run_norms on this worker thread that the
     * backend timed (dc_run_phase; 0: not timed), into phase_ns, for the
     * metrics: a norm phase has no dc_step_result of its own. NULL where
     * the backend times none. */
    void (*norm_times)(dc_backend *be, uint64_t phase_ns[DC_RUN_N]);
    /* Every output the step names (dc_step_output) set to zero in the
     * memory the backend's steps use, and waited for: a failed step with a
     * completion flag (dc_step.done_flag) is consumed as zeros. Worker
     * thread. */
    int (*zero_outputs)(dc_backend *be, const dc_step *step);
    /* Between tasks, on the worker thread: the memory the backend grew
     * beyond its preallocation (a larger workspace, kept stores given back)
     * freed; the next task that needs it grows it again. A daemon idle on
     * a shared node should not hold a job's peak (gpu.idle_release_s).
     * Stores a norm group still holds stay. NULL where nothing grows. */
    void (*release)(dc_backend *be);
    /* The bytes of kept stores (run_norms' *kept) it holds, in use or
     * given back for reuse; NULL: none. Worker thread. */
    size_t (*kept_bytes)(const dc_backend *be);
} dc_backend_ops;

struct dc_backend {
    const dc_backend_ops *ops;
};

static inline int dc_backend_run_step(dc_backend *be, const dc_step *step, dc_step_result *res,
                                      dc_err *err) {
    return be->ops->run_step(be, step, res, err);
}

static inline const char *dc_backend_name(const dc_backend *be) { return be->ops->name; }

/* The optional operations (see dc_backend_ops): whether this backend has
 * each (a caller refuses by name where it has not), then the calls. */
static inline bool dc_backend_has_norm_phase(const dc_backend *be) {
    return be->ops->run_norms != NULL;
}

/* The last norm phase's timed parts into phase_ns (left alone where the
 * backend times none). */
static inline void dc_backend_norm_times(dc_backend *be, uint64_t phase_ns[DC_RUN_N]) {
    if (be->ops->norm_times) be->ops->norm_times(be, phase_ns);
}

static inline bool dc_backend_has_clip_phase(const dc_backend *be) {
    return be->ops->run_clip != NULL;
}

static inline bool dc_backend_has_hash(const dc_backend *be) {
    return be->ops->tensors_hash != NULL;
}

static inline bool dc_backend_has_accumulators(const dc_backend *be) {
    return be->ops->acc_alloc != NULL && be->ops->acc_free != NULL;
}

/* kept: NULL, or where the backend may leave what it kept (*kept NULL
 * where it kept nothing, or failed). */
static inline int dc_backend_run_norms(dc_backend *be, const dc_step *step, double *n2,
                                       dc_kept **kept, dc_err *err) {
    if (kept) *kept = NULL;
    return be->ops->run_norms(be, step, n2, be->ops->kept_free ? kept : NULL, err);
}

/* kept_at: where each of the step's layers is in kept (a sums step's pass
 * index); NULL: the same place (a group member's own norm phase). */
static inline int dc_backend_run_clip(dc_backend *be, const dc_step *step, const double *n2,
                                      const double *tot, double e_min, const dc_kept *kept,
                                      const size_t *kept_at, dc_step_result *res, dc_err *err) {
    return be->ops->run_clip(be, step, n2, tot, e_min, kept, kept_at, res, err);
}

static inline void dc_backend_kept_free(dc_backend *be, dc_kept *kept) {
    if (kept) be->ops->kept_free(be, kept);
}

static inline int dc_backend_tensors_hash(dc_backend *be, const dc_tensor *const *ts, size_t n,
                                          uint64_t key, uint64_t *out, dc_err *err) {
    return be->ops->tensors_hash(be, ts, n, key, out, err);
}

static inline float *dc_backend_acc_alloc(dc_backend *be, size_t n) {
    return be->ops->acc_alloc(be, n);
}

static inline void dc_backend_acc_free(dc_backend *be, float *p) { be->ops->acc_free(be, p); }

/* The device queue's events (DC_EUNIMPL without one) and workspace (0). */
static inline int dc_backend_wait_event(dc_backend *be, void *event) {
    return be->ops->wait_event ? be->ops->wait_event(be, event) : DC_EUNIMPL;
}

static inline int dc_backend_zero_outputs(dc_backend *be, const dc_step *step) {
    return be->ops->zero_outputs ? be->ops->zero_outputs(be, step) : DC_EUNIMPL;
}

static inline int dc_backend_record_event(dc_backend *be, void *event) {
    return be->ops->record_event ? be->ops->record_event(be, event) : DC_EUNIMPL;
}

static inline size_t dc_backend_workspace_bytes(const dc_backend *be) {
    return be->ops->workspace_bytes ? be->ops->workspace_bytes(be) : 0;
}

static inline void dc_backend_release(dc_backend *be) {
    if (be->ops->release) be->ops->release(be);
}

static inline size_t dc_backend_kept_bytes(const dc_backend *be) {
    return be->ops->kept_bytes ? be->ops->kept_bytes(be) : 0;
}

static inline void dc_backend_destroy(dc_backend *be) {
    if (be) be->ops->destroy(be);
}

/* The CPU backend. threads: BLAS threads this instance may use (0 = 1). */
int dc_cpu_backend_create(int threads, dc_backend **out, dc_err *err);

#endif
