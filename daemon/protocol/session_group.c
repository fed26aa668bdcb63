/* A session's norm group: JoinGroup, and the grouped step's stages.
 *
 * A step of a NORM_REDUCE group on one daemon is delivered to the group
 * unrun; once every member's step is there, on one device, they run as one
 * fused step (step_fuse.c: one norm pass over every member's layers, no
 * round trip between phases), unless groups.fuse is off. Otherwise (a
 * group across daemons, members on different devices) it runs as two
 * worker tasks with the group's reduction between them (group.c):
 *   1. norm phase (the backend's run_norms): the step's own squared layer
 *      norms; their per-sample sum over the member's layers (replicated
 *      layers counted by rank 0 only) goes to the group;
 *   2. once every member has delivered, the group's per-sample totals come
 *      back and the clip phase (run_clip) clips by them, adds the noise and
 *      writes the outputs; dc_session_step_done replies.
 * Validation and the ledger come before (session_step.c): rank 0 is charged
 * for the group step, the other members not (their steps are the same
 * logical step). A GROUP_WISE group needs no reduction: each member's step
 * runs whole, clipped to C / sqrt(size), noised at sigma * C. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "host.h"
#include "log.h"
#include "session_int.h"
#include "step_fuse.h"
#include "validate.h"
#include "step_run.h"

_Static_assert(DC_LEDGER_JOB_ID_MAX <= DC_GROUP_JOB_ID_MAX,
               "a group keeps each member's ledger job id whole");

void dc_session_join_group(dc_session *s, uint64_t id, const Dpclip__JoinGroup *m) {
    dc_host *host = s->host;
    Dpclip__Reply reply = DPCLIP__REPLY__INIT;
    Dpclip__JoinGroupReply jr = DPCLIP__JOIN_GROUP_REPLY__INIT;
    dc_group_spec sp;
    uint8_t nccl_id[DC_NCCL_ID_BYTES];
    uint32_t nccl_version;
    dc_group *g;
    dc_err e;

    if (m->nccl_id.len && m->nccl_id.len != DC_NCCL_ID_BYTES) {
        dc_err_set(&e, DC_EINVAL, "join_group.nccl_id", "%zu bytes; an NCCL id has %d",
                   m->nccl_id.len, DC_NCCL_ID_BYTES);
        dc_session_reject(s, id, &e);
        return;
    }
    memset(&sp, 0, sizeof sp);
    sp.name = m->name;
    sp.rank = m->rank;
    sp.size = m->size;
    sp.timeout_ms = m->timeout_ms;
    sp.clipping = (dc_group_clipping)m->clipping;
    sp.daemons = m->daemons;
    sp.daemon_rank = m->daemon_rank;
    sp.local_size = m->local_size;
    sp.nccl_id = m->nccl_id.len ? m->nccl_id.data : NULL;
    sp.nccl_version = m->nccl_version;
    sp.job_id = s->account ? s->account->job_id : s->job_id; /* coverage is per account */
    /* the link's few bytes per step travel through the daemon's first GPU */
    sp.device = host->gpu->n > 0 ? 0 : -1;
    /* A join refused on its own terms leaves the current group alone; one
     * that could go ahead leaves it first (the same group may be joined
     * again: its rank must be free). */
    if (dc_group_join_check(host->groups, &sp, &e)) {
        dc_session_reject(s, id, &e);
        return;
    }
    dc_session_group_leave(s, "it joined again");
    if (dc_group_join(host->groups, (uint32_t)s->peer_uid, &sp, &g, &e)) {
        dc_session_reject(s, id, &e);
        return;
    }
    s->group = g;
    s->group_rank = m->rank;
    s->group_steps = 0;
    dc_log_info("session %llu: joins norm group '%s' %llu as rank %u of %u%s",
                (unsigned long long)s->id, m->name, (unsigned long long)dc_group_id(g), m->rank,
                m->size, m->daemons > 1 ? " (across daemons)" : "");
    jr.group_id = dc_group_id(g);
    jr.members = dc_group_joined(g);
    if (dc_group_nccl_id(g, nccl_id, &nccl_version)) {
        jr.nccl_id.data = nccl_id;
        jr.nccl_id.len = DC_NCCL_ID_BYTES;
        jr.nccl_version = nccl_version;
    }
    reply.id = id;
    reply.body_case = DPCLIP__REPLY__BODY_JOIN_GROUP;
    reply.join_group = &jr;
    dc_session_send(s, &reply);
}

/* FNV-1a over the replicated layers' names, in order: members must agree. */
static uint64_t replicated_hash(const dc_step *st) {
    uint64_t h = 0xcbf29ce484222325ull;
    for (size_t l = 0; l < st->n_layers; l++) {
        if (!st->layers[l].replicated) continue;
        for (const char *p = st->layers[l].name; *p; p++) h = (h ^ (uint8_t)*p) * 0x100000001b3ull;
        h = (h ^ 0xff) * 0x100000001b3ull;
    }
    return h;
}

int dc_session_group_prepare(dc_session *s, dc_step_call *sc, dc_err *e) {
    const struct dc_step_params *m = &sc->params;
    dc_step *st = &sc->step;
    bool replicated = false;
    const char *why;
    for (size_t l = 0; l < st->n_layers; l++) replicated |= st->layers[l].replicated;
    if (!s->group) {
        if (replicated)
            return dc_err_set(e, DC_EINVAL, "clip_step.layers.replicated",
                              "replicated layers need a norm group (JoinGroup)");
        if (m->group_step)
            return dc_err_set(e, DC_EPRECOND, "clip_step.group_step",
                              "this session is in no norm group (JoinGroup)");
        return 0;
    }
    dc_group *g = s->group;
    if (dc_group_dissolved(g, &why))
        return dc_err_set(e, DC_EUNAVAIL, "join_group",
                          "norm group '%s' was dissolved: %s; every member must join again",
                          dc_group_name(g), why);
    if (st->mode == DC_CLIP_PER_LAYER)
        return dc_err_set(e, DC_EINVAL, "clip_step.clip.mode",
                          "per-layer clipping needs no norm group: each member clips its own "
                          "layers (leave the group)");
    /* A micro-batch of a logical step, numbered implicitly, takes the group
     * step its (logical step, micro-batch) names: every member numbers it
     * alike, whatever micro-batches a member dropped before (a pipeline
     * stage that gave up a logical step part-way). */
    uint64_t implicit = s->group_steps + 1;
    if (!m->group_step && m->logical_id) {
        if (m->logical_id >= DC_GROUP_STEP_MAX >> DC_GROUP_MICRO_BITS ||
            m->micro_batch >= (1u << DC_GROUP_MICRO_BITS))
            return dc_err_set(e, DC_EINVAL, "clip_step.logical",
                              "logical step %llu, micro-batch %u: a norm group numbers its "
                              "micro-batches below 2^%d and its logical steps below 2^%d",
                              (unsigned long long)m->logical_id, m->micro_batch,
                              DC_GROUP_MICRO_BITS, 62 - DC_GROUP_MICRO_BITS);
        implicit = (m->logical_id << DC_GROUP_MICRO_BITS) + m->micro_batch;
        if (implicit <= s->group_steps)
            return dc_err_set(e, DC_EINVAL, "clip_step.logical",
                              "logical step %llu, micro-batch %u: this member is at group step "
                              "%llu already (logical steps only increase)",
                              (unsigned long long)m->logical_id, m->micro_batch,
                              (unsigned long long)s->group_steps);
    }
    /* Group steps only go forward: a step number taken again could claim
     * the leader's charge for a step already released. And they stay far
     * from wrapping (DC_GROUP_STEP_MAX). */
    if (m->group_step > DC_GROUP_STEP_MAX || (!m->group_step && implicit > DC_GROUP_STEP_MAX))
        return dc_err_set(e, DC_EINVAL, "clip_step.group_step",
                          "group step %llu: group steps run from 1 to %llu",
                          (unsigned long long)(m->group_step ? m->group_step : implicit),
                          (unsigned long long)DC_GROUP_STEP_MAX);
    if (m->group_step && m->group_step <= s->group_steps)
        return dc_err_set(e, DC_EINVAL, "clip_step.group_step",
                          "group step %llu: this member is at group step %llu already (group "
                          "steps only increase)",
                          (unsigned long long)m->group_step, (unsigned long long)s->group_steps);
    sc->group_step = m->group_step ? m->group_step : implicit;
    if (dc_group_clipping_of(g) == DC_GROUP_WISE) {
        /* He et al.: C_k = C / sqrt(K), so that sum_k C_k^2 = C^2; the
         * noise stays sigma * C on every coordinate */
        if (replicated)
            return dc_err_set(e, DC_EINVAL, "clip_step.layers.replicated",
                              "a GROUP_WISE group cannot share replicated layers (each member "
                              "clips to its own threshold): give each to one member");
        st->noise_norm = st->max_grad_norm;
        st->max_grad_norm = (float)(st->max_grad_norm / sqrt((double)dc_group_size(g)));
        s->group_steps = sc->group_step;
        return 0;
    }
    if (m->notify_enqueued)
        return dc_err_set(e, DC_EINVAL, "clip_step.notify_enqueued",
                          "a step of a NORM_REDUCE group has no early notice: its outputs are "
                          "queued only once every member's norms are in");
    sc->grouped = true;
    sc->group_id = dc_group_id(g);
    st->group_noise_key = dc_group_noise_key(g);
    st->group_step = sc->group_step;
    sc->gw.terms.batch = st->batch;
    sc->gw.terms.max_grad_norm = st->max_grad_norm;
    sc->gw.terms.noise_multiplier = st->noise_multiplier;
    sc->gw.terms.reduction = (int)st->reduction;
    sc->gw.terms.expected_batch = st->expected_batch;
    sc->gw.terms.replicated_hash = replicated_hash(st);
    sc->gw.terms.logical_id = m->logical_id;
    sc->gw.terms.micro_batch = m->micro_batch;
    sc->gw.terms.commit = m->commit;
    return 0;
}

/* --- the stages ------------------------------------------------------------ */

/* The group's totals (or why the group step failed). */
static void on_totals(dc_group_waiter *w, int rc, const double *tot, const dc_err *err) {
    dc_step_call *sc = w->arg;
    dc_session *s = sc->s;
    if (rc) {
        sc->rc = rc;
        sc->err = *err;
        dc_session_step_done(&sc->task);
        return;
    }
    memcpy(sc->tot, tot, sc->step.batch * sizeof *sc->tot);
    sc->e_min = w->e_group;
    /* across daemons the group's noise key is daemon 0's, known once the
     * totals came through the link (group.c) */
    if (s->group) sc->step.group_noise_key = dc_group_noise_key(s->group);
    sc->group_wait_ns = w->wait_ns;
    sc->group_exchange_ns = w->exchange_ns;
    /* From here the other members may release their parts of this step:
     * rank 0's charge for it stands whatever happens to its own part. */
    if (s->group_rank == 0) sc->res.released = true;
    sc->task.work = dc_step_run_clip_work;
    sc->task.done = dc_session_step_done;
    dc_worker_pool_submit(dc_session_step_pool(sc), &sc->task);
}

static void norms_done(dc_task *task) {
    dc_step_call *sc = (dc_step_call *)task;
    dc_session *s = sc->s;
    const uint32_t B = sc->step.batch;
    dc_err e;
    if (!s->group) { /* it left meanwhile */
        dc_err_set(&sc->err, DC_EUNAVAIL, "join_group", "the session left its norm group");
        sc->rc = DC_EUNAVAIL;
        dc_session_step_done(task);
        return;
    }
    if (sc->rc) {
        dc_group_fail(s->group, s->group_rank, sc->group_step, &sc->err);
        dc_session_step_done(task);
        return;
    }
    /* This member's part of each sample's squared norm: a replicated
     * layer's is counted by rank 0 alone. */
    bool replicated = false;
    for (uint32_t b = 0; b < B; b++) {
        double p = 0.0, r = 0.0;
        for (size_t l = 0; l < sc->step.n_layers; l++) {
            const bool rl = sc->step.layers[l].replicated;
            if (!rl || s->group_rank == 0) p += sc->n2[l * B + b];
            if (rl) r += sc->n2[l * B + b];
            replicated |= rl;
        }
        sc->partial[b] = p;
        sc->rep[b] = r;
    }
    sc->gw.partial = sc->partial; /* the rest was set at submission */
    /* every member's copy of the replicated layers is measured against the
     * others' (the one counted is rank 0's) */
    sc->gw.replicated = replicated ? sc->rep : NULL;
    s->group_steps = sc->group_step;
    if ((sc->rc = dc_group_deliver(s->group, &sc->gw, &e))) {
        sc->err = e;
        dc_session_step_done(task);
    }
}

/* --- fused: every member's step as one (step_fuse.c) ------------------------ */

static void fused_done(dc_task *task) {
    dc_step_fused *f = (dc_step_fused *)task;
    dc_step_fuse_split(f);
    /* every member's reply first (they wait for it), then each session's
     * bookkeeping, which may start its next request */
    for (uint32_t i = 0; i < f->n; i++) dc_session_step_reply(f->members[i]);
    for (uint32_t i = 0; i < f->n; i++) dc_session_step_finish(f->members[i]);
    dc_step_fuse_free(f);
    free(f);
}

static void submit_norms(dc_step_call *sc);

/* The group's every member is here, unrun, on one device (loop thread),
 * chained in rank order through next_call; the members are chained through
 * their step calls (fuse_next) before any reply. */
static void on_fuse(dc_group_waiter *all, uint32_t n) {
    dc_step_call *first = all->arg, *chain = NULL, **tail = &chain;
    dc_step_fused *f = malloc(sizeof *f);
    dc_err e;
    for (dc_group_waiter *w = all; w; w = w->next_call) {
        dc_step_call *sc = w->arg;
        *tail = sc;
        tail = &sc->fuse_next;
        /* rank 0's charge for this group step stands from here, whatever
         * happens to the step (as on_totals) */
        if (sc->s->group_rank == 0) sc->res.released = true;
    }
    *tail = NULL;
    if (!f || dc_step_fuse_build(f, chain, n, &e)) {
        if (!f) dc_err_set(&e, DC_ENOSPACE, "clip_step", "out of memory");
        free(f);
        while (chain) {
            dc_step_call *sc = chain;
            chain = sc->fuse_next;
            sc->rc = e.code;
            sc->err = e;
            dc_session_step_done(&sc->task);
        }
        return;
    }
    if (dc_validate_step_cost(&f->step, first->s->host->limits, &e)) {
        /* every member's step fits the per-step limits, their sum may not:
         * each runs its own phases instead (a new reduction of this step) */
        dc_step_fuse_free(f);
        free(f);
        while (chain) {
            dc_step_call *sc = chain;
            chain = sc->fuse_next;
            sc->gw.wait_ns = 0;
            submit_norms(sc);
        }
        return;
    }
    if (first->s->group) dc_group_fused(first->s->group);
    f->task.work = dc_step_fuse_work;
    f->task.done = fused_done;
    f->task.owner = first->task.owner;
    dc_worker_pool_submit(dc_session_step_pool(first), &f->task);
    dc_session_step_expect(first, uv_hrtime());
}

static void submit_norms(dc_step_call *sc) {
    sc->task.work = dc_step_run_norms_work;
    sc->task.done = norms_done;
    sc->t_submit = uv_hrtime();
    dc_worker_pool_submit(dc_session_step_pool(sc), &sc->task);
    if (sc->s->group) dc_group_norms_started(sc->s->group); /* the exchange's window */
}

/* Not every member's step can join a fused one: this one computes its
 * norms and delivers them to the same group step. */
static void on_unfuse(dc_group_waiter *w) { submit_norms(w->arg); }

void dc_session_group_submit(dc_step_call *sc) {
    dc_session *s = sc->s;
    dc_err e;
    size_t LB = sc->step.n_layers * (size_t)sc->step.batch;
    /* The step may have waited (its curve, its spend on disk) while the
     * session left the group it was prepared for: its client went, or the
     * group was dissolved and freed. Nothing of it runs then. */
    if (!s->group || s->gone || dc_group_id(s->group) != sc->group_id) {
        dc_err_set(&sc->err, DC_EUNAVAIL, "join_group",
                   "the session left its norm group while this step waited for the ledger");
        sc->rc = DC_EUNAVAIL;
        dc_session_step_done(&sc->task);
        return;
    }
    sc->n2 = malloc(LB * sizeof *sc->n2);
    sc->partial = malloc(sc->step.batch * sizeof *sc->partial);
    sc->tot = malloc(sc->step.batch * sizeof *sc->tot);
    sc->rep = malloc(sc->step.batch * sizeof *sc->rep);
    sc->seal = malloc((sc->step.n_layers ? sc->step.n_layers : 1) * sizeof *sc->seal);
    if (!sc->n2 || !sc->partial || !sc->tot || !sc->rep || !sc->seal) {
        dc_err_set(&sc->err, DC_ENOSPACE, "clip_step", "out of memory");
        sc->rc = DC_ENOSPACE;
        dc_group_fail(s->group, s->group_rank, sc->group_step, &sc->err);
        dc_session_step_done(&sc->task);
        return;
    }
    sc->gw.rank = s->group_rank;
    sc->gw.step = sc->group_step;
    sc->gw.done = on_totals;
    sc->gw.arg = sc;
    sc->gw.wait_ns = 0;
    sc->gw.device = sc->step.device;
    sc->gw.fuse = on_fuse;
    sc->gw.unfuse = on_unfuse;
    sc->gw.replicated = NULL;
    if (s->host->cfg.group_fuse && dc_group_daemons(s->group) <= 1) {
        sc->gw.partial = NULL; /* unrun: the group decides (group.h) */
        sc->t_submit = uv_hrtime();
        s->group_steps = sc->group_step;
        if ((sc->rc = dc_group_deliver(s->group, &sc->gw, &e))) {
            sc->err = e;
            dc_session_step_done(&sc->task);
        }
        return;
    }
    submit_norms(sc);
}
