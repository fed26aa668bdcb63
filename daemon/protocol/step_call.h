/* A step call: one ClipStep from request to reply, what its stages read and
 * fill (dc_step_call; its work on a worker is the dc_task it embeds). The
 * session (session_step.c) drives the chain; each stage fills its part of
 * the call and returns, and the session decides what comes next. In data-path
 * order (docs/daemon.md, "A step, top to bottom"):
 *   frame.c          the frame decoded (session_requests.c hands a ClipStep on);
 *   step_validate.c  the request's fields, device and events: sc->step;
 *   session_group.c  a norm group's terms for the step;
 *   step_account.c   the privacy ledger: the terms, the charge, durability;
 *   step_run.c       on a worker: norms, coefficients, clipped sum and
 *                    noise (the backend's run_step); a NORM_REDUCE group's
 *                    step runs fused with its other members' (step_fuse.c),
 *                    or the norm phase, the group's reduction (group.c) and
 *                    the clip phase (session_group.c);
 *   step_reply.c     the reply and the step's metrics.
 *
 * Loop thread, except where a field says a worker writes it. */
#ifndef DC_STEP_CALL_H
#define DC_STEP_CALL_H

#include <stdbool.h>
#include <stdint.h>

#include "backend.h"
#include "dc_err.h"
#include "group.h"
#include "ledger.h"
#include "step.h"
#include "worker.h"

typedef struct dc_session dc_session;
typedef struct dc_step_call dc_step_call;

/* The session's continuation after a stage that waited (on the loop): rc 0
 * to go on, else err says why the step is refused. */
typedef void (*dc_step_cb)(dc_step_call *sc, int rc, const dc_err *err);

/* An interprocess CUDA event a session registered (session_gpu.c), which its
 * steps may wait on (their inputs) or signal (their outputs). */
struct dc_session_event {
    uint64_t id;
    int device;
    void *event; /* cudaEvent_t opened in the daemon */
};

/* ClipStep.phase: a logical step whole, or its norm pass and the clipped
 * sums that follow it (step_pass.c). */
typedef enum dc_step_phase {
    DC_PHASE_WHOLE = 0,
    DC_PHASE_NORMS = 1,
    DC_PHASE_SUMS = 2
} dc_step_phase;

/* What a ClipStep asks besides its tensors: the events it names and its
 * accounting terms (kept with the plan cache, step_validate.c). */
struct dc_step_params {
    uint64_t wait_event, signal_event;
    uint64_t group_step; /* 0: the session's next */
    bool notify_enqueued;
    dc_step_phase phase;
    double sample_rate, target_delta, target_epsilon;
    dc_dp_member dp; /* ClipStep.data_parallel; the charge fills in its place */
    /* ClipStep.logical: a micro-batch of a logical step (step_logical.h);
     * logical_id 0: none */
    uint64_t logical_id;
    uint32_t micro_batch;
    bool commit;
};

/* A wait on a step's input event issued ahead of its validation: the
 * driver call (tens of microseconds with an interprocess event) overlaps
 * the loop's work instead of following it. Harmless if the step is then
 * refused: the daemon's stream only waits for the client's own work. */
struct dc_prewait {
    dc_task task;
    dc_session *s;
    void *event;      /* cudaEvent_t of the session's plan */
    uint64_t t_frame; /* the frame it was issued for */
    bool busy;        /* submitted, done() not run yet */
    int rc;           /* worker thread: the wait's result */
    dc_err err;
};

/* A step from request to reply. Owned by the session (s->call) from the
 * moment it is accepted until dc_session_step_done has replied. */
struct dc_step_call {
    dc_task task;
    dc_session *s;
    uint64_t req_id;
    struct dc_step_params params; /* as the request gave them */
    dc_step_cb resume;            /* after a stage that waited (step_account.c) */
    void *wait_event;             /* GPU steps: cudaEvent_t or NULL */
    void *signal_event;
    struct dc_prewait *prewait; /* issued for this step's frame and event, if any */
    /* notify_enqueued: the backend (worker thread) calls step_run.c's hook,
     * which records signal_event and has the session send the notice. */
    bool notify;
    bool signaled; /* signal_event recorded (worker thread) */
    /* step.done_flag: what the worker stores there at the step's end (set
     * before the step is submitted; the notice says it) */
    uint32_t done_value;
    /* a failed step whose outputs could not be zeroed (a broken CUDA
     * context): its flag was not stored, and the session closes after its
     * error (step_run.c done_store) */
    bool abandoned;
    bool cached;    /* from the session's plan cache: step.layers is the plan's */
    dc_backend *be; /* the worker's backend, while work() runs */
    dc_step step;
    dc_step_result res;
    dc_err err;
    int rc;
    /* Privacy accounting: the step's spend in the session's account,
     * reserved (and, with a persistent ledger, on disk) before the step may
     * run. */
    dc_ledger_account *account;
    double q, sigma;       /* as recorded in the ledger */
    double eps, delta;     /* the account's eps with this step, at its delta */
    dc_ledger_waiter wait; /* for the curve, then for the spend to be durable */
    bool waiting_sync;     /* inside the persist call: its outcome is handled there */
    bool sync_done;        /* ... and came within it */
    int sync_rc;
    dc_err sync_err;
    uint64_t workspace; /* GPU steps: the backend's workspace after it */
    /* Phases (uv_hrtime ns): request decoded, validated and accounted,
     * submitted to a worker, worker started, input event waited, worker
     * finished. */
    uint64_t t_recv, t_checked, t_submit, t_start, t_waited, t_end;
    uint64_t t_done;   /* back on the loop */
    uint64_t t_normed; /* a step in phases: its norm phase done (0: none) */
    uint64_t t_frame;  /* the request's frame taken up for decoding */
    /* Norm groups (session_group.c): the step's own squared layer norms
     * [L*B] from its norm phase, its partial sum [B] delivered to the group,
     * the group's totals [B] for its clip phase. */
    bool grouped;
    uint64_t group_id; /* the group it was prepared for (dc_group_id) */
    uint64_t group_step;
    double *n2, *partial, *tot;
    /* the bound the clip phase clips by at least (backend.h run_clip: the
     * group's e_group, the pass's e); 0 for a step on its own */
    double e_min;
    double *rep; /* [B] its replicated layers' squared norms (group.h) */
    /* A step in phases (a group member's, a norm pass's sums): each layer's
     * seal [L] taken right after its norms, under seal_key (step_run.h) */
    uint64_t *seal;
    uint64_t seal_key;
    /* A norm pass's kept layers it left unsealed, and a sums step's of its
     * layers (step_pass.h): [L] or NULL (none) */
    uint8_t *unsealed;
    /* a group member's norm phase's kept per-sample gradients (backend.h:
     * its clip phase sums those layers from them, unsealed), and the
     * backend that holds them; given back after the clip phase or with
     * the call. A norm pass's move to its dc_pass, which lends them to
     * its sums steps (sealed there all the same). */
    dc_kept *kept;
    dc_backend *kept_be;
    bool kept_borrowed; /* a sums step's: its norm pass's store (step_pass.c owns it) */
    size_t *pass_at;    /* a sums step: each layer's index in its pass (step_pass.h) */
    bool pass_reserved; /* a norm pass: the session's pass bytes are its reservation */
    dc_group_waiter gw;
    dc_step_call *fuse_next; /* the next member of a fused group step (rank order) */
    uint64_t group_wait_ns, group_exchange_ns; /* for the reply */
};

#endif
