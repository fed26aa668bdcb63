/* A norm group across daemons (group.h): the NCCL link between them, and
 * each group step's exchange, once this daemon's members are all in: every
 * daemon sends its members' totals and terms, checks the others', and
 * sums the totals in one order everywhere. */
#include "group_int.h"

#include "dc_ewma.h"
#include "log.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* One daemon's part of an exchange: its group step, its members' terms
 * (each daemon checks the others'), its group noise key (every daemon
 * takes daemon 0's: replicated layers are noised alike on every member,
 * and the key travels between daemons only, never through a trainer), the
 * largest rounding bound of its members' (group.h e: every member clips
 * by the largest over all daemons) and then its totals [batch]. Fixed
 * widths: daemons of one group may be different builds. */
typedef struct link_head {
    uint64_t magic, step, replicated_hash, noise_key;
    uint32_t batch, daemon_rank, expected_batch;
    int32_t reduction;
    float max_grad_norm, noise_multiplier;
    uint32_t has_rep, pad; /* the replicated layers' measure follows the totals */
    uint64_t logical_id;   /* a micro-batch of a logical step, its index, whether it commits */
    uint32_t micro_batch, commit;
    double e;
} link_head;
#define LINK_MAGIC 0x6470636c69703035ull /* "dpclip05" */
/* One daemon's part: the head, its totals [B], its replicated copy [B]. */
#define LINK_EACH(B) (sizeof(link_head) + 2 * (size_t)(B) * sizeof(double))

const char *dc_group_link_name(dc_group_link l) {
    switch (l) {
    case DC_GROUP_LINK_NONE: return "none";
    case DC_GROUP_LINK_WAITING: return "waiting";
    case DC_GROUP_LINK_FORMING: return "forming";
    case DC_GROUP_LINK_READY: return "ready";
    case DC_GROUP_LINK_BROKEN: return "broken";
    }
    return "?";
}

static void on_link_state(dc_nccl *link, dc_nccl_state st, const dc_err *err, void *arg) {
    dc_group *g = arg;
    char why[256];
    (void)link;
    if (st == DC_NCCL_READY) {
        g->link_state = DC_GROUP_LINK_READY;
        if (g->exchange_due) dc_group_exchange_start(g);
        return;
    }
    if (st != DC_NCCL_BROKEN || g->dissolved) return;
    g->gs->link_failures++;
    snprintf(why, sizeof why, "its cross-daemon link (daemon %u of %u) failed: %.180s",
             g->daemon_rank, g->daemons, err->msg);
    dc_group_dissolve(g, why);
    dc_group_maybe_free(g);
}

int dc_group_link_open(dc_group *g, dc_err *err) {
    int rc;
    if (g->daemons <= 1 || g->link || g->n_joined < g->local_size) return 0;
    if ((rc = dc_nccl_open(g->gs->loop, g->device, g->nccl_id, (int)g->daemons, (int)g->daemon_rank,
                           g->timeout_ms, on_link_state, g, &g->link, err)))
        return rc;
    g->link_state = DC_GROUP_LINK_FORMING;
    return 0;
}

static void fail_exchange(dc_group *g, const char *fmt, ...);

static void on_exchanged(dc_nccl_op *op) {
    dc_group *g = op->arg;
    const size_t B = g->terms.batch, each = LINK_EACH(B);
    link_head mine;
    if (op->rc) {
        fail_exchange(g, "the cross-daemon exchange of group step %llu failed: %s",
                      (unsigned long long)g->cur, op->err.msg);
        return;
    }
    memcpy(&mine, g->xsend, sizeof mine);
    /* each daemon's step and terms first: a mismatch names the daemon */
    for (uint32_t d = 0; d < g->daemons; d++) {
        link_head h;
        dc_group_terms t;
        const char *f;
        memcpy(&h, g->xrecv + d * each, sizeof h);
        if (h.magic != LINK_MAGIC || h.daemon_rank != d) {
            fail_exchange(g, "daemon %u sent a malformed exchange in group step %llu", d,
                          (unsigned long long)g->cur);
            return;
        }
        if (h.step != mine.step) {
            fail_exchange(g, "daemon %u is at group step %llu, this daemon (%u) at %llu", d,
                          (unsigned long long)h.step, g->daemon_rank,
                          (unsigned long long)mine.step);
            return;
        }
        t.batch = h.batch;
        t.max_grad_norm = h.max_grad_norm;
        t.noise_multiplier = h.noise_multiplier;
        t.reduction = h.reduction;
        t.expected_batch = h.expected_batch;
        t.replicated_hash = h.replicated_hash;
        t.logical_id = h.logical_id;
        t.micro_batch = h.micro_batch;
        t.commit = h.commit != 0;
        if ((f = dc_group_terms_differ(&g->terms, &t))) {
            fail_exchange(g,
                          "the members on daemon %u and on this daemon (%u) disagree on %s in "
                          "group step %llu",
                          d, g->daemon_rank, f, (unsigned long long)g->cur);
            return;
        }
    }
    /* every daemon's copy of the replicated layers measures alike */
    for (uint32_t d = 0; d < g->daemons; d++) {
        link_head h;
        const uint8_t *rep = g->xrecv + d * each + sizeof(link_head) + B * sizeof(double);
        memcpy(&h, g->xrecv + d * each, sizeof h);
        if (!h.has_rep || !mine.has_rep) {
            if (h.has_rep != mine.has_rep) {
                fail_exchange(g,
                              "daemon %u and this daemon (%u) disagree on whether group step "
                              "%llu has replicated layers",
                              d, g->daemon_rank, (unsigned long long)g->cur);
                return;
            }
            continue;
        }
        for (size_t b = 0; b < B; b++) {
            double v, w;
            memcpy(&v, rep + b * sizeof v, sizeof v);
            memcpy(&w, g->xrecv + g->daemon_rank * each + sizeof(link_head) + (B + b) * sizeof w,
                   sizeof w);
            if (!dc_group_replicas_agree(v, w)) {
                fail_exchange(g,
                              "group step %llu: the copy of the replicated layers on daemon "
                              "%u measures %.6g for sample %zu, this daemon's (%u) %.6g",
                              (unsigned long long)g->cur, d, v, b, g->daemon_rank, w);
                return;
            }
        }
    }
    /* daemon 0's key for the replicated layers' noise (link_head) */
    {
        link_head h0;
        memcpy(&h0, g->xrecv, sizeof h0);
        g->noise_key = h0.noise_key;
    }
    /* every daemon's largest bound (NaN wins: coefficients 0) */
    for (uint32_t d = 0; d < g->daemons; d++) {
        link_head h;
        memcpy(&h, g->xrecv + d * each, sizeof h);
        g->e_max = dc_clip_e_max(g->e_max, h.e);
    }
    /* the same order on every daemon: bit-identical totals everywhere */
    for (size_t b = 0; b < B; b++) {
        double sum = 0.0;
        for (uint32_t d = 0; d < g->daemons; d++) {
            double v;
            memcpy(&v, g->xrecv + d * each + sizeof(link_head) + b * sizeof v, sizeof v);
            sum += v;
        }
        g->tot[b] = sum;
    }
    dc_ewma_add(&g->ewma_exchange_ns, uv_hrtime() - g->t_exchange);
    g->exchanges++;
    g->gs->exchanges++;
    if (op->polled) {
        g->exchanges_polled++;
        g->gs->exchanges_polled++;
    }
    g->last_exchange_ns = op->ns;
    dc_group_answer(g, uv_hrtime() - g->t_local);
}

/* The window: the usual margins, widened by twice the recent deviation
 * from the average (without MPS a member's norms share the GPU with its
 * trainer, and their time varies from step to step), at most to three
 * times the margins: a trainer whose steps' inputs come erratically cannot
 * have the link's thread poll for much more than a sixth of its steps'
 * time (daemon.spin_us = 0: never). */
void dc_group_norms_started(dc_group *g) {
    /* timed only while the link is ready: the first exchange waits for it
     * to form (seconds), which says nothing of the next */
    if (g->daemons <= 1 || g->dissolved || g->t_norms || !g->link ||
        g->link_state != DC_GROUP_LINK_READY)
        return;
    uint64_t now = uv_hrtime(), run = g->ewma_norms_ns;
    g->t_norms = now;
    if (!run || !g->gs->poll) return; /* (no polling: daemon.spin_us = 0) */
    uint64_t m = dc_ewma_margin(run), w = 2 * g->ewma_norms_dev_ns, from, to;
    dc_ewma_window(now, run, w > 2 * m ? 2 * m : w, &from, &to);
    dc_nccl_expect(g->link, from, to);
}

void dc_group_exchange_start(dc_group *g) {
    const size_t B = g->terms.batch, each = LINK_EACH(B);
    link_head h;
    dc_err e;
    g->exchange_due = false;
    if (g->t_norms) { /* what the next exchange's window predicts from */
        uint64_t took = uv_hrtime() - g->t_norms, was = g->ewma_norms_ns;
        if (was) dc_ewma_add(&g->ewma_norms_dev_ns, took > was ? took - was : was - took);
        dc_ewma_add(&g->ewma_norms_ns, took);
        dc_log_debug("norm group '%s': this daemon's members' norms reached exchange %llu in "
                     "%.1f us (expected %.1f +- %.1f)",
                     g->name, (unsigned long long)(g->exchanges + 1), took / 1e3, was / 1e3,
                     g->ewma_norms_dev_ns / 1e3);
        g->t_norms = 0;
    }
    if (each * g->daemons > g->xcap) {
        uint8_t *s = realloc(g->xsend, each), *r = s ? realloc(g->xrecv, each * g->daemons) : NULL;
        if (s) g->xsend = s;
        if (!s || !r) {
            fail_exchange(g, "out of memory for the cross-daemon exchange");
            return;
        }
        g->xrecv = r;
        g->xcap = each * g->daemons;
    }
    memset(&h, 0, sizeof h);
    h.magic = LINK_MAGIC;
    h.step = g->cur;
    h.replicated_hash = g->terms.replicated_hash;
    h.noise_key = g->noise_key;
    h.batch = g->terms.batch;
    h.daemon_rank = g->daemon_rank;
    h.expected_batch = g->terms.expected_batch;
    h.reduction = g->terms.reduction;
    h.max_grad_norm = g->terms.max_grad_norm;
    h.noise_multiplier = g->terms.noise_multiplier;
    h.has_rep = g->has_rep;
    h.logical_id = g->terms.logical_id;
    h.micro_batch = g->terms.micro_batch;
    h.commit = g->terms.commit;
    h.e = g->e_max;
    memcpy(g->xsend, &h, sizeof h);
    memcpy(g->xsend + sizeof h, g->tot, B * sizeof(double));
    if (g->has_rep) memcpy(g->xsend + sizeof h + B * sizeof(double), g->rep, B * sizeof(double));
    else memset(g->xsend + sizeof h + B * sizeof(double), 0, B * sizeof(double));
    g->op.send = g->xsend;
    g->op.recv = g->xrecv;
    g->op.bytes = each;
    g->op.done = on_exchanged;
    g->op.arg = g;
    if (dc_nccl_submit(g->link, &g->op, &e)) {
        fail_exchange(g, "the cross-daemon exchange of group step %llu: %s",
                      (unsigned long long)g->cur, e.msg);
        return;
    }
    /* the loop polls around when the answer is due, rather than sleep until
     * the link's thread wakes it */
    uint64_t now = g->t_exchange = uv_hrtime(), run = g->ewma_exchange_ns;
    if (run && g->gs->poll) {
        uint64_t from, to;
        dc_ewma_window(now, run, 0, &from, &to);
        g->gs->poll(g->gs->poll_ctx, from, to);
    }
}

static void fail_exchange(dc_group *g, const char *fmt, ...) {
    char why[256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(why, sizeof why, fmt, ap);
    va_end(ap);
    g->gs->link_failures++;
    dc_group_dissolve(g, why);
    dc_group_maybe_free(g);
}
