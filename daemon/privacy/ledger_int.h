/* Internals shared by ledger.c (accounts and accounting) and ledger_file.c
 * (the account files, opening and closing a ledger, opening an account),
 * which builds on ledger.c. Loop thread only. */
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
/* How many accounts uid holds in memory, after dropping, at the cap, those
 * of uid that nothing uses and that lose nothing by going (never spent, or
 * on disk: read back when named), whatever their idle time. */
size_t dc_ledger_make_room(dc_ledger *l, uint32_t uid);
/* Frees every account. */
void dc_ledger_drop_accounts(dc_ledger *l);

#endif
