/* The stage that computes: a step's work on a worker thread (its GPU's
 * worker, or the CPU pool's). The input event is waited on (GPU steps), the
 * backend's run_step computes the per-sample norms, the coefficients, the
 * clipped sums and the noise (backend.h says what each is), and the
 * client's signal event is recorded. A NORM_REDUCE group's step runs the
 * same parts as two tasks, the backend's run_norms and run_clip, with the
 * group's reduction (group.c) between them (session_group.c).
 *
 * The session (session_step.c) prepares the step call, submits its task with
 * dc_step_run_work as its work and its own completion as done, and reads
 * the result there: rc, err, res and the phase stamps. */
#ifndef DC_STEP_RUN_H
#define DC_STEP_RUN_H

#include "step_call.h"

/* On the loop, before the task is submitted: the result's arrays and, with a
 * signal event, the backend's enqueued hook (sc->notify: the early notice
 * too, and outputs zeroed on a later failure, as the client may already
 * read them). An error (out of memory) refuses the step. */
int dc_step_run_prepare(dc_step_call *sc, dc_err *e);
/* dc_task.work of a step (worker thread): sc->rc, sc->err, sc->res,
 * t_start, t_waited, t_end (and a GPU backend's workspace). */
void dc_step_run_work(dc_task *task, dc_backend *be);
/* A failed step that released something: its message, whatever the
 * backend wrote there, says so and holds no noised value. */
void dc_step_run_released_error(dc_err *e);
/* dc_task.work of a dc_prewait: the stream waits on the client's input event
 * ahead of the step's validation (pw->rc). */
void dc_step_run_prewait(dc_task *task, dc_backend *be);
/* A NORM_REDUCE group's step (session_group.c): the norm phase (input
 * event, the backend's run_norms into sc->n2) and, once the group's totals
 * are in sc->tot, the clip phase (run_clip, then the signal event). */
void dc_step_run_norms_work(dc_task *task, dc_backend *be);
void dc_step_run_clip_work(dc_task *task, dc_backend *be);
/* The keyed checksum (common/dc_hash.h) of a grouped step's replicated
 * layers' inputs and output grads, in order, under `key`: a member's copy
 * is the same as another's if and only if (but for chance) the checksums
 * are. *any false: the step has no replicated layer. Worker thread.
 * dc_step_run_replicas_key: the key, from the group's noise key and step
 * as the step has them (no client knows it); a phased step keeps it for its
 * clip phase (across daemons its noise key becomes daemon 0's meanwhile). */
int dc_step_run_replicas_hash(dc_backend *be, const dc_step *st, uint64_t key, uint64_t *out,
                              bool *any, dc_err *e);
uint64_t dc_step_run_replicas_key(const dc_step *st);
/* A step in phases reads client memory in two tasks, which the client may
 * rewrite between them. Its norm task seals each layer right after its
 * norms: out[l], the keyed checksum of layer l's input and output grad
 * under a fresh random key (dc_step_run_seal_key: the daemon's, never
 * told), and its clip task sums a layer only if the seal is the same
 * again. Without the key a client cannot choose other data with the same
 * seal; a checksum costs one read of the data, where measuring the norms
 * again cost the norm pass. */
int dc_step_run_seal_key(uint64_t *key, dc_err *e);
/* kept: the layers summed from the daemon's copy (backend.h), not the
 * client's data: a member's whole store, a pass's kept layers without a
 * bias or a tie (sc->unsealed); their seal is 0, nothing hashed. */
int dc_step_run_seal(dc_backend *be, const dc_step *st, uint64_t key, const dc_kept *kept,
                     uint64_t *out, dc_err *e);
/* A step in phases (step_pass.h): the norm pass (as a group's norm phase,
 * into sc->n2), and a sums step (as dc_step_run_work, with run_clip on the
 * pass's n2 rows and totals in sc->n2 and sc->tot). */
void dc_step_run_pass_work(dc_task *task, dc_backend *be);
void dc_step_run_sums_work(dc_task *task, dc_backend *be);

#endif
