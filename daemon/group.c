#include "group.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define GROUP_NAME_MAX 64

struct dc_group {
    dc_group *next;
    dc_groups *gs;
    uint64_t id;
    uint32_t uid;
    char name[GROUP_NAME_MAX];
    uint32_t size, timeout_ms;
    dc_group_clipping clipping;
    uint64_t noise_key;
    int refs;                  /* members holding it */
    bool *joined;              /* [size] */
    uint32_t n_joined;
    bool dissolved;
    char why[256];
    /* the group step being reduced: 0 = none */
    uint64_t cur;
    dc_group_waiter **waiting; /* [size] */
    dc_group_waiter **calling; /* [size]: the waiters being answered */
    uint32_t n_waiting;
    dc_group_terms terms;      /* of the first member to deliver */
    uint32_t first_rank;
    double *tot;               /* [terms.batch] */
    uint32_t tot_cap;
    uint64_t t_first, last_wait_ns, reductions;
    /* the last group step that failed on a member, and why */
    uint64_t failed;
    dc_err failed_err;
    uv_timer_t timer;
};

/* splitmix64: group noise keys from the daemon's secret seed and the id */
static uint64_t mix(uint64_t x) {
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

void dc_groups_init(dc_groups *gs, uv_loop_t *loop, uint64_t key_seed, uint32_t max_size,
                    uint32_t timeout_ms) {
    memset(gs, 0, sizeof *gs);
    gs->loop = loop;
    gs->key_seed = key_seed;
    gs->max_size = max_size;
    gs->timeout_ms = timeout_ms;
    gs->next_id = 1;
}

static void on_timer_closed(uv_handle_t *h) {
    dc_group *g = h->data;
    free(g->joined);
    free(g->waiting);
    free(g->calling);
    free(g->tot);
    free(g);
}

static void unlink_group(dc_group *g) {
    for (dc_group **p = &g->gs->list; *p; p = &(*p)->next)
        if (*p == g) {
            *p = g->next;
            break;
        }
}

static void maybe_free(dc_group *g) {
    if (!g->dissolved || g->refs > 0) return;
    unlink_group(g);
    uv_close((uv_handle_t *)&g->timer, on_timer_closed);
}

/* Fails every step waiting now, with rc and err; the group step ends. */
static void fail_waiting(dc_group *g, int rc, const dc_err *err) {
    dc_group_waiter **w = g->calling;
    uint32_t n = 0;
    for (uint32_t r = 0; r < g->size; r++)
        if (g->waiting[r]) {
            w[n++] = g->waiting[r];
            g->waiting[r] = NULL;
        }
    g->n_waiting = 0;
    g->cur = 0;
    uv_timer_stop(&g->timer);
    for (uint32_t i = 0; i < n; i++) w[i]->done(w[i], rc, NULL, err);
}

static void dissolve(dc_group *g, const char *why) {
    dc_err e;
    if (g->dissolved) return;
    g->dissolved = true;
    g->gs->dissolved++;
    snprintf(g->why, sizeof g->why, "%s", why);
    dc_err_set(&e, DC_EUNAVAIL, "join_group",
               "norm group '%s' was dissolved: %s; every member must join again", g->name, why);
    fail_waiting(g, DC_EUNAVAIL, &e);
}

void dc_groups_close(dc_groups *gs) {
    for (dc_group *g = gs->list, *next; g; g = next) {
        next = g->next;
        dissolve(g, "the daemon is shutting down");
        maybe_free(g);
    }
}

static void on_timeout(uv_timer_t *t) {
    dc_group *g = t->data;
    char missing[160] = "", why[256];
    size_t off = 0;
    int n = 0;
    for (uint32_t r = 0; r < g->size && off < sizeof missing - 16; r++)
        if (!g->waiting[r]) {
            int k = snprintf(missing + off, sizeof missing - off, "%s%u", n ? ", " : "", r);
            if (k > 0) off += (size_t)k;
            n++;
        }
    g->gs->timeouts++;
    snprintf(why, sizeof why, "step %llu: rank%s %s did not arrive within %u ms",
             (unsigned long long)g->cur, n > 1 ? "s" : "", missing, g->timeout_ms);
    dissolve(g, why);
    maybe_free(g);
}

int dc_group_join(dc_groups *gs, uint32_t uid, const char *name, uint32_t rank, uint32_t size,
                  uint32_t timeout_ms, dc_group_clipping clipping, dc_group **out, dc_err *err) {
    dc_group *g;
    if (!name || !name[0] || strlen(name) >= GROUP_NAME_MAX)
        return dc_err_set(err, DC_EINVAL, "join_group.name",
                          "a group name of 1 to %d bytes is needed", GROUP_NAME_MAX - 1);
    if (size == 0 || size > gs->max_size)
        return dc_err_set(err, DC_EINVAL, "join_group.size",
                          "size %u outside [1, %u] (limits.max_group_size)", size, gs->max_size);
    if (rank >= size)
        return dc_err_set(err, DC_EINVAL, "join_group.rank", "rank %u outside [0, %u)", rank,
                          size);
    if (clipping != DC_GROUP_NORM_REDUCE && clipping != DC_GROUP_WISE)
        return dc_err_set(err, DC_EINVAL, "join_group.clipping", "unknown clipping %d",
                          (int)clipping);
    for (g = gs->list; g; g = g->next)
        if (!g->dissolved && g->uid == uid && strcmp(g->name, name) == 0) break;
    if (g) {
        if (g->size != size)
            return dc_err_set(err, DC_EINVAL, "join_group.size",
                              "group '%s' has %u members, this join says %u", name, g->size,
                              size);
        if (g->clipping != clipping)
            return dc_err_set(err, DC_EINVAL, "join_group.clipping",
                              "group '%s' clips %s", name,
                              g->clipping == DC_GROUP_WISE ? "GROUP_WISE" : "NORM_REDUCE");
        if (g->joined[rank])
            return dc_err_set(err, DC_EINVAL, "join_group.rank",
                              "rank %u of group '%s' has joined already", rank, name);
    } else {
        g = calloc(1, sizeof *g);
        if (!g || !(g->joined = calloc(size, sizeof *g->joined)) ||
            !(g->waiting = calloc(size, sizeof *g->waiting)) ||
            !(g->calling = calloc(size, sizeof *g->calling))) {
            if (g) {
                free(g->joined);
                free(g->waiting);
            }
            free(g);
            return dc_err_set(err, DC_ENOSPACE, "join_group", "out of memory");
        }
        g->gs = gs;
        g->id = gs->next_id++;
        g->uid = uid;
        snprintf(g->name, sizeof g->name, "%s", name);
        g->size = size;
        g->clipping = clipping;
        g->timeout_ms = timeout_ms ? timeout_ms : gs->timeout_ms;
        g->noise_key = mix(gs->key_seed ^ mix(g->id));
        uv_timer_init(gs->loop, &g->timer);
        g->timer.data = g;
        g->next = gs->list;
        gs->list = g;
        gs->formed++;
    }
    g->joined[rank] = true;
    g->n_joined++;
    g->refs++;
    *out = g;
    return 0;
}

void dc_group_leave(dc_group *g, uint32_t rank, const char *why) {
    if (!g) return;
    if (rank < g->size && g->joined[rank]) {
        char msg[200];
        g->joined[rank] = false;
        g->n_joined--;
        /* A GROUP_WISE group's steps never wait for each other: a member
         * leaving (a fast one done first) takes nothing from the others. */
        if (g->clipping != DC_GROUP_WISE) {
            snprintf(msg, sizeof msg, "rank %u left (%s)", rank, why);
            dissolve(g, msg);
        } else if (g->n_joined == 0) {
            dissolve(g, "every member left");
        }
    }
    g->refs--;
    maybe_free(g);
}

/* The field two members' terms differ in, or NULL. */
static const char *terms_differ(const dc_group_terms *a, const dc_group_terms *b) {
    if (a->batch != b->batch) return "clip_step.batch_size";
    if (a->max_grad_norm != b->max_grad_norm) return "clip_step.clip.max_grad_norm";
    if (a->noise_multiplier != b->noise_multiplier) return "clip_step.noise_multiplier";
    if (a->reduction != b->reduction) return "clip_step.clip.loss_reduction";
    if (a->expected_batch != b->expected_batch) return "clip_step.clip.expected_batch_size";
    if (a->replicated_hash != b->replicated_hash) return "clip_step.layers.replicated";
    return NULL;
}

int dc_group_deliver(dc_group *g, dc_group_waiter *w, dc_err *err) {
    const char *f;
    if (g->dissolved)
        return dc_err_set(err, DC_EUNAVAIL, "join_group",
                          "norm group '%s' was dissolved: %s; every member must join again",
                          g->name, g->why);
    if (w->rank >= g->size || !g->joined[w->rank] || g->waiting[w->rank])
        return dc_err_set(err, DC_EINTERNAL, "clip_step", "rank %u cannot deliver", w->rank);
    if (g->failed && w->step == g->failed) {
        *err = g->failed_err;
        return err->code;
    }
    if (g->cur && w->step != g->cur)
        return dc_err_set(err, DC_EPRECOND, "clip_step.group_step",
                          "rank %u sent group step %llu while the group is at step %llu",
                          w->rank, (unsigned long long)w->step, (unsigned long long)g->cur);
    if (!g->cur) {
        if (w->terms.batch > g->tot_cap) {
            double *t = realloc(g->tot, w->terms.batch * sizeof *t);
            if (!t) return dc_err_set(err, DC_ENOSPACE, "clip_step", "out of memory");
            g->tot = t;
            g->tot_cap = w->terms.batch;
        }
        memset(g->tot, 0, w->terms.batch * sizeof *g->tot);
        g->cur = w->step;
        g->terms = w->terms;
        g->first_rank = w->rank;
        g->t_first = uv_hrtime();
        uv_timer_start(&g->timer, on_timeout, g->timeout_ms, 0);
    } else if ((f = terms_differ(&g->terms, &w->terms))) {
        dc_err e;
        dc_err_set(&e, DC_EINVAL, f,
                   "the members of norm group '%s' disagree on %s in group step %llu (rank %u "
                   "and rank %u)",
                   g->name, f, (unsigned long long)g->cur, g->first_rank, w->rank);
        g->failed = g->cur;
        g->failed_err = e;
        fail_waiting(g, DC_EINVAL, &e);
        *err = e;
        return DC_EINVAL;
    }
    for (uint32_t b = 0; b < g->terms.batch; b++) g->tot[b] += w->partial[b];
    g->waiting[w->rank] = w;
    if (++g->n_waiting < g->size) return 0;
    /* every member is here: the totals go to each */
    {
        dc_group_waiter **all = g->calling;
        memcpy(all, g->waiting, g->size * sizeof *all);
        memset(g->waiting, 0, g->size * sizeof *g->waiting);
        g->n_waiting = 0;
        g->cur = 0;
        uv_timer_stop(&g->timer);
        g->last_wait_ns = uv_hrtime() - g->t_first;
        g->gs->reductions++;
        g->reductions++;
        for (uint32_t r = 0; r < g->size; r++) all[r]->done(all[r], 0, g->tot, NULL);
    }
    return 0;
}

void dc_group_fail(dc_group *g, uint32_t rank, uint64_t step, const dc_err *err) {
    dc_err e;
    if (!g || g->dissolved) return;
    dc_err_set(&e, err->code, err->field, "rank %u of norm group '%s' failed group step %llu: %s",
               rank, g->name, (unsigned long long)step, err->msg);
    g->failed = step;
    g->failed_err = e;
    if (g->cur == step) fail_waiting(g, e.code, &e);
}

uint64_t dc_group_id(const dc_group *g) { return g->id; }
const char *dc_group_name(const dc_group *g) { return g->name; }
uint32_t dc_group_size(const dc_group *g) { return g->size; }
dc_group_clipping dc_group_clipping_of(const dc_group *g) { return g->clipping; }
uint64_t dc_group_noise_key(const dc_group *g) { return g->noise_key; }
uint64_t dc_group_last_wait_ns(const dc_group *g) { return g->last_wait_ns; }

bool dc_group_dissolved(const dc_group *g, const char **why) {
    if (why) *why = g->why;
    return g->dissolved;
}

size_t dc_groups_count(const dc_groups *gs) {
    size_t n = 0;
    for (const dc_group *g = gs->list; g; g = g->next) n++;
    return n;
}

size_t dc_groups_info(const dc_groups *gs, dc_group_info *out, size_t max) {
    size_t n = 0;
    for (const dc_group *g = gs->list; g && n < max; g = g->next, n++) {
        dc_group_info *o = &out[n];
        o->id = g->id;
        o->uid = g->uid;
        memcpy(o->name, g->name, sizeof o->name);
        o->size = g->size;
        o->joined = g->n_joined;
        o->waiting = g->n_waiting;
        o->clipping = g->clipping;
        o->dissolved = g->dissolved;
        o->step = g->cur;
        o->reductions = g->reductions;
        o->last_wait_ns = g->last_wait_ns;
    }
    return n;
}
