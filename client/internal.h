/* libdpclip internals shared by its files, in the order they build on each
 * other: conn.c (a handle's state under its lock: errors, the request FIFO,
 * completions, results), framing.c (frames over the Unix socket), calls.c
 * (a request and its reply), step_build.c (step objects and the ClipStep
 * message), buffers.c, cuda.c, submit.c (running steps), client.c
 * (handles). Nothing here is exported: the library is built with
 * -fvisibility=hidden and only DPCLIP_API functions are visible.
 *
 * Locking: every public call on a dpclip_client takes c->mu for its whole
 * duration (a blocking dpclip_run holds it for the round trip). The framing
 * and step-building functions below assume the caller holds it. User callbacks
 * (dpclip_submit_cb) are never run with the lock held: completions are
 * collected during the call and their callbacks run just before it returns,
 * so a callback may call back into the library. */
#ifndef DPCLIP_INTERNAL_H
#define DPCLIP_INTERNAL_H

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

#include "dc_clock.h"
#include "dpclip.h"
#include "dpclip.pb-c.h"

#define DPCLIP_API __attribute__((visibility("default")))

/* Replies larger than this are treated as a broken stream. The largest
 * legitimate one carries 2 * max_layers * max_batch floats. */
#define CL_MAX_REPLY (1u << 30)

typedef enum cl_req_kind {
    CL_REQ_SYNC = 1, /* a blocking call waits for it (run, ping, register, ...) */
    CL_REQ_TICKET,   /* dpclip_submit: result kept until dpclip_wait */
    CL_REQ_CB        /* dpclip_submit_cb: callback when it completes */
} cl_req_kind;

/* A finished (or, while pending, future) ticket or callback completion:
 * status, error text and, on success, the result, whose arrays it owns
 * until they are handed to the caller. Allocated when the request is
 * submitted, so that completing it never needs memory. */
typedef struct cl_done {
    struct cl_done *next; /* in c->done_* or c->cb_* once finished */
    cl_req_kind kind;
    uint64_t ticket;
    dpclip_step_cb cb;
    void *user;
    int status;
    char errmsg[256];
    char errfield[128];
    dpclip_result res;
    int enqueued; /* the step's early notice arrived (enq filled) */
    dpclip_enqueued enq;
    uint64_t t_sent; /* CLOCK_MONOTONIC ns when the request went out */
} cl_done;

/* A request sent and not answered yet. Replies come in request order, so
 * these form a FIFO. */
typedef struct cl_pending {
    uint64_t req_id;
    cl_req_kind kind;
    uint32_t batch; /* ClipStep: to check the reply's arrays */
    uint32_t n_layers;
    cl_done *d; /* CL_REQ_TICKET, CL_REQ_CB; owned until completion */
} cl_pending;

typedef struct cl_mapping {
    uint64_t id;
    void *addr;
    size_t size;
} cl_mapping;

/* A registered CUDA allocation, so that tensors inside it reuse the buffer. */
typedef struct cl_cuda_buf {
    uint64_t id;
    int device;
    uint64_t base, size;
    uint8_t handle[64]; /* the IPC handle it was registered with */
    uint64_t cu_id;     /* the driver's id of the allocation (unique in this process), 0: unknown */
} cl_cuda_buf;

struct dpclip_client {
    pthread_mutex_t mu;
    int fd; /* -1 once the connection is dead */
    uint64_t next_req_id;
    uint64_t next_ticket;
    dpclip_daemon_info info;
    char job_id[256]; /* as the Hello named it (dpclip_job_id) */
    int insecure;     /* a reply said the daemon's noise is predictable */
    char notice[256]; /* the daemon's words about the connection (an Error with
                             * id 0 and field "daemon": it is shutting down), the
                             * reason for every failure once the connection ends */
    char errmsg[512];
    char errfield[128];

    uint8_t *sbuf; /* send buffer, reused: frame header + packed request */
    size_t scap;
    uint8_t *rbuf; /* bytes received and not yet parsed */
    size_t rlen, rcap;

    cl_pending *pend; /* ring buffer FIFO */
    size_t p_head, p_len, p_cap;
    cl_done *done_head;         /* finished tickets awaiting dpclip_wait (any order) */
    cl_done *cb_head, *cb_tail; /* finished callbacks, run once the lock is dropped */

    cl_mapping *maps; /* dpclip_buffer_alloc mappings, unmapped on release */
    size_t m_len, m_cap;

    cl_cuda_buf *cuda_bufs; /* CUDA allocations registered (cuda.c) */
    size_t cb_n, cb_capn;

    /* Scratch for building ClipStep messages (step_build.c), reused across
     * steps. */
    void *msg_scratch;
    size_t msg_scratch_cap;

    /* Adaptive polling for blocking steps: a long step's reply is expected
     * about when the previous one's came (ewma_rt_ns after sending); from
     * spin_from_ns to spin_to_ns (CLOCK_MONOTONIC) the reply wait polls
     * instead of sleeping, saving the thread wake-up (tens to hundreds of
     * microseconds on an idle core). DPCLIP_SPIN=0 turns it off. */
    int spin_enabled;
    uint64_t ewma_rt_ns;
    uint64_t ewma_notice_ns; /* the same for early notices (dpclip_wait_enqueued) */
    uint64_t spin_from_ns, spin_to_ns;

    dpclip_timing last_timing; /* of the last successful dpclip_run */

    /* The last ClipStep sent, packed as a Request without its id (proto3
     * leaves a zero id out): sent again with a new id while the step object
     * is unchanged (same pointer and version), so a trainer re-sending its
     * step pays no message building and packing. */
    uint8_t *packed;
    size_t packed_len, packed_cap;
    const dpclip_step *packed_step;
    uint64_t packed_ver;
};

/* --- errors, locking, the FIFO, results (conn.c) ------------------------- */
/* Records code/message/field on the handle; returns code. */
int cl_fail(dpclip_client *c, int code, const char *field, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
/* Socket failure: closes the connection (the handle is dead from now on),
 * fails every pending request with DPCLIP_EIO and returns DPCLIP_EIO. */
int cl_die(dpclip_client *c, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* A call on a dead handle: DPCLIP_EIO, with the notice's words if any. */
int cl_closed(dpclip_client *c);
/* 1 if r is the daemon's notice about the connection (kept in c->notice,
 * and answering no request), else 0. */
int cl_keep_notice(dpclip_client *c, const Dpclip__Reply *r);

void cl_lock(dpclip_client *c);
/* Drops the lock, then runs the callbacks collected meanwhile. */
void cl_unlock(dpclip_client *c);

/* The request FIFO: room for one more request before it is sent; the
 * request, once sent. An async request completed with `status` (its result,
 * if any, already in d->res), queued where its owner finds it; every
 * request in flight failed so (the connection went). */
int cl_reserve_pending(dpclip_client *c);
void cl_push_pending(dpclip_client *c, const cl_pending *p);
void cl_finish(dpclip_client *c, cl_done *d, int status, const char *field, const char *msg);
void cl_fail_all_pending(dpclip_client *c, const char *msg);
/* A daemon ErrorCode as our DPCLIP_E* value (they are equal; bogus values
 * become DPCLIP_EINTERNAL). */
int cl_daemon_code(Dpclip__ErrorCode code);
/* A ClipStepReply as a result with malloc'd arrays; msg says what is wrong. */
int cl_to_result(const Dpclip__ClipStepReply *r, uint32_t batch, uint32_t n_layers,
                 dpclip_result *res, char *msg, size_t msgn);

/* --- a request and its reply (calls.c) ------------------------------------ */
/* One reply read (a synchronous request's is handed back in *sync, an async
 * one completed; an early notice marks its step and pops nothing). */
int cl_read_one(dpclip_client *c, int64_t deadline, Dpclip__Reply **sync);
/* Sends req and waits for its reply (completing earlier submits on the
 * way). On success *out is the reply with body `expect` (free with
 * dpclip__reply__free_unpacked); an Error reply becomes the handle's error
 * and its code. Caller holds the lock. */
int cl_call(dpclip_client *c, Dpclip__Request *req, int pass_fd, Dpclip__Reply__BodyCase expect,
            int64_t deadline, Dpclip__Reply **out);

/* --- buffers (buffers.c) -------------------------------------------------- */
/* RegisterBuffer (rb filled but for the request envelope; pass_fd >= 0 is
 * attached) and ReleaseBuffer (also drops our mapping / CUDA cache entry).
 * Caller holds the lock. */
int cl_register_buffer(dpclip_client *c, Dpclip__RegisterBuffer *rb, int pass_fd, uint64_t *id);
int cl_release_buffer(dpclip_client *c, uint64_t buffer_id);
/* Forgets a released buffer id among the CUDA registrations (no-op for
 * non-CUDA buffers). */
void cl_cuda_forget(dpclip_client *c, uint64_t id);

/* --- CUDA (cuda.c) -------------------------------------------------------- */
/* dpclip_buffer_register_cuda with the handle's lock held. */
int cl_cuda_ref_locked(dpclip_client *c, uint64_t dev_ptr, uint64_t *buffer_id, uint64_t *offset);

/* --- framing (framing.c) -------------------------------------------------- */
/* Deadlines are absolute dc_clock_ms() values (common/dc_clock.h), -1 = none. */
int64_t cl_deadline(int timeout_ms);
/* Packs req into c->sbuf as one frame and writes it all (with `pass_fd`
 * attached as SCM_RIGHTS when >= 0). While the socket is full it keeps
 * reading incoming bytes so a pipelining client cannot deadlock with the
 * daemon. 0, or DPCLIP_EIO (handle dead), DPCLIP_ENOMEM, DPCLIP_EARG (frame
 * larger than the daemon's max_frame). */
int cl_send_request(dpclip_client *c, Dpclip__Request *req, int pass_fd, int64_t deadline);
/* Sends a Request packed without its id (body: the fields after it) with a
 * new id (*id), as cl_send_request does. */
int cl_send_body(dpclip_client *c, const uint8_t *body, size_t len, int64_t deadline, uint64_t *id);
/* Reads until one whole reply frame is buffered, then unpacks it into *out
 * (free with dpclip__reply__free_unpacked). DPCLIP_EAGAIN when the deadline
 * passes first, DPCLIP_EIO (handle dead) on socket errors or EOF. */
int cl_read_reply(dpclip_client *c, int64_t deadline, Dpclip__Reply **out);

/* --- steps (step_build.c) ------------------------------------------------- */
/* Builds the ClipStep message for s into scratch owned by c (valid until the
 * next call); local argument checks fail with DPCLIP_EARG. */
int cl_step_message(dpclip_client *c, const dpclip_step *s, Dpclip__ClipStep **out);
uint32_t cl_step_batch(const dpclip_step *s);
uint32_t cl_step_layers(const dpclip_step *s);
/* Changes whenever the step object does (any setter, reset, add). */
uint64_t cl_step_version(const dpclip_step *s);
void cl_step_scratch_free(dpclip_client *c);

#endif
