/* Internals shared by group.c (membership, group steps, fusing) and
 * group_link.c (a group across daemons: its NCCL link and the exchange of
 * each group step's totals). Loop thread only. */
#ifndef DC_GROUP_INT_H
#define DC_GROUP_INT_H

#include "group.h"
#include "step.h" /* dc_clip_e_max */

#define GROUP_NAME_MAX 64

/* One charge of the leader's, for GROUP_WISE coverage. */
typedef struct group_charge {
    uint64_t step;
    float sigma;
    char job_id[DC_GROUP_JOB_ID_MAX];
} group_charge;

struct dc_group {
    dc_group *next;
    dc_groups *gs;
    uint64_t id;
    uint32_t uid;
    char name[GROUP_NAME_MAX];
    uint32_t size, timeout_ms;
    dc_group_clipping clipping;
    uint64_t noise_key;
    int refs;     /* members holding it */
    bool *joined; /* [size] */
    uint32_t n_joined;
    bool dissolved;
    bool closing; /* its timer's close is under way: freed in its callback */
    char why[256];
    /* the group step being reduced, while `active`: a flag, not a sentinel
     * value of cur, so that no step number a client sends can mean "none" */
    bool active;
    uint64_t cur;
    dc_group_waiter **waiting;  /* [size] */
    dc_group_waiter **unfusing; /* [size]: unrun steps sent to compute their norms */
    uint32_t n_waiting;
    /* The last group step's members were on different devices: later steps
     * compute their norms on arrival instead of waiting to be fused. */
    bool split_devices;
    dc_group_terms terms; /* of the first member to deliver */
    uint32_t first_rank;
    double *tot;  /* [terms.batch] */
    double e_max; /* the largest e delivered with the totals (group.h) */
    double *rep;  /* [terms.batch]: the first copy of the replicated layers */
    bool has_rep;
    uint64_t rep_hash; /* and its checksum */
    uint32_t rep_from; /* the rank it came from */
    uint32_t tot_cap;
    uint64_t t_first, last_wait_ns, reductions;
    /* the last group step that failed on a member, and why */
    bool has_failed;
    uint64_t failed;
    dc_err failed_err;
    uv_timer_t timer;
    /* across daemons */
    uint32_t daemons, daemon_rank, local_size;
    int device;
    uint8_t nccl_id[DC_NCCL_ID_BYTES];
    uint32_t nccl_version;
    bool made_id; /* this daemon made the id (rank 0's join) */
    dc_group_link link_state;
    dc_nccl *link;
    bool exchange_due; /* the local totals wait for the link to form */
    dc_nccl_op op;
    uint8_t *xsend, *xrecv; /* the exchange's bytes, this daemon's and all */
    size_t xcap;
    uint64_t t_local, exchanges, exchanges_polled, last_exchange_ns;
    /* the first local member's norms' submission of the coming exchange (0:
     * none yet), and the moving average of its time to the exchange */
    uint64_t t_norms, ewma_norms_ns, ewma_norms_dev_ns; /* and its mean deviation */
    /* the exchange in flight's submission, and the recent ones' time to their answer */
    uint64_t t_exchange, ewma_exchange_ns;
    /* Coverage (dc_group_covers): each member's job id, the leader's last
     * charges (a ring), and per rank the last group step covered. */
    char (*job_ids)[DC_GROUP_JOB_ID_MAX]; /* [size] */
    group_charge charges[DC_GROUP_CHARGED_WINDOW];
    uint32_t n_charges, next_charge;
    uint64_t *covered; /* [size] */
};

/* group_end.c */
/* Fails every step waiting in the group and marks it dissolved (why). */
void dc_group_dissolve(dc_group *g, const char *why);
/* Frees a dissolved group no member holds (idempotent; the free itself
 * comes in the timer's close callback). */
void dc_group_maybe_free(dc_group *g);
/* Every member waiting gets g->tot; the group step ends. */
void dc_group_answer(dc_group *g, uint64_t exchange_ns);
/* The field two members' terms differ in, or NULL. */
const char *dc_group_terms_differ(const dc_group_terms *a, const dc_group_terms *b);
/* Fails every step waiting in the group step (rc, err); the step ends. */
void dc_group_fail_waiting(dc_group *g, int rc, const dc_err *err);
/* Ends the group step as reduced: the steps waiting, chained in rank
 * order through next_call, their wait times set; *n their count. */
dc_group_waiter *dc_group_take_reduced(dc_group *g, uint64_t exchange_ns, uint32_t *n);

/* group_link.c */
/* Opens the link once every member on this daemon has joined. */
int dc_group_link_open(dc_group *g, dc_err *err);
/* This daemon's members are all in: its totals go to the other daemons. */
void dc_group_exchange_start(dc_group *g);

#endif
