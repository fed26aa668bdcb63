/* One client connection: its frames (frame.c), the handshake, the session's
 * buffer registry, and its requests, processed strictly one at a time and in
 * order (a ClipStep runs on a worker while the loop serves everyone else;
 * this session's next request waits for it, which is also what keeps its
 * buffers mapped and unchanged while a step reads them).
 *
 * Ownership: the server's session list owns each session. A session whose
 * client went away while a step is in flight stays allocated (detached from
 * its socket) until the step completes, then frees itself. A session
 * reaches the server only through the dc_host it was started with (host.h):
 * the protocol layer cannot include the server's headers. */
#ifndef DC_SESSION_H
#define DC_SESSION_H

#include <stdbool.h>
#include <stdint.h>
#include <sys/socket.h>
#include <uv.h>

#include "frame.h"
#include "ledger.h"
#include "log.h"
#include "registry.h"
#include "step_call.h"
#include "validate.h"

typedef struct dc_host dc_host;
typedef struct dc_wbuf dc_wbuf;
struct dc_session;

/* A session's request handlers (session_requests.c), which its connection
 * (session_io.c) hands each whole frame to. */
typedef void (*dc_session_dispatch)(struct dc_session *s, const dc_frame *f);

typedef struct dc_session {
    struct dc_session *prev, *next; /* server list */
    dc_host *host;                  /* the daemon it runs in (host.h) */
    dc_session_dispatch dispatch;   /* its handlers: set at start */
    uint64_t id;
    int fd;
    uv_poll_t poll;
    int poll_events;  /* current uv_poll interest */
    uv_timer_t timer; /* the handshake's deadline, then the idle one */
    int handles_open; /* poll and timer, until both are closed */
    pid_t peer_pid;
    uid_t peer_uid;
    gid_t peer_gid;
    char client_name[64];
    char job_id[64];

    dc_frame_in in; /* bytes and fds received, not yet answered */

    dc_wbuf *w_head, *w_tail; /* replies not yet written */
    size_t w_bytes;

    bool hello_done;
    bool closing;                    /* close once the write queue drains */
    bool gone;                       /* socket closed; waiting for the step */
    bool poll_closed;                /* both handles closed, the socket too */
    bool drain_armed;                /* closing: the timer ends the wait for the client */
    dc_step_call *call;              /* the step in flight, if any */
    int async_ops;                   /* GPU handle opens in flight (0 or 1) */
    struct dc_session_event *events; /* registered (step_call.h) */
    size_t n_events, cap_events;
    dc_registry reg;
    uint64_t steps;
    uint64_t steps_failed;
    uint32_t done_seq;          /* the last done value given (ClipStep.done_flag); wraps */
    uint64_t ewma_gpu_run_ns;   /* recent GPU steps' worker time */
    uint64_t ewma_notice_ns;    /* recent steps' submit-to-early-notice time */
    uint64_t ewma_period_ns;    /* recent time between this session's steps */
    uint64_t prev_step_frame;   /* t_frame of the last step request, 0 = none */
    uint64_t connected_ns;      /* uv_hrtime at accept */
    uint64_t t_frame;           /* uv_hrtime when the current request began decoding */
    uint64_t last_step_ns;      /* uv_hrtime of the last reply to a step, 0 = none */
    uint64_t last_send_ns;      /* how long the last send() took (debug log) */
    uint64_t stall_warned;      /* t_frame of the step a stall was logged for (check_stall) */
    dc_ledger_account *account; /* the ledger's (uid, job id) since Hello; not owned */
    struct dc_group *group;     /* the norm group joined (a reference), or NULL */
    uint32_t group_rank;
    uint64_t group_steps;  /* the last group step this member delivered */
    uint64_t step_req_id;  /* the last ClipStep taken up: its error is logged */
    dc_log_limit fail_log; /* failed steps logged at most once a second */
    /* The last ClipStep that validated (session_step.c), so that the same
     * step sent again (a trainer's every iteration) skips decoding and
     * validation. Owned. */
    struct dc_step_plan *plan; /* step_validate.h */
    /* The stream wait on the plan's input event, issued on the GPU's worker
     * as soon as a ClipStep frame arrives, while the loop validates it
     * (session_step.c). Owned; NULL until the first one. */
    struct dc_prewait *prewait;
    /* The norm pass of a step in phases, for its STEP_SUMS steps
     * (step_pass.h). Owned; NULL when none. */
    struct dc_pass *pass;
    /* Host bytes of that pass, from the moment its NORMS step is accepted
     * (a reservation) until it is freed: what limits.max_pass_memory and
     * limits.max_pass_memory_per_uid count (host.h, dc_uid_usage). */
    uint64_t pass_bytes;
    /* Gradient accumulation: the session's logical step and its
     * accumulators (step_logical.h). Owned; NULL until the first. */
    struct dc_logical *logical;
} dc_session;

/* Before Hello a frame may be at most this long (a Hello is a few hundred
 * bytes): connections that never said Hello cannot each hold max_frame. */
#define DC_SESSION_HELLO_MAX_FRAME 65536u

/* Takes ownership of a connected, non-blocking socket. */
int dc_session_start(dc_host *host, int fd, dc_session **out);
/* Answers a connection the server will not serve with one Error frame (what
 * a non-blocking send takes) and closes it. */
void dc_session_refuse(int fd, const dc_err *e);
/* The timeouts changed (reload): re-arm the session's deadline. */
void dc_session_limits_changed(dc_session *s);
/* A request other than a step waiting behind the session's step in
 * flight once that step has run for DC_SESSION_STALL_NS: logged once per
 * step (the server's tick).
 * Requests are answered in order, so a client that waits for, say, a
 * registration before it lets the step finish (a norm group member's
 * device work queued after it) has deadlocked itself: docs/groups.md, "A
 * member never blocks mid-schedule". */
#define DC_SESSION_STALL_NS 10000000000ull
void dc_session_check_stall(dc_session *s, uint64_t now_ns);
/* Server shutdown: reply to the step in flight (if any), then close. */
void dc_session_shutdown(dc_session *s);
/* Server shutdown, first: tells the client why its connection will close
 * (an Error with id 0 and field "daemon": docs/protocol.md). */
void dc_session_notify_shutdown(dc_session *s);
/* Closes now, dropping queued replies (the step in flight, if any, still
 * completes before the memory goes). */
void dc_session_close(dc_session *s);

#endif
