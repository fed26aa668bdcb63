#include "step_logical.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <uv.h>

#include "host.h"
#include "log.h"
#include "session.h"
#include "step_pass.h"

/* One output of one layer of the logical step: what every micro-batch must
 * name there, and its accumulator. */
typedef struct logical_out {
    const void *dst; /* the output tensor (daemon address); NULL: none */
    dc_dtype dtype;
    int ndim;
    int64_t shape[3];
    uint64_t n;
    float *acc; /* allocated by the backend, n floats; NULL: not yet */
} logical_out;

struct dc_logical {
    uint64_t id; /* the logical step open, or the last one */
    bool open, aborted;
    /* in phases (a sharded model's): each micro-batch a STEP_NORMS pass and
     * its STEP_SUMS steps; the outputs are then per layer of the pass (its
     * index), their shapes taken from the first sums step that names them
     * (the trainer's staging may sit at one address for several layers) */
    bool phased;
    char why[200]; /* what aborted it */
    uint32_t next; /* its next micro-batch */
    uint64_t opened_ns;
    /* the terms every micro-batch repeats */
    uint32_t expected_batch;
    float max_grad_norm, noise_multiplier;
    dc_reduction reduction;
    dc_clip_mode mode;
    double q, target_delta, target_epsilon;
    dc_dp_member dp;
    /* the outputs, [2 * n_layers] (weight, bias), on `device` */
    size_t n_layers;
    logical_out *outs;
    int device;
    uint64_t bytes; /* accumulators allocated */
};

static uint64_t out_bytes(const dc_tensor *t) {
    uint64_t n = 1;
    if (!t->data) return 0;
    for (int i = 0; i < t->ndim; i++) n *= (uint64_t)t->shape[i];
    return n;
}

/* --- accumulators back to their backend -------------------------------------- */

typedef struct free_task {
    dc_task task;
    size_t n;
    float *p[];
} free_task;

static void free_work(dc_task *task, dc_backend *be) {
    free_task *f = (free_task *)task;
    for (size_t i = 0; i < f->n; i++) dc_backend_acc_free(be, f->p[i]);
}

static void free_done(dc_task *task) { free(task); }

/* The accumulators of lg go (lg keeps its layout, without them). Host
 * memory is freed here; device memory by a task on its GPU's worker, which
 * owns the context (and its stream may still read them). */
static void drop_accumulators(const dc_host *host, dc_logical *lg) {
    size_t n = 0;
    free_task *f;
    for (size_t i = 0; i < 2 * lg->n_layers; i++) n += lg->outs[i].acc != NULL;
    if (n == 0) return;
    if (lg->device < 0 || lg->device >= host->gpu->n ||
        !(f = malloc(sizeof *f + n * sizeof f->p[0]))) {
        /* host memory; or (out of memory for the task) leaked rather than
         * freed on the wrong thread */
        for (size_t i = 0; i < 2 * lg->n_layers; i++)
            if (lg->device < 0) free(lg->outs[i].acc);
    } else {
        f->n = 0;
        for (size_t i = 0; i < 2 * lg->n_layers; i++)
            if (lg->outs[i].acc) f->p[f->n++] = lg->outs[i].acc;
        memset(&f->task, 0, sizeof f->task);
        f->task.work = free_work;
        f->task.done = free_done;
        dc_worker_pool_submit(&host->gpu->pools[lg->device], &f->task);
    }
    for (size_t i = 0; i < 2 * lg->n_layers; i++) lg->outs[i].acc = NULL;
    lg->bytes = 0;
}

static void abort_logical(dc_session *s, const char *why) {
    dc_logical *lg = s->logical;
    if (!lg || !lg->open) return;
    lg->open = false;
    lg->aborted = true;
    snprintf(lg->why, sizeof lg->why, "%s", why);
    dc_log_info("session %llu: logical step %llu aborted after %u micro-batches: %s; nothing "
                "was written or charged",
                (unsigned long long)s->id, (unsigned long long)lg->id, lg->next, why);
}

/* --- the stage ----------------------------------------------------------------- */

/* The field a micro-batch's terms differ from its logical step's in. */
static const char *terms_differ(const dc_logical *lg, const dc_step_call *sc) {
    const dc_step *st = &sc->step;
    const struct dc_step_params *m = &sc->params;
    if (st->max_grad_norm != lg->max_grad_norm) return "clip_step.clip.max_grad_norm";
    if (st->noise_multiplier != lg->noise_multiplier) return "clip_step.noise_multiplier";
    if (st->reduction != lg->reduction) return "clip_step.clip.loss_reduction";
    /* the divisor of a MEAN step (a SUM step divides by nothing) */
    if (st->reduction == DC_REDUCTION_MEAN && st->expected_batch != lg->expected_batch)
        return "clip_step.clip.expected_batch_size";
    if (st->mode != lg->mode) return "clip_step.clip.mode";
    if (m->sample_rate != lg->q) return "clip_step.sample_rate";
    if (m->target_delta != lg->target_delta) return "clip_step.target_delta";
    if (m->target_epsilon != lg->target_epsilon) return "clip_step.target_epsilon";
    if (memcmp(&m->dp, &lg->dp, sizeof m->dp) != 0) return "clip_step.data_parallel";
    if (st->device != lg->device) return "clip_step";
    return NULL;
}

static bool out_same(const logical_out *o, const dc_tensor *t) {
    if (o->dst != t->data) return false;
    if (!t->data) return true;
    if (o->dtype != t->dtype || o->ndim != t->ndim) return false;
    for (int i = 0; i < t->ndim; i++)
        if (o->shape[i] != t->shape[i]) return false;
    return true;
}

static void out_keep(logical_out *o, const dc_tensor *t) {
    float *acc = o->acc;
    memset(o, 0, sizeof *o);
    o->acc = acc;
    o->dst = t->data;
    o->dtype = t->dtype;
    o->ndim = t->ndim;
    memcpy(o->shape, t->shape, sizeof o->shape);
    o->n = out_bytes(t);
}

/* Whether the step's outputs are the logical step's layout (layer by layer;
 * in phases, the pass's layer count: the sums steps check each output). */
static bool layout_same(const dc_logical *lg, const dc_step *st, bool phased) {
    if (lg->n_layers != st->n_layers || lg->device != st->device || lg->phased != phased)
        return false;
    if (phased) return true;
    for (size_t l = 0; l < st->n_layers; l++)
        if (!out_same(&lg->outs[2 * l], &st->layers[l].weight_grad_out) ||
            !out_same(&lg->outs[2 * l + 1], &st->layers[l].bias_grad_out))
            return false;
    return true;
}

/* `need` more bytes of accumulators for the session, against the user's
 * and the daemon's limits (those held already count in the usage). */
static int acc_limits(dc_session *s, uint64_t need, dc_err *e) {
    dc_host *host = s->host;
    dc_uid_usage mine, all;
    if (!need) return 0;
    dc_host_uid_usage(host, (uint32_t)s->peer_uid, &mine, &all);
    if (mine.acc_bytes + need > host->cfg.max_accumulator_memory_per_uid)
        return dc_err_set(e, DC_ENOSPACE, "limits.max_accumulator_memory_per_uid",
                          "a logical step's accumulators of %llu more bytes would take uid %u's "
                          "past %llu bytes (limits.max_accumulator_memory_per_uid; %llu held)",
                          (unsigned long long)need, (unsigned)s->peer_uid,
                          (unsigned long long)host->cfg.max_accumulator_memory_per_uid,
                          (unsigned long long)mine.acc_bytes);
    if (all.acc_bytes + need > host->cfg.max_accumulator_memory)
        return dc_err_set(e, DC_ENOSPACE, "limits.max_accumulator_memory",
                          "a logical step's accumulators of %llu more bytes would take the "
                          "daemon's past %llu bytes (limits.max_accumulator_memory; %llu held)",
                          (unsigned long long)need,
                          (unsigned long long)host->cfg.max_accumulator_memory,
                          (unsigned long long)all.acc_bytes);
    return 0;
}

/* Micro-batch 0: a new logical step, on the accumulators of the last one
 * where the outputs are the same, else on a new layout (the old
 * accumulators go). */
static int open_logical(dc_session *s, dc_step_call *sc, dc_err *e) {
    dc_host *host = s->host;
    const dc_step *st = &sc->step;
    dc_logical *lg = s->logical;
    uint64_t need = 0;
    if (lg && sc->params.logical_id <= lg->id)
        return dc_err_set(e, DC_EINVAL, "clip_step.logical.id",
                          "logical step %llu: this session's logical steps are numbered up, and "
                          "it had %llu already",
                          (unsigned long long)sc->params.logical_id, (unsigned long long)lg->id);
    if (lg && lg->open) abort_logical(s, "the next logical step was opened before its commit");
    const bool phased = sc->params.phase == DC_PHASE_NORMS;
    if (lg && !layout_same(lg, st, phased)) {
        drop_accumulators(host, lg);
        free(lg->outs);
        lg->outs = NULL;
        lg->n_layers = 0;
    }
    if (!lg) {
        if (!(lg = s->logical = calloc(1, sizeof *lg)))
            return dc_err_set(e, DC_ENOSPACE, "clip_step", "out of memory");
    }
    if (!lg->outs) {
        if (!(lg->outs = calloc(2 * (st->n_layers ? st->n_layers : 1), sizeof *lg->outs)))
            return dc_err_set(e, DC_ENOSPACE, "clip_step", "out of memory");
        lg->n_layers = st->n_layers;
        lg->device = st->device;
        lg->phased = phased;
        for (size_t l = 0; l < st->n_layers && !phased; l++) {
            out_keep(&lg->outs[2 * l], &st->layers[l].weight_grad_out);
            out_keep(&lg->outs[2 * l + 1], &st->layers[l].bias_grad_out);
        }
    }
    /* what its accumulators will hold, against the user's and the daemon's
     * limits (those held already count in the usage) */
    for (size_t i = 0; i < 2 * lg->n_layers; i++)
        if (!lg->outs[i].acc) need += lg->outs[i].n * sizeof(float);
    if (acc_limits(s, need, e)) return e->code;
    lg->id = sc->params.logical_id;
    lg->open = true;
    lg->aborted = false;
    lg->why[0] = '\0';
    lg->next = 0;
    lg->opened_ns = uv_hrtime();
    lg->expected_batch = st->expected_batch;
    lg->max_grad_norm = st->max_grad_norm;
    lg->noise_multiplier = st->noise_multiplier;
    lg->reduction = st->reduction;
    lg->mode = st->mode;
    lg->q = sc->params.sample_rate;
    lg->target_delta = sc->params.target_delta;
    lg->target_epsilon = sc->params.target_epsilon;
    lg->dp = sc->params.dp;
    return 0;
}

/* Micro-batch k > 0: of the logical step open, next in order, its terms
 * and outputs. */
static int continue_logical(dc_session *s, dc_step_call *sc, dc_err *e) {
    const dc_host_cfg *c = &s->host->cfg;
    dc_logical *lg = s->logical;
    const char *f;
    if (!lg || lg->id != sc->params.logical_id)
        return dc_err_set(e, DC_EPRECOND, "clip_step.logical.id",
                          "logical step %llu is not open on this session: micro-batch 0 opens it",
                          (unsigned long long)sc->params.logical_id);
    if (lg->aborted)
        return dc_err_set(e, DC_EPRECOND, "clip_step.logical",
                          "logical step %llu was aborted (%s): nothing of it was written or "
                          "charged; open a new one",
                          (unsigned long long)lg->id, lg->why);
    if (!lg->open)
        return dc_err_set(e, DC_EPRECOND, "clip_step.logical",
                          "logical step %llu was committed already", (unsigned long long)lg->id);
    if (sc->params.micro_batch != lg->next)
        return dc_err_set(e, DC_EINVAL, "clip_step.logical.micro_batch",
                          "logical step %llu expects micro-batch %u, got %u",
                          (unsigned long long)lg->id, lg->next, sc->params.micro_batch);
    if ((f = terms_differ(lg, sc)))
        return dc_err_set(e, DC_EINVAL, f,
                          "every micro-batch of logical step %llu carries its terms: %s differs "
                          "from micro-batch 0's",
                          (unsigned long long)lg->id, f);
    if (!layout_same(lg, &sc->step, sc->params.phase == DC_PHASE_NORMS))
        return dc_err_set(e, DC_EINVAL, "clip_step.layers",
                          "every micro-batch of logical step %llu names the same outputs, layer "
                          "by layer, as micro-batch 0",
                          (unsigned long long)lg->id);
    if (lg->next >= c->max_micro_batches)
        return dc_err_set(e, DC_ENOSPACE, "limits.max_micro_batches",
                          "logical step %llu has %u micro-batches, the limit "
                          "(limits.max_micro_batches)",
                          (unsigned long long)lg->id, lg->next);
    if (uv_hrtime() - lg->opened_ns > (uint64_t)(c->logical_step_timeout * 1e9))
        return dc_err_set(e, DC_EUNAVAIL, "limits.logical_step_timeout",
                          "logical step %llu has been open longer than %g s "
                          "(limits.logical_step_timeout)",
                          (unsigned long long)lg->id, c->logical_step_timeout);
    return 0;
}

/* A sums step of a micro-batch's pass (the pass matched its layers and
 * its ClipStep.logical: sc->pass_at): of the logical step open, its outputs
 * of the shapes the logical step has for those layers of the pass (taken
 * from the first sums step that names them, within the limits). */
static int sums_logical(dc_session *s, dc_step_call *sc, dc_err *e) {
    dc_logical *lg = s->logical;
    const dc_step *st = &sc->step;
    uint64_t need = 0;
    if (!lg || !lg->open || !lg->phased || lg->id != sc->params.logical_id ||
        lg->next != sc->params.micro_batch + 1)
        return dc_err_set(e, DC_EPRECOND, "clip_step.logical",
                          "this sums step's logical step %llu, micro-batch %u, is not the "
                          "session's open one",
                          (unsigned long long)sc->params.logical_id, sc->params.micro_batch);
    /* a whole step: no accumulator */
    if (sc->params.micro_batch == 0 && sc->params.commit) return 0;
    for (size_t l = 0; l < st->n_layers; l++)
        for (int k = 0; k < 2; k++) {
            const dc_tensor *t = k ? &st->layers[l].bias_grad_out : &st->layers[l].weight_grad_out;
            logical_out *o = &lg->outs[2 * sc->pass_at[l] + (size_t)k];
            if (!t->data) continue;
            if (o->n && (o->dtype != t->dtype || o->ndim != t->ndim ||
                         memcmp(o->shape, t->shape, sizeof o->shape) != 0))
                return dc_err_set(e, DC_EINVAL, "clip_step.layers",
                                  "layer %zu ('%s'): every micro-batch of logical step %llu "
                                  "names its outputs with the same dtype and shape",
                                  l, st->layers[l].name, (unsigned long long)lg->id);
            if (!o->n) {
                out_keep(o, t);
                if (!o->acc) need += o->n * sizeof(float);
            }
        }
    return acc_limits(s, need, e);
}

int dc_logical_prepare(dc_session *s, dc_step_call *sc, dc_err *e) {
    const struct dc_step_params *m = &sc->params;
    dc_logical *lg = s->logical;
    int rc;
    if (!m->logical_id) {
        if (lg && lg->open)
            return dc_err_set(e, DC_EPRECOND, "clip_step.logical",
                              "logical step %llu is open (micro-batch %u next): its samples "
                              "would be charged apart from this step's; commit it first",
                              (unsigned long long)lg->id, lg->next);
        return 0;
    }
    if (m->phase == DC_PHASE_SUMS) rc = sums_logical(s, sc, e);
    else rc = m->micro_batch == 0 ? open_logical(s, sc, e) : continue_logical(s, sc, e);
    if (rc) return rc;
    /* a logical step of one micro-batch is a whole step; a norm pass writes
     * nothing (its sums accumulate) */
    if (m->phase == DC_PHASE_NORMS) return 0;
    sc->step.acc = m->micro_batch == 0 ? (m->commit ? DC_ACC_NONE : DC_ACC_FIRST)
                                       : (m->commit ? DC_ACC_COMMIT : DC_ACC_ADD);
    return 0;
}

int dc_logical_ensure(dc_step_call *sc, dc_backend *be, dc_err *e) {
    dc_logical *lg = sc->s->logical;
    dc_step *st = &sc->step;
    if (st->acc == DC_ACC_NONE) return 0;
    if (!lg || !dc_backend_has_accumulators(be))
        return dc_err_set(e, DC_EUNIMPL, "clip_step.logical",
                          "the %s backend holds no accumulators", dc_backend_name(be));
    for (size_t l = 0; l < st->n_layers; l++) {
        /* a sums step's layers are the pass's (its index), else the step's */
        const size_t slot = sc->params.phase == DC_PHASE_SUMS ? sc->pass_at[l] : l;
        for (int k = 0; k < 2; k++) {
            logical_out *o = &lg->outs[2 * slot + (size_t)k];
            float **to = k ? &st->layers[l].acc_b : &st->layers[l].acc_w;
            if (!o->dst) {
                *to = NULL;
                continue;
            }
            if (!o->acc) {
                if (!(o->acc = dc_backend_acc_alloc(be, o->n)))
                    return dc_err_set(e, DC_ENOSPACE, "clip_step.logical",
                                      "out of %s memory for a logical step's accumulator of "
                                      "%llu floats ('%s')",
                                      st->device >= 0 ? "device" : "host", (unsigned long long)o->n,
                                      st->layers[l].name);
                lg->bytes += o->n * sizeof(float);
            }
            *to = o->acc;
        }
    }
    return 0;
}

void dc_logical_done(dc_session *s, const dc_step_call *sc) {
    dc_logical *lg = s->logical;
    if (!sc->params.logical_id || !lg || lg->id != sc->params.logical_id || !lg->open) return;
    if (sc->rc) {
        abort_logical(s, sc->err.msg[0] ? sc->err.msg : "a micro-batch failed");
        return;
    }
    /* a micro-batch counts once: its whole step, or its norm pass; the
     * commit closes the logical step with its step, or its pass's last sums */
    if (sc->params.phase != DC_PHASE_SUMS) lg->next++;
    if (sc->params.commit && (sc->params.phase == DC_PHASE_WHOLE ||
                              (sc->params.phase == DC_PHASE_SUMS && dc_pass_done(s->pass))))
        lg->open = false;
}

void dc_logical_refused(dc_session *s, const dc_step_call *sc, const dc_err *why) {
    dc_logical *lg = s->logical;
    if (!sc->params.logical_id || !lg || lg->id != sc->params.logical_id) return;
    abort_logical(s, why->msg[0] ? why->msg : "a micro-batch was refused");
}

bool dc_logical_is_open(const dc_session *s, uint64_t id) {
    return s->logical && s->logical->open && s->logical->id == id;
}

uint32_t dc_logical_micro_batches(const dc_session *s) { return s->logical ? s->logical->next : 0; }

uint64_t dc_logical_bytes(const dc_session *s) { return s->logical ? s->logical->bytes : 0; }

void dc_logical_expire(dc_session *s, uint64_t now_ns) {
    dc_logical *lg = s->logical;
    const double limit = s->host->cfg.logical_step_timeout;
    if (!lg || !lg->open || s->call || now_ns - lg->opened_ns <= (uint64_t)(limit * 1e9)) return;
    abort_logical(s, "it was open longer than limits.logical_step_timeout");
    drop_accumulators(s->host, lg);
}

void dc_logical_free(dc_session *s) {
    dc_logical *lg = s->logical;
    if (!lg) return;
    drop_accumulators(s->host, lg);
    free(lg->outs);
    free(lg);
    s->logical = NULL;
}
