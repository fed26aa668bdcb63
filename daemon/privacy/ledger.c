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

static dc_ledger_entry *find_entry(const dc_ledger_account *acct, double q, double sigma) {
    for (size_t i = 0; i < acct->n_hist; i++)
        if (acct->hist[i].q == q && acct->hist[i].sigma == sigma) return &acct->hist[i];
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

/* The per-step curve of (q, sigma): from the account's history, the cache, or
 * computed here (and cached). */
const double *dc_ledger_curve(dc_ledger *l, const dc_ledger_account *acct, double q, double sigma) {
    const dc_ledger_entry *e = acct ? find_entry(acct, q, sigma) : NULL;
    const double *c;
    double tmp[DC_RDP_N_ORDERS];
    if (e) return e->rdp;
    if ((c = cache_find(l, q, sigma))) return c;
    compute_curve(q, sigma, tmp);
    return cache_put(l, q, sigma, tmp);
}

bool dc_ledger_has_curve(const dc_ledger *l, const dc_ledger_account *acct, double q,
                         double sigma) {
    return (acct && find_entry(acct, q, sigma)) || cache_find(l, q, sigma);
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

void dc_ledger_recompute(dc_ledger_account *acct) {
    const double *orders = dc_rdp_default_orders();
    acct->steps = acct->folded_steps;
    memcpy(acct->rdp, acct->folded, sizeof acct->rdp);
    for (size_t i = 0; i < acct->n_hist; i++) {
        const dc_ledger_entry *e = &acct->hist[i];
        acct->steps += e->steps;
        for (size_t k = 0; k < DC_RDP_N_ORDERS; k++) acct->rdp[k] += (double)e->steps * e->rdp[k];
    }
    if (acct->steps == 0) {
        /* As Opacus: an empty history has spent nothing. */
        acct->eps = 0.0;
        acct->best_order = NAN;
    } else {
        acct->eps = dc_rdp_epsilon(orders, acct->rdp, DC_RDP_N_ORDERS, acct->delta,
                                   &acct->best_order);
    }
}

double dc_ledger_eps_at(const dc_ledger_account *acct, double delta, double *best_order) {
    if (acct->steps == 0) {
        if (best_order) *best_order = NAN;
        return 0.0;
    }
    return dc_rdp_epsilon(dc_rdp_default_orders(), acct->rdp, DC_RDP_N_ORDERS, delta, best_order);
}

double dc_ledger_eps_after(dc_ledger *l, const dc_ledger_account *acct, double q, double sigma,
                           double delta) {
    const double *c = dc_ledger_curve(l, acct, q, sigma);
    double tmp[DC_RDP_N_ORDERS];
    for (size_t k = 0; k < DC_RDP_N_ORDERS; k++) tmp[k] = acct->rdp[k] + c[k];
    return dc_rdp_epsilon(dc_rdp_default_orders(), tmp, DC_RDP_N_ORDERS, delta, NULL);
}

/* The least recently used pair leaves the history: its steps stay in the
 * folded sum, so the history stays bounded whatever a client sends. */
static void fold_oldest(dc_ledger_account *acct) {
    size_t o = 0;
    for (size_t i = 1; i < acct->n_hist; i++)
        if (acct->hist[i].used < acct->hist[o].used) o = i;
    for (size_t k = 0; k < DC_RDP_N_ORDERS; k++)
        acct->folded[k] = up(acct->folded[k] +
                             up((double)acct->hist[o].steps * acct->hist[o].rdp[k]));
    acct->folded_steps += acct->hist[o].steps;
    acct->hist[o] = acct->hist[acct->n_hist - 1];
    acct->n_hist--;
}

/* Appends an entry with a computed curve and zero steps. */
dc_ledger_entry *dc_ledger_add_entry(dc_ledger *l, dc_ledger_account *acct, double q,
                                     double sigma) {
    dc_ledger_entry *e;
    const double *c = dc_ledger_curve(l, acct, q, sigma);
    if (acct->n_hist == DC_LEDGER_HIST_MAX) fold_oldest(acct);
    if (acct->n_hist == acct->cap_hist) {
        size_t cap = acct->cap_hist ? 2 * acct->cap_hist : 2;
        dc_ledger_entry *h;
        if (cap > DC_LEDGER_HIST_MAX) cap = DC_LEDGER_HIST_MAX;
        if (!(h = realloc(acct->hist, cap * sizeof *h))) return NULL;
        acct->hist = h;
        acct->cap_hist = cap;
    }
    e = &acct->hist[acct->n_hist];
    memcpy(e->rdp, c, sizeof e->rdp);
    e->q = q;
    e->sigma = sigma;
    e->steps = 0;
    e->used = acct->gen;
    acct->n_hist++;
    return e;
}

int dc_ledger_spend(dc_ledger *l, dc_ledger_account *acct, double q, double sigma, dc_err *err) {
    dc_ledger_entry *e = find_entry(acct, q, sigma);
    if (!e && !(e = dc_ledger_add_entry(l, acct, q, sigma)))
        return dc_err_set(err, DC_ENOSPACE, "ledger", "out of memory for the ledger");
    e->steps++;
    e->used = ++acct->gen;
    if (l->insecure) acct->insecure = true;
    acct->used_ns = uv_hrtime();
    dc_ledger_recompute(acct);
    return 0;
}

void dc_ledger_refund(dc_ledger_account *acct, double q, double sigma) {
    dc_ledger_entry *e = find_entry(acct, q, sigma);
    if (e && e->steps > 0) {
        if (--e->steps == 0) *e = acct->hist[--acct->n_hist];
    } else if (acct->folded_steps > 0) {
        /* Its pair was folded while the step ran. Rounded up again: the
         * sum keeps covering what stays in it. */
        const double *c = dc_ledger_curve(acct->ledger, NULL, q, sigma);
        if (--acct->folded_steps == 0) {
            memset(acct->folded, 0, sizeof acct->folded);
        } else {
            for (size_t k = 0; k < DC_RDP_N_ORDERS; k++)
                if (isfinite(acct->folded[k]))
                    acct->folded[k] = acct->folded[k] > c[k] ? up(acct->folded[k] - c[k]) : 0.0;
        }
    } else {
        return;
    }
    dc_ledger_recompute(acct);
    acct->gen++;
}

int dc_ledger_account_terms(dc_ledger_account *acct, double delta, double budget_eps, dc_err *err) {
    bool changed = false;
    if (delta > 0 && delta != acct->delta) {
        /* A delta fixed by the first step: a later, larger delta would make
         * the same spend look smaller and let a budget be overrun. */
        if (acct->steps > 0)
            return dc_err_set(err, DC_EPRECOND, "clip_step.target_delta",
                              "job '%s' (uid %u) reports epsilon at delta %g, fixed by its first "
                              "step; a step cannot change it to %g (use a new job id)",
                              acct->job_id, acct->uid, acct->delta, delta);
        acct->delta = delta;
        changed = true;
    }
    if (budget_eps > 0 && (acct->budget_eps == 0 || budget_eps < acct->budget_eps)) {
        acct->budget_eps = budget_eps;
        changed = true;
    }
    if (changed) {
        dc_ledger_recompute(acct);
        acct->gen++;
    }
    return 0;
}

/* --- accounts in memory ---------------------------------------------------------- */

void dc_ledger_set_limits(dc_ledger *l, uint32_t max_jobs_per_uid, uint32_t job_idle_s) {
    l->max_jobs_per_uid = max_jobs_per_uid;
    l->job_idle_ns = (uint64_t)job_idle_s * 1000000000u;
}

dc_ledger_account *dc_ledger_account_find(dc_ledger *l, uint32_t uid, const char *job_id) {
    for (dc_ledger_account *acct = l->accounts; acct; acct = acct->next)
        if (acct->uid == uid && strcmp(acct->job_id, job_id) == 0) return acct;
    return NULL;
}

dc_ledger_account *dc_ledger_account_new(dc_ledger *l, uint32_t uid, const char *job_id) {
    dc_ledger_account *acct = calloc(1, sizeof *acct);
    if (!acct) return NULL;
    acct->ledger = l;
    acct->uid = uid;
    snprintf(acct->job_id, sizeof acct->job_id, "%s", job_id);
    acct->delta = l->default_delta;
    acct->best_order = NAN;
    acct->used_ns = uv_hrtime();
    acct->next = l->accounts;
    l->accounts = acct;
    l->n_accounts++;
    return acct;
}

/* Nothing refers to it and nothing of it is only in memory, or what is
 * only in memory may be forgotten after the idle time. */
static bool account_idle(const dc_ledger *l, const dc_ledger_account *acct) {
    return acct->sessions == 0 && !acct->writing && !acct->dirty && !acct->waiters &&
           (!dc_ledger_persistent(l) || acct->saved_gen >= acct->gen);
}

static void account_drop(dc_ledger *l, dc_ledger_account **pp) {
    dc_ledger_account *acct = *pp;
    *pp = acct->next;
    l->n_accounts--;
    dc_ledger_dp_free(acct);
    free(acct->hist);
    free(acct);
}

size_t dc_ledger_expire(dc_ledger *l, uint64_t now_ns) {
    size_t n = 0;
    l->swept_ns = now_ns;
    for (dc_ledger_account **pp = &l->accounts; *pp;) {
        dc_ledger_account *acct = *pp;
        bool go = account_idle(l, acct) &&
                  (acct->steps == 0 || (l->job_idle_ns && now_ns >= acct->used_ns &&
                                        now_ns - acct->used_ns >= l->job_idle_ns));
        if (go) {
            account_drop(l, pp);
            n++;
        } else {
            pp = &acct->next;
        }
    }
    return n;
}

size_t dc_ledger_make_room(dc_ledger *l, uint32_t uid) {
    size_t n = 0;
    for (dc_ledger_account *acct = l->accounts; acct; acct = acct->next) n += acct->uid == uid;
    if (!l->max_jobs_per_uid || n < l->max_jobs_per_uid) return n;
    for (dc_ledger_account **pp = &l->accounts; *pp && n >= l->max_jobs_per_uid;) {
        if ((*pp)->uid == uid && account_idle(l, *pp) &&
            ((*pp)->steps == 0 || dc_ledger_persistent(l))) {
            account_drop(l, pp);
            n--;
        } else {
            pp = &(*pp)->next;
        }
    }
    return n;
}

void dc_ledger_drop_accounts(dc_ledger *l) {
    while (l->accounts) account_drop(l, &l->accounts);
}
