/* A fused group step: every member's step of one NORM_REDUCE group step,
 * on one daemon and one device, run as a single step.
 *
 * The phased path (session_group.c) runs each member's norm phase, waits on
 * the loop for the group's totals and then runs each clip phase: two worker
 * tasks and a synchronisation per member, and the device idles between the
 * phases. When every member's step has arrived unrun (group.h: fuse), this
 * stage instead builds one dc_step of every member's layers (in rank order)
 * and runs it with the backend's run_step, so that the grouped step costs
 * what the unsplit model's step costs:
 *   - the per-sample norm is the sum over every member's layers, a
 *     replicated layer counted once (rank 0's; the others' norm_excluded);
 *   - each member's layers keep their own noise stream (noise_step and
 *     noise_index: the member's step and the layer's place in it), and
 *     replicated layers the group's, so every output is noised exactly as
 *     the member's own step would have noised it;
 *   - each member's norms_out and coefs_out are written, and its tied
 *     layers point within its own layers;
 *   - on a GPU the stream waits on every member's input event, and every
 *     member's signal event is recorded once the outputs are queued.
 * dc_step_fuse_split hands each member its part of the result (norms,
 * coefficients, its layers' norms, timing, the error of a failed step).
 *
 * Ownership: the fused step owns its step's layer array and the result; the
 * members' step calls stay the sessions' (the fused step only points at
 * them). */
#ifndef DC_STEP_FUSE_H
#define DC_STEP_FUSE_H

#include "step_call.h"

typedef struct dc_step_fused {
    dc_task task;
    uint32_t n;
    dc_step_call **members;             /* [n], rank order */
    dc_step step;                       /* every member's layers */
    dc_tensor *more_norms, *more_coefs; /* [n - 1]: the other members' outputs */
    dc_step_result res;
    int rc;
    dc_err err;
    uint64_t workspace; /* GPU: the backend's workspace after the step */
    uint64_t t_start, t_waited, t_end;
} dc_step_fused;

/* On the loop: the fused step of the n member calls chained from `chain`
 * through fuse_next, in rank order (their steps validated and accounted,
 * their terms agreed by the group). An error is out of memory. */
int dc_step_fuse_build(dc_step_fused *f, dc_step_call *chain, uint32_t n, dc_err *e);
/* dc_task.work of a fused step (worker thread): the members' input events,
 * the backend's run_step, their signal events. */
void dc_step_fuse_work(dc_task *task, dc_backend *be);
/* On the loop, after the work: each member's rc, err, res and stamps. */
void dc_step_fuse_split(dc_step_fused *f);
void dc_step_fuse_free(dc_step_fused *f);

#endif
