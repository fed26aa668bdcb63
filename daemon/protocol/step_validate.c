#include "step_validate.h"

#include <stdlib.h>
#include <string.h>

int dc_step_validate(dc_step_call *sc, const Dpclip__ClipStep *m, const dc_registry *reg,
                     const dc_limits *lim, dc_err *e) {
    if (m->phase != DPCLIP__STEP_PHASE__STEP_WHOLE && m->phase != DPCLIP__STEP_PHASE__STEP_NORMS &&
        m->phase != DPCLIP__STEP_PHASE__STEP_SUMS)
        return dc_err_set(e, DC_EINVAL, "clip_step.phase", "unknown phase %d", (int)m->phase);
    sc->params = (struct dc_step_params){.wait_event = m->wait_event,
                                         .signal_event = m->signal_event,
                                         .group_step = m->group_step,
                                         .notify_enqueued = m->notify_enqueued,
                                         .phase = (dc_step_phase)m->phase,
                                         .sample_rate = m->sample_rate,
                                         .target_delta = m->target_delta,
                                         .target_epsilon = m->target_epsilon};
    if (m->data_parallel)
        sc->params.dp = (dc_dp_member){.declared = true,
                                       .world = m->data_parallel->world,
                                       .rank = m->data_parallel->rank,
                                       .step = m->data_parallel->step,
                                       .sigma = m->data_parallel->noise_multiplier};
    if (m->logical) {
        if (m->logical->id == 0)
            return dc_err_set(e, DC_EINVAL, "clip_step.logical.id",
                              "a logical step's id is > 0 (leave logical unset for a whole step)");
        sc->params.logical_id = m->logical->id;
        sc->params.micro_batch = m->logical->micro_batch;
        sc->params.commit = m->logical->commit;
    }
    return dc_validate_step(m, reg, lim, &sc->step, e);
}

int dc_step_validate_names(dc_step_call *sc, int n_gpus, const struct dc_session_event *w,
                           const struct dc_session_event *g, dc_err *e) {
    const struct dc_step_params *m = &sc->params;
    if (sc->step.device >= n_gpus)
        return dc_err_set(e, DC_EPRECOND, "clip_step", "no GPU backend for device %d",
                          sc->step.device);
    if (m->wait_event && !w)
        return dc_err_set(e, DC_ENOTFOUND, "clip_step.wait_event",
                          "event %llu is not registered in this session",
                          (unsigned long long)m->wait_event);
    if (m->signal_event && !g)
        return dc_err_set(e, DC_ENOTFOUND, "clip_step.signal_event",
                          "event %llu is not registered in this session",
                          (unsigned long long)m->signal_event);
    if ((w && w->device != sc->step.device) || (g && g->device != sc->step.device))
        return dc_err_set(e, DC_EINVAL,
                          w && w->device != sc->step.device ? "clip_step.wait_event"
                                                            : "clip_step.signal_event",
                          "events must be on the step's device (%s)",
                          sc->step.device < 0 ? "host memory" : "the tensors' GPU");
    sc->wait_event = w ? w->event : NULL;
    sc->signal_event = g ? g->event : NULL;
    if (sc->step.done_flag) {
        if (!m->notify_enqueued)
            return dc_err_set(e, DC_EINVAL, "clip_step.done_flag",
                              "needs notify_enqueued: the notice says the value to wait for");
        if (m->phase != DC_PHASE_WHOLE)
            return dc_err_set(e, DC_EINVAL, "clip_step.done_flag",
                              "a whole step only: a step in phases completes through its replies");
    }
    if (m->notify_enqueued) {
        if (!sc->signal_event && !sc->step.done_flag)
            return dc_err_set(e, DC_EINVAL, "clip_step.notify_enqueued",
                              "an early notice needs a signal_event or a done_flag for the client "
                              "to wait on");
        sc->notify = true;
    }
    return 0;
}

dc_step_plan *dc_step_plan_new(const dc_step_call *sc, const uint8_t *key, size_t key_len,
                               uint64_t reg_gen, const dc_limits *lim) {
    const dc_step *step = &sc->step;
    dc_step_plan *n = calloc(1, sizeof *n);
    if (!n) return NULL;
    n->bytes = malloc(key_len ? key_len : 1);
    n->step = *step;
    n->step.layers = malloc(step->n_layers * sizeof *step->layers);
    if (!n->bytes || !n->step.layers) {
        free(n->step.layers);
        free(n->bytes);
        free(n);
        return NULL;
    }
    memcpy(n->bytes, key, key_len);
    n->len = key_len;
    memcpy(n->step.layers, step->layers, step->n_layers * sizeof *step->layers);
    n->reg_gen = reg_gen;
    n->limits = *lim;
    n->params = sc->params;
    return n;
}

void dc_step_plan_free(dc_step_plan *p) {
    if (!p) return;
    dc_validate_step_free(&p->step);
    free(p->bytes);
    free(p);
}

bool dc_step_plan_matches(const dc_step_plan *p, const uint8_t *key, size_t key_len,
                          uint64_t reg_gen, const dc_limits *lim) {
    return p->len == key_len && p->reg_gen == reg_gen &&
           memcmp(&p->limits, lim, sizeof p->limits) == 0 && memcmp(p->bytes, key, key_len) == 0;
}

void dc_step_plan_use(const dc_step_plan *p, dc_step_call *sc) {
    sc->step = p->step;
    sc->params = p->params;
    sc->cached = true;
}
