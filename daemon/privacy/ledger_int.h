/* Internals shared by ledger.c (accounts and accounting) and ledger_file.c
 * (the account files, opening and closing a ledger). Loop thread only. */
#ifndef DC_LEDGER_INT_H
#define DC_LEDGER_INT_H

#include "ledger.h"

/* The per-step curve of (q, sigma): the account's history (acct may be NULL),
 * the cache, or computed on the calling thread and cached. */
const double *dc_ledger_curve(dc_ledger *l, const dc_ledger_account *acct, double q, double sigma);
/* The account's steps, RDP curve and eps from its folded sum and history. */
void dc_ledger_recompute(dc_ledger_account *acct);
/* A history entry for (q, sigma) with zero steps (folding the oldest one if
 * the history is full); NULL when out of memory. */
dc_ledger_entry *dc_ledger_add_entry(dc_ledger *l, dc_ledger_account *acct, double q, double sigma);
/* A new empty account in memory (no checks); NULL when out of memory. */
dc_ledger_account *dc_ledger_account_new(dc_ledger *l, uint32_t uid, const char *job_id);
/* Reads the file of (uid, job id) back: *out is the account, or NULL when it
 * has no file. An error names the file. */
int dc_ledger_load_account(dc_ledger *l, uint32_t uid, const char *job_id, dc_ledger_account **out,
                           dc_err *err);
/* Frees every account. */
void dc_ledger_drop_accounts(dc_ledger *l);

#endif
