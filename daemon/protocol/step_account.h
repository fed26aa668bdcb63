/* The stage that accounts: a step's privacy spend in its account of the
 * ledger (the session's uid and job id), decided on the loop before any
 * work.
 *   1. check: the step's sample rate, delta and budget are in range (a step
 *      that states no sample rate counts as q = 1, or is refused under
 *      ledger.require_sample_rate);
 *   2. terms: the account's delta (fixed by its first step) and budget;
 *   3. curve: a (q, sigma) pair the ledger has no curve for waits while
 *      libuv's pool computes it;
 *   4. charge: refused (RESOURCE_EXHAUSTED, naming the budget) if it would
 *      take the account past its own budget or the node's; otherwise the
 *      spend is recorded. A norm group's member other than rank 0 is
 *      covered by rank 0's charge. A step that declares
 *      ClipStep.data_parallel is a member of a logical step of its account
 *      (ledger.h, ledger_dp.c): the first member charges it at the
 *      account's sigma, the others are covered (a noiseless one: a share),
 *      whatever their group. A sigma-0 step
 *      that declares nothing is charged as no privacy;
 *   5. durable: with a persistent ledger the step waits until its spend is
 *      on disk: its noised outputs reach the trainer's memory as soon as it
 *      runs, so its cost must already be recorded if the daemon dies right
 *      after. A data-parallel member covered by another's charge waits for
 *      that charge likewise.
 * A step that fails writes no output. If it failed before anything depended
 * on its noise (a non-finite input, ...) it released nothing and its spend
 * is refunded; one that failed once noised (an output beyond its dtype's
 * range) or after writing its outputs has released something and stays
 * charged (dc_step_result.released).
 *
 * The session (session_step.c) calls these in order; where one waits, the
 * session's `resume` is called on the loop when it is over. Refusals name
 * the field or setting. */
#ifndef DC_STEP_ACCOUNT_H
#define DC_STEP_ACCOUNT_H

#include <stdbool.h>
#include <uv.h>

#include "host.h"
#include "ledger.h"
#include "metrics.h"
#include "step_call.h"

/* What the charge did with a step, for its caller (a norm group's leader
 * covers its members only where it charged). */
typedef enum dc_step_charge {
    DC_STEP_CHARGED = 1, /* the account was charged for it */
    DC_STEP_COVERED,     /* covered by another step's charge (a group's rank 0, or
                          * a data-parallel member that adds noise) */
    DC_STEP_SHARE        /* a noiseless data-parallel member, covered by its
                          * logical step's charge */
} dc_step_charge;

/* 1. sc->params against their ranges and c; sets sc->q and sc->sigma (what
 * the ledger charges: the step's noise multiplier, or for a data-parallel
 * member the account's, data_parallel.noise_multiplier). */
int dc_step_account_check(dc_step_call *sc, const dc_host_cfg *c, dc_err *e);
/* 2. The step's delta and budget set on the account. */
int dc_step_account_terms(dc_step_call *sc, dc_ledger_account *acct, dc_err *e);
/* 3. false: the curve of (sc->q, sc->sigma) is at hand. true: it is being
 * computed; resume(sc, 0, NULL) follows on the loop. */
bool dc_step_account_curve(dc_step_call *sc, dc_ledger_account *acct, uv_loop_t *loop,
                           dc_step_cb resume);
/* 4. The charge: *kind says what it was; sc->eps and sc->delta are the
 * account's after it; sc->account is set where the step charged the
 * account, and for every data-parallel member (sc->params.dp then holds
 * its logical step and role). group_member: a norm group's member other
 * than rank 0 (ignored for a data-parallel member). Budget refusals are
 * counted in m. */
int dc_step_account_charge(dc_step_call *sc, dc_ledger_account *acct, bool group_member,
                           const dc_host_cfg *c, dc_metrics *m, dc_step_charge *kind, dc_err *e);
/* 5. 0 and *wait false: nothing to wait for (in memory, or already on
 * disk); 0 and *wait true: resume(sc, rc, err) follows on the loop, with an
 * error (UNAVAILABLE, field "ledger") if the write failed, the spend then
 * refunded. An error now: the write failed at once; refunded. */
int dc_step_account_durable(dc_step_call *sc, dc_step_cb resume, bool *wait, dc_err *e);
/* The spend goes back (the step released nothing); a step not charged is
 * left as it is, and so is the charge of a data-parallel logical step
 * another member has taken. */
void dc_step_account_refund(dc_step_call *sc);

#endif
