/* The privacy ledger: per job (uid + job id), every step's Poisson-sampled
 * Gaussian mechanism, composed in RDP (accountant.h), and the job's budget.
 *
 * A job's history is the list of distinct (sample rate q, noise multiplier
 * sigma) pairs with a step count each (what Opacus' RDPAccountant keeps);
 * the RDP curve is sum(count * rdp(q, sigma)) over it, recomputed from the
 * history at each change, so adding and refunding steps never drifts.
 *
 * Persistence: one small text file per job under the ledger directory,
 * "<uid>-<hex of job id>.ledger", replaced atomically (written to a temp
 * file, fsync'd, renamed over the old one, directory fsync'd): a crash leaves
 * either the old or the new file, never a torn one. A lock file keeps two
 * daemons from sharing a directory.
 *
 * Threads: a dc_ledger and its jobs belong to the loop thread. Only
 * dc_ledger_write_file is safe on another thread (it touches no ledger
 * state): the server serializes a job on the loop, writes it on a pool
 * thread, and records the generation it made durable back on the loop.
 *
 * Ownership: the ledger owns its jobs; jobs live until dc_ledger_close. */
#ifndef DC_LEDGER_H
#define DC_LEDGER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "accountant.h"
#include "dc_err.h"

#define DC_LEDGER_JOB_MAX 64 /* bytes of a job id, with its NUL (as the session keeps it) */

typedef struct dc_ledger_entry {
    double q, sigma;
    uint64_t steps;
    double rdp[DC_RDP_N_ORDERS]; /* of one step */
} dc_ledger_entry;

typedef struct dc_ledger_waiter dc_ledger_waiter;

typedef struct dc_ledger_job {
    struct dc_ledger_job *next;
    uint32_t uid;
    char job[DC_LEDGER_JOB_MAX];
    uint64_t steps;               /* all entries' steps */
    double delta;                 /* the job's delta: eps is reported at it */
    double budget_eps;            /* the job's own budget at `delta`; 0 = none */
    dc_ledger_entry *hist;
    size_t n_hist, cap_hist;
    double rdp[DC_RDP_N_ORDERS];  /* composed over the history */
    double eps, best_order;       /* at delta, kept current */
    int sessions;                 /* live sessions naming this job */

    /* Durability, driven by the server (loop thread). gen counts changes;
     * saved_gen is the last one on disk. */
    uint64_t gen, saved_gen;
    bool writing, dirty;
    dc_ledger_waiter *waiters;
} dc_ledger_job;

/* Something waiting for a job's state (as of generation `gen`) to be on
 * disk: a step that may not start before its spend is durable. */
struct dc_ledger_waiter {
    dc_ledger_waiter *next;
    uint64_t gen;
    void (*done)(dc_ledger_waiter *w, int rc, const dc_err *err);
};

typedef struct dc_ledger {
    char dir[256];                /* "" = in memory only */
    int lock_fd;
    double default_delta;
    dc_ledger_job *jobs;
    size_t n_jobs;
    /* Recently computed per-step RDP curves, so a new job (or a session
     * that changes q or sigma back and forth) rarely recomputes one. */
    dc_ledger_entry cache[8];
    size_t n_cache, next_cache;
} dc_ledger;

/* Opens (creating it, mode 0750) and locks the directory and loads every job
 * file in it; dir "" makes an in-memory ledger. A corrupt job file is an
 * error naming it: the daemon must not start believing a job spent nothing. */
int dc_ledger_open(dc_ledger *l, const char *dir, double default_delta, dc_err *err);
void dc_ledger_close(dc_ledger *l);
static inline bool dc_ledger_persistent(const dc_ledger *l) { return l->dir[0] != '\0'; }

/* The job, created (in memory) when absent; NULL only when out of memory. */
dc_ledger_job *dc_ledger_job_get(dc_ledger *l, uint32_t uid, const char *job);
dc_ledger_job *dc_ledger_job_find(dc_ledger *l, uint32_t uid, const char *job);

/* The job's eps at `delta` if one more step (q, sigma) were added. */
double dc_ledger_eps_after(dc_ledger *l, const dc_ledger_job *j, double q, double sigma,
                           double delta);
/* The job's eps now at `delta` (any delta, not only the job's). */
double dc_ledger_eps_at(const dc_ledger_job *j, double delta, double *best_order);

/* Adds one step (bumps gen). Fails only when out of memory. */
int dc_ledger_spend(dc_ledger *l, dc_ledger_job *j, double q, double sigma, dc_err *err);
/* Takes back one step of (q, sigma) that was spent and then not released
 * (the step failed before writing anything). Bumps gen. */
void dc_ledger_refund(dc_ledger_job *j, double q, double sigma);
/* Sets the job's delta and lowers (never raises) its budget; 0 leaves
 * either unchanged. Bumps gen when something changed. */
void dc_ledger_job_terms(dc_ledger_job *j, double delta, double budget_eps);

/* The job's file contents (malloc'd, NUL-terminated) and its path. */
int dc_ledger_serialize(const dc_ledger_job *j, char **out, size_t *len);
void dc_ledger_job_path(const dc_ledger *l, const dc_ledger_job *j, char *out, size_t n);
/* Replaces `path` with buf crash-safely (temp, fsync, rename, fsync dir).
 * Thread-safe: no ledger state involved. */
int dc_ledger_write_file(const char *path, const char *buf, size_t len, dc_err *err);
/* Synchronous save of one job (serialize + write) and its saved_gen. */
int dc_ledger_save(dc_ledger *l, dc_ledger_job *j, dc_err *err);

#endif
