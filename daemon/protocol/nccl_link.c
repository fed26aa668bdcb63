#include "nccl_link.h"

#include <stdio.h>
#include <string.h>

void dc_nccl_version_str(uint32_t code, char *buf, size_t n) {
    /* NCCL_VERSION(X,Y,Z) = X*10000 + Y*100 + Z since 2.9 */
    snprintf(buf, n, "%u.%u.%u", code / 10000, code / 100 % 100, code % 100);
}

#ifdef DPCLIP_HAVE_NCCL
#include <cuda_runtime_api.h>
#include <nccl.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdlib.h>
#include <time.h>

#include "dc_window.h"
#include "log.h"

/* Where an exchange's time went (ns, uv_hrtime differences), for the debug
 * log: the hand-off to the link's thread, its CUDA and NCCL calls, the
 * device's work, and the hand-back to the loop. */
typedef struct dc_nccl_times {
    uint64_t woke;    /* submit -> the link's thread running it */
    uint64_t copy_in; /* queueing the copy to the device */
    uint64_t gather;  /* the all-gather call (blocking communicator: until queued) */
    uint64_t queued;  /* all of the link's calls for it (the copy out too) */
    uint64_t done;    /* from then until the stream was idle */
    bool polled;      /* the thread was polling when it came (dc_nccl_expect) */
} dc_nccl_times;

struct dc_nccl {
    uv_loop_t *loop;
    uv_async_t async;
    uv_thread_t thread;
    uv_mutex_t mu;
    uv_cond_t cv;
    int device, ranks, rank;
    uint32_t timeout_ms;
    ncclUniqueId id;
    dc_nccl_state_cb on_state;
    void *arg;
    atomic_bool closing; /* loop -> thread: abort and end */
    /* loop thread only */
    dc_nccl_state state;
    dc_nccl_op *op;                 /* the exchange in flight */
    uint8_t *send_copy, *recv_copy; /* op's bytes; the thread reads/writes them in flight */
    size_t copy_cap;
    size_t op_bytes;
    uint64_t op_submitted; /* uv_hrtime of dc_nccl_submit (under mu: read by the thread) */
    /* under mu, loop -> thread: a window in which an exchange is expected
     * (dc_nccl_expect): the thread sleeps until it opens, then polls
     * op_queued until it ends */
    dc_window win;
    atomic_bool op_queued; /* written under mu; polled without it */
    /* under mu: thread -> loop */
    bool exited, state_posted, op_finished;
    dc_nccl_state posted_state;
    dc_err state_err;
    int op_rc;
    dc_err op_err;
    uint64_t op_ns;
    dc_nccl_times op_times;
    /* the link's thread only */
    ncclComm_t comm; /* non-blocking: formed within the timeout */
    ncclComm_t fast; /* its blocking split, which the exchanges use */
    cudaStream_t stream;
    void *d_send, *d_recv, *h_send, *h_recv;
    size_t dev_cap; /* bytes per rank the buffers hold */
};

uint32_t dc_nccl_version(void) {
    int v = 0;
    return ncclGetVersion(&v) == ncclSuccess && v > 0 ? (uint32_t)v : 0;
}

int dc_nccl_unique_id(uint8_t id[DC_NCCL_ID_BYTES], dc_err *err) {
    ncclUniqueId u;
    ncclResult_t r = ncclGetUniqueId(&u);
    if (r != ncclSuccess)
        return dc_err_set(err, DC_EUNAVAIL, "join_group", "ncclGetUniqueId: %s",
                          ncclGetErrorString(r));
    memcpy(id, u.internal, DC_NCCL_ID_BYTES);
    return 0;
}

static void nap(unsigned spins) {
    /* spin first (an exchange takes tens of microseconds), then sleep */
    if (spins < 2000) {
        sched_yield();
        return;
    }
    struct timespec ts = {0, spins < 20000 ? 20000 : 1000000};
    nanosleep(&ts, NULL);
}

static int nccl_fail(dc_nccl *l, dc_err *err, const char *what, ncclResult_t r) {
    const char *last = l->comm ? ncclGetLastError(l->comm) : NULL;
    return dc_err_set(err, r == ncclRemoteError ? DC_EUNAVAIL : DC_EINTERNAL, "join_group",
                      "%s: %s%s%s", what,
                      r == ncclRemoteError ? "a peer daemon failed or went away"
                                           : ncclGetErrorString(r),
                      last && last[0] ? ": " : "", last ? last : "");
}

static int cuda_fail(dc_err *err, const char *what, cudaError_t e) {
    return dc_err_set(err, DC_EUNAVAIL, "join_group", "%s: %s", what, cudaGetErrorString(e));
}

/* Why a wait of the link's thread ends before what it waits for: the link
 * closed, or the deadline (ns, uv_hrtime) passed (the other daemons did not
 * answer); 0 to go on waiting. */
static int give_up(dc_nccl *l, uint64_t deadline, const char *what, dc_err *err) {
    if (atomic_load(&l->closing))
        return dc_err_set(err, DC_EUNAVAIL, "join_group", "%s: the link was closed", what);
    if (uv_hrtime() <= deadline) return 0;
    if (l->ranks == 2)
        return dc_err_set(err, DC_EUNAVAIL, "join_group",
                          "%s: daemon %d of the group did not answer within %u ms", what,
                          1 - l->rank, l->timeout_ms);
    return dc_err_set(err, DC_EUNAVAIL, "join_group",
                      "%s: one of the group's other %d daemons (all but daemon %d) did not "
                      "answer within %u ms",
                      what, l->ranks - 1, l->rank, l->timeout_ms);
}

/* Waits until NCCL has no call in progress on `comm` and, when `stream`,
 * until the link's stream is idle; within deadline (ns, uv_hrtime) and
 * until the link is closed. */
static int wait_done(dc_nccl *l, ncclComm_t comm, uint64_t deadline, bool stream, const char *what,
                     dc_err *err) {
    int rc;
    for (unsigned spins = 0;; spins++) {
        ncclResult_t ar;
        ncclResult_t r = ncclCommGetAsyncError(comm, &ar);
        if (r != ncclSuccess) return nccl_fail(l, err, what, r);
        if (ar != ncclSuccess && ar != ncclInProgress) return nccl_fail(l, err, what, ar);
        if (ar == ncclSuccess) {
            if (!stream) return 0;
            cudaError_t ce = cudaStreamQuery(l->stream);
            if (ce == cudaSuccess) return 0;
            if (ce != cudaErrorNotReady) return cuda_fail(err, what, ce);
        }
        if ((rc = give_up(l, deadline, what, err))) return rc;
        nap(spins);
    }
}

/* A non-blocking parent's split goes on in NCCL's thread, which writes
 * the new communicator when it has made it: wait for it to appear and to
 * be ready, within the deadline (the parent reports the split's failure). */
static int wait_split(dc_nccl *l, uint64_t deadline, dc_err *err) {
    const char *what = "splitting the NCCL communicator";
    int rc;
    for (unsigned spins = 0;; spins++) {
        ncclComm_t fast = __atomic_load_n(&l->fast, __ATOMIC_ACQUIRE);
        ncclResult_t ar, r = ncclCommGetAsyncError(fast ? fast : l->comm, &ar);
        if (r != ncclSuccess) return nccl_fail(l, err, what, r);
        if (ar != ncclSuccess && ar != ncclInProgress) return nccl_fail(l, err, what, ar);
        if (fast && ar == ncclSuccess) return 0;
        if ((rc = give_up(l, deadline, what, err))) return rc;
        nap(spins);
    }
}

static int form(dc_nccl *l, dc_err *err) {
    ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
    cudaError_t ce;
    ncclResult_t r;
    if ((ce = cudaSetDevice(l->device)) != cudaSuccess) return cuda_fail(err, "cudaSetDevice", ce);
    /* The exchange is a few bytes that every member's clip phase waits
     * for: its kernels go first of this process's whenever they compete
     * (the greatest priority the device has). */
    int lo = 0, hi = 0;
    if ((ce = cudaDeviceGetStreamPriorityRange(&lo, &hi)) != cudaSuccess)
        return cuda_fail(err, "cudaDeviceGetStreamPriorityRange", ce);
    if ((ce = cudaStreamCreateWithPriority(&l->stream, cudaStreamNonBlocking, hi)) != cudaSuccess) {
        l->stream = NULL;
        return cuda_fail(err, "cudaStreamCreate", ce);
    }
    cfg.blocking = 0; /* we poll, with a timeout, instead of hanging on a dead peer */
    r = ncclCommInitRankConfig(&l->comm, l->ranks, l->id, l->rank, &cfg);
    if (r != ncclSuccess && r != ncclInProgress) {
        l->comm = NULL;
        return nccl_fail(l, err, "forming the NCCL communicator", r);
    }
    uint64_t deadline = uv_hrtime() + (uint64_t)l->timeout_ms * 1000000u;
    int rc = wait_done(l, l->comm, deadline, false, "forming the NCCL communicator", err);
    if (rc) return rc;
    /* The exchanges go over a blocking split of it. A non-blocking
     * communicator's all-gather returns while NCCL's own thread still
     * enqueues it: that, and polling for it, took ~0.3 ms of each exchange
     * from the last member's arrival on H200s, against ~0.1 ms for a
     * blocking call, which returns with the kernel queued. Both daemons
     * split right after forming (no member's request is needed); a peer
     * gone meanwhile fails the split. A peer that dies later leaves a
     * kernel waiting on the device, not a call: the exchange's poll times
     * out and aborts both communicators, as before. */
    ncclConfig_t fcfg = NCCL_CONFIG_INITIALIZER;
    fcfg.blocking = 1;
    r = ncclCommSplit(l->comm, 0, l->rank, &l->fast, &fcfg);
    if (r != ncclSuccess && r != ncclInProgress) {
        l->fast = NULL;
        return nccl_fail(l, err, "splitting the NCCL communicator", r);
    }
    return wait_split(l, deadline, err);
}

static void free_buffers(dc_nccl *l) {
    cudaFree(l->d_send);
    cudaFree(l->d_recv);
    cudaFreeHost(l->h_send);
    cudaFreeHost(l->h_recv);
    l->d_send = l->d_recv = l->h_send = l->h_recv = NULL;
    l->dev_cap = 0;
}

/* Device buffers for the all-gather and pinned host ones to copy through.
 * (Pinned host buffers mapped into the device, which the all-gather's
 * kernels read and write themselves, were measured too: one call instead
 * of three, but NCCL's call took longer and the kernels ran slower on host
 * memory, 189 against 202 us from the last member's submission on two
 * H200s, within the runs' spread; not kept.) */
static int grow(dc_nccl *l, size_t bytes, dc_err *err) {
    cudaError_t ce;
    if (bytes <= l->dev_cap) return 0;
    free_buffers(l);
    size_t all = bytes * (size_t)l->ranks;
    if ((ce = cudaMalloc(&l->d_send, bytes)) != cudaSuccess ||
        (ce = cudaMalloc(&l->d_recv, all)) != cudaSuccess ||
        (ce = cudaMallocHost(&l->h_send, bytes)) != cudaSuccess ||
        (ce = cudaMallocHost(&l->h_recv, all)) != cudaSuccess)
        return cuda_fail(err, "allocating the exchange buffers", ce);
    l->dev_cap = bytes;
    return 0;
}

/* One exchange at once, while both daemons are here: NCCL connects a
 * communicator's peers at its first collective, which on a blocking
 * communicator waits on the host for the peer's, so a first exchange whose
 * peer never came (its member never sent a step) would hold the link's
 * thread past any timeout; later ones only queue a kernel. A peer daemon
 * that dies between the split and this exchange fails it (its sockets
 * close); one stopped (SIGSTOP) in that window would hold the thread until
 * it runs again. */
static int warm(dc_nccl *l, dc_err *err) {
    const char *what = "the NCCL link's first exchange";
    int rc;
    if ((rc = grow(l, 64, err))) return rc;
    ncclResult_t r = ncclAllGather(l->d_send, l->d_recv, 64, ncclUint8, l->fast, l->stream);
    if (r != ncclSuccess) return nccl_fail(l, err, what, r);
    return wait_done(l, l->fast, uv_hrtime() + (uint64_t)l->timeout_ms * 1000000u, true, what, err);
}

static int exchange(dc_nccl *l, size_t bytes, dc_nccl_times *tm, dc_err *err) {
    const char *what = "the cross-daemon norm exchange";
    uint64_t t0 = uv_hrtime(), deadline = t0 + (uint64_t)l->timeout_ms * 1000000u, t1 = t0, t2;
    size_t all = bytes * (size_t)l->ranks;
    cudaError_t ce;
    ncclResult_t r;
    int rc;
    if ((rc = grow(l, bytes, err))) return rc;
    memcpy(l->h_send, l->send_copy, bytes);
    if ((ce = cudaMemcpyAsync(l->d_send, l->h_send, bytes, cudaMemcpyHostToDevice, l->stream)) !=
        cudaSuccess)
        return cuda_fail(err, what, ce);
    t1 = uv_hrtime();
    r = ncclAllGather(l->d_send, l->d_recv, bytes, ncclUint8, l->fast, l->stream);
    if (r != ncclSuccess) return nccl_fail(l, err, what, r);
    t2 = uv_hrtime();
    if ((ce = cudaMemcpyAsync(l->h_recv, l->d_recv, all, cudaMemcpyDeviceToHost, l->stream)) !=
        cudaSuccess)
        return cuda_fail(err, what, ce);
    uint64_t t_queued = uv_hrtime();
    if ((rc = wait_done(l, l->fast, deadline, true, what, err))) return rc;
    memcpy(l->recv_copy, l->h_recv, all);
    tm->copy_in = t1 - t0;
    tm->gather = t2 - t1;
    tm->queued = t_queued - t0;
    tm->done = uv_hrtime() - t_queued;
    return 0;
}

static void post_state(dc_nccl *l, dc_nccl_state s, const dc_err *err) {
    uv_mutex_lock(&l->mu);
    l->state_posted = true;
    l->posted_state = s;
    if (err) l->state_err = *err;
    uv_mutex_unlock(&l->mu);
    uv_async_send(&l->async);
}

/* Polls for an exchange (or the link's closing) until `end`. */
static void link_spin_until(dc_nccl *l, uint64_t end) {
    do {
        for (int i = 0; i < 64; i++)
            if (atomic_load_explicit(&l->op_queued, memory_order_acquire) ||
                atomic_load(&l->closing))
                return;
        sched_yield();
    } while (uv_hrtime() < end);
}

/* With mu held and no exchange queued: waits (polling inside the window,
 * else sleeping, mu released meanwhile) until one is queued, the link
 * closes or the window changes. Returns with mu held, and whether an
 * exchange came while it polled. The worker pools' idle wait (worker.c)
 * does the same for their tasks. */
static bool link_idle(dc_nccl *l) {
    uint64_t now = uv_hrtime();
    dc_window_now at = dc_window_at(&l->win, now);
    if (at == DC_WINDOW_OPEN) {
        uint64_t end = l->win.to;
        uv_mutex_unlock(&l->mu);
        link_spin_until(l, end);
        uv_mutex_lock(&l->mu);
        dc_window_spent(&l->win, end);
        return atomic_load(&l->op_queued);
    }
    if (at == DC_WINDOW_LATER) /* sleep until it opens (or something changes) */
        (void)uv_cond_timedwait(&l->cv, &l->mu, l->win.from - now);
    else uv_cond_wait(&l->cv, &l->mu);
    return false;
}

static void link_main(void *arg) {
    dc_nccl *l = arg;
    dc_err err;
    dc_err_clear(&err);
    int rc = form(l, &err);
    if (rc == 0) rc = warm(l, &err);
    post_state(l, rc ? DC_NCCL_BROKEN : DC_NCCL_READY, &err);
    while (rc == 0) {
        uv_mutex_lock(&l->mu);
        bool polled = false;
        while (!atomic_load(&l->op_queued) && !atomic_load(&l->closing)) polled = link_idle(l);
        size_t bytes = l->op_bytes;
        uint64_t submitted = l->op_submitted;
        uv_mutex_unlock(&l->mu);
        if (atomic_load(&l->closing)) break;
        uint64_t t0 = uv_hrtime();
        dc_nccl_times tm = {t0 - submitted, 0, 0, 0, 0, polled};
        dc_err_clear(&err);
        rc = exchange(l, bytes, &tm, &err);
        uv_mutex_lock(&l->mu);
        atomic_store(&l->op_queued, false);
        l->op_finished = true;
        l->op_rc = rc;
        l->op_err = err;
        l->op_ns = uv_hrtime() - t0;
        l->op_times = tm;
        uv_mutex_unlock(&l->mu);
        uv_async_send(&l->async);
        if (rc) post_state(l, DC_NCCL_BROKEN, &err);
    }
    /* Abort, not finalize: it needs no peer, so a dead daemon cannot hold
     * this one; the live peers then see this link go (a remote error). */
    if (l->fast) ncclCommAbort(l->fast);
    if (l->comm) ncclCommAbort(l->comm);
    l->fast = l->comm = NULL;
    if (l->stream) cudaStreamDestroy(l->stream);
    free_buffers(l);
    uv_mutex_lock(&l->mu);
    l->exited = true;
    uv_mutex_unlock(&l->mu);
    uv_async_send(&l->async); /* the thread's last touch of the link */
}

static void on_closed(uv_handle_t *h) {
    dc_nccl *l = h->data;
    uv_mutex_destroy(&l->mu);
    uv_cond_destroy(&l->cv);
    free(l->send_copy);
    free(l->recv_copy);
    free(l);
}

static void on_async(uv_async_t *a) {
    dc_nccl *l = a->data;
    bool state_posted, op_finished, exited;
    dc_nccl_state st;
    dc_err serr, oerr;
    int orc;
    uint64_t ons, now = uv_hrtime();
    dc_nccl_times tm;
    uv_mutex_lock(&l->mu);
    state_posted = l->state_posted;
    st = l->posted_state;
    serr = l->state_err;
    op_finished = l->op_finished;
    orc = l->op_rc;
    oerr = l->op_err;
    ons = l->op_ns;
    tm = l->op_times;
    exited = l->exited;
    l->state_posted = l->op_finished = false;
    uv_mutex_unlock(&l->mu);
    if (!atomic_load(&l->closing) && op_finished && l->op) {
        dc_nccl_op *op = l->op;
        l->op = NULL;
        if (orc == 0 && dc_log_get_level() >= DC_LOG_DEBUG)
            dc_log_debug("nccl link (daemon %d of %d): exchange of %zu bytes in %.1f us: "
                         "hand-off %.1f, copy in %.1f, all-gather %.1f, queued %.1f, device "
                         "%.1f, hand-back %.1f%s",
                         l->rank, l->ranks, op->bytes, (now - l->op_submitted) / 1e3, tm.woke / 1e3,
                         tm.copy_in / 1e3, tm.gather / 1e3, tm.queued / 1e3, tm.done / 1e3,
                         (now - l->op_submitted - tm.woke - ons) / 1e3,
                         tm.polled ? " (polled)" : "");
        op->rc = orc;
        op->err = oerr;
        op->ns = ons;
        op->polled = tm.polled;
        if (op->rc == 0) memcpy(op->recv, l->recv_copy, op->bytes * (size_t)l->ranks);
        op->done(op); /* may close the link */
    }
    if (!atomic_load(&l->closing) && state_posted && st != l->state) {
        l->state = st;
        l->on_state(l, st, &serr, l->arg); /* may close the link */
    }
    if (atomic_load(&l->closing) && exited) {
        uv_thread_join(&l->thread); /* it has posted its last async: returns at once */
        uv_close((uv_handle_t *)&l->async, on_closed);
    }
}

int dc_nccl_open(uv_loop_t *loop, int device, const uint8_t id[DC_NCCL_ID_BYTES], int ranks,
                 int rank, uint32_t timeout_ms, dc_nccl_state_cb on_state, void *arg, dc_nccl **out,
                 dc_err *err) {
    dc_nccl *l = calloc(1, sizeof *l);
    if (!l) return dc_err_set(err, DC_ENOSPACE, "join_group", "out of memory");
    l->loop = loop;
    l->device = device;
    l->ranks = ranks;
    l->rank = rank;
    l->timeout_ms = timeout_ms;
    memcpy(l->id.internal, id, DC_NCCL_ID_BYTES);
    l->on_state = on_state;
    l->arg = arg;
    l->state = DC_NCCL_FORMING;
    atomic_init(&l->closing, false);
    atomic_init(&l->op_queued, false);
    uv_mutex_init(&l->mu);
    uv_cond_init(&l->cv);
    if (uv_async_init(loop, &l->async, on_async) != 0) {
        uv_mutex_destroy(&l->mu);
        uv_cond_destroy(&l->cv);
        free(l);
        return dc_err_set(err, DC_EINTERNAL, "join_group", "uv_async_init failed");
    }
    l->async.data = l;
    if (uv_thread_create(&l->thread, link_main, l) != 0) {
        atomic_store(&l->closing, true);
        uv_close((uv_handle_t *)&l->async, on_closed);
        return dc_err_set(err, DC_EINTERNAL, "join_group", "cannot start the link's thread");
    }
    *out = l;
    return 0;
}

int dc_nccl_submit(dc_nccl *l, dc_nccl_op *op, dc_err *err) {
    if (l->state != DC_NCCL_READY || l->op)
        return dc_err_set(err, DC_EINTERNAL, "join_group", "the NCCL link is %s",
                          l->op ? "busy" : "not ready");
    size_t all = op->bytes * (size_t)l->ranks;
    if (all > l->copy_cap) {
        uint8_t *s = realloc(l->send_copy, all), *r;
        if (!s) return dc_err_set(err, DC_ENOSPACE, "clip_step", "out of memory");
        l->send_copy = s;
        if (!(r = realloc(l->recv_copy, all)))
            return dc_err_set(err, DC_ENOSPACE, "clip_step", "out of memory");
        l->recv_copy = r;
        l->copy_cap = all;
    }
    memcpy(l->send_copy, op->send, op->bytes);
    l->op = op;
    uv_mutex_lock(&l->mu);
    l->op_bytes = op->bytes;
    l->op_submitted = uv_hrtime();
    dc_window_clear(&l->win); /* the exchange it waited for came */
    atomic_store_explicit(&l->op_queued, true, memory_order_release);
    uv_cond_signal(&l->cv);
    uv_mutex_unlock(&l->mu);
    return 0;
}

void dc_nccl_expect(dc_nccl *l, uint64_t from_ns, uint64_t to_ns) {
    if (l->state != DC_NCCL_READY) return;
    uv_mutex_lock(&l->mu);
    bool set = dc_window_set(&l->win, from_ns, to_ns, uv_hrtime());
    uv_mutex_unlock(&l->mu);
    if (set) uv_cond_signal(&l->cv); /* a sleeping thread recomputes its wake-up */
}

void dc_nccl_close(dc_nccl *l) {
    if (!l) return;
    atomic_store(&l->closing, true);
    uv_mutex_lock(&l->mu);
    uv_cond_signal(&l->cv);
    uv_mutex_unlock(&l->mu);
    uv_async_send(&l->async); /* on_async frees it once the thread has ended */
}

dc_nccl_state dc_nccl_state_of(const dc_nccl *l) { return l->state; }

#else /* no NCCL in this build */

static int no_nccl(dc_err *err) {
    return dc_err_set(err, DC_EUNIMPL, "join_group.daemons",
                      "this dpclipd was built without NCCL (it needs the CUDA toolkit's NCCL): "
                      "it serves groups whose members all use this daemon");
}

uint32_t dc_nccl_version(void) { return 0; }

int dc_nccl_unique_id(uint8_t id[DC_NCCL_ID_BYTES], dc_err *err) {
    (void)id;
    return no_nccl(err);
}

int dc_nccl_open(uv_loop_t *loop, int device, const uint8_t id[DC_NCCL_ID_BYTES], int ranks,
                 int rank, uint32_t timeout_ms, dc_nccl_state_cb on_state, void *arg, dc_nccl **out,
                 dc_err *err) {
    (void)loop, (void)device, (void)id, (void)ranks, (void)rank, (void)timeout_ms;
    (void)on_state, (void)arg, (void)out;
    return no_nccl(err);
}

int dc_nccl_submit(dc_nccl *l, dc_nccl_op *op, dc_err *err) {
    (void)l, (void)op;
    return no_nccl(err);
}

void dc_nccl_close(dc_nccl *l) { (void)l; }

void dc_nccl_expect(dc_nccl *l, uint64_t from_ns, uint64_t to_ns) {
    (void)l, (void)from_ns, (void)to_ns;
}

dc_nccl_state dc_nccl_state_of(const dc_nccl *l) {
    (void)l;
    return DC_NCCL_BROKEN;
}

#endif
