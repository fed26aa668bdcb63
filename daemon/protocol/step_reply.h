/* The last stage of a step: what its client gets back, and what the
 * daemon's metrics and debug log record of it. The session (session_step.c)
 * sends what is built here; nothing here touches the session.
 *
 * The arrays of a ClipStepReply point into the step call's result: send it
 * before the call is freed. */
#ifndef DC_STEP_REPLY_H
#define DC_STEP_REPLY_H

#include <stdint.h>

#include "dpclip.pb-c.h"
#include "metrics.h"
#include "step_call.h"

/* The reply to a step that ran (sc->rc 0): per-sample norms and
 * coefficients; layer norms when asked for or per-layer; layer
 * coefficients per layer; the account's spend; the daemon's stamps (now is the
 * reply's). step_index: the session's count of steps done, this one
 * included. */
void dc_step_reply_fill(const dc_step_call *sc, uint64_t step_index, Dpclip__ClipStepReply *cr);
/* The early notice of a GPU step whose outputs are queued
 * (ClipStep.notify_enqueued): the index it gets if it succeeds, its spend. */
void dc_step_reply_notice(const dc_step_call *sc, uint64_t step_index, Dpclip__ClipStepEnqueued *n);
/* The step's phases, outcome and size in the metrics; now: when its reply
 * was queued. */
void dc_step_reply_count(const dc_step_call *sc, uint64_t now, dc_metrics *m);
/* The debug log's line for a step (only at DC_LOG_DEBUG): where its time
 * went. t_done: when the worker handed it back; now: reply queued;
 * send_ns: the last send() of the session. */
void dc_step_reply_log(const dc_step_call *sc, uint64_t session_id, uint64_t step_index,
                       uint64_t t_done, uint64_t now, uint64_t send_ns);

#endif
