/* Internals shared by session.c (framing, requests, lifecycle) and
 * session_gpu.c (CUDA buffers and events). Loop thread only. */
#ifndef DC_SESSION_INT_H
#define DC_SESSION_INT_H

#include "dpclip.pb-c.h"
#include "session.h"

/* A request is being worked on off the loop: later ones wait for it. */
int dc_session_busy(const dc_session *s);
/* Queues a reply and writes what the socket takes now. */
void dc_session_send(dc_session *s, Dpclip__Reply *reply);
/* An error reply for request id (counted as a rejected request). */
void dc_session_reject(dc_session *s, uint64_t id, const dc_err *e);
/* Consumes buffered frames until the session is busy or out of frames. */
void dc_session_process(dc_session *s);
/* Frees the session once its socket is closed and nothing runs for it. */
void dc_session_destroy(dc_session *s);

void dc_session_register_cuda(dc_session *s, uint64_t id, const Dpclip__RegisterBuffer *m);
void dc_session_register_event(dc_session *s, uint64_t id, const Dpclip__RegisterEvent *m);
const struct dc_session_event *dc_session_find_event(const dc_session *s, uint64_t id);

#endif
