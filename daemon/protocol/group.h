/* Norm groups: the sessions that together hold one model replica (tensor or
 * pipeline parallel ranks), and the reduction stage of a grouped step.
 *
 * With flat clipping a sample's gradient norm spans every member's layers.
 * Each member's step computes its own per-sample squared norms (the
 * backend's run_norms) and delivers their sum over its layers here; when
 * every member has delivered the same group step, the group sums them and
 * hands each member the per-sample totals, from which it clips (run_clip).
 * Members may arrive in any order (pipeline stages finish their backward
 * passes at different times); a step waits at most the group's timeout.
 *
 * A group is per uid and name: members must run as the same user. It forms
 * as members join; a member that leaves (disconnects, joins again) or a step
 * that times out dissolves it: the steps waiting fail on every member with
 * an error naming the member missing, and the members must join again,
 * which forms a new group (a new id). A step that fails on one member
 * before its norms are delivered fails on every member; the group goes on
 * with the next step.
 *
 * A group may span daemons (members on several nodes, or several daemons
 * on one): each daemon then sums its own members' norms as above, and the
 * daemons exchange their totals over the group's NCCL link (nccl.h), one
 * exchange per group step; every daemon sums the totals in daemon order,
 * so every member everywhere clips by bit-identical norms.
 *
 * Everything here runs on the loop thread. Ownership: dc_groups owns its
 * groups; a member holds a reference (dc_group_join / dc_group_leave), and a
 * group is freed when dissolved and left by every member. */
#ifndef DC_GROUP_H
#define DC_GROUP_H

#include <stdbool.h>
#include <stdint.h>
#include <uv.h>

#include "dc_err.h"
#include "nccl_link.h"

/* How far two copies of the replicated layers may measure apart (relative,
 * on squared norms): the rounding of one kernel plan against another. */
#define DC_GROUP_REPLICA_TOL (1.0 / 1024.0)

typedef enum dc_group_clipping {
    DC_GROUP_NORM_REDUCE = 0, /* norms summed over the group: exact flat clipping */
    DC_GROUP_WISE = 1         /* each member clips to C / sqrt(size) alone */
} dc_group_clipping;

typedef struct dc_group dc_group;

/* The largest group step a member may take. Steps count up from 1 and a
 * session's next implicit step is its last plus one: bounded far below
 * UINT64_MAX, no step number can wrap. */
#define DC_GROUP_STEP_MAX (UINT64_C(1) << 62)
/* A logical step's micro-batch k, numbered implicitly, is group step
 * (logical id << DC_GROUP_MICRO_BITS) + k (session_group.c). */
#define DC_GROUP_MICRO_BITS 24

/* What every member's step of one group step must agree on; a mismatch
 * fails the step on every member, naming the field. */
typedef struct dc_group_terms {
    uint32_t batch;
    float max_grad_norm, noise_multiplier;
    int reduction;
    uint32_t expected_batch;
    uint64_t replicated_hash; /* names of the replicated layers, in order */
    /* a micro-batch of a logical step (ClipStep.logical); id 0: none */
    uint64_t logical_id;
    uint32_t micro_batch;
    bool commit;
} dc_group_terms;

/* One member's step in the reduction stage. The caller fills rank, step,
 * terms, partial and done, and keeps the waiter alive until done ran. */
typedef struct dc_group_waiter dc_group_waiter;
struct dc_group_waiter {
    uint32_t rank;
    uint64_t step;
    dc_group_terms terms;
    const double *partial; /* [batch] this member's squared norms, summed over its layers;
                            * NULL: the step is delivered unrun (one-daemon groups), see fuse */
    /* with partial: the rounding bound its clip phase would clip by on its
     * own (compute/step.h dc_clip_e_phase). The totals count every
     * member's layers, so every member clips by the largest, e_group, set
     * before done (NaN or infinite ones win: their coefficients are 0). */
    double e, e_group;
    /* [batch] its replicated layers' squared norms, summed (their copies'
     * norms count once, rank 0's, so every member's copy must measure the
     * same: a copy that differs fails the group step on every member);
     * NULL: no replicated layers. */
    const double *replicated;
    /* and the checksum of its replicated layers' data (dc_step_run_replicas_
     * hash): equal norms are not equal data (a negated copy has the same
     * norms, and the copies' identical noise would cancel between members'
     * outputs), so one daemon's members' copies are compared by it */
    uint64_t rep_hash, rep_key;
    bool has_rep_hash;
    /* Loop thread. rc 0: tot[batch] are the group's per-sample squared
     * norms (valid during the call). Else err says why the step fails. */
    void (*done)(dc_group_waiter *w, int rc, const double *tot, const dc_err *err);
    void *arg;
    /* set before done: from this delivery to the totals, and the part of
     * it spent in the cross-daemon exchange (0 for a one-daemon group).
     * The caller zeroes wait_ns before a step's first delivery. */
    uint64_t wait_ns, exchange_ns;
    /* An unrun step (partial NULL) and where its tensors are (device, -1
     * = host). When every member's step arrives unrun, on one device,
     * fuse(first, n) gets them all (chained through next_call) and the group
     * step ends there: the caller
     * runs them as one step (one norm pass over every member's layers, no
     * round trip between phases). Otherwise unfuse(w) takes a step back,
     * to compute its norms and deliver them to the same group step. Loop
     * thread; done still reports a failure of the group step. */
    int device;
    void (*fuse)(dc_group_waiter *first, uint32_t n);
    void (*unfuse)(dc_group_waiter *w);
    /* group.c's: a group step's waiters taken out of the group to be
     * answered, chained in rank order (fuse gets them so) */
    dc_group_waiter *next_call;
};

/* How a member joins (the JoinGroup request). */
typedef struct dc_group_spec {
    const char *name;
    uint32_t rank, size;
    uint32_t timeout_ms; /* 0 = groups.timeout_ms */
    dc_group_clipping clipping;
    const char *job_id; /* the member's ledger job (coverage is per job) */
    /* Across daemons (daemons > 1): this daemon's place and how many of the
     * members use it; the NCCL id made by daemon 0 (NULL on rank 0's join,
     * which makes it) and that daemon's NCCL version. */
    uint32_t daemons, daemon_rank, local_size;
    const uint8_t *nccl_id;
    uint32_t nccl_version;
    int device; /* the GPU the link uses; -1 = none */
} dc_group_spec;

/* The cross-daemon link's state, for /status. */
typedef enum dc_group_link {
    DC_GROUP_LINK_NONE = 0, /* one daemon: no link */
    DC_GROUP_LINK_WAITING,  /* for this daemon's members to join */
    DC_GROUP_LINK_FORMING,  /* the NCCL communicator is being formed */
    DC_GROUP_LINK_READY,
    DC_GROUP_LINK_BROKEN
} dc_group_link;
const char *dc_group_link_name(dc_group_link l);

typedef struct dc_groups {
    uv_loop_t *loop;
    dc_group *list;
    uint64_t next_id;
    uint64_t key_seed;       /* secret: group noise keys derive from it */
    uint32_t max_size;       /* limits.max_group_size */
    uint32_t max_links;      /* limits.max_group_links */
    uint32_t links;          /* cross-daemon groups held now */
    uint32_t timeout_ms;     /* groups.timeout_ms, a join may ask for another */
    uint32_t max_timeout_ms; /* limits.max_group_timeout_ms: the longest it may ask for */
    /* The loop's polling window (the server's), opened around when an
     * exchange's answer is due; NULL where nothing polls (daemon.spin_us =
     * 0): then the links' threads do not poll for their exchanges either. */
    void (*poll)(void *ctx, uint64_t from_ns, uint64_t to_ns);
    void *poll_ctx;
    /* totals, for /status and /metrics */
    uint64_t formed, dissolved, reductions, timeouts;
    uint64_t fused;                    /* reductions run as one fused step */
    uint64_t exchanges, link_failures; /* cross-daemon */
    uint64_t exchanges_polled;         /* of them, found the link's thread polling */
} dc_groups;

void dc_groups_init(dc_groups *gs, uv_loop_t *loop, uint64_t key_seed, uint32_t max_size,
                    uint32_t timeout_ms, uint32_t max_timeout_ms);
/* Dissolves every group (at shutdown); members' references stay valid until
 * they leave. */
void dc_groups_close(dc_groups *gs);

/* Joins (uid, spec->name) as spec->rank of spec->size; *out is the
 * member's reference. Refused (naming the join_group field) for a rank taken
 * or out of range, a size, clipping or cross-daemon layout unlike the
 * group's, size over the limit, or a cross-daemon group this daemon cannot
 * link (no NCCL or GPU, another NCCL version, an id it did not make). */
int dc_group_join(dc_groups *gs, uint32_t uid, const dc_group_spec *spec, dc_group **out,
                  dc_err *err);
/* The checks of a join that need no group (name, size, rank, timeout,
 * layout): a join they refuse leaves the session's current group alone. */
int dc_group_join_check(const dc_groups *gs, const dc_group_spec *spec, dc_err *err);
/* Members joined now (the join reply's `members`). */
uint32_t dc_group_joined(const dc_group *g);
/* A cross-daemon group's NCCL id and version (for the join reply); false
 * for a one-daemon group. */
bool dc_group_nccl_id(const dc_group *g, uint8_t id[DC_NCCL_ID_BYTES], uint32_t *version);
/* The member of rank leaves: a NORM_REDUCE group is dissolved, the steps
 * waiting fail naming the member and `why`; a GROUP_WISE group goes on
 * until its last member leaves. Drops the reference. */
void dc_group_leave(dc_group *g, uint32_t rank, const char *why);

/* Delivers a member's norms for a step (see dc_group_waiter). Returns an
 * error (and does not call done) when the step cannot wait: the group is
 * dissolved, the rank is not this member's, or the step is not the group's
 * current one. */
int dc_group_deliver(dc_group *g, dc_group_waiter *w, dc_err *err);
/* A member's step failed before it could deliver: the other members' steps
 * of that group step fail with err (those waiting now and those to come). */
void dc_group_fail(dc_group *g, uint32_t rank, uint64_t step, const dc_err *err);
/* A member's norms were submitted (loop thread): across daemons, the
 * group's link is awake around when the exchange is due, the time this
 * daemon's members' norms have recently taken. */
void dc_group_norms_started(dc_group *g);

/* Accounting: a group step is one logical step, charged on each daemon
 * once, to the step of the group's leader there (its lowest rank joined on
 * this daemon: rank 0 on daemon 0). dc_group_covers says whether rank's
 * step of group step `step`, in the ledger account of job id `job_id`, is
 * covered by the leader's charge, and if so records it as covered:
 *   - never for the leader, nor for a member of another account than the
 *     leader's (membership is by uid and name, the charge is the account's);
 *   - NORM_REDUCE: every other member's step waits for the leader's (and
 *     fails with it, terms checked equal): covered;
 *   - GROUP_WISE, whose steps never wait: only if the leader's step of
 *     exactly that group step was charged to that account, at a noise
 *     multiplier <= sigma, among its last DC_GROUP_CHARGED_WINDOW charges;
 *     and each rank is covered once per group step, in increasing order, for
 *     the group's life: a member joining again (its step counter starts
 *     over) is not covered by charges it was covered by before.
 * Otherwise the step is charged itself (over-counting, never
 * under-counting). dc_group_charged records a step the ledger really
 * charged (not a data-parallel share). */
#define DC_GROUP_CHARGED_WINDOW 64
#define DC_GROUP_JOB_ID_MAX 128 /* a ledger job id, whole (DC_LEDGER_JOB_ID_MAX fits) */
bool dc_group_covers(dc_group *g, uint32_t rank, uint64_t step, float sigma, const char *job_id);
void dc_group_charged(dc_group *g, uint32_t rank, uint64_t step, float sigma, const char *job_id);

/* Whether two copies of the replicated layers' per-sample squared norm
 * agree within DC_GROUP_REPLICA_TOL (step_fuse.c checks the same). */
bool dc_group_replicas_agree(double a, double b);

/* The group's facts, for the session and /status. */
uint64_t dc_group_id(const dc_group *g);
const char *dc_group_name(const dc_group *g);
uint32_t dc_group_size(const dc_group *g);
uint32_t dc_group_daemons(const dc_group *g); /* 1: every member uses this daemon */
dc_group_clipping dc_group_clipping_of(const dc_group *g);
uint64_t dc_group_noise_key(const dc_group *g);
/* A group step handed to fuse ran fused (counted as its reduction; one
 * that fell back to the phases is counted when their reduction answers). */
void dc_group_fused(dc_group *g);
bool dc_group_dissolved(const dc_group *g, const char **why);
/* The last reduction's latency: first delivery to the totals, ns. */
uint64_t dc_group_last_wait_ns(const dc_group *g);

/* A copy of a group's state for /status (taken on the loop thread). */
typedef struct dc_group_info {
    uint64_t id;
    uint32_t uid;
    char name[64];
    uint32_t size, joined, waiting;
    dc_group_clipping clipping;
    bool dissolved;
    uint64_t step;         /* the group step being reduced, 0 = none */
    uint64_t reductions;   /* group steps completed */
    uint64_t last_wait_ns; /* the last one's first delivery to its totals */
    uint32_t daemons, daemon_rank, local_size;
    dc_group_link link;
    uint64_t exchanges;        /* cross-daemon exchanges completed */
    uint64_t exchanges_polled; /* of them, found the link's thread polling (not asleep) */
    uint64_t last_exchange_ns; /* the last one's time on the link */
    char why[160];             /* why it was dissolved */
} dc_group_info;
size_t dc_groups_count(const dc_groups *gs);
/* Fills out[0..max) with the groups' states; returns how many. */
size_t dc_groups_info(const dc_groups *gs, dc_group_info *out, size_t max);

#endif
