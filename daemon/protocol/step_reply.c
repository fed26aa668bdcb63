#include "step_reply.h"

#include <uv.h>

#include "dc_dtype.h"
#include "log.h"

void dc_step_reply_fill(const dc_step_call *sc, uint64_t step_index, Dpclip__ClipStepReply *cr) {
    size_t lb = sc->res.n_layers * sc->res.batch;
    cr->n_norms = sc->res.batch;
    cr->norms = sc->res.norms;
    cr->n_coefficients = sc->res.batch;
    cr->coefficients = sc->res.coefs;
    if (sc->step.want_layer_norms || sc->step.mode == DC_CLIP_PER_LAYER) {
        cr->n_layer_norms = lb;
        cr->layer_norms = sc->res.layer_norms;
    }
    if (sc->step.mode == DC_CLIP_PER_LAYER && sc->res.layer_coefs) {
        cr->n_layer_coefficients = lb;
        cr->layer_coefficients = sc->res.layer_coefs;
    }
    cr->step_index = step_index;
    cr->compute_ns = sc->res.compute_ns;
    cr->input_wait_ns = sc->res.phase_ns[DC_RUN_WAIT_INPUT];
    cr->epsilon = sc->eps;
    cr->delta = sc->delta;
    cr->t_received_ns = sc->t_frame;
    cr->group_wait_ns = sc->group_wait_ns;
    cr->group_exchange_ns = sc->group_exchange_ns;
    cr->t_replied_ns = uv_hrtime();
}

void dc_step_reply_notice(const dc_step_call *sc, uint64_t step_index,
                          Dpclip__ClipStepEnqueued *n) {
    n->step_index = step_index;
    n->epsilon = sc->eps;
    n->delta = sc->delta;
    n->done_value = sc->done_value;
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

void dc_step_reply_count(const dc_step_call *sc, uint64_t now, dc_metrics *m) {
    uint64_t t_submit = sc->t_submit ? sc->t_submit : sc->t_checked;
    dc_hist_add(&m->phase[DC_PH_VALIDATE], (sc->t_checked - sc->t_recv) / 1e9);
    dc_hist_add(&m->phase[DC_PH_LEDGER], (t_submit - sc->t_checked) / 1e9);
    dc_hist_add(&m->phase[DC_PH_QUEUE], (sc->t_start - t_submit) / 1e9);
    if (sc->step.device >= 0)
        dc_hist_add(&m->phase[DC_PH_WAIT_INPUT],
                    (sc->res.phase_ns[DC_RUN_WAIT_INPUT] ? sc->res.phase_ns[DC_RUN_WAIT_INPUT]
                                                         : sc->t_waited - sc->t_start) /
                        1e9);
    if (sc->rc == 0)
        for (int k = DC_RUN_NORMS; k < DC_RUN_N; k++)
            if (sc->res.phase_ns[k])
                dc_hist_add(&m->phase[DC_PH_NORMS + (k - DC_RUN_NORMS)], sc->res.phase_ns[k] / 1e9);
    dc_hist_add(&m->phase[DC_PH_RUN], (sc->t_end - sc->t_waited) / 1e9);
    dc_hist_add(&m->phase[DC_PH_REPLY], (now - sc->t_end) / 1e9);
    dc_hist_add(&m->step, (now - sc->t_recv) / 1e9);
    if (sc->rc == 0) {
        m->steps_ok++;
        m->samples += sc->step.batch;
        m->layers += sc->step.n_layers;
        m->compute_ns += sc->res.compute_ns;
        for (size_t i = 0; i < sc->step.n_layers; i++)
            m->bytes_referenced += tensor_bytes(&sc->step.layers[i].input) +
                                   tensor_bytes(&sc->step.layers[i].grad);
    } else {
        m->steps_failed++;
        dc_metrics_error(m, sc->err.code);
    }
}

/* from -> to in microseconds; 0 where a stage was never reached (a step
 * that failed before it leaves its time 0, or earlier than the last). */
static double span_us(uint64_t from, uint64_t to) {
    return from && to > from ? (to - from) / 1e3 : 0.0;
}

void dc_step_reply_log(const dc_step_call *sc, uint64_t session_id, uint64_t step_index,
                       uint64_t t_done, uint64_t now, uint64_t send_ns) {
    if (dc_log_get_level() < DC_LOG_DEBUG) return;
    dc_log_debug("session %llu: step %llu (%zu layers, B=%u, %s%s): decode %.1f us, "
                 "validate %.1f us, ledger %.1f us, queue %.1f us, wait %.1f us (device "
                 "%.1f us), run %.1f us (backend %.1f us: norms %.1f, reduction %.1f, "
                 "clipping %.1f, noise %.1f), reply %.1f us (hand-off %.1f, send %.1f), eps %.4g; "
                 "group step %llu; at (monotonic ms) frame %.3f, submitted %.3f, norms done %.3f, "
                 "started %.3f, ended %.3f, answered %.3f",
                 (unsigned long long)session_id, (unsigned long long)step_index, sc->step.n_layers,
                 sc->step.batch, sc->step.device < 0 ? "cpu" : "gpu", sc->cached ? ", cached" : "",
                 span_us(sc->t_frame, sc->t_recv), span_us(sc->t_recv, sc->t_checked),
                 span_us(sc->t_checked, sc->t_submit), span_us(sc->t_submit, sc->t_start),
                 span_us(sc->t_start, sc->t_waited), sc->res.phase_ns[DC_RUN_WAIT_INPUT] / 1e3,
                 span_us(sc->t_waited, sc->t_end), sc->res.compute_ns / 1e3,
                 sc->res.phase_ns[DC_RUN_NORMS] / 1e3, sc->res.phase_ns[DC_RUN_REDUCTION] / 1e3,
                 sc->res.phase_ns[DC_RUN_CLIPPING] / 1e3, sc->res.phase_ns[DC_RUN_NOISE] / 1e3,
                 span_us(sc->t_end, now), span_us(sc->t_end, t_done), send_ns / 1e3, sc->eps,
                 (unsigned long long)sc->group_step, sc->t_frame / 1e6, sc->t_submit / 1e6,
                 sc->t_normed / 1e6, sc->t_start / 1e6, sc->t_end / 1e6, now / 1e6);
}
