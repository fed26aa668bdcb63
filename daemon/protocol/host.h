/* The daemon as the protocol layer sees it: what a session needs of the
 * program that runs it, handed down instead of reached for.
 *
 * The protocol layer sits below the application (daemon/service/: the loop,
 * the listener, the configuration) and includes none of its headers; the
 * build gives it no include path there (CMakeLists.txt). Yet a session reads
 * settings, counts into the daemon's metrics, opens ledger accounts, submits
 * to worker pools, asks what its user's other sessions hold, and tells the
 * daemon when it has closed. So the server fills one dc_host (server.c) and
 * hands it to every session it starts (dc_session_start), the way libuv
 * hands a loop to its handles: state by pointer, and the few things only
 * the server can do as callbacks (dc_host_ops) with the server as their
 * context.
 *
 * Threads: loop thread only, like everything it points at.
 * Ownership: the server owns the dc_host and all it points at, and outlives
 * every session. */
#ifndef DC_HOST_H
#define DC_HOST_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <uv.h>

#include "gpu.h"
#include "group.h"
#include "ledger.h"
#include "metrics.h"
#include "registry.h"
#include "validate.h"
#include "worker.h"

typedef struct dc_session dc_session;

/* The most uids and gids [access] lists (the server checks that its
 * configuration's lists fit). */
#define DC_HOST_MAX_IDS 64

/* The settings the protocol layer reads, a copy of the configuration's
 * (dpclipd.conf(5) names each): the server copies them at start and again
 * after a reload has changed its own, so a session sees a reload exactly
 * when it saw it in the configuration itself. */
typedef struct dc_host_cfg {
    bool fixed_seed; /* --insecure-fixed-seed: every reply says so */
    /* [limits] a session checks */
    uint32_t max_buffers, max_buffers_per_uid;
    uint64_t max_mapped_bytes_per_uid; /* 0 = no cap */
    uint32_t max_events;
    uint64_t max_pass_memory, max_pass_memory_per_uid;
    uint32_t max_micro_batches;
    uint64_t max_accumulator_memory, max_accumulator_memory_per_uid;
    double logical_step_timeout;
    double handshake_timeout, idle_timeout; /* s; idle 0 = never */
    uint64_t max_reply_queue;
    /* [groups] */
    bool group_fuse;
    /* [daemon] */
    uint64_t gpu_workspace; /* bytes preallocated per GPU backend */
    /* [access]: empty lists = whoever can open the socket */
    uint32_t allowed_uids[DC_HOST_MAX_IDS];
    size_t n_allowed_uids;
    uint32_t allowed_gids[DC_HOST_MAX_IDS];
    size_t n_allowed_gids;
    /* [ledger] */
    double budget_epsilon; /* 0 = no node-wide budget per job */
    double budget_delta;
    bool require_sample_rate;
} dc_host_cfg;

/* What one user's (uid's) sessions hold, and all sessions: per-uid shares
 * of the daemon-wide limits (limits.max_*_per_uid) are checked against it,
 * so that one user cannot take every connection, buffer or pass byte from
 * the others. Counted over the sessions when asked (connections, buffer
 * registrations and norm passes are rare next to steps): no second tally
 * to keep in step. Closed sessions still finishing a step count. */
typedef struct dc_uid_usage {
    uint32_t connections;
    uint64_t buffers, shm_bytes, pass_bytes, acc_bytes;
} dc_uid_usage;

/* What only the server can do: it keeps the list of sessions and the
 * loop's polling windows. `ctx` is dc_host.ctx. */
typedef struct dc_host_ops {
    /* Usage of uid's sessions (*mine) and of all (*all; may be NULL). */
    void (*uid_usage)(void *ctx, uint32_t uid, dc_uid_usage *mine, dc_uid_usage *all);
    /* A session has fully closed (its memory goes next): it leaves the
     * server's list, which may let a stopping daemon finish. */
    void (*session_gone)(void *ctx, dc_session *s);
    /* The loop polls instead of sleeping from from_ns to to_ns (uv_hrtime),
     * so that what is expected then (a step's completion, a trainer's next
     * request) is picked up without a thread wake-up. `idle` false: the
     * window closes early once nothing is in flight; true: it stays open.
     * No-op when daemon.spin_us is 0. */
    void (*poll)(void *ctx, uint64_t from_ns, uint64_t to_ns, bool idle);
    /* A window of daemon.spin_us from now (as poll). */
    void (*spin)(void *ctx, bool idle);
} dc_host_ops;

typedef struct dc_host {
    const dc_host_ops *ops;
    void *ctx; /* the server, passed to every op */
    uv_loop_t *loop;
    dc_host_cfg cfg;
    const dc_limits *limits; /* what validation reads (reloadable) */
    /* Fixed once the daemon runs. */
    int workers;        /* CPU workers */
    uint64_t spin_ns;   /* daemon.spin_us: 0 = no polling windows */
    uint64_t noise_key; /* from getrandom, or the fixed test seed */
    /* The daemon's state, which sessions read and update. */
    dc_metrics *metrics;
    dc_ledger *ledger;
    dc_groups *groups;
    dc_gpu *gpu; /* zero GPUs without CUDA */
    dc_worker_pool *cpu_pool;
    dc_registry_totals *buf_totals; /* every session's buffers, against the daemon's caps */
    uint64_t *gpu_workspace;        /* [DC_MAX_GPUS]: bytes each GPU's backend holds */
    /* Counters, so that an id is never reused within the daemon's life. */
    uint64_t *next_session_id, *next_buffer_id;
    uint64_t *noise_steps; /* steps drawn so far: the noise counter */
} dc_host;

static inline void dc_host_uid_usage(const dc_host *h, uint32_t uid, dc_uid_usage *mine,
                                     dc_uid_usage *all) {
    h->ops->uid_usage(h->ctx, uid, mine, all);
}
static inline void dc_host_session_gone(const dc_host *h, dc_session *s) {
    h->ops->session_gone(h->ctx, s);
}
static inline void dc_host_poll(const dc_host *h, uint64_t from_ns, uint64_t to_ns, bool idle) {
    h->ops->poll(h->ctx, from_ns, to_ns, idle);
}
static inline void dc_host_spin(const dc_host *h, bool idle) { h->ops->spin(h->ctx, idle); }

#endif
