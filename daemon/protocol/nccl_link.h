/* The cross-daemon link of a norm group: one NCCL communicator per group
 * and daemon, with one rank per daemon, over which the daemons exchange
 * their local per-sample norm totals once per group step.
 *
 * Why a thread per link: NCCL's non-blocking communicators (config.blocking
 * = 0) return at once and leave the waiting to the caller, who polls
 * ncclCommGetAsyncError; the loop thread must not poll (it serves every
 * other session) and a GPU worker must not either (it runs other sessions'
 * steps). The link's thread owns the communicator, its stream and staging
 * buffers; it alone calls into NCCL and CUDA for it, and posts its results
 * to the loop (uv_async). A link waits at most its timeout for anything
 * (forming, each exchange); past it, or when NCCL reports a peer's failure,
 * the communicators are aborted (ncclCommAbort) and the link is broken for
 * good: the group is dissolved and rejoining forms a new link.
 *
 * Two communicators: the non-blocking one is formed (a peer that never
 * comes times out), then split into a blocking one right away, over which
 * one warm-up exchange connects the peers while both are there. The
 * exchanges use the blocking one: its all-gather returns with the kernel
 * queued (~0.1 ms), where the non-blocking one's finished enqueueing in
 * NCCL's thread ~0.3 ms later (H200s). A peer gone afterwards leaves a
 * kernel waiting on the device, which the poll's timeout aborts.
 *
 * Bootstrap: the daemon of the group's rank 0 makes the NCCL unique id
 * (dc_nccl_unique_id; NCCL's bootstrap root then listens in this
 * long-running process), the trainers relay it to the other daemons over
 * their own rendezvous, and each daemon opens its link with it. dpclipd
 * itself opens no port. Daemons whose NCCL versions differ are refused at
 * join (the version travels with the id).
 *
 * Built without NCCL (or CUDA), every call fails with DC_EUNIMPL saying so.
 * Ownership: dc_nccl_open returns a link the caller owns until
 * dc_nccl_close; the loop frees it once its thread has ended. */
#ifndef DC_NCCL_LINK_H
#define DC_NCCL_LINK_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <uv.h>

#include "dc_err.h"

#define DC_NCCL_ID_BYTES 128

typedef enum dc_nccl_state {
    DC_NCCL_FORMING = 0, /* ncclCommInitRankConfig in progress */
    DC_NCCL_READY = 1,
    DC_NCCL_BROKEN = 2 /* aborted: timed out, a peer failed, or closed */
} dc_nccl_state;

typedef struct dc_nccl dc_nccl;

/* One exchange: every daemon's `bytes` of send, gathered in daemon-rank
 * order into recv[daemons * bytes] (an all-gather, so that each daemon can
 * check the others' step and terms before it sums). The caller keeps it
 * alive until done ran, on the loop thread, with rc/err and the time the
 * exchange took on the link's thread. */
typedef struct dc_nccl_op dc_nccl_op;
struct dc_nccl_op {
    const void *send;
    void *recv;
    size_t bytes;
    int rc;
    dc_err err;
    uint64_t ns;
    bool polled; /* the link's thread was polling when it came (dc_nccl_expect) */
    void (*done)(dc_nccl_op *op);
    void *arg;
};

/* Called on the loop thread when the link formed or broke. */
typedef void (*dc_nccl_state_cb)(dc_nccl *link, dc_nccl_state state, const dc_err *err, void *arg);

/* The NCCL version code of this build's library (e.g. 22809), 0 without. */
uint32_t dc_nccl_version(void);
/* Formats a version code as "2.28.9". */
void dc_nccl_version_str(uint32_t code, char *buf, size_t n);

/* A fresh unique id (its bootstrap root lives in this process). */
int dc_nccl_unique_id(uint8_t id[DC_NCCL_ID_BYTES], dc_err *err);

/* Starts forming the link of rank `rank` of `ranks` on CUDA device `device`;
 * on_state reports READY or BROKEN (within timeout_ms). */
int dc_nccl_open(uv_loop_t *loop, int device, const uint8_t id[DC_NCCL_ID_BYTES], int ranks,
                 int rank, uint32_t timeout_ms, dc_nccl_state_cb on_state, void *arg, dc_nccl **out,
                 dc_err *err);
/* Queues an exchange; one at a time (a group reduces one step at a time).
 * On a link not READY it fails (returns the error, done is not called). */
int dc_nccl_submit(dc_nccl *link, dc_nccl_op *op, dc_err *err);
/* An exchange is expected between from_ns and to_ns (uv_hrtime's clock):
 * the link's thread is awake and polling then, so that the exchange does
 * not wait for a sleeping thread's wake-up (~70 us on H200 hosts) before
 * its copy and all-gather are queued. Windows merge (earliest start, latest
 * end); one already past is ignored; an exchange's submission spends the
 * window. Loop thread; a no-op without NCCL. */
void dc_nccl_expect(dc_nccl *link, uint64_t from_ns, uint64_t to_ns);
/* Aborts the link and frees it once its thread ends. No callback runs
 * after this returns, not even an exchange's done: the thread never touches
 * the op (send is copied at submit, recv on the loop thread). */
void dc_nccl_close(dc_nccl *link);

dc_nccl_state dc_nccl_state_of(const dc_nccl *link);

#endif
