#include "group_int.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* splitmix64: group noise keys from the daemon's secret seed and the id */
static uint64_t mix(uint64_t x) {
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

void dc_groups_init(dc_groups *gs, uv_loop_t *loop, uint64_t key_seed, uint32_t max_size,
                    uint32_t timeout_ms, uint32_t max_timeout_ms) {
    memset(gs, 0, sizeof *gs);
    gs->loop = loop;
    gs->key_seed = key_seed;
    gs->max_size = max_size;
    gs->timeout_ms = timeout_ms;
    gs->max_timeout_ms = max_timeout_ms;
    gs->next_id = 1;
}

void dc_groups_close(dc_groups *gs) {
    for (dc_group *g = gs->list, *next; g; g = next) {
        next = g->next;
        dc_group_dissolve(g, "the daemon is shutting down");
        dc_group_maybe_free(g);
    }
}

/* The members this daemon waits for in a group step. */
static uint32_t local_members(const dc_group *g) {
    return g->daemons > 1 ? g->local_size : g->size;
}

static void on_timeout(uv_timer_t *t) {
    dc_group *g = t->data;
    char missing[160] = "", why[256];
    size_t off = 0;
    int n = 0;
    /* across daemons only this daemon's joined members are known here */
    for (uint32_t r = 0; r < g->size && off < sizeof missing - 16; r++)
        if (!g->waiting[r] && (g->daemons <= 1 || g->joined[r])) {
            int k = snprintf(missing + off, sizeof missing - off, "%s%u", n ? ", " : "", r);
            if (k > 0) off += (size_t)k;
            n++;
        }
    g->gs->timeouts++;
    if (g->daemons > 1 && g->n_joined < g->local_size)
        snprintf(why, sizeof why,
                 "step %llu: %u of the %u members on this daemon never joined (within %u ms)",
                 (unsigned long long)g->cur, g->local_size - g->n_joined, g->local_size,
                 g->timeout_ms);
    else
        snprintf(why, sizeof why, "step %llu: rank%s %s did not arrive within %u ms",
                 (unsigned long long)g->cur, n > 1 ? "s" : "", missing, g->timeout_ms);
    dc_group_dissolve(g, why);
    dc_group_maybe_free(g);
}

/* Whether rank's copy of the replicated layers measures as the first copy
 * this group step saw (which it becomes if it is the first): NULL, or what
 * differs (in a static buffer, the loop thread's). */
static const char *replica_differs(dc_group *g, uint32_t rank, const double *rep, uint64_t hash) {
    static char why[160];
    const uint32_t B = g->terms.batch;
    if (!g->has_rep) {
        memcpy(g->rep, rep, B * sizeof *rep);
        g->has_rep = true;
        g->rep_from = rank;
        g->rep_hash = hash;
        return NULL;
    }
    if (hash != g->rep_hash) {
        snprintf(why, sizeof why,
                 "rank %u's copy of the replicated layers holds other data than rank %u's", rank,
                 g->rep_from);
        return why;
    }
    for (uint32_t b = 0; b < B; b++)
        if (!dc_group_replicas_agree(rep[b], g->rep[b])) {
            snprintf(why, sizeof why,
                     "rank %u's copy of the replicated layers measures %.6g for sample %u, rank "
                     "%u's %.6g",
                     rank, rep[b], b, g->rep_from, g->rep[b]);
            return why;
        }
    return NULL;
}

/* Whether the steps waiting now are on one device (or host memory). */
static bool one_device(const dc_group *g) {
    int device = 0;
    bool seen = false;
    for (uint32_t r = 0; r < g->size; r++) {
        const dc_group_waiter *w = g->waiting[r];
        if (!w) continue;
        if (seen && w->device != device) return false;
        device = w->device;
        seen = true;
    }
    return true;
}

/* Whether the steps waiting now can still run as one fused step: none has
 * computed its norms, all on one device. */
static bool may_fuse(const dc_group *g) {
    for (uint32_t r = 0; r < g->size; r++)
        if (g->waiting[r] && g->waiting[r]->partial) return false;
    return one_device(g);
}

/* Each unrun step waiting leaves the list to compute its norms and
 * delivers them again (unfuse). */
static void split_unrun(dc_group *g) {
    uint32_t m = 0;
    for (uint32_t r = 0; r < g->size; r++) {
        dc_group_waiter *w = g->waiting[r];
        if (!w || w->partial) continue;
        g->unfusing[m++] = w;
        g->waiting[r] = NULL;
        g->n_waiting--;
    }
    for (uint32_t i = 0; i < m; i++) g->unfusing[i]->unfuse(g->unfusing[i]);
}

/* Every member of a one-daemon group is here. Steps delivered unrun
 * (partial NULL) run as one fused step when all were, on one device: the
 * group step ends, handed to fuse. Otherwise each unrun step leaves the
 * waiting list to compute its norms and delivers them again. Returns false
 * when every member delivered norms (the caller answers). */
static bool fuse_or_split(dc_group *g) {
    uint32_t unrun = 0;
    g->split_devices = !one_device(g);
    for (uint32_t r = 0; r < g->size; r++) unrun += g->waiting[r] && !g->waiting[r]->partial;
    if (unrun == 0) return false;
    if (unrun == g->n_waiting && !g->split_devices) {
        uint32_t n;
        dc_group_waiter *first = dc_group_take_reduced(g, 0, &n);
        first->fuse(first, n);
        return true;
    }
    split_unrun(g);
    return true;
}

int dc_group_join_check(const dc_groups *gs, const dc_group_spec *sp, dc_err *err) {
    if (!sp->name || !sp->name[0] || strlen(sp->name) >= GROUP_NAME_MAX)
        return dc_err_set(err, DC_EINVAL, "join_group.name",
                          "a group name of 1 to %d bytes is needed", GROUP_NAME_MAX - 1);
    if (sp->timeout_ms > gs->max_timeout_ms)
        return dc_err_set(err, DC_EINVAL, "join_group.timeout_ms",
                          "%u ms is over the longest wait this daemon allows, %u ms "
                          "(limits.max_group_timeout_ms)",
                          sp->timeout_ms, gs->max_timeout_ms);
    if (sp->size == 0 || sp->size > gs->max_size)
        return dc_err_set(err, DC_EINVAL, "join_group.size",
                          "size %u outside [1, %u] (limits.max_group_size)", sp->size,
                          gs->max_size);
    if (sp->rank >= sp->size)
        return dc_err_set(err, DC_EINVAL, "join_group.rank", "rank %u outside [0, %u)", sp->rank,
                          sp->size);
    if (sp->clipping != DC_GROUP_NORM_REDUCE && sp->clipping != DC_GROUP_WISE)
        return dc_err_set(err, DC_EINVAL, "join_group.clipping", "unknown clipping %d",
                          (int)sp->clipping);
    if (sp->daemons <= 1 || sp->clipping == DC_GROUP_WISE) return 0;
    if (sp->daemons > sp->size)
        return dc_err_set(err, DC_EINVAL, "join_group.daemons",
                          "%u daemons for %u members: each daemon serves one member or more",
                          sp->daemons, sp->size);
    if (sp->daemon_rank >= sp->daemons)
        return dc_err_set(err, DC_EINVAL, "join_group.daemon_rank", "%u outside [0, %u)",
                          sp->daemon_rank, sp->daemons);
    if (sp->local_size == 0 || sp->local_size > sp->size - (sp->daemons - 1))
        return dc_err_set(err, DC_EINVAL, "join_group.local_size",
                          "%u members on this daemon: outside [1, %u] for %u members on %u "
                          "daemons",
                          sp->local_size, sp->size - (sp->daemons - 1), sp->size, sp->daemons);
    if (sp->rank == 0 && sp->daemon_rank != 0)
        return dc_err_set(err, DC_EINVAL, "join_group.daemon_rank",
                          "rank 0's daemon is daemon 0 (it makes the group's NCCL id)");
    if (!dc_nccl_version()) {
        dc_err_set(err, DC_EUNIMPL, "join_group.daemons",
                   "this dpclipd was built without NCCL: it serves only groups whose members "
                   "all use it (daemons = 1)");
        return err->code;
    }
    if (sp->device < 0)
        return dc_err_set(err, DC_EUNIMPL, "join_group.daemons",
                          "this dpclipd has no GPU, and a group across daemons needs one for "
                          "its NCCL link: it serves only groups whose members all use it");
    if (sp->nccl_id && sp->nccl_version != dc_nccl_version()) {
        char a[24], b[24];
        dc_nccl_version_str(sp->nccl_version, a, sizeof a);
        dc_nccl_version_str(dc_nccl_version(), b, sizeof b);
        return dc_err_set(err, DC_EINVAL, "join_group.nccl_version",
                          "daemon 0 of the group runs NCCL %s, this daemon NCCL %s: the daemons "
                          "of a group need the same NCCL",
                          a, b);
    }
    if (!sp->nccl_id && sp->rank != 0)
        return dc_err_set(err, DC_EINVAL, "join_group.nccl_id",
                          "a member of a group across daemons joins with the NCCL id that rank "
                          "0's join returned");
    return 0;
}

/* A member joining an existing group must agree with it. */
static int join_agrees(const dc_group *g, const dc_group_spec *sp, dc_err *err) {
    bool multi = sp->daemons > 1 && sp->clipping != DC_GROUP_WISE;
    if (g->size != sp->size)
        return dc_err_set(err, DC_EINVAL, "join_group.size",
                          "group '%s' has %u members, this join says %u", g->name, g->size,
                          sp->size);
    if (g->clipping != sp->clipping)
        return dc_err_set(err, DC_EINVAL, "join_group.clipping", "group '%s' clips %s", g->name,
                          g->clipping == DC_GROUP_WISE ? "GROUP_WISE" : "NORM_REDUCE");
    if (g->joined[sp->rank])
        return dc_err_set(err, DC_EINVAL, "join_group.rank",
                          "rank %u of group '%s' has joined already", sp->rank, g->name);
    if ((multi ? sp->daemons : 1) != (g->daemons > 1 ? g->daemons : 1))
        return dc_err_set(err, DC_EINVAL, "join_group.daemons",
                          "group '%s' spans %u daemons, this join says %u", g->name,
                          g->daemons > 1 ? g->daemons : 1, multi ? sp->daemons : 1);
    if (!multi) return 0;
    if (g->daemon_rank != sp->daemon_rank)
        return dc_err_set(err, DC_EINVAL, "join_group.daemon_rank",
                          "this daemon is daemon %u of group '%s', this join says %u",
                          g->daemon_rank, g->name, sp->daemon_rank);
    if (g->local_size != sp->local_size)
        return dc_err_set(err, DC_EINVAL, "join_group.local_size",
                          "group '%s' has %u members on this daemon, this join says %u", g->name,
                          g->local_size, sp->local_size);
    if (!sp->nccl_id || memcmp(sp->nccl_id, g->nccl_id, DC_NCCL_ID_BYTES) != 0)
        return dc_err_set(err, DC_EINVAL, "join_group.nccl_id",
                          "not the NCCL id of group '%s' (rank 0's join returned it)", g->name);
    return 0;
}

int dc_group_join(dc_groups *gs, uint32_t uid, const dc_group_spec *sp, dc_group **out,
                  dc_err *err) {
    dc_group *g;
    int rc;
    if ((rc = dc_group_join_check(gs, sp, err))) return rc;
    for (g = gs->list; g; g = g->next)
        if (!g->dissolved && g->uid == uid && strcmp(g->name, sp->name) == 0) break;
    if (g) {
        if ((rc = join_agrees(g, sp, err))) return rc;
    } else {
        bool multi = sp->daemons > 1 && sp->clipping != DC_GROUP_WISE;
        uint8_t id[DC_NCCL_ID_BYTES];
        /* Daemon 0 makes the id at rank 0's join; anywhere else an id names
         * a group that must be forming already or be made on another daemon. */
        if (multi && sp->nccl_id && sp->daemon_rank == 0)
            return dc_err_set(err, DC_EINVAL, "join_group.nccl_id",
                              "group '%s' is not forming on this daemon (its daemon 0): rank "
                              "0 joins first, without an id, and its reply carries the id",
                              sp->name);
        if (multi && gs->links >= gs->max_links)
            return dc_err_set(err, DC_ENOSPACE, "join_group.daemons",
                              "this daemon holds %u groups across daemons already "
                              "(limits.max_group_links)",
                              gs->links);
        if (multi && !sp->nccl_id && (rc = dc_nccl_unique_id(id, err))) return rc;
        g = calloc(1, sizeof *g);
        if (!g || !(g->joined = calloc(sp->size, sizeof *g->joined)) ||
            !(g->waiting = calloc(sp->size, sizeof *g->waiting)) ||
            !(g->unfusing = calloc(sp->size, sizeof *g->unfusing)) ||
            !(g->job_ids = calloc(sp->size, sizeof *g->job_ids)) ||
            !(g->covered = calloc(sp->size, sizeof *g->covered))) {
            if (g) {
                free(g->joined);
                free(g->waiting);
                free(g->unfusing);
                free(g->job_ids);
            }
            free(g);
            return dc_err_set(err, DC_ENOSPACE, "join_group", "out of memory");
        }
        g->gs = gs;
        g->id = gs->next_id++;
        g->uid = uid;
        snprintf(g->name, sizeof g->name, "%s", sp->name);
        g->size = sp->size;
        g->clipping = sp->clipping;
        g->timeout_ms = sp->timeout_ms ? sp->timeout_ms : gs->timeout_ms;
        g->noise_key = mix(gs->key_seed ^ mix(g->id));
        g->daemons = multi ? sp->daemons : 1;
        gs->links += multi;
        if (multi) {
            g->daemon_rank = sp->daemon_rank;
            g->local_size = sp->local_size;
            g->device = sp->device;
            g->made_id = !sp->nccl_id;
            memcpy(g->nccl_id, sp->nccl_id ? sp->nccl_id : id, DC_NCCL_ID_BYTES);
            g->nccl_version = dc_nccl_version();
            g->link_state = DC_GROUP_LINK_WAITING;
        }
        uv_timer_init(gs->loop, &g->timer);
        g->timer.data = g;
        g->next = gs->list;
        gs->list = g;
        gs->formed++;
    }
    if (g->daemons > 1 && g->n_joined >= g->local_size)
        return dc_err_set(err, DC_EINVAL, "join_group.local_size",
                          "group '%s' has its %u members on this daemon already", g->name,
                          g->local_size);
    g->joined[sp->rank] = true;
    g->n_joined++;
    g->refs++;
    snprintf(g->job_ids[sp->rank], DC_GROUP_JOB_ID_MAX, "%s", sp->job_id ? sp->job_id : "");
    *out = g;
    if ((rc = dc_group_link_open(g, err))) {
        /* the group cannot work: the others' steps fail, this join too */
        char why[256];
        snprintf(why, sizeof why, "its cross-daemon link cannot open: %.200s", err->msg);
        dc_group_dissolve(g, why);
        g->joined[sp->rank] = false;
        g->n_joined--;
        g->refs--;
        dc_group_maybe_free(g);
        *out = NULL;
        return rc;
    }
    return 0;
}

bool dc_group_nccl_id(const dc_group *g, uint8_t id[DC_NCCL_ID_BYTES], uint32_t *version) {
    if (g->daemons <= 1) return false;
    memcpy(id, g->nccl_id, DC_NCCL_ID_BYTES);
    *version = g->nccl_version;
    return true;
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
            dc_group_dissolve(g, msg);
        } else if (g->n_joined == 0) {
            dc_group_dissolve(g, "every member left");
        }
    }
    g->refs--;
    dc_group_maybe_free(g);
}

/* Whether the group takes a delivery from w now. */
static int deliver_check(const dc_group *g, const dc_group_waiter *w, dc_err *err) {
    if (g->dissolved)
        return dc_err_set(err, DC_EUNAVAIL, "join_group",
                          "norm group '%s' was dissolved: %s; every member must join again",
                          g->name, g->why);
    if (w->rank >= g->size || !g->joined[w->rank] || g->waiting[w->rank] ||
        (!w->partial && (g->daemons > 1 || !w->fuse || !w->unfuse)))
        return dc_err_set(err, DC_EINTERNAL, "clip_step", "rank %u cannot deliver", w->rank);
    return 0;
}

int dc_group_deliver(dc_group *g, dc_group_waiter *w, dc_err *err) {
    const char *f;
    int rc;
    if ((rc = deliver_check(g, w, err))) return rc;
    if (g->has_failed && w->step == g->failed) {
        *err = g->failed_err;
        return err->code;
    }
    if (g->active && w->step > g->cur) {
        /* A member moved past the group step in progress: its numbers only
         * increase, so that step cannot complete. It fails on the members
         * waiting in it (their logical step, if any, aborts), and this one
         * opens the next. */
        dc_err e;
        dc_err_set(&e, DC_EUNAVAIL, "clip_step.group_step",
                   "norm group '%s': rank %u moved on to group step %llu, so group step %llu "
                   "was given up",
                   g->name, w->rank, (unsigned long long)w->step, (unsigned long long)g->cur);
        g->has_failed = true;
        g->failed = g->cur;
        g->failed_err = e;
        dc_group_fail_waiting(g, e.code, &e);
        /* what the failed members' sessions did next ran meanwhile: a
         * member leaving dissolved the group, another opened a step */
        if ((rc = deliver_check(g, w, err))) return rc;
    }
    if (g->active && w->step != g->cur)
        return dc_err_set(err, DC_EPRECOND, "clip_step.group_step",
                          "rank %u sent group step %llu while the group is at step %llu", w->rank,
                          (unsigned long long)w->step, (unsigned long long)g->cur);
    if (!g->active) {
        if (w->terms.batch > g->tot_cap) {
            double *t = realloc(g->tot, w->terms.batch * sizeof *t), *r;
            if (t) g->tot = t;
            if (!t || !(r = realloc(g->rep, w->terms.batch * sizeof *r)))
                return dc_err_set(err, DC_ENOSPACE, "clip_step", "out of memory");
            g->rep = r;
            g->tot_cap = w->terms.batch;
        }
        memset(g->tot, 0, w->terms.batch * sizeof *g->tot);
        g->e_max = 0.0;
        g->has_rep = false;
        g->active = true;
        g->cur = w->step;
        g->terms = w->terms;
        g->first_rank = w->rank;
        g->t_first = uv_hrtime();
        uv_timer_start(&g->timer, on_timeout, g->timeout_ms, 0);
    } else if ((f = dc_group_terms_differ(&g->terms, &w->terms))) {
        dc_err e;
        dc_err_set(&e, DC_EINVAL, f,
                   "the members of norm group '%s' disagree on %s in group step %llu (rank %u "
                   "and rank %u)",
                   g->name, f, (unsigned long long)g->cur, g->first_rank, w->rank);
        g->has_failed = true;
        g->failed = g->cur;
        g->failed_err = e;
        dc_group_fail_waiting(g, DC_EINVAL, &e);
        *err = e;
        return DC_EINVAL;
    }
    if (w->replicated && (f = replica_differs(g, w->rank, w->replicated, w->rep_hash))) {
        dc_err e;
        dc_err_set(&e, DC_EINVAL, "clip_step.layers.replicated",
                   "norm group '%s', group step %llu: %s; replicated layers hold the same data "
                   "on every member, whose copies are clipped by one copy's norms",
                   g->name, (unsigned long long)g->cur, f);
        g->has_failed = true;
        g->failed = g->cur;
        g->failed_err = e;
        dc_group_fail_waiting(g, DC_EINVAL, &e);
        *err = e;
        return DC_EINVAL;
    }
    if (w->partial) {
        for (uint32_t b = 0; b < g->terms.batch; b++) g->tot[b] += w->partial[b];
        g->e_max = dc_clip_e_max(g->e_max, w->e);
    }
    g->waiting[w->rank] = w;
    if (!w->wait_ns) w->wait_ns = uv_hrtime(); /* kept from a fusable delivery */
    if (++g->n_waiting < local_members(g)) {
        /* Steps that can no longer fuse (members on several GPUs) compute
         * their norms now rather than after the last member's arrival. */
        if (g->daemons <= 1 && (g->split_devices || !may_fuse(g))) split_unrun(g);
        return 0;
    }
    if (g->daemons <= 1) {
        /* every member is here: the totals go to each */
        if (!fuse_or_split(g)) dc_group_answer(g, 0);
        return 0;
    }
    /* this daemon's members are here: the link's own deadline bounds the
     * rest (forming, exchanging) */
    uv_timer_stop(&g->timer);
    g->t_local = uv_hrtime();
    g->exchange_due = true;
    if (g->link_state == DC_GROUP_LINK_READY) dc_group_exchange_start(g);
    return 0;
}

void dc_group_fail(dc_group *g, uint32_t rank, uint64_t step, const dc_err *err) {
    dc_err e;
    if (!g || g->dissolved) return;
    g->t_norms = 0; /* no exchange for that step, if it was this daemon's first */
    dc_err_set(&e, err->code, err->field, "rank %u of norm group '%s' failed group step %llu: %s",
               rank, g->name, (unsigned long long)step, err->msg);
    g->has_failed = true;
    g->failed = step;
    g->failed_err = e;
    if (g->active && g->cur == step) dc_group_fail_waiting(g, e.code, &e);
}

static uint32_t leader(const dc_group *g) {
    for (uint32_t r = 0; r < g->size; r++)
        if (g->joined[r]) return r;
    return UINT32_MAX;
}

bool dc_group_covers(dc_group *g, uint32_t rank, uint64_t step, float sigma, const char *job_id) {
    uint32_t lead = leader(g);
    if (g->dissolved || rank >= g->size || rank == lead || lead == UINT32_MAX) return false;
    if (!job_id || strncmp(job_id, g->job_ids[lead], DC_GROUP_JOB_ID_MAX) != 0) return false;
    if (g->clipping == DC_GROUP_NORM_REDUCE) return true;
    if (step <= g->covered[rank]) return false; /* covered once, in order */
    for (uint32_t i = 0; i < g->n_charges; i++) {
        const group_charge *c = &g->charges[i];
        if (c->step == step && sigma >= c->sigma &&
            strncmp(job_id, c->job_id, DC_GROUP_JOB_ID_MAX) == 0) {
            g->covered[rank] = step;
            return true;
        }
    }
    return false;
}

void dc_group_charged(dc_group *g, uint32_t rank, uint64_t step, float sigma, const char *job_id) {
    group_charge *c;
    if (rank != leader(g)) return;
    c = &g->charges[g->next_charge];
    g->next_charge = (g->next_charge + 1) % DC_GROUP_CHARGED_WINDOW;
    if (g->n_charges < DC_GROUP_CHARGED_WINDOW) g->n_charges++;
    c->step = step;
    c->sigma = sigma;
    snprintf(c->job_id, sizeof c->job_id, "%s", job_id ? job_id : "");
}

uint64_t dc_group_id(const dc_group *g) { return g->id; }
const char *dc_group_name(const dc_group *g) { return g->name; }
uint32_t dc_group_size(const dc_group *g) { return g->size; }
uint32_t dc_group_joined(const dc_group *g) { return g->n_joined; }
uint32_t dc_group_daemons(const dc_group *g) { return g->daemons > 1 ? g->daemons : 1; }
dc_group_clipping dc_group_clipping_of(const dc_group *g) { return g->clipping; }
uint64_t dc_group_noise_key(const dc_group *g) { return g->noise_key; }

void dc_group_fused(dc_group *g) {
    g->gs->reductions++;
    g->gs->fused++;
    g->reductions++;
}
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
        o->step = g->active ? g->cur : 0;
        o->reductions = g->reductions;
        o->last_wait_ns = g->last_wait_ns;
        o->daemons = g->daemons;
        o->daemon_rank = g->daemon_rank;
        o->local_size = g->daemons > 1 ? g->local_size : g->size;
        o->link = g->link_state;
        o->exchanges = g->exchanges;
        o->exchanges_polled = g->exchanges_polled;
        o->last_exchange_ns = g->last_exchange_ns;
        snprintf(o->why, sizeof o->why, "%.150s", g->dissolved ? g->why : "");
    }
    return n;
}
