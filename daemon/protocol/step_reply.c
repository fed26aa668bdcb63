#include "step_reply.h"

#include <uv.h>

#include "dc_dtype.h"
#include "log.h"

void dc_step_reply_fill(const dc_step_job *j, uint64_t step_index, Dpclip__ClipStepReply *cr) {
    size_t lb = j->res.n_layers * j->res.batch;
    cr->n_norms = j->res.batch;
    cr->norms = j->res.norms;
    cr->n_coefficients = j->res.batch;
    cr->coefficients = j->res.coefs;
    if (j->step.want_layer_norms || j->step.mode == DC_CLIP_PER_LAYER) {
        cr->n_layer_norms = lb;
        cr->layer_norms = j->res.layer_norms;
    }
    if (j->step.mode == DC_CLIP_PER_LAYER && j->res.layer_coefs) {
        cr->n_layer_coefficients = lb;
        cr->layer_coefficients = j->res.layer_coefs;
    }
    cr->step_index = step_index;
    cr->compute_ns = j->res.compute_ns;
    cr->input_wait_ns = j->res.phase_ns[DC_RUN_WAIT_INPUT];
    cr->epsilon = j->eps;
    cr->delta = j->delta;
    cr->t_received_ns = j->t_frame;
    cr->group_wait_ns = j->group_wait_ns;
    cr->group_exchange_ns = j->group_exchange_ns;
    cr->t_replied_ns = uv_hrtime();
}

void dc_step_reply_notice(const dc_step_job *j, uint64_t step_index, Dpclip__ClipStepEnqueued *n) {
    n->step_index = step_index;
    n->epsilon = j->eps;
    n->delta = j->delta;
}

static uint64_t tensor_bytes(const dc_tensor *t) {
    uint64_t n = 1;
    if (!t->data) return 0;
    for (int i = 0; i < t->ndim; i++) n *= (uint64_t)t->shape[i];
    return n * dc_dtype_size(t->dtype);
}

_Static_assert(DC_PH_NOISE - DC_PH_NORMS == DC_RUN_NOISE - DC_RUN_NORMS &&
                   DC_PH_N - DC_PH_NORMS == DC_RUN_N - DC_RUN_NORMS,
               "the backend's parts and their histograms are in the same order");

void dc_step_reply_count(const dc_step_job *j, uint64_t now, dc_metrics *m) {
    uint64_t t_submit = j->t_submit ? j->t_submit : j->t_checked;
    dc_hist_add(&m->phase[DC_PH_VALIDATE], (j->t_checked - j->t_recv) / 1e9);
    dc_hist_add(&m->phase[DC_PH_LEDGER], (t_submit - j->t_checked) / 1e9);
    dc_hist_add(&m->phase[DC_PH_QUEUE], (j->t_start - t_submit) / 1e9);
    if (j->step.device >= 0)
        dc_hist_add(&m->phase[DC_PH_WAIT_INPUT],
                    (j->res.phase_ns[DC_RUN_WAIT_INPUT] ? j->res.phase_ns[DC_RUN_WAIT_INPUT]
                                                        : j->t_waited - j->t_start) / 1e9);
    if (j->rc == 0)
        for (int k = DC_RUN_NORMS; k < DC_RUN_N; k++)
            if (j->res.phase_ns[k])
                dc_hist_add(&m->phase[DC_PH_NORMS + (k - DC_RUN_NORMS)], j->res.phase_ns[k] / 1e9);
    dc_hist_add(&m->phase[DC_PH_RUN], (j->t_end - j->t_waited) / 1e9);
    dc_hist_add(&m->phase[DC_PH_REPLY], (now - j->t_end) / 1e9);
    dc_hist_add(&m->step, (now - j->t_recv) / 1e9);
    if (j->rc == 0) {
        m->steps_ok++;
        m->samples += j->step.batch;
        m->layers += j->step.n_layers;
        m->compute_ns += j->res.compute_ns;
        for (size_t i = 0; i < j->step.n_layers; i++)
            m->bytes_referenced += tensor_bytes(&j->step.layers[i].input) +
                                   tensor_bytes(&j->step.layers[i].grad);
    } else {
        m->steps_failed++;
        dc_metrics_error(m, j->err.code);
    }
}

void dc_step_reply_log(const dc_step_job *j, uint64_t session_id, uint64_t step_index,
                       uint64_t t_done, uint64_t now, uint64_t send_ns) {
    if (dc_log_get_level() < DC_LOG_DEBUG) return;
    dc_log_debug("session %llu: step %llu (%zu layers, B=%u, %s%s): decode %.1f us, "
                 "validate %.1f us, ledger %.1f us, queue %.1f us, wait %.1f us (device "
                 "%.1f us), run %.1f us (backend %.1f us: norms %.1f, reduction %.1f, "
                 "clipping %.1f, noise %.1f), reply %.1f us (hand-off %.1f, send %.1f), eps %.4g",
                 (unsigned long long)session_id, (unsigned long long)step_index,
                 j->step.n_layers, j->step.batch, j->step.device < 0 ? "cpu" : "gpu",
                 j->cached ? ", cached" : "", (j->t_recv - j->t_frame) / 1e3,
                 (j->t_checked - j->t_recv) / 1e3, (j->t_submit - j->t_checked) / 1e3,
                 (j->t_start - j->t_submit) / 1e3, (j->t_waited - j->t_start) / 1e3,
                 j->res.phase_ns[DC_RUN_WAIT_INPUT] / 1e3, (j->t_end - j->t_waited) / 1e3,
                 j->res.compute_ns / 1e3, j->res.phase_ns[DC_RUN_NORMS] / 1e3,
                 j->res.phase_ns[DC_RUN_REDUCTION] / 1e3,
                 j->res.phase_ns[DC_RUN_CLIPPING] / 1e3, j->res.phase_ns[DC_RUN_NOISE] / 1e3,
                 (now - j->t_end) / 1e3, (t_done - j->t_end) / 1e3, send_ns / 1e3, j->eps);
}
