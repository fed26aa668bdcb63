/* Internals shared by a session's files, from the top down (each calls
 * only those below it): session_requests.c (the request handlers), session_step.c
 * (ClipStep: drives its stages, step_call.h), session_group.c (norm
 * groups), session_end.c (how a step ends), session_gpu.c (CUDA buffers
 * and events) and session_io.c (the connection, its frames and replies,
 * the session's life). Loop thread only. */
#ifndef DC_SESSION_INT_H
#define DC_SESSION_INT_H

#include "dpclip.pb-c.h"
#include "group.h"
#include "ledger.h"
#include "session.h"
#include "step.h"
#include "step_call.h"
#include "worker.h"

/* --- session_io.c --- */

/* A session on the connected socket fd, whose frames go to dispatch. */
int dc_session_open(dc_host *host, int fd, dc_session_dispatch dispatch, dc_session **out);
/* A request is being worked on off the loop: later ones wait for it. */
int dc_session_busy(const dc_session *s);
/* Queues a reply and writes what the socket takes now. */
void dc_session_send(dc_session *s, Dpclip__Reply *reply);
/* An error reply for request id (counted as a rejected request). */
void dc_session_reject(dc_session *s, uint64_t id, const dc_err *e);
/* An error reply that is not counted as rejected (a failed step). */
void dc_session_send_error(dc_session *s, uint64_t id, const dc_err *e);
/* Consumes buffered frames until the session is busy or out of frames. */
void dc_session_process(dc_session *s);
/* Frees the session once its socket is closed and nothing runs for it. */
void dc_session_destroy(dc_session *s);
/* The plan cache's step dropped (session_step.c fills it). */
void dc_session_plan_drop(dc_session *s);
/* The session leaves its group (disconnect, a new join): the group is
 * dissolved and its waiting steps fail, naming this member. */
void dc_session_group_leave(dc_session *s, const char *why);

/* --- session_gpu.c --- */

void dc_session_register_cuda(dc_session *s, uint64_t id, const Dpclip__RegisterBuffer *m);
void dc_session_register_event(dc_session *s, uint64_t id, const Dpclip__RegisterEvent *m);
const struct dc_session_event *dc_session_find_event(const dc_session *s, uint64_t id);

/* --- session_step.c --- */

/* ClipStep. key: the request's bytes after its id (the plan cache's key;
 * NULL = do not cache). */
void dc_session_step(dc_session *s, uint64_t id, const Dpclip__ClipStep *m, const uint8_t *key,
                     size_t key_len);
/* The same step as the last one that validated: run it from the cache
 * without decoding. 1 if handled, 0 if the request must be decoded. */
int dc_session_step_cached(dc_session *s, uint64_t id, const uint8_t *key, size_t key_len);
/* A ClipStep frame arrived (s->t_frame): if the session's last step waited
 * on an input event on a GPU, have that GPU's stream wait on it now. */
void dc_session_prewait(dc_session *s);

/* --- session_end.c --- */

/* A step call freed, with what it holds. */
void dc_session_call_free(dc_step_call *sc);
/* The session may take its next request, or go if its client went. */
void dc_session_next(dc_session *s);
/* The session's norm pass goes, with its bytes against the pass limits. */
void dc_session_pass_drop(dc_session *s);
/* The last stage of a step's worker task, on the loop thread: the reply.
 * A grouped step's clip phase ends here too. */
void dc_session_step_done(dc_task *task);
/* dc_session_step_done in two halves, for a fused group step that answers
 * every member before the bookkeeping of any (session_group.c): the reply
 * (or error) sent, then the metrics, the next request and the call freed. */
void dc_session_step_reply(dc_step_call *sc);
void dc_session_step_finish(dc_step_call *sc);
/* Where a step's work runs: its GPU's worker, or the CPU pool. */
dc_worker_pool *dc_session_step_pool(const dc_step_call *sc);
/* After submitting sc's work at `now`: the loop polls around when it should
 * come back (its early notice, a GPU step's usual run time) instead of
 * sleeping through the wake-up. */
void dc_session_step_expect(const dc_step_call *sc, uint64_t now);

/* --- session_group.c: norm groups --- */
void dc_session_join_group(dc_session *s, uint64_t id, const Dpclip__JoinGroup *m);
/* After validation: fits the step to the session's group (the group step,
 * replicated layers, group-wise thresholds); an error refuses it. */
int dc_session_group_prepare(dc_session *s, dc_step_call *sc, dc_err *e);
/* Runs an accepted grouped step (norm phase, reduction, clip phase); the
 * reply comes from dc_session_step_done. */
void dc_session_group_submit(dc_step_call *sc);

#endif
