/* Internals shared by ledger.c (accounts and accounting) and ledger_file.c
 * (the job files, opening and closing a ledger). Loop thread only. */
#ifndef DC_LEDGER_INT_H
#define DC_LEDGER_INT_H

#include "ledger.h"

/* The per-step curve of (q, sigma): the job's history (j may be NULL), the
 * cache, or computed on the calling thread and cached. */
const double *dc_ledger_curve(dc_ledger *l, const dc_ledger_job *j, double q, double sigma);
/* The job's steps, RDP curve and eps from its folded sum and history. */
void dc_ledger_recompute(dc_ledger_job *j);
/* A history entry for (q, sigma) with zero steps (folding the oldest one if
 * the history is full); NULL when out of memory. */
dc_ledger_entry *dc_ledger_add_entry(dc_ledger *l, dc_ledger_job *j, double q, double sigma);
/* A new empty account in memory (no checks); NULL when out of memory. */
dc_ledger_job *dc_ledger_job_new(dc_ledger *l, uint32_t uid, const char *job);
/* Reads the file of (uid, job) back: *out is the account, or NULL when it
 * has no file. An error names the file. */
int dc_ledger_load_job(dc_ledger *l, uint32_t uid, const char *job, dc_ledger_job **out,
                       dc_err *err);
/* Frees every account. */
void dc_ledger_drop_jobs(dc_ledger *l);

#endif
