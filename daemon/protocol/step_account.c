#include "step_account.h"

#include <math.h>
#include <stddef.h>

int dc_step_account_check(dc_step_job *j, const dc_config *c, dc_err *e) {
    const struct dc_step_params *m = &j->params;
    double q = m->sample_rate;

    if (!(q >= 0.0 && q <= 1.0))
        return dc_err_set(e, DC_EINVAL, "clip_step.sample_rate",
                          "sample rate %g is not in [0, 1]", q);
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
    j->q = q;
    j->sigma = (double)j->step.noise_multiplier;
    if (j->params.dp.declared) {
        /* a logical step's members are charged at the job's sigma, whoever
         * of them adds the noise */
        if (dc_ledger_dp_check(&j->params.dp, j->sigma, e)) return e->code;
        j->sigma = j->params.dp.sigma;
    }
    return 0;
}

int dc_step_account_terms(dc_step_job *j, dc_ledger_job *job, dc_err *e) {
    return dc_ledger_job_terms(job, j->params.target_delta, j->params.target_epsilon, e);
}

/* The curve of a (q, sigma) pair the ledger had not seen lately is ready. */
static void on_curve(dc_ledger_waiter *w, int rc, const dc_err *err) {
    dc_step_job *j = (dc_step_job *)((char *)w - offsetof(dc_step_job, wait));
    (void)rc;
    (void)err;
    j->resume(j, 0, NULL);
}

bool dc_step_account_curve(dc_step_job *j, dc_ledger_job *job, uv_loop_t *loop,
                           dc_step_cb resume) {
    if (j->sigma <= 0 || dc_ledger_has_curve(job->ledger, job, j->q, j->sigma)) return false;
    /* Its curve costs 0.1-3 ms: computed off the loop while the step waits. */
    j->resume = resume;
    j->wait.done = on_curve;
    dc_ledger_curve_async(job->ledger, loop, j->q, j->sigma, &j->wait);
    return true;
}

/* One step of (j->q, j->sigma) spent in the job, unless a budget refuses it. */
static int spend(dc_step_job *j, dc_ledger_job *job, const dc_config *c, dc_metrics *m,
                 dc_err *e) {
    double q = j->q, sigma = j->sigma, eps;

    if (job->budget_eps > 0 &&
        (eps = dc_ledger_eps_after(job->ledger, job, q, sigma, job->delta)) > job->budget_eps) {
        m->budget_refusals++;
        dc_ledger_persist(job, NULL); /* the terms, if they changed */
        return dc_err_set(e, DC_ENOSPACE, "clip_step.target_epsilon",
                          "job '%s' (uid %u) has spent epsilon %.4g at delta %g in %llu steps; "
                          "this step would bring it to %.4g, over the job's budget of %.4g: "
                          "refused before any work",
                          job->job, job->uid, job->eps, job->delta,
                          (unsigned long long)job->steps, eps, job->budget_eps);
    }
    if (c->budget_epsilon > 0 &&
        (eps = dc_ledger_eps_after(job->ledger, job, q, sigma, c->budget_delta)) >
            c->budget_epsilon) {
        m->budget_refusals++;
        dc_ledger_persist(job, NULL);
        return dc_err_set(e, DC_ENOSPACE, "ledger.budget_epsilon",
                          "job '%s' (uid %u): this step would bring epsilon at delta %g to "
                          "%.4g, over this node's per-job budget of %.4g (ledger.budget_epsilon): "
                          "refused before any work",
                          job->job, job->uid, c->budget_delta, eps, c->budget_epsilon);
    }
    return dc_ledger_spend(job->ledger, job, q, sigma, e) ? e->code : 0;
}

/* The terms a data-parallel logical step's members share (ledger.h). */
static dc_dp_terms dp_terms(const dc_step_job *j) {
    const dc_step *st = &j->step;
    dc_dp_terms t = {j->q, st->noise_norm > 0.0f ? st->noise_norm : st->max_grad_norm, 1};
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
static int charge_member(dc_step_job *j, dc_ledger_job *job, const dc_config *c,
                         dc_metrics *m, dc_step_charge *kind, dc_err *e) {
    const double own = (double)j->step.noise_multiplier;
    const dc_dp_terms t = dp_terms(j);
    dc_dp_plan plan;

    if (dc_ledger_dp_plan(job, &j->params.dp, own, &t, &plan, e)) return e->code;
    if (plan.charge && spend(j, job, c, m, e)) return e->code;
    dc_ledger_dp_commit(job, &j->params.dp, own, &t, &plan);
    /* every member waits for its logical step's charge to be durable */
    j->ljob = job;
    *kind = j->params.dp.role == DC_DP_CHARGED  ? DC_STEP_CHARGED
            : j->params.dp.role == DC_DP_SHARE ? DC_STEP_SHARE
                                               : DC_STEP_COVERED;
    return 0;
}

int dc_step_account_charge(dc_step_job *j, dc_ledger_job *job, bool group_member,
                           const dc_config *c, dc_metrics *m, dc_step_charge *kind,
                           dc_err *e) {
    int rc;

    *kind = DC_STEP_CHARGED;
    if (j->params.dp.declared) {
        rc = charge_member(j, job, c, m, kind, e);
    } else if (group_member) {
        /* A norm group's step is one logical step: rank 0 is charged for it,
         * and every member's step waits for rank 0's (the group fails the
         * step on all if rank 0's is refused). */
        *kind = DC_STEP_COVERED;
        rc = 0;
    } else if ((rc = spend(j, job, c, m, e)) == 0) {
        /* sigma 0 included: a noiseless step that is no data-parallel
         * member is charged as what it is (epsilon infinite) */
        j->ljob = job;
    }
    if (rc) return rc;
    j->eps = job->eps;
    j->delta = job->delta;
    return 0;
}

void dc_step_account_refund(dc_step_job *j) {
    if (!j->ljob) return;
    if (j->params.dp.declared &&
        (j->params.dp.role != DC_DP_CHARGED || !dc_ledger_dp_unwind(j->ljob, &j->params.dp))) {
        j->ljob = NULL; /* covered, or its charge covers another member too */
        return;
    }
    dc_ledger_refund(j->ljob, j->q, j->sigma);
    dc_ledger_persist(j->ljob, NULL);
    j->ljob = NULL;
}

static int not_recorded(dc_err *e, const char *why) {
    return dc_err_set(e, DC_EUNAVAIL, "ledger", "the privacy ledger could not record this "
                      "step's spend, so the step was not run: %s", why);
}

/* The spend is on disk (or could not be written). */
static void on_spend_durable(dc_ledger_waiter *w, int rc, const dc_err *err) {
    dc_step_job *j = (dc_step_job *)((char *)w - offsetof(dc_step_job, wait));
    dc_err e;

    if (j->waiting_sync) {
        /* Called from within dc_step_account_durable, which answers: the
         * session never processes requests re-entrantly. */
        j->sync_done = true;
        j->sync_rc = rc;
        if (err) j->sync_err = *err;
        return;
    }
    if (rc == 0) {
        j->resume(j, 0, NULL);
        return;
    }
    /* Without a durable record the step must not release anything. */
    dc_step_account_refund(j);
    j->resume(j, not_recorded(&e, err ? err->msg : "write failed"), &e);
}

int dc_step_account_durable(dc_step_job *j, dc_step_cb resume, bool *wait, dc_err *e) {
    uint64_t gen;
    *wait = false;
    if (!j->ljob || !dc_ledger_persistent(j->ljob->ledger)) return 0;
    /* a data-parallel member: the charge of its logical step, whoever made it */
    gen = j->params.dp.declared ? j->params.dp.gen : j->ljob->gen;
    if (j->ljob->saved_gen >= gen) return 0;
    j->resume = resume;
    j->wait.gen = gen;
    j->wait.done = on_spend_durable;
    j->waiting_sync = true;
    dc_ledger_persist(j->ljob, &j->wait); /* usually completes later */
    j->waiting_sync = false;
    if (!j->sync_done) {
        *wait = true;
        return 0;
    }
    if (j->sync_rc) { /* failed at once (out of memory) */
        dc_step_account_refund(j);
        return not_recorded(e, j->sync_err.msg);
    }
    return 0;
}
