/* The ledger's accounts and their accounting: RDP curves (cached, computed
 * off the loop), the bounded history, spends, refunds, terms, and which
 * accounts stay in memory. The file format is in ledger_file.c. */
#include "ledger.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ledger_int.h"

/* --- RDP curves -------------------------------------------------------------- */

static const double *cache_find(const dc_ledger *l, double q, double sigma) {
    for (size_t i = 0; i < l->n_cache; i++)
        if (l->cache[i].q == q && l->cache[i].sigma == sigma) return l->cache[i].rdp;
    return NULL;
}

static dc_ledger_entry *find_entry(const dc_ledger_job *j, double q, double sigma) {
    for (size_t i = 0; i < j->n_hist; i++)
        if (j->hist[i].q == q && j->hist[i].sigma == sigma) return &j->hist[i];
    return NULL;
}

/* A computed curve into the cache (replacing the oldest entry). */
static const double *cache_put(dc_ledger *l, double q, double sigma, const double *rdp) {
    dc_ledger_entry *e = &l->cache[l->next_cache];
    l->next_cache = (l->next_cache + 1) % DC_LEDGER_CACHE;
    if (l->n_cache < DC_LEDGER_CACHE) l->n_cache++;
    e->q = q;
    e->sigma = sigma;
    e->steps = 0;
    memcpy(e->rdp, rdp, sizeof e->rdp);
    return e->rdp;
}

/* One step's curve. An order the accountant cannot bound (NaN: arguments
 * it refuses) counts as infinite, i.e. unusable for the conversion. */
static void compute_curve(double q, double sigma, double *out) {
    dc_rdp_steps(q, sigma, dc_rdp_default_orders(), DC_RDP_N_ORDERS, out);
    for (size_t k = 0; k < DC_RDP_N_ORDERS; k++)
        if (isnan(out[k])) out[k] = INFINITY;
}

/* The per-step curve of (q, sigma): from the job's history, the cache, or
 * computed here (and cached). */
const double *dc_ledger_curve(dc_ledger *l, const dc_ledger_job *j, double q, double sigma) {
    const dc_ledger_entry *e = j ? find_entry(j, q, sigma) : NULL;
    const double *c;
    double tmp[DC_RDP_N_ORDERS];
    if (e) return e->rdp;
    if ((c = cache_find(l, q, sigma))) return c;
    compute_curve(q, sigma, tmp);
    return cache_put(l, q, sigma, tmp);
}

bool dc_ledger_has_curve(const dc_ledger *l, const dc_ledger_job *j, double q, double sigma) {
    return (j && find_entry(j, q, sigma)) || cache_find(l, q, sigma);
}

static void calc_start(dc_ledger *l, uv_loop_t *loop);

static void calc_work(uv_work_t *req) {
    dc_ledger *l = req->data;
    compute_curve(l->calc_q, l->calc_sigma, l->calc_rdp);
}

static void calc_done(uv_work_t *req, int status) {
    dc_ledger *l = req->data;
    dc_ledger_waiter **pp = &l->calc_head, *ready = NULL, **rt = &ready;
    l->calc_busy = false;
    if (status == 0) cache_put(l, l->calc_q, l->calc_sigma, l->calc_rdp);
    /* Every waiter whose curve is now at hand goes, in order (a cancelled
     * computation: all of them, they compute it themselves). */
    l->calc_tail = NULL;
    while (*pp) {
        dc_ledger_waiter *w = *pp;
        if (status != 0 || cache_find(l, w->q, w->sigma)) {
            *pp = w->next;
            w->next = NULL;
            *rt = w;
            rt = &w->next;
        } else {
            l->calc_tail = w;
            pp = &w->next;
        }
    }
    if (l->calc_head) calc_start(l, req->loop);
    while (ready) {
        dc_ledger_waiter *w = ready;
        ready = w->next;
        w->next = NULL;
        w->done(w, 0, NULL);
    }
}

static void calc_start(dc_ledger *l, uv_loop_t *loop) {
    l->calc_busy = true;
    l->calc_q = l->calc_head->q;
    l->calc_sigma = l->calc_head->sigma;
    l->calc_req.data = l;
    if (uv_queue_work(loop, &l->calc_req, calc_work, calc_done) != 0) {
        /* Cannot happen with valid arguments; never leave a step waiting. */
        l->calc_req.loop = loop;
        calc_work(&l->calc_req);
        calc_done(&l->calc_req, 0);
    }
}

void dc_ledger_curve_async(dc_ledger *l, uv_loop_t *loop, double q, double sigma,
                           dc_ledger_waiter *w) {
    w->q = q;
    w->sigma = sigma;
    w->next = NULL;
    if (l->calc_tail) l->calc_tail->next = w;
    else l->calc_head = w;
    l->calc_tail = w;
    if (!l->calc_busy) calc_start(l, loop);
}

/* --- composition --------------------------------------------------------------- */

/* x rounded away from the true value towards +inf: the folded sum must never
 * understate what it holds, whatever rounding its additions met. */
static double up(double x) { return isfinite(x) && x != 0.0 ? nextafter(x, INFINITY) : x; }

void dc_ledger_recompute(dc_ledger_job *j) {
    const double *orders = dc_rdp_default_orders();
    j->steps = j->folded_steps;
    memcpy(j->rdp, j->folded, sizeof j->rdp);
    for (size_t i = 0; i < j->n_hist; i++) {
        const dc_ledger_entry *e = &j->hist[i];
        j->steps += e->steps;
        for (size_t k = 0; k < DC_RDP_N_ORDERS; k++) j->rdp[k] += (double)e->steps * e->rdp[k];
    }
    if (j->steps == 0) {
        /* As Opacus: an empty history has spent nothing. */
        j->eps = 0.0;
        j->best_order = NAN;
    } else {
        j->eps = dc_rdp_epsilon(orders, j->rdp, DC_RDP_N_ORDERS, j->delta, &j->best_order);
    }
}

double dc_ledger_eps_at(const dc_ledger_job *j, double delta, double *best_order) {
    if (j->steps == 0) {
        if (best_order) *best_order = NAN;
        return 0.0;
    }
    return dc_rdp_epsilon(dc_rdp_default_orders(), j->rdp, DC_RDP_N_ORDERS, delta, best_order);
}

double dc_ledger_eps_after(dc_ledger *l, const dc_ledger_job *j, double q, double sigma,
                           double delta) {
    const double *c = dc_ledger_curve(l, j, q, sigma);
    double tmp[DC_RDP_N_ORDERS];
    for (size_t k = 0; k < DC_RDP_N_ORDERS; k++) tmp[k] = j->rdp[k] + c[k];
    return dc_rdp_epsilon(dc_rdp_default_orders(), tmp, DC_RDP_N_ORDERS, delta, NULL);
}

/* The least recently used pair leaves the history: its steps stay in the
 * folded sum, so the history stays bounded whatever a client sends. */
static void fold_oldest(dc_ledger_job *j) {
    size_t o = 0;
    for (size_t i = 1; i < j->n_hist; i++)
        if (j->hist[i].used < j->hist[o].used) o = i;
    for (size_t k = 0; k < DC_RDP_N_ORDERS; k++)
        j->folded[k] = up(j->folded[k] + up((double)j->hist[o].steps * j->hist[o].rdp[k]));
    j->folded_steps += j->hist[o].steps;
    j->hist[o] = j->hist[j->n_hist - 1];
    j->n_hist--;
}

/* Appends an entry with a computed curve and zero steps. */
dc_ledger_entry *dc_ledger_add_entry(dc_ledger *l, dc_ledger_job *j, double q, double sigma) {
    dc_ledger_entry *e;
    const double *c = dc_ledger_curve(l, j, q, sigma);
    if (j->n_hist == DC_LEDGER_HIST_MAX) fold_oldest(j);
    if (j->n_hist == j->cap_hist) {
        size_t cap = j->cap_hist ? 2 * j->cap_hist : 2;
        dc_ledger_entry *h;
        if (cap > DC_LEDGER_HIST_MAX) cap = DC_LEDGER_HIST_MAX;
        if (!(h = realloc(j->hist, cap * sizeof *h))) return NULL;
        j->hist = h;
        j->cap_hist = cap;
    }
    e = &j->hist[j->n_hist];
    memcpy(e->rdp, c, sizeof e->rdp);
    e->q = q;
    e->sigma = sigma;
    e->steps = 0;
    e->used = j->gen;
    j->n_hist++;
    return e;
}

int dc_ledger_spend(dc_ledger *l, dc_ledger_job *j, double q, double sigma, dc_err *err) {
    dc_ledger_entry *e = find_entry(j, q, sigma);
    if (!e && !(e = dc_ledger_add_entry(l, j, q, sigma)))
        return dc_err_set(err, DC_ENOSPACE, "ledger", "out of memory for the ledger");
    e->steps++;
    e->used = ++j->gen;
    if (l->insecure) j->insecure = true;
    j->used_ns = uv_hrtime();
    dc_ledger_recompute(j);
    return 0;
}

void dc_ledger_refund(dc_ledger_job *j, double q, double sigma) {
    dc_ledger_entry *e = find_entry(j, q, sigma);
    if (e && e->steps > 0) {
        if (--e->steps == 0) *e = j->hist[--j->n_hist];
    } else if (j->folded_steps > 0) {
        /* Its pair was folded while the step ran. Rounded up again: the
         * sum keeps covering what stays in it. */
        const double *c = dc_ledger_curve(j->ledger, NULL, q, sigma);
        if (--j->folded_steps == 0) {
            memset(j->folded, 0, sizeof j->folded);
        } else {
            for (size_t k = 0; k < DC_RDP_N_ORDERS; k++)
                if (isfinite(j->folded[k]))
                    j->folded[k] = j->folded[k] > c[k] ? up(j->folded[k] - c[k]) : 0.0;
        }
    } else {
        return;
    }
    dc_ledger_recompute(j);
    j->gen++;
}

int dc_ledger_job_terms(dc_ledger_job *j, double delta, double budget_eps, dc_err *err) {
    bool changed = false;
    if (delta > 0 && delta != j->delta) {
        /* A delta fixed by the first step: a later, larger delta would make
         * the same spend look smaller and let a budget be overrun. */
        if (j->steps > 0)
            return dc_err_set(err, DC_EPRECOND, "clip_step.target_delta",
                              "job '%s' (uid %u) reports epsilon at delta %g, fixed by its first "
                              "step; a step cannot change it to %g (use a new job id)",
                              j->job, j->uid, j->delta, delta);
        j->delta = delta;
        changed = true;
    }
    if (budget_eps > 0 && (j->budget_eps == 0 || budget_eps < j->budget_eps)) {
        j->budget_eps = budget_eps;
        changed = true;
    }
    if (changed) {
        dc_ledger_recompute(j);
        j->gen++;
    }
    return 0;
}

/* --- accounts in memory ---------------------------------------------------------- */

void dc_ledger_set_limits(dc_ledger *l, uint32_t max_jobs_per_uid, uint32_t job_idle_s) {
    l->max_jobs_per_uid = max_jobs_per_uid;
    l->job_idle_ns = (uint64_t)job_idle_s * 1000000000u;
}

dc_ledger_job *dc_ledger_job_find(dc_ledger *l, uint32_t uid, const char *job) {
    for (dc_ledger_job *j = l->jobs; j; j = j->next)
        if (j->uid == uid && strcmp(j->job, job) == 0) return j;
    return NULL;
}

dc_ledger_job *dc_ledger_job_new(dc_ledger *l, uint32_t uid, const char *job) {
    dc_ledger_job *j = calloc(1, sizeof *j);
    if (!j) return NULL;
    j->ledger = l;
    j->uid = uid;
    snprintf(j->job, sizeof j->job, "%s", job);
    j->delta = l->default_delta;
    j->best_order = NAN;
    j->used_ns = uv_hrtime();
    j->next = l->jobs;
    l->jobs = j;
    l->n_jobs++;
    return j;
}

/* Nothing refers to it and nothing of it is only in memory, or what is
 * only in memory may be forgotten after the idle time. */
static bool job_idle(const dc_ledger *l, const dc_ledger_job *j) {
    return j->sessions == 0 && !j->writing && !j->dirty && !j->waiters &&
           (!dc_ledger_persistent(l) || j->saved_gen >= j->gen);
}

static void job_drop(dc_ledger *l, dc_ledger_job **pp) {
    dc_ledger_job *j = *pp;
    *pp = j->next;
    l->n_jobs--;
    dc_ledger_dp_free(j);
    free(j->hist);
    free(j);
}

size_t dc_ledger_expire(dc_ledger *l, uint64_t now_ns) {
    size_t n = 0;
    l->swept_ns = now_ns;
    for (dc_ledger_job **pp = &l->jobs; *pp;) {
        dc_ledger_job *j = *pp;
        bool go = job_idle(l, j) &&
                  (j->steps == 0 ||
                   (l->job_idle_ns && now_ns >= j->used_ns && now_ns - j->used_ns >= l->job_idle_ns));
        if (go) {
            job_drop(l, pp);
            n++;
        } else {
            pp = &j->next;
        }
    }
    return n;
}

/* Accounts of uid in memory; at the cap, those of uid that nothing uses and
 * that lose nothing by going (never spent, or on disk: read back when
 * named) go first, whatever their idle time. */
static size_t make_room(dc_ledger *l, uint32_t uid) {
    size_t n = 0;
    for (dc_ledger_job *j = l->jobs; j; j = j->next) n += j->uid == uid;
    if (!l->max_jobs_per_uid || n < l->max_jobs_per_uid) return n;
    for (dc_ledger_job **pp = &l->jobs; *pp && n >= l->max_jobs_per_uid;) {
        if ((*pp)->uid == uid && job_idle(l, *pp) &&
            ((*pp)->steps == 0 || dc_ledger_persistent(l))) {
            job_drop(l, pp);
            n--;
        } else {
            pp = &(*pp)->next;
        }
    }
    return n;
}

int dc_ledger_job_open(dc_ledger *l, uint32_t uid, const char *job, dc_ledger_job **out,
                       dc_err *err) {
    dc_ledger_job *j;
    uint64_t now = uv_hrtime();
    size_t len = strlen(job), n;
    int rc;

    *out = NULL;
    if (len >= DC_LEDGER_JOB_MAX)
        return dc_err_set(err, DC_EINVAL, "hello.job_id", "job id of %zu bytes: at most %d bytes "
                          "are allowed (a longer id would share an account with another job)",
                          len, DC_LEDGER_JOB_MAX - 1);
    if ((j = dc_ledger_job_find(l, uid, job))) {
        *out = j;
        return 0;
    }
    if (now - l->swept_ns >= 1000000000u) dc_ledger_expire(l, now);
    if (l->max_jobs_per_uid && (n = make_room(l, uid)) >= l->max_jobs_per_uid)
        return dc_err_set(err, DC_ENOSPACE, "ledger.max_jobs_per_uid",
                          "uid %u already has %zu jobs in the privacy ledger, the most "
                          "ledger.max_jobs_per_uid allows; a job's account goes once its "
                          "sessions have ended (ledger.job_idle_s after its last step)", uid, n);
    if (dc_ledger_persistent(l) && (rc = dc_ledger_load_job(l, uid, job, &j, err)) != 0)
        return rc;
    if (!j && !(j = dc_ledger_job_new(l, uid, job)))
        return dc_err_set(err, DC_ENOSPACE, "ledger", "out of memory for the ledger");
    *out = j;
    return 0;
}

dc_ledger_job *dc_ledger_job_get(dc_ledger *l, uint32_t uid, const char *job) {
    dc_ledger_job *j;
    return dc_ledger_job_open(l, uid, job, &j, NULL) == 0 ? j : NULL;
}

void dc_ledger_drop_jobs(dc_ledger *l) {
    while (l->jobs) job_drop(l, &l->jobs);
}
