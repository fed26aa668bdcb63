/* Validation: turns a decoded ClipStep into a dc_step, checking every field
 * before any work is done. Runs on the loop thread; touches no tensor data.
 *
 * Each tensor reference is resolved against the session's own registry only,
 * and its byte range [offset, offset + numel * elem_size) is checked against
 * the buffer's size with overflow-checked arithmetic. Errors name the field
 * by its dotted path, e.g. "clip_step.layers[2].linear.activations.offset". */
#ifndef DC_VALIDATE_H
#define DC_VALIDATE_H

#include "dpclip.pb-c.h"
#include "registry.h"
#include "step.h"

typedef struct dc_limits {
    uint32_t max_batch;
    uint32_t max_layers;
    uint32_t max_frame;
    /* What one step may cost (dc_step_cost); 0 = unchecked (tests) */
    uint64_t max_step_samples;
    uint64_t max_step_memory;
    double max_step_gflop, max_gpu_step_gflop;
} dc_limits;

/* On success *out is filled and owns out->layers (free with
 * dc_validate_step_free). On failure *out holds nothing to free. */
/* What a step will cost the daemon (dc_step_cost_estimate) against the
 * limits.max_step_* settings; the error names the setting. */
int dc_validate_step_cost(const dc_step *s, const dc_limits *lim, dc_err *err);
int dc_validate_step(const Dpclip__ClipStep *msg, const dc_registry *reg, const dc_limits *lim,
                     dc_step *out, dc_err *err);
void dc_validate_step_free(dc_step *s);

/* Resolves one TensorRef (exposed for the unit tests). `field` is the path of
 * the reference; ndim must be in [min_ndim, max_ndim]; dtype_mask has bit
 * (1 << dtype) set for each allowed dtype. *device receives the buffer's
 * device (-1 for host memory). */
int dc_validate_tensor(const Dpclip__TensorRef *ref, const char *field, const dc_registry *reg,
                       unsigned dtype_mask, int min_ndim, int max_ndim, dc_tensor *out, int *device,
                       dc_err *err);

#define DC_MASK_FLOAT ((1u << DC_F32) | (1u << DC_BF16) | (1u << DC_F16))
#define DC_MASK_INDEX ((1u << DC_I32) | (1u << DC_I64))
#define DC_MASK_F32 (1u << DC_F32)

#endif
