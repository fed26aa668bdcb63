/* What the status endpoint serves: /status as JSON and /metrics in the
 * Prometheus text format, rendered from the server's own structures on the
 * loop thread (status.c asks for it), so no locking is needed here. */
#include <math.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "log.h"
#include "server.h"
#include "session.h"

static const char *level_name(dc_log_level l) {
    static const char *n[] = {"error", "warn", "info", "debug"};
    return l <= DC_LOG_DEBUG ? n[l] : "info";
}

static void json_ids(dc_sbuf *b, const uint32_t *ids, size_t n) {
    dc_sbuf_puts(b, "[");
    for (size_t i = 0; i < n; i++) dc_sbuf_printf(b, "%s%u", i ? "," : "", ids[i]);
    dc_sbuf_puts(b, "]");
}

static void render_status(dc_server *srv, dc_sbuf *b) {
    uint64_t now = uv_hrtime();
    const dc_config *c = &srv->cfg;
    bool first;

    dc_sbuf_printf(b, "{\"daemon\":{\"version\":\"%s\",\"pid\":%d,\"uptime_s\":%.3f,"
                      "\"started\":%lld,",
                   DPCLIP_VERSION, (int)getpid(), (now - srv->start_ns) / 1e9,
                   (long long)srv->start_time);
    dc_sbuf_puts(b, "\"config_file\":");
    dc_sbuf_json_str(b, c->config_path);
    dc_sbuf_puts(b, ",\"socket\":");
    dc_sbuf_json_str(b, srv->socket_path);
    dc_sbuf_printf(b, ",\"socket_activated\":%s,\"log_level\":\"%s\",\"stopping\":%s},",
                   srv->listen_activated ? "true" : "false", level_name(dc_log_get_level()),
                   srv->stopping ? "true" : "false");

    dc_sbuf_printf(b, "\"backends\":[{\"backend\":\"cpu\",\"workers\":%d,\"busy\":%d}",
                   srv->workers, srv->pool_ready ? dc_worker_pool_busy(&srv->cpu_pool) : 0);
    for (int i = 0; i < srv->gpu.n; i++) {
        dc_sbuf_printf(b, ",{\"backend\":\"cuda\",\"index\":%d,\"name\":", i);
        dc_sbuf_json_str(b, srv->gpu.names[i]);
        dc_sbuf_printf(b, ",\"busy\":%d,\"workspace_bytes\":%llu}",
                       dc_worker_pool_busy(&srv->gpu.pools[i]),
                       (unsigned long long)(i < 8 ? srv->gpu_workspace[i] : 0));
    }
    dc_sbuf_printf(b, "],\"mps_active\":%s,", srv->gpu.mps_active ? "true" : "false");
    dc_sbuf_printf(b, "\"limits\":{\"max_batch\":%u,\"max_layers\":%u,\"max_frame\":%u,"
                      "\"max_buffers\":%u},",
                   srv->limits.max_batch, srv->limits.max_layers, srv->limits.max_frame,
                   c->max_buffers);
    dc_sbuf_puts(b, "\"access\":{\"allowed_uids\":");
    json_ids(b, c->allowed_uids, c->n_allowed_uids);
    dc_sbuf_puts(b, ",\"allowed_gids\":");
    json_ids(b, c->allowed_gids, c->n_allowed_gids);
    dc_sbuf_puts(b, "},\"sessions\":[");
    first = true;
    for (dc_session *s = srv->sessions; s; s = s->next) {
        dc_sbuf_printf(b, "%s{\"id\":%llu,\"pid\":%d,\"uid\":%u,\"gid\":%u,\"client\":",
                       first ? "" : ",", (unsigned long long)s->id, (int)s->peer_pid,
                       (unsigned)s->peer_uid, (unsigned)s->peer_gid);
        dc_sbuf_json_str(b, s->client_name);
        dc_sbuf_puts(b, ",\"job\":");
        dc_sbuf_json_str(b, s->job_id);
        dc_sbuf_printf(b, ",\"hello\":%s,\"steps\":%llu,\"steps_failed\":%llu,\"buffers\":%zu,"
                          "\"buffer_bytes\":%llu,\"busy\":%s,\"connected_s\":%.3f,\"idle_s\":",
                       s->hello_done ? "true" : "false", (unsigned long long)s->steps,
                       (unsigned long long)s->steps_failed, s->reg.n,
                       (unsigned long long)s->reg.bytes, s->job ? "true" : "false",
                       (now - s->connected_ns) / 1e9);
        dc_sbuf_json_num(b, s->last_step_ns ? (now - s->last_step_ns) / 1e9 : NAN);
        dc_sbuf_puts(b, "}");
        first = false;
    }
    /* Groups the daemon knows: the sessions of one job (uid + job id) on this
     * node, i.e. a job's data-parallel ranks here. Model-shard groups (a
     * norm reduction across ranks) will be listed here too once they exist. */
    dc_sbuf_puts(b, "],\"groups\":[");
    first = true;
    for (dc_session *s = srv->sessions; s; s = s->next) {
        bool seen = false;
        if (!s->hello_done) continue;
        for (dc_session *t = srv->sessions; t != s; t = t->next)
            if (t->hello_done && t->peer_uid == s->peer_uid && strcmp(t->job_id, s->job_id) == 0)
                seen = true;
        if (seen) continue; /* listed with its first session */
        uint64_t steps = 0;
        int busy = 0;
        bool first_id = true;
        dc_sbuf_printf(b, "%s{\"kind\":\"job\",\"uid\":%u,\"job\":", first ? "" : ",",
                       (unsigned)s->peer_uid);
        dc_sbuf_json_str(b, s->job_id);
        dc_sbuf_puts(b, ",\"sessions\":[");
        for (dc_session *t = s; t; t = t->next) {
            if (!t->hello_done || t->peer_uid != s->peer_uid || strcmp(t->job_id, s->job_id) != 0)
                continue;
            dc_sbuf_printf(b, "%s%llu", first_id ? "" : ",", (unsigned long long)t->id);
            steps += t->steps;
            busy += t->job != NULL;
            first_id = false;
        }
        dc_sbuf_printf(b, "],\"steps\":%llu,\"busy\":%d}", (unsigned long long)steps, busy);
        first = false;
    }
    dc_sbuf_puts(b, "],\"ledger\":{\"dir\":");
    dc_sbuf_json_str(b, srv->ledger.dir);
    dc_sbuf_printf(b, ",\"persistent\":%s,\"delta\":%.17g,\"budget_epsilon\":%.17g,"
                      "\"budget_delta\":%.17g,\"require_sample_rate\":%s,"
                      "\"writes_in_flight\":%d,\"jobs\":[",
                   dc_ledger_persistent(&srv->ledger) ? "true" : "false", c->delta,
                   c->budget_epsilon, c->budget_delta, c->require_sample_rate ? "true" : "false",
                   srv->ledger_writes_in_flight);
    first = true;
    for (dc_ledger_job *j = srv->ledger.jobs; j; j = j->next) {
        dc_sbuf_printf(b, "%s{\"uid\":%u,\"job\":", first ? "" : ",", j->uid);
        dc_sbuf_json_str(b, j->job);
        dc_sbuf_printf(b, ",\"sessions\":%d,\"steps\":%llu,\"epsilon\":", j->sessions,
                       (unsigned long long)j->steps);
        dc_sbuf_json_num(b, j->eps);
        dc_sbuf_printf(b, ",\"epsilon_infinite\":%s,\"delta\":%.17g,\"best_order\":",
                       isinf(j->eps) ? "true" : "false", j->delta);
        dc_sbuf_json_num(b, j->best_order);
        dc_sbuf_printf(b, ",\"budget_epsilon\":%.17g,\"on_disk\":%s,\"history\":[",
                       j->budget_eps,
                       !dc_ledger_persistent(&srv->ledger) ? "false"
                       : j->saved_gen >= j->gen            ? "true"
                                                           : "false");
        for (size_t i = 0; i < j->n_hist; i++)
            dc_sbuf_printf(b, "%s{\"sample_rate\":%.17g,\"noise_multiplier\":%.17g,\"steps\":%llu}",
                           i ? "," : "", j->hist[i].q, j->hist[i].sigma,
                           (unsigned long long)j->hist[i].steps);
        dc_sbuf_puts(b, "]}");
        first = false;
    }
    dc_sbuf_printf(b, "]},\"totals\":{\"sessions\":%llu,\"steps_ok\":%llu,\"steps_failed\":%llu,"
                      "\"samples\":%llu,\"layers\":%llu}}\n",
                   (unsigned long long)srv->metrics.sessions_total,
                   (unsigned long long)srv->metrics.steps_ok,
                   (unsigned long long)srv->metrics.steps_failed,
                   (unsigned long long)srv->metrics.samples,
                   (unsigned long long)srv->metrics.layers);
}

static void counter(dc_sbuf *b, const char *name, const char *help, uint64_t v) {
    dc_prom_head(b, name, "counter", help);
    dc_sbuf_printf(b, "%s %llu\n", name, (unsigned long long)v);
}

static void gauge(dc_sbuf *b, const char *name, const char *help, double v) {
    dc_prom_head(b, name, "gauge", help);
    dc_sbuf_printf(b, "%s ", name);
    dc_sbuf_prom_num(b, v);
    dc_sbuf_puts(b, "\n");
}

/* One gauge sample per ledger job, labelled uid and job. */
static void job_gauge(dc_sbuf *b, dc_server *srv, const char *name, const char *help, int which) {
    dc_prom_head(b, name, "gauge", help);
    for (dc_ledger_job *j = srv->ledger.jobs; j; j = j->next) {
        double v = which == 0 ? j->eps : which == 1 ? (double)j->steps : which == 2 ? j->delta
                                                                                    : j->budget_eps;
        if (which == 3 && j->budget_eps <= 0) continue;
        dc_sbuf_printf(b, "%s{uid=\"%u\",job=", name, j->uid);
        dc_sbuf_prom_str(b, j->job);
        dc_sbuf_puts(b, "} ");
        dc_sbuf_prom_num(b, v);
        dc_sbuf_puts(b, "\n");
    }
}

static void render_metrics(dc_server *srv, dc_sbuf *b) {
    const dc_metrics *m = &srv->metrics;
    uint64_t buffers = 0, bytes = 0, busy_sessions = 0;
    char labels[64];

    for (dc_session *s = srv->sessions; s; s = s->next) {
        buffers += s->reg.n;
        bytes += s->reg.bytes;
        busy_sessions += s->job != NULL;
    }
    dc_prom_head(b, "dpclip_build_info", "gauge", "dpclipd version");
    dc_sbuf_printf(b, "dpclip_build_info{version=\"%s\"} 1\n", DPCLIP_VERSION);
    gauge(b, "dpclip_uptime_seconds", "Seconds since the daemon started",
          (uv_hrtime() - srv->start_ns) / 1e9);

    dc_prom_head(b, "dpclip_requests_total", "counter", "Requests received, by type");
    for (int i = 0; i < DC_REQ_N; i++)
        dc_sbuf_printf(b, "dpclip_requests_total{type=\"%s\"} %llu\n", dc_req_names[i],
                       (unsigned long long)m->requests[i]);
    dc_prom_head(b, "dpclip_errors_total", "counter",
                 "Error replies (refused requests and failed steps), by code");
    for (int i = 1; i <= 10; i++)
        dc_sbuf_printf(b, "dpclip_errors_total{code=\"%s\"} %llu\n", dc_code_name(i),
                       (unsigned long long)m->errors[i]);
    dc_prom_head(b, "dpclip_steps_total", "counter", "ClipSteps that ran, by result");
    dc_sbuf_printf(b, "dpclip_steps_total{result=\"ok\"} %llu\ndpclip_steps_total{result=\"failed\"}"
                      " %llu\n",
                   (unsigned long long)m->steps_ok, (unsigned long long)m->steps_failed);
    counter(b, "dpclip_layers_total", "Layers in successful steps", m->layers);
    counter(b, "dpclip_samples_total", "Samples in successful steps", m->samples);
    counter(b, "dpclip_bytes_referenced_total",
            "Bytes of input tensors (activations, gradients) successful steps named",
            m->bytes_referenced);
    dc_prom_head(b, "dpclip_compute_seconds_total", "counter", "Backend time of successful steps");
    dc_sbuf_printf(b, "dpclip_compute_seconds_total %.9f\n", m->compute_ns / 1e9);
    counter(b, "dpclip_sessions_total", "Connections accepted", m->sessions_total);
    counter(b, "dpclip_sessions_refused_total", "Hellos refused by [access]", m->sessions_refused);
    counter(b, "dpclip_budget_refusals_total", "Steps refused by a privacy budget",
            m->budget_refusals);
    dc_prom_head(b, "dpclip_ledger_writes_total", "counter", "Crash-safe ledger file writes");
    dc_sbuf_printf(b, "dpclip_ledger_writes_total{result=\"ok\"} %llu\n"
                      "dpclip_ledger_writes_total{result=\"error\"} %llu\n",
                   (unsigned long long)m->ledger_writes, (unsigned long long)m->ledger_write_errors);
    dc_prom_head(b, "dpclip_reloads_total", "counter", "Configuration reloads (SIGHUP)");
    dc_sbuf_printf(b, "dpclip_reloads_total{result=\"ok\"} %llu\n"
                      "dpclip_reloads_total{result=\"error\"} %llu\n",
                   (unsigned long long)m->reloads, (unsigned long long)m->reload_errors);

    dc_prom_head(b, "dpclip_step_phase_seconds", "histogram",
                 "Where a step's time goes: validate (and budget check), ledger (spend to disk), "
                 "queue (waiting for a worker), wait_input (GPU: the daemon's stream waiting for "
                 "the trainer's event), run (the backend's whole step), reply; and run's parts "
                 "as the backend times them: norms (per-sample norms), reduction (over layers, "
                 "coefficients), clipping (clipped sums), noise (noise, checks, outputs)");
    for (int i = 0; i < DC_PH_N; i++) {
        snprintf(labels, sizeof labels, "phase=\"%s\"", dc_phase_names[i]);
        dc_prom_hist(b, "dpclip_step_phase_seconds", labels, &m->phase[i]);
    }
    dc_prom_head(b, "dpclip_step_seconds", "histogram",
                 "A step in the daemon: request decoded to reply queued");
    dc_prom_hist(b, "dpclip_step_seconds", "", &m->step);
    dc_prom_head(b, "dpclip_ledger_write_seconds", "histogram",
                 "One crash-safe ledger write (temp file, fsync, rename, fsync dir)");
    dc_prom_hist(b, "dpclip_ledger_write_seconds", "", &m->ledger_write);

    gauge(b, "dpclip_sessions", "Open sessions", (double)srv->n_sessions);
    gauge(b, "dpclip_steps_in_flight", "Sessions with a step accepted and not answered",
          (double)busy_sessions);
    gauge(b, "dpclip_buffers", "Registered buffers", (double)buffers);
    gauge(b, "dpclip_buffer_bytes", "Bytes of registered buffers", (double)bytes);
    dc_prom_head(b, "dpclip_queue_depth", "gauge", "Jobs submitted to a worker pool, not done");
    dc_sbuf_printf(b, "dpclip_queue_depth{pool=\"cpu\"} %d\n",
                   srv->pool_ready ? dc_worker_pool_busy(&srv->cpu_pool) : 0);
    for (int i = 0; i < srv->gpu.n; i++)
        dc_sbuf_printf(b, "dpclip_queue_depth{pool=\"cuda:%d\"} %d\n", i,
                       dc_worker_pool_busy(&srv->gpu.pools[i]));
    dc_prom_head(b, "dpclip_gpu_workspace_bytes", "gauge", "Device workspace of each GPU's backend");
    for (int i = 0; i < srv->gpu.n && i < 8; i++)
        dc_sbuf_printf(b, "dpclip_gpu_workspace_bytes{device=\"%d\"} %llu\n", i,
                       (unsigned long long)srv->gpu_workspace[i]);
    gauge(b, "dpclip_mps_active", "1 when the CUDA MPS control daemon serves this node",
          srv->gpu.mps_active ? 1 : 0);
    gauge(b, "dpclip_ledger_jobs", "Jobs in the privacy ledger", (double)srv->ledger.n_jobs);
    job_gauge(b, srv, "dpclip_job_epsilon", "Epsilon a job has spent, at dpclip_job_delta", 0);
    job_gauge(b, srv, "dpclip_job_steps", "Steps a job has spent", 1);
    job_gauge(b, srv, "dpclip_job_delta", "Delta at which a job's epsilon is reported", 2);
    job_gauge(b, srv, "dpclip_job_budget_epsilon", "A job's own budget, where it set one", 3);
}

void dc_server_render(void *arg, dc_sbuf *status_json, dc_sbuf *metrics_text) {
    dc_server *srv = arg;
    render_status(srv, status_json);
    render_metrics(srv, metrics_text);
}
