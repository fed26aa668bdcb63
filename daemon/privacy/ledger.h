/* The privacy ledger: per account (uid + job id), every step's
 * Poisson-sampled Gaussian mechanism, composed in RDP (accountant.h), and
 * the account's budget.
 *
 * An account's history is the list of distinct (sample rate q, noise multiplier
 * sigma) pairs with a step count each (what Opacus' RDPAccountant keeps),
 * bounded to DC_LEDGER_HIST_MAX pairs: when a new pair comes to a full
 * history, the least recently used pair is folded into a running sum of
 * RDP curves (rounded upwards, so it never understates the spend) and only
 * its step count is kept apart. The RDP curve is that sum plus
 * sum(count * rdp(q, sigma)) over the history, recomputed at each change, so
 * a step costs O(DC_LEDGER_HIST_MAX) however many pairs an account used, and
 * adding and refunding steps of the history never drifts.
 *
 * An account's delta is fixed by its first step: eps is always reported, and
 * budgets checked, at one delta (a step naming another is refused).
 *
 * Data parallelism (ledger_dp.c): an account's data-parallel ranks send one
 * step each per logical step, and one of them adds the noise. Such steps
 * declare the account's world size W and sigma (both fixed by its first such
 * step, and on disk) and their rank. The first member of a logical step to
 * come charges it, once, at (q, the account's sigma); every other member is
 * covered by that charge. At most W - 1 members of a logical step may be
 * noiseless (the others add noise with at least the account's sigma), each
 * rank takes each logical step once (its steps are numbered, and a number
 * it has used is refused), and members release only once the charge is on
 * disk. Across a restart the account's numbers go on after the highest one
 * charged, so no number can be taken twice. A sigma-0 step that declares
 * nothing is charged as what it is: no privacy.
 *
 * Persistence: one small text file per account under the ledger directory,
 * "<uid>-<hex of job id>.ledger", replaced atomically (written to a temp
 * file, fsync'd, renamed over the old one, directory fsync'd): a crash leaves
 * either the old or the new file, never a torn one. A lock file keeps two
 * daemons from sharing a directory.
 *
 * Memory: accounts are created by a session naming a job id, at most
 * max_jobs_per_uid per uid, and dropped from memory once no session uses
 * them and nothing of theirs is in flight: at once when they never spent
 * anything, else after job_idle_s without a step. A persistent account
 * stays on disk and is read back when a session names it again (an account
 * on disk may also be dropped early to make room under the cap); an
 * in-memory one is forgotten.
 *
 * Curves: computing one (q, sigma) pair costs 0.1-3 ms, so the loop does
 * not: dc_ledger_curve_async computes it on libuv's thread pool, one at a
 * time, and steps wait for it (a client changing q every step delays its
 * own steps and one pool thread, not the loop).
 *
 * Threads: a dc_ledger and its accounts belong to the loop thread. Only
 * dc_ledger_write_file is safe on another thread (it touches no ledger
 * state): dc_ledger_persist (ledger_store.c) serializes an account on the loop,
 * writes it on a pool thread, and records the generation it made durable
 * back on the loop.
 *
 * Ownership: the ledger owns its accounts. An account pointer stays valid while
 * a session counts itself in acct->sessions, a write or waiter is pending,
 * or until dc_ledger_close. */
#ifndef DC_LEDGER_H
#define DC_LEDGER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <uv.h>

#include "accountant.h"
#include "dc_err.h"
#include "metrics.h"

#define DC_LEDGER_JOB_ID_MAX 64 /* bytes of a job id, with its NUL: longer ids are refused */
#define DC_LEDGER_HIST_MAX 16   /* (q, sigma) pairs an account keeps apart; older are folded */
#define DC_LEDGER_CACHE 16      /* recently computed curves, shared by all accounts */
/* Data parallelism: the most ranks an account may declare (each costs the
 * account 8 bytes), and the logical steps an account keeps open (charged,
 * waiting for other members; a member of a step no longer open charges it
 * again). Settings wanted: ledger.dp_world_max, ledger.dp_window. */
#define DC_LEDGER_DP_WORLD_MAX 4096
#define DC_LEDGER_DP_WINDOW 64

typedef struct dc_ledger_entry {
    double q, sigma;
    uint64_t steps;
    uint64_t used;               /* the account's gen at its last spend: the oldest is folded */
    double rdp[DC_RDP_N_ORDERS]; /* of one step */
} dc_ledger_entry;

typedef struct dc_ledger_waiter dc_ledger_waiter;

typedef struct dc_ledger dc_ledger;

/* What a step of a data-parallel account is to its logical step. */
typedef enum dc_dp_role {
    DC_DP_NONE = 0, /* not accounted (yet) */
    DC_DP_CHARGED,  /* the first member: it charged the logical step */
    DC_DP_COVERED,  /* a later member adding noise: covered by the charge */
    DC_DP_SHARE     /* a later noiseless member: a share of the charge */
} dc_dp_role;

/* A step's membership of a data-parallel logical step: as the request
 * states it (ClipStep.data_parallel; world 0: none), then as accounted. */
typedef struct dc_dp_member {
    bool declared; /* the request has ClipStep.data_parallel */
    uint32_t world, rank;
    uint64_t step;   /* 0: the rank's next; once accounted, the logical step */
    double sigma;    /* the account's data-parallel sigma, as the step states it */
    dc_dp_role role; /* set by dc_ledger_dp_commit */
    uint64_t gen;    /* the account's generation holding the charge: durable first */
} dc_dp_member;

/* What every member of one logical step must agree on, so that the noise
 * one of them adds covers each one's sum: the sample rate charged, the C
 * of the noise's std (flat: C, or the group's; per layer: sqrt(sum C_l^2))
 * and the divisor of the noised sum (MEAN: the expected batch; SUM: 1). */
typedef struct dc_dp_terms {
    double q, c;
    uint32_t divisor;
} dc_dp_terms;

/* A logical step charged and still waiting for members. */
typedef struct dc_ledger_dp_open {
    uint64_t step, gen;
    dc_dp_terms terms;
    uint32_t members, noiseless;
} dc_ledger_dp_open;

/* An account's data parallelism (allocated at its first data-parallel step, or
 * read back from its file). */
typedef struct dc_ledger_dp {
    uint32_t world;  /* fixed by the first member accepted; 0 = not yet */
    double sigma;    /* the account's sigma: every logical step is charged at it */
    uint64_t newest; /* the highest logical step charged (on disk) */
    uint64_t *next;  /* [cap_next]: each rank's next logical step */
    uint32_t cap_next;
    dc_ledger_dp_open open[DC_LEDGER_DP_WINDOW];
    size_t n_open;
} dc_ledger_dp;

/* Where a data-parallel step goes (dc_ledger_dp_plan), to be committed
 * once its charge, if any, is spent. */
typedef struct dc_dp_plan {
    uint64_t step;
    bool charge; /* no open logical step: this member charges it */
} dc_dp_plan;

/* An account: what one uid's job id has spent, and its terms. The job id is
 * the name a trainer's Hello gives (hello.job_id), its file's name and what
 * /status and /metrics show as "job". */
typedef struct dc_ledger_account {
    struct dc_ledger_account *next;
    dc_ledger *ledger; /* its owner (refunds may need the curve cache) */
    uint32_t uid;
    char job_id[DC_LEDGER_JOB_ID_MAX];
    uint64_t steps;        /* every step charged, folded ones included */
    uint64_t shares;       /* noiseless data-parallel members seen (not on disk) */
    dc_ledger_dp *dp;      /* data parallelism; NULL until the account declares it */
    double delta;          /* the account's delta: eps is reported at it */
    double budget_eps;     /* the account's own budget at `delta`; 0 = none */
    dc_ledger_entry *hist; /* at most DC_LEDGER_HIST_MAX */
    size_t n_hist, cap_hist;
    uint64_t folded_steps;          /* steps of pairs folded out of hist */
    double folded[DC_RDP_N_ORDERS]; /* their RDP, summed (rounded up) */
    double rdp[DC_RDP_N_ORDERS];    /* composed over folded + history */
    double eps, best_order;         /* at delta, kept current */
    int sessions;                   /* live sessions naming this account */
    bool insecure;                  /* spent under --insecure-fixed-seed: not private */
    uint64_t used_ns;               /* uv_hrtime of its last step (or creation) */

    /* Durability, driven by the server (loop thread). gen counts changes;
     * saved_gen is the last one on disk. */
    uint64_t gen, saved_gen;
    bool writing, dirty;
    dc_ledger_waiter *waiters;
} dc_ledger_account;

/* Something waiting on the ledger: a step that may not start before its
 * spend is durable (gen: the account's state as of that generation), or that
 * waits for the curve of (q, sigma). */
struct dc_ledger_waiter {
    dc_ledger_waiter *next;
    uint64_t gen;
    double q, sigma;
    void (*done)(dc_ledger_waiter *w, int rc, const dc_err *err);
};

struct dc_ledger {
    char dir[256]; /* "" = in memory only */
    int lock_fd;
    double default_delta;
    uint32_t max_jobs_per_uid; /* ledger.max_jobs_per_uid; 0 = no cap */
    uint64_t job_idle_ns;      /* ledger.job_idle_s; 0 = keep spent accounts */
    bool insecure;             /* --insecure-fixed-seed: mark what is spent */
    dc_ledger_account *accounts;
    size_t n_accounts;
    uint64_t swept_ns; /* last expiry sweep */
    /* Recently computed per-step RDP curves, so a new account (or a session
     * that changes q or sigma back and forth) rarely recomputes one. */
    dc_ledger_entry cache[DC_LEDGER_CACHE];
    size_t n_cache, next_cache;
    /* Curves being computed (dc_ledger_curve_async): one on the pool at a
     * time, the waiters queued in order. */
    uv_work_t calc_req;
    bool calc_busy;
    double calc_q, calc_sigma, calc_rdp[DC_RDP_N_ORDERS];
    dc_ledger_waiter *calc_head, *calc_tail;
    /* Writes (ledger_store.c): the loop whose pool runs them, the daemon's
     * metrics that count them (NULL: none), and how many are running. */
    uv_loop_t *loop;
    dc_metrics *metrics;
    int writes_in_flight;
};

/* Opens (creating it, mode 0750) and locks the directory and loads every
 * account file in it; dir "" makes an in-memory ledger. A corrupt account
 * file is an error naming it: the daemon must not start believing an account
 * spent nothing. No cap or expiry until dc_ledger_set_limits. */
int dc_ledger_open(dc_ledger *l, const char *dir, double default_delta, dc_err *err);
void dc_ledger_close(dc_ledger *l);
static inline bool dc_ledger_persistent(const dc_ledger *l) { return l->dir[0] != '\0'; }
/* ledger.max_jobs_per_uid and ledger.job_idle_s (0: no cap / never). */
void dc_ledger_set_limits(dc_ledger *l, uint32_t max_jobs_per_uid, uint32_t job_idle_s);

/* The account: in memory, read back from its file, or created. Refused (NULL
 * and *err) when the id is too long (field hello.job_id), the uid already
 * has max_jobs_per_uid accounts in memory (field ledger.max_jobs_per_uid),
 * its file cannot be read, or out of memory. */
int dc_ledger_account_open(dc_ledger *l, uint32_t uid, const char *job_id, dc_ledger_account **out,
                           dc_err *err);
/* dc_ledger_account_open without the reason. */
dc_ledger_account *dc_ledger_account_get(dc_ledger *l, uint32_t uid, const char *job_id);
dc_ledger_account *dc_ledger_account_find(dc_ledger *l, uint32_t uid, const char *job_id);
/* Drops the accounts that may go by `now_ns` (uv_hrtime) as described
 * above; returns how many. Runs by itself at most once a second from
 * dc_ledger_account_open; the status rendering calls it too. */
size_t dc_ledger_expire(dc_ledger *l, uint64_t now_ns);

/* Whether the curve of one step of (q, sigma) is at hand (the account's history
 * or the cache). When it is not, dc_ledger_eps_after and dc_ledger_spend
 * compute it on the calling thread: the loop asks dc_ledger_curve_async. */
bool dc_ledger_has_curve(const dc_ledger *l, const dc_ledger_account *acct, double q, double sigma);
/* Computes that curve on libuv's thread pool and calls w->done(w, 0, NULL)
 * on the loop with it in the cache (w->q, w->sigma are set here). */
void dc_ledger_curve_async(dc_ledger *l, uv_loop_t *loop, double q, double sigma,
                           dc_ledger_waiter *w);

/* The account's eps at `delta` if one more step (q, sigma) were added. */
double dc_ledger_eps_after(dc_ledger *l, const dc_ledger_account *acct, double q, double sigma,
                           double delta);
/* The account's eps now at `delta` (any delta, not only the account's). */
double dc_ledger_eps_at(const dc_ledger_account *acct, double delta, double *best_order);

/* Adds one step (bumps gen). Fails only when out of memory. */
int dc_ledger_spend(dc_ledger *l, dc_ledger_account *acct, double q, double sigma, dc_err *err);
/* Takes back one step of (q, sigma) that was spent and then not released
 * (the step failed before writing anything). Bumps gen. */
void dc_ledger_refund(dc_ledger_account *acct, double q, double sigma);
/* --- ledger_dp.c: data-parallel logical steps ------------------------------- */

/* The member's declaration alone: world in [2, DC_LEDGER_DP_WORLD_MAX],
 * rank in [0, world), a finite sigma > 0, a step number below 2^63, and
 * the step's own noise multiplier 0 (noiseless) or at least that sigma.
 * Refusals name clip_step.data_parallel.* or clip_step.noise_multiplier. */
int dc_ledger_dp_check(const dc_dp_member *m, double step_sigma, dc_err *err);
/* Where the member goes in account acct, changing nothing that counts: the
 * account's world and sigma (a different one is refused, FAILED_PRECONDITION
 * naming clip_step.data_parallel.world / .noise_multiplier), the rank's next
 * number (a smaller one is a replay: clip_step.data_parallel.step), and an
 * open logical step's terms (clip_step.sample_rate, clip_step.clip) and
 * noiseless members (a W-th: clip_step.noise_multiplier). Out of memory
 * (field "ledger") is the only other error. */
int dc_ledger_dp_plan(dc_ledger_account *acct, const dc_dp_member *m, double step_sigma,
                      const dc_dp_terms *t, dc_dp_plan *plan, dc_err *err);
/* Takes the planned place (after the charge was spent, if planned): fixes
 * the account's world and sigma, advances the rank, opens or fills the logical
 * step; sets m->step, m->role and m->gen. */
void dc_ledger_dp_commit(dc_ledger_account *acct, dc_dp_member *m, double step_sigma,
                         const dc_dp_terms *t, const dc_dp_plan *plan);
/* The member that charged a logical step released nothing: true when no
 * other member took it (the charge may be refunded; the step is closed),
 * false when one did or it is no longer open (the charge stays). */
bool dc_ledger_dp_unwind(dc_ledger_account *acct, const dc_dp_member *m);
/* The account's data parallelism as read back (world, sigma, highest step
 * charged): every rank goes on after that step. 0, or out of memory. */
int dc_ledger_dp_restore(dc_ledger_account *acct, uint32_t world, double sigma, uint64_t newest);
void dc_ledger_dp_free(dc_ledger_account *acct);
/* The account's terms from a step: delta (0 = the account's) may be set until
 * the account's first step, then a different one is refused (field
 * clip_step.target_delta); the budget (0 = keep) is lowered, never raised.
 * Bumps gen when something changed. */
int dc_ledger_account_terms(dc_ledger_account *acct, double delta, double budget_eps, dc_err *err);

/* The account's file contents (malloc'd, NUL-terminated) and its path. */
int dc_ledger_serialize(const dc_ledger_account *acct, char **out, size_t *len);
void dc_ledger_account_path(const dc_ledger *l, const dc_ledger_account *acct, char *out, size_t n);
/* Replaces `path` with buf crash-safely (temp, fsync, rename, fsync dir).
 * Thread-safe: no ledger state involved. */
int dc_ledger_write_file(const char *path, const char *buf, size_t len, dc_err *err);
/* Synchronous save of one account (serialize + write) and its saved_gen. */
int dc_ledger_save(dc_ledger *l, dc_ledger_account *acct, dc_err *err);

/* --- ledger_store.c: durability off the loop ------------------------------ */

/* Where dc_ledger_persist writes from (after dc_ledger_open, which clears
 * it): loop's thread pool, counted in m (may be NULL). */
void dc_ledger_store_init(dc_ledger *l, uv_loop_t *loop, dc_metrics *m);
/* Makes the account's ledger state durable. `w` (may be NULL) is called back on
 * the loop once a write holding generation w->gen has reached the disk, or
 * failed; with an in-memory ledger, or nothing changed since the last
 * write, at once (within this call). Writes of one account never overlap;
 * changes made while one is in flight go out in the next. */
void dc_ledger_persist(dc_ledger_account *acct, dc_ledger_waiter *w);

#endif
