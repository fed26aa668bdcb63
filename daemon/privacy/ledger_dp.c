/* Data-parallel logical steps (ledger.h): which member of which logical
 * step a data-parallel rank's step is, and whether it charges the step or
 * is covered by the charge another member made.
 *
 * Why members are numbered: the daemon cannot see the trainers' all-reduce,
 * so it cannot check that a noiseless sum is ever added to a noised one.
 * What it can bound is how many noiseless sums each charge pays for: at
 * most W - 1 per logical step, one per rank, every logical step charged
 * once at the account's sigma. A rank's steps take increasing numbers (its
 * next one unless it names a later one), so no rank is in one logical step
 * twice, whatever sessions it opens; a number no open step has is a new
 * logical step, charged by whoever comes first, so being first, coming
 * late (past the window) or after a restart never releases anything
 * uncharged. The numbers an account has charged are on disk (their highest),
 * and after a restart every rank goes on above it. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "ledger.h"

#define DP_STEP_MAX (UINT64_C(1) << 63) /* step numbers stay below, so next never wraps */

int dc_ledger_dp_check(const dc_dp_member *m, double step_sigma, dc_err *err) {
    if (m->world < 2 || m->world > DC_LEDGER_DP_WORLD_MAX)
        return dc_err_set(err, DC_EINVAL, "clip_step.data_parallel.world",
                          "a data-parallel job has 2 to %d ranks; %u given", DC_LEDGER_DP_WORLD_MAX,
                          m->world);
    if (m->rank >= m->world)
        return dc_err_set(err, DC_EINVAL, "clip_step.data_parallel.rank",
                          "rank %u is not in [0, %u)", m->rank, m->world);
    if (!(m->sigma > 0 && isfinite(m->sigma)))
        return dc_err_set(err, DC_EINVAL, "clip_step.data_parallel.noise_multiplier",
                          "the job's noise multiplier, added once per logical step by one of its "
                          "members, must be finite and > 0 (%g given)",
                          m->sigma);
    if (m->step >= DP_STEP_MAX)
        return dc_err_set(err, DC_EINVAL, "clip_step.data_parallel.step",
                          "logical step numbers are below 2^63");
    if (step_sigma != 0.0 && step_sigma < m->sigma)
        return dc_err_set(
            err, DC_EINVAL, "clip_step.noise_multiplier",
            "a member of a data-parallel logical step adds its noise, at least the "
            "job's noise multiplier (data_parallel.noise_multiplier %g), or none (0); "
            "%g would be charged as %g while adding less",
            m->sigma, step_sigma, m->sigma);
    return 0;
}

static dc_ledger_dp_open *find_open(dc_ledger_dp *dp, uint64_t step) {
    for (size_t i = 0; i < dp->n_open; i++)
        if (dp->open[i].step == step) return &dp->open[i];
    return NULL;
}

static void close_open(dc_ledger_dp *dp, dc_ledger_dp_open *o) { *o = dp->open[--dp->n_open]; }

/* A slot for a newly charged logical step: with the window full, the
 * oldest open step's place (a member of it that comes later charges it
 * again: more than it owes, never less). */
static dc_ledger_dp_open *new_open(dc_ledger_dp *dp) {
    size_t o = 0;
    if (dp->n_open < DC_LEDGER_DP_WINDOW) return &dp->open[dp->n_open++];
    for (size_t i = 1; i < dp->n_open; i++)
        if (dp->open[i].step < dp->open[o].step) o = i;
    return &dp->open[o];
}

/* next[0, n) for ranks that have taken nothing since the account's highest
 * step on record. */
static int size_next(dc_ledger_dp *dp, uint32_t n) {
    uint64_t *p;
    if (dp->cap_next >= n) return 0;
    if (!(p = realloc(dp->next, n * sizeof *p))) return -1;
    for (uint32_t r = dp->cap_next; r < n; r++) p[r] = dp->newest + 1;
    dp->next = p;
    dp->cap_next = n;
    return 0;
}

static dc_ledger_dp *dp_of(dc_ledger_account *acct) {
    if (!acct->dp) acct->dp = calloc(1, sizeof *acct->dp);
    return acct->dp;
}

int dc_ledger_dp_plan(dc_ledger_account *acct, const dc_dp_member *m, double step_sigma,
                      const dc_dp_terms *t, dc_dp_plan *plan, dc_err *err) {
    dc_ledger_dp *dp = dp_of(acct);
    const dc_ledger_dp_open *o;
    uint64_t next;

    if (!dp) return dc_err_set(err, DC_ENOSPACE, "ledger", "out of memory for the ledger");
    if (dp->world && m->world != dp->world)
        return dc_err_set(err, DC_EPRECOND, "clip_step.data_parallel.world",
                          "job '%s' (uid %u) has %u data-parallel ranks, fixed by its first "
                          "data-parallel step; a step cannot declare %u (use a new job id)",
                          acct->job_id, acct->uid, dp->world, m->world);
    if (dp->world && m->sigma != dp->sigma)
        return dc_err_set(err, DC_EPRECOND, "clip_step.data_parallel.noise_multiplier",
                          "job '%s' (uid %u) charges each logical step at noise multiplier %g, "
                          "fixed by its first data-parallel step; a step cannot declare %g (use "
                          "a new job id)",
                          acct->job_id, acct->uid, dp->sigma, m->sigma);
    if (size_next(dp, m->world))
        return dc_err_set(err, DC_ENOSPACE, "ledger", "out of memory for the ledger");
    next = dp->next[m->rank];
    if (m->step && m->step < next)
        return dc_err_set(err, DC_EPRECOND, "clip_step.data_parallel.step",
                          "rank %u of job '%s' (uid %u) has taken logical steps below %llu (the "
                          "job's numbers go on above %llu, its highest charged, after a restart): "
                          "each rank takes a logical step once, so %llu is refused; 0 takes the "
                          "rank's next",
                          m->rank, acct->job_id, acct->uid, (unsigned long long)next,
                          (unsigned long long)dp->newest, (unsigned long long)m->step);
    plan->step = m->step ? m->step : next;
    if (plan->step >= DP_STEP_MAX) /* a rank that named 2^63 - 1 has no next */
        return dc_err_set(err, DC_EPRECOND, "clip_step.data_parallel.step",
                          "rank %u of job '%s' (uid %u) has no logical step left below 2^63",
                          m->rank, acct->job_id, acct->uid);
    plan->charge = !(o = find_open(dp, plan->step));
    if (plan->charge) return 0;
    if (t->q != o->terms.q)
        return dc_err_set(err, DC_EPRECOND, "clip_step.sample_rate",
                          "logical step %llu of job '%s' was charged at sample rate %g; its every "
                          "member states that rate (this one: %g)",
                          (unsigned long long)o->step, acct->job_id, o->terms.q, t->q);
    if (t->c != o->terms.c)
        return dc_err_set(err, DC_EPRECOND, "clip_step.clip.max_grad_norm",
                          "logical step %llu of job '%s' is noised for a clipping norm of %g; a "
                          "member clipping to %g would not be covered by that noise",
                          (unsigned long long)o->step, acct->job_id, o->terms.c, t->c);
    if (t->divisor != o->terms.divisor)
        return dc_err_set(err, DC_EPRECOND, "clip_step.clip.expected_batch_size",
                          "logical step %llu of job '%s' divides its noised sum by %u; every "
                          "member divides by the same (this one: %u)",
                          (unsigned long long)o->step, acct->job_id, o->terms.divisor, t->divisor);
    if (step_sigma == 0.0 && o->noiseless + 1 >= dp->world)
        return dc_err_set(err, DC_EPRECOND, "clip_step.noise_multiplier",
                          "logical step %llu of job '%s' has %u noiseless members already: the "
                          "last of its %u ranks must add the noise (noise_multiplier at least "
                          "%g)",
                          (unsigned long long)o->step, acct->job_id, o->noiseless, dp->world,
                          dp->sigma);
    return 0;
}

void dc_ledger_dp_commit(dc_ledger_account *acct, dc_dp_member *m, double step_sigma,
                         const dc_dp_terms *t, const dc_dp_plan *plan) {
    dc_ledger_dp *dp = acct->dp;
    dc_ledger_dp_open *o;

    if (!dp->world) {
        dp->world = m->world;
        dp->sigma = m->sigma;
    }
    dp->next[m->rank] = plan->step + 1;
    if (plan->charge) {
        o = new_open(dp);
        o->step = plan->step;
        o->gen = acct->gen; /* the spend's */
        o->terms = *t;
        o->members = o->noiseless = 0;
        if (plan->step > dp->newest) dp->newest = plan->step;
        m->role = DC_DP_CHARGED;
    } else {
        o = find_open(dp, plan->step);
        m->role = step_sigma == 0.0 ? DC_DP_SHARE : DC_DP_COVERED;
    }
    m->step = plan->step;
    m->gen = o->gen;
    o->members++;
    if (step_sigma == 0.0) {
        o->noiseless++;
        acct->shares++;
    }
    if (o->members >= dp->world) close_open(dp, o); /* every rank is in */
}

bool dc_ledger_dp_unwind(dc_ledger_account *acct, const dc_dp_member *m) {
    dc_ledger_dp_open *o = acct->dp ? find_open(acct->dp, m->step) : NULL;
    if (!o || o->members != 1) return false;
    close_open(acct->dp, o);
    return true;
}

int dc_ledger_dp_restore(dc_ledger_account *acct, uint32_t world, double sigma, uint64_t newest) {
    dc_ledger_dp *dp = dp_of(acct);
    if (!dp) return -1;
    dp->world = world;
    dp->sigma = sigma;
    dp->newest = newest;
    return size_next(dp, world);
}

void dc_ledger_dp_free(dc_ledger_account *acct) {
    if (!acct->dp) return;
    free(acct->dp->next);
    free(acct->dp);
    acct->dp = NULL;
}
