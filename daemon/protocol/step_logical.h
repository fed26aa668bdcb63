/* Logical steps: gradient accumulation over micro-batches (ClipStep.logical;
 * docs/protocol.md, "Logical steps").
 *
 * DP-SGD trains well only with large logical batches (hundreds to thousands
 * of samples), and a GPU holds a few sequences at a time: a logical batch,
 * Poisson-sampled as one, is sent as micro-batches. Each micro-batch's
 * per-sample norms are complete (a sample lies in one micro-batch, all its
 * layers in its step), so its samples' clipped sum is final; the daemon
 * adds it into its own accumulator of each output and writes no output.
 * The commit (the last micro-batch) adds its sum and the accumulators,
 * draws the noise once, divides by the logical batch's expected size and
 * writes the outputs; it alone is accounted, at the logical batch's sample
 * rate, before anything is written. So the release is one Gaussian
 * mechanism on the logical batch's clipped sum, as a whole step's.
 *
 * What this stage guards: micro-batches in order (0, 1, ...), of one id per
 * logical step (ids increase per session), each with the logical step's
 * terms (C, sigma, reduction, expected batch, mode, the accounting terms)
 * and outputs (same tensors, same layers); limits on micro-batches, the
 * accumulators' bytes (per uid, and the daemon's) and the time a logical
 * step stays open. Any refusal or failure of a micro-batch aborts its
 * logical step: nothing written, nothing charged. A whole step while a
 * logical step is open is refused (its samples would be charged apart).
 *
 * Accumulators are allocated by the step's backend on its worker (device
 * memory on a GPU) at the first micro-batch that needs them, kept for the
 * session's next logical steps of the same outputs, and freed on the
 * backend's worker (dc_logical_free) when the session ends or the outputs
 * change.
 *
 * Ownership: the session owns its dc_logical (dc_session.logical); a step
 * call points at it (sc->step.layers[].acc_*) only while the session is
 * busy with that call. Loop thread, except dc_logical_ensure (the call's
 * worker). */
#ifndef DC_STEP_LOGICAL_H
#define DC_STEP_LOGICAL_H

#include <stdbool.h>
#include <stdint.h>

#include "dc_err.h"
#include "step_call.h"

typedef struct dc_logical dc_logical;
typedef struct dc_session dc_session;

/* The stage, after validation (loop thread): a step with ClipStep.logical
 * is checked against (micro-batch 0: opens) the session's logical step and
 * gets its accumulation mode (sc->step.acc); a step without is refused
 * while a logical step is open. */
int dc_logical_prepare(dc_session *s, dc_step_call *sc, dc_err *e);

/* On the call's worker, before the backend runs an accumulating step:
 * allocates what accumulators are missing and points the step's layers at
 * them (sc->step.layers[].acc_w / acc_b). */
int dc_logical_ensure(dc_step_call *sc, dc_backend *be, dc_err *e);

/* The step's outcome (loop thread): a micro-batch that ran moves the
 * logical step on (the commit closes it); a failure aborts it. */
void dc_logical_done(dc_session *s, const dc_step_call *sc);
/* A micro-batch refused before it ran aborts its logical step (why: the
 * error it got). */
void dc_logical_refused(dc_session *s, const dc_step_call *sc, const dc_err *why);

/* Whether the session's logical step `id` is open (not committed, not
 * aborted). */
bool dc_logical_is_open(const dc_session *s, uint64_t id);

/* The micro-batches the session's logical step has run (after
 * dc_logical_done: the reply's count, this one included), and the bytes of
 * accumulators the session holds. */
uint32_t dc_logical_micro_batches(const dc_session *s);
uint64_t dc_logical_bytes(const dc_session *s);

/* An open logical step past limits.logical_step_timeout is aborted (the
 * server's tick; not while a step of the session runs). */
void dc_logical_expire(dc_session *s, uint64_t now_ns);

/* The session's end: the accumulators go back to their backend (a task on
 * the worker pool of their device); the logical step is gone. */
void dc_logical_free(dc_session *s);

#endif
