#include "step_account.h"

#include <math.h>
#include <stddef.h>

int dc_step_account_check(dc_step_call *sc, const dc_host_cfg *c, dc_err *e) {
    const struct dc_step_params *m = &sc->params;
    double q = m->sample_rate;

    if (!(q >= 0.0 && q <= 1.0))
        return dc_err_set(e, DC_EINVAL, "clip_step.sample_rate", "sample rate %g is not in [0, 1]",
                          q);
    if (!(m->target_delta >= 0.0 && m->target_delta < 1.0))
        return dc_err_set(e, DC_EINVAL, "clip_step.target_delta", "delta %g is not in [0, 1)",
                          m->target_delta);
    if (!(m->target_epsilon >= 0.0 && isfinite(m->target_epsilon)))
        return dc_err_set(e, DC_EINVAL, "clip_step.target_epsilon",
                          "budget %g is not a finite epsilon >= 0", m->target_epsilon);
    if (q == 0.0) {
        if (c->require_sample_rate)
            return dc_err_set(e, DC_EPRECOND, "clip_step.sample_rate",
                              "this daemon requires every step to state its sample rate "
                              "(ledger.require_sample_rate)");
        q = 1.0; /* unknown sampling: no amplification may be assumed */
    }
    sc->q = q;
    sc->sigma = (double)sc->step.noise_multiplier;
    if (sc->params.dp.declared) {
        /* a logical step's members are charged at the account's sigma,
         * whoever of them adds the noise */
        if (dc_ledger_dp_check(&sc->params.dp, sc->sigma, e)) return e->code;
        sc->sigma = sc->params.dp.sigma;
    }
    return 0;
}

int dc_step_account_terms(dc_step_call *sc, dc_ledger_account *acct, dc_err *e) {
    return dc_ledger_account_terms(acct, sc->params.target_delta, sc->params.target_epsilon, e);
}

/* The curve of a (q, sigma) pair the ledger had not seen lately is ready. */
static void on_curve(dc_ledger_waiter *w, int rc, const dc_err *err) {
    dc_step_call *sc = (dc_step_call *)((char *)w - offsetof(dc_step_call, wait));
    (void)rc;
    (void)err;
    sc->resume(sc, 0, NULL);
}

bool dc_step_account_curve(dc_step_call *sc, dc_ledger_account *acct, uv_loop_t *loop,
                           dc_step_cb resume) {
    if (sc->sigma <= 0 || dc_ledger_has_curve(acct->ledger, acct, sc->q, sc->sigma)) return false;
    /* Its curve costs 0.1-3 ms: computed off the loop while the step waits. */
    sc->resume = resume;
    sc->wait.done = on_curve;
    dc_ledger_curve_async(acct->ledger, loop, sc->q, sc->sigma, &sc->wait);
    return true;
}

/* One step of (sc->q, sc->sigma) spent in the account, unless a budget
 * refuses it. */
static int spend(dc_step_call *sc, dc_ledger_account *acct, const dc_host_cfg *c, dc_metrics *m,
                 dc_err *e) {
    double q = sc->q, sigma = sc->sigma, eps;

    if (acct->budget_eps > 0 &&
        (eps = dc_ledger_eps_after(acct->ledger, acct, q, sigma, acct->delta)) > acct->budget_eps) {
        m->budget_refusals++;
        dc_ledger_persist(acct, NULL); /* the terms, if they changed */
        return dc_err_set(e, DC_ENOSPACE, "clip_step.target_epsilon",
                          "job '%s' (uid %u) has spent epsilon %.4g at delta %g in %llu steps; "
                          "this step would bring it to %.4g, over the job's budget of %.4g: "
                          "refused before any work",
                          acct->job_id, acct->uid, acct->eps, acct->delta,
                          (unsigned long long)acct->steps, eps, acct->budget_eps);
    }
    if (c->budget_epsilon > 0 && (eps = dc_ledger_eps_after(acct->ledger, acct, q, sigma,
                                                            c->budget_delta)) > c->budget_epsilon) {
        m->budget_refusals++;
        dc_ledger_persist(acct, NULL);
        return dc_err_set(e, DC_ENOSPACE, "ledger.budget_epsilon",
                          "job '%s' (uid %u): this step would bring epsilon at delta %g to "
                          "%.4g, over this node's per-job budget of %.4g (ledger.budget_epsilon): "
                          "refused before any work",
                          acct->job_id, acct->uid, c->budget_delta, eps, c->budget_epsilon);
    }
    return dc_ledger_spend(acct->ledger, acct, q, sigma, e) ? e->code : 0;
}

/* The terms a data-parallel logical step's members share (ledger.h). */
static dc_dp_terms dp_terms(const dc_step_call *sc) {
    const dc_step *st = &sc->step;
    dc_dp_terms t = {sc->q, st->noise_norm > 0.0f ? st->noise_norm : st->max_grad_norm, 1};
    if (st->mode == DC_CLIP_PER_LAYER) {
        double c2 = 0.0;
        for (size_t l = 0; l < st->n_layers; l++)
            c2 += (double)st->layers[l].max_grad_norm * st->layers[l].max_grad_norm;
        t.c = sqrt(c2);
    }
    if (st->reduction == DC_REDUCTION_MEAN) t.divisor = st->expected_batch;
    return t;
}

/* A data-parallel member: charges its logical step if it is the first,
 * else is covered by the charge. */
static int charge_member(dc_step_call *sc, dc_ledger_account *acct, const dc_host_cfg *c,
                         dc_metrics *m, dc_step_charge *kind, dc_err *e) {
    const double own = (double)sc->step.noise_multiplier;
    const dc_dp_terms t = dp_terms(sc);
    dc_dp_plan plan;

    if (dc_ledger_dp_plan(acct, &sc->params.dp, own, &t, &plan, e)) return e->code;
    if (plan.charge && spend(sc, acct, c, m, e)) return e->code;
    dc_ledger_dp_commit(acct, &sc->params.dp, own, &t, &plan);
    /* every member waits for its logical step's charge to be durable */
    sc->account = acct;
    *kind = sc->params.dp.role == DC_DP_CHARGED ? DC_STEP_CHARGED
            : sc->params.dp.role == DC_DP_SHARE ? DC_STEP_SHARE
                                                : DC_STEP_COVERED;
    return 0;
}

int dc_step_account_charge(dc_step_call *sc, dc_ledger_account *acct, bool group_member,
                           const dc_host_cfg *c, dc_metrics *m, dc_step_charge *kind, dc_err *e) {
    int rc;

    *kind = DC_STEP_CHARGED;
    if (sc->params.dp.declared) {
        rc = charge_member(sc, acct, c, m, kind, e);
    } else if (group_member) {
        /* A norm group's step is one logical step: rank 0 is charged for it,
         * and every member's step waits for rank 0's (the group fails the
         * step on all if rank 0's is refused). */
        *kind = DC_STEP_COVERED;
        rc = 0;
    } else if ((rc = spend(sc, acct, c, m, e)) == 0) {
        /* sigma 0 included: a noiseless step that is no data-parallel
         * member is charged as what it is (epsilon infinite) */
        sc->account = acct;
    }
    if (rc) return rc;
    sc->eps = acct->eps;
    sc->delta = acct->delta;
    return 0;
}

void dc_step_account_refund(dc_step_call *sc) {
    if (!sc->account) return;
    if (sc->params.dp.declared && (sc->params.dp.role != DC_DP_CHARGED ||
                                   !dc_ledger_dp_unwind(sc->account, &sc->params.dp))) {
        sc->account = NULL; /* covered, or its charge covers another member too */
        return;
    }
    dc_ledger_refund(sc->account, sc->q, sc->sigma);
    dc_ledger_persist(sc->account, NULL);
    sc->account = NULL;
}

static int not_recorded(dc_err *e, const char *why) {
    return dc_err_set(e, DC_EUNAVAIL, "ledger",
                      "the privacy ledger could not record this "
                      "step's spend, so the step was not run: %s",
                      why);
}

/* The spend is on disk (or could not be written). */
static void on_spend_durable(dc_ledger_waiter *w, int rc, const dc_err *err) {
    dc_step_call *sc = (dc_step_call *)((char *)w - offsetof(dc_step_call, wait));
    dc_err e;

    if (sc->waiting_sync) {
        /* Called from within dc_step_account_durable, which answers: the
         * session never processes requests re-entrantly. */
        sc->sync_done = true;
        sc->sync_rc = rc;
        if (err) sc->sync_err = *err;
        return;
    }
    if (rc == 0) {
        sc->resume(sc, 0, NULL);
        return;
    }
    /* Without a durable record the step must not release anything. */
    dc_step_account_refund(sc);
    sc->resume(sc, not_recorded(&e, err ? err->msg : "write failed"), &e);
}

int dc_step_account_durable(dc_step_call *sc, dc_step_cb resume, bool *wait, dc_err *e) {
    uint64_t gen;
    *wait = false;
    if (!sc->account || !dc_ledger_persistent(sc->account->ledger)) return 0;
    /* a data-parallel member: the charge of its logical step, whoever made it */
    gen = sc->params.dp.declared ? sc->params.dp.gen : sc->account->gen;
    if (sc->account->saved_gen >= gen) return 0;
    sc->resume = resume;
    sc->wait.gen = gen;
    sc->wait.done = on_spend_durable;
    sc->waiting_sync = true;
    dc_ledger_persist(sc->account, &sc->wait); /* usually completes later */
    sc->waiting_sync = false;
    if (!sc->sync_done) {
        *wait = true;
        return 0;
    }
    if (sc->sync_rc) { /* failed at once (out of memory) */
        dc_step_account_refund(sc);
        return not_recorded(e, sc->sync_err.msg);
    }
    return 0;
}
