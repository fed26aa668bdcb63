/* How a group step and a group end: a step answered with the group's
 * totals (dc_group_answer) or failed (dc_group_fail_waiting), a group
 * dissolved and freed, and the checks members are held to (their terms,
 * their replicated copies). Both the group's own code (group.c) and its
 * link to other daemons (group_link.c, whose finished exchange answers the
 * group) end steps here, so neither calls into the other for it. */
#include "group_int.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void on_timer_closed(uv_handle_t *h) {
    dc_group *g = h->data;
    free(g->joined);
    free(g->waiting);
    free(g->unfusing);
    free(g->tot);
    free(g->rep);
    free(g->xsend);
    free(g->xrecv);
    free(g->job_ids);
    free(g->covered);
    if (g->daemons > 1) g->gs->links--;
    free(g);
}

static void unlink_group(dc_group *g) {
    for (dc_group **p = &g->gs->list; *p; p = &(*p)->next)
        if (*p == g) {
            *p = g->next;
            break;
        }
}

/* Idempotent: a dissolution's callbacks may leave the group (a member's
 * session closing) and so free it before the caller's own maybe_free. */
void dc_group_maybe_free(dc_group *g) {
    if (!g->dissolved || g->refs > 0 || g->closing) return;
    g->closing = true;
    unlink_group(g);
    uv_close((uv_handle_t *)&g->timer, on_timer_closed);
}

/* Ends the group step: the steps waiting leave the group, chained in rank
 * order through next_call; returns the first. Their done may run anything
 * (a member's reply starts its session's next request, which may deliver,
 * fail or end a group step of this group), so the chain is the caller's
 * alone: nothing of the group is shared with what the callbacks start. */
static dc_group_waiter *take_waiting(dc_group *g, uint32_t *n) {
    dc_group_waiter *first = NULL, **tail = &first;
    *n = 0;
    for (uint32_t r = 0; r < g->size; r++)
        if (g->waiting[r]) {
            *tail = g->waiting[r];
            tail = &g->waiting[r]->next_call;
            g->waiting[r] = NULL;
            ++*n;
        }
    *tail = NULL;
    g->n_waiting = 0;
    g->active = false;
    uv_timer_stop(&g->timer);
    return first;
}

/* Each waiter's done, its successor read first: a done ends its step call. */
static void fail_chain(dc_group_waiter *w, int rc, const dc_err *err) {
    while (w) {
        dc_group_waiter *next = w->next_call;
        w->done(w, rc, NULL, err);
        w = next;
    }
}

void dc_group_fail_waiting(dc_group *g, int rc, const dc_err *err) {
    uint32_t n;
    g->t_norms = 0; /* that step's exchange will not come */
    fail_chain(take_waiting(g, &n), rc, err);
}

void dc_group_dissolve(dc_group *g, const char *why) {
    dc_err e;
    if (g->dissolved) return;
    g->dissolved = true;
    g->gs->dissolved++;
    snprintf(g->why, sizeof g->why, "%s", why);
    /* aborting the link tells the other daemons at once (a remote error)
     * instead of leaving them to their timeout */
    if (g->link) {
        dc_nccl_close(g->link);
        g->link = NULL;
        g->link_state = DC_GROUP_LINK_BROKEN;
    }
    g->exchange_due = false;
    dc_err_set(&e, DC_EUNAVAIL, "join_group",
               "norm group '%s' was dissolved: %s; every member must join again", g->name, why);
    dc_group_fail_waiting(g, DC_EUNAVAIL, &e);
}

/* The field two members' terms differ in, or NULL. */
const char *dc_group_terms_differ(const dc_group_terms *a, const dc_group_terms *b) {
    if (a->batch != b->batch) return "clip_step.batch_size";
    if (a->max_grad_norm != b->max_grad_norm) return "clip_step.clip.max_grad_norm";
    if (a->noise_multiplier != b->noise_multiplier) return "clip_step.noise_multiplier";
    if (a->reduction != b->reduction) return "clip_step.clip.loss_reduction";
    if (a->expected_batch != b->expected_batch) return "clip_step.clip.expected_batch_size";
    if (a->replicated_hash != b->replicated_hash) return "clip_step.layers.replicated";
    if (a->logical_id != b->logical_id || a->micro_batch != b->micro_batch ||
        a->commit != b->commit)
        return "clip_step.logical";
    return NULL;
}

bool dc_group_replicas_agree(double a, double b) {
    double hi = a > b ? a : b;
    return fabs(a - b) <= DC_GROUP_REPLICA_TOL * hi; /* false for NaN */
}

/* Ends the group step as reduced: the waiters' chain (take_waiting) with
 * their wait times set. */
dc_group_waiter *dc_group_take_reduced(dc_group *g, uint64_t exchange_ns, uint32_t *n) {
    dc_group_waiter *first = take_waiting(g, n);
    uint64_t now = uv_hrtime();
    g->last_wait_ns = now - g->t_first;
    for (dc_group_waiter *w = first; w; w = w->next_call) {
        w->exchange_ns = exchange_ns;
        w->wait_ns = now - w->wait_ns; /* wait_ns held the delivery time */
        w->e_group = g->e_max;
    }
    return first;
}

/* Every member waiting gets the totals; the group step ends. The totals
 * go to every member first: a done given them copies them and starts no
 * request, while a failure's done may (its reply starts the session's
 * next request, whose delivery could open the next group step and so
 * reset g->tot under the members not answered yet). */
void dc_group_answer(dc_group *g, uint64_t exchange_ns) {
    uint32_t n;
    dc_group_waiter *w = dc_group_take_reduced(g, exchange_ns, &n), *bad = NULL, **bad_tail = &bad;
    const uint32_t batch = g->terms.batch;
    g->gs->reductions++;
    g->reductions++;
    while (w) {
        dc_group_waiter *next = w->next_call;
        /* tot has the group step's batch: a waiter of another batch would
         * read or write past its own tables (delivery checked the terms;
         * this holds whatever the group's state says) */
        if (w->terms.batch != batch) {
            *bad_tail = w;
            bad_tail = &w->next_call;
        } else {
            w->done(w, 0, g->tot, NULL);
        }
        w = next;
    }
    *bad_tail = NULL;
    while (bad) {
        dc_group_waiter *next = bad->next_call;
        dc_err e;
        dc_err_set(&e, DC_EINVAL, "clip_step.batch_size",
                   "rank %u's batch of %u is not its group step's %u", bad->rank, bad->terms.batch,
                   batch);
        bad->done(bad, e.code, NULL, &e);
        bad = next;
    }
}
