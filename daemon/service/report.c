/* What the status endpoint serves: the loop copies the server's state into a
 * dc_report (report.h), and the HTTP thread that answers renders /status as
 * JSON or /metrics in the Prometheus text format from it, for its caller. */
#include "report.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
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

/* "limits":{...}, from the config table: every setting that bounds what a
 * client can make the daemon hold, [limits] ones by key, others by
 * section.key (status.max_connections is not limits.max_connections). */
static void json_limits(dc_sbuf *b, const dc_config *c) {
    const char *section, *key;
    char v[32];
    bool first = true;
    dc_sbuf_puts(b, "\"limits\":{");
    for (size_t i = 0; dc_config_key(i, &section, &key); i++) {
        bool own = strcmp(section, "limits") == 0;
        if (!dc_config_is_limit(i) || !dc_config_number(c, i, v, sizeof v)) continue;
        dc_sbuf_printf(b, "%s\"%s%s%s\":%s", first ? "" : ",", own ? "" : section, own ? "" : ".",
                       key, v);
        first = false;
    }
    dc_sbuf_puts(b, "},");
}

/* --- the snapshot (loop thread) ---------------------------------------------------- */

/* status.ops_group's gid, -1 for none. Looked up again only when the name
 * changes (a reload): a group database lookup may block. */
static int64_t ops_gid(const char *name) {
    static char last[64];
    static int64_t gid = -1;
    uint32_t g;
    if (strcmp(name, last) != 0) {
        snprintf(last, sizeof last, "%s", name);
        gid = name[0] && dc_config_group_id(name, &g) == 0 ? (int64_t)g : -1;
    }
    return gid;
}

static void *snapshot(void *arg) {
    dc_server *srv = arg;
    const dc_config *c = &srv->cfg;
    uint64_t now = uv_hrtime();
    dc_report *r = calloc(1, sizeof *r);
    size_t i;

    if (!r) return NULL;
    /* Accounts nothing uses go here too, not only when accounts are opened. */
    dc_ledger_expire(&srv->ledger, now);
    if ((srv->n_sessions && !(r->sessions = calloc(srv->n_sessions, sizeof *r->sessions))) ||
        (srv->ledger.n_accounts &&
         !(r->accounts = calloc(srv->ledger.n_accounts, sizeof *r->accounts)))) {
        dc_report_free(r);
        return NULL;
    }
    r->pid = (int)getpid();
    r->daemon_uid = (uint32_t)geteuid();
    r->ops_gid = ops_gid(c->status_ops_group);
    r->uptime_s = (now - srv->start_ns) / 1e9;
    r->started = srv->start_time;
    snprintf(r->config_file, sizeof r->config_file, "%s", c->config_path);
    snprintf(r->socket, sizeof r->socket, "%s", srv->socket_path);
    r->socket_activated = srv->listen_activated;
    r->stopping = srv->stopping;
    r->insecure = c->fixed_seed;
    r->log_level = level_name(dc_log_get_level());
    r->cpu_workers = srv->workers;
    r->cpu_busy = srv->pool_ready ? dc_worker_pool_busy(&srv->cpu_pool) : 0;
    r->n_gpus = srv->gpu.n < DC_MAX_GPUS ? srv->gpu.n : DC_MAX_GPUS;
    for (int g = 0; g < r->n_gpus; g++) {
        memcpy(r->gpu_names[g], srv->gpu.names[g], sizeof r->gpu_names[g]);
        r->gpu_uuids[g][0] = 0;
        if (srv->gpu.has_uuid[g]) dc_gpu_uuid_str(srv->gpu.uuids[g], r->gpu_uuids[g]);
        r->gpu_busy[g] = dc_worker_pool_busy(&srv->gpu.pools[g]);
        /* the worker's own view: it changes between steps (idle release) */
        const dc_worker_held held = dc_worker_pool_held(&srv->gpu.pools[g], 0);
        r->gpu_workspace[g] = held.workspace;
        r->gpu_kept[g] = held.kept;
    }
    r->mps_active = srv->gpu.mps_active;
    r->cfg = *c;
    memcpy(r->allowed_uids, c->allowed_uids, sizeof r->allowed_uids);
    memcpy(r->allowed_gids, c->allowed_gids, sizeof r->allowed_gids);
    r->n_allowed_uids = c->n_allowed_uids;
    r->n_allowed_gids = c->n_allowed_gids;
    snprintf(r->ledger_dir, sizeof r->ledger_dir, "%s", srv->ledger.dir);
    r->persistent = dc_ledger_persistent(&srv->ledger);
    r->require_sample_rate = c->require_sample_rate;
    r->delta = c->delta;
    r->budget_epsilon = c->budget_epsilon;
    r->budget_delta = c->budget_delta;
    r->max_jobs_per_uid = c->ledger_max_jobs_per_uid;
    r->job_idle_s = c->ledger_job_idle_s;
    r->writes_in_flight = srv->ledger.writes_in_flight;
    {
        size_t ng = dc_groups_count(&srv->groups);
        if (ng && (r->norm_groups = calloc(ng, sizeof *r->norm_groups)))
            r->n_norm_groups = dc_groups_info(&srv->groups, r->norm_groups, ng);
        r->groups_formed = srv->groups.formed;
        r->groups_dissolved = srv->groups.dissolved;
        r->group_reductions = srv->groups.reductions;
        r->group_exchanges = srv->groups.exchanges;
        r->group_exchanges_polled = srv->groups.exchanges_polled;
        r->group_fused = srv->groups.fused;
        r->group_link_failures = srv->groups.link_failures;
        r->group_timeouts = srv->groups.timeouts;
    }

    i = 0;
    for (dc_session *s = srv->sessions; s && i < srv->n_sessions; s = s->next, i++) {
        dc_report_session *o = &r->sessions[i];
        o->id = s->id;
        o->pid = (int)s->peer_pid;
        o->uid = (uint32_t)s->peer_uid;
        o->gid = (uint32_t)s->peer_gid;
        memcpy(o->client, s->client_name, sizeof o->client);
        memcpy(o->job_id, s->job_id, sizeof o->job_id);
        o->client[sizeof o->client - 1] = o->job_id[sizeof o->job_id - 1] = '\0';
        o->hello = s->hello_done;
        o->busy = s->call != NULL;
        o->steps = s->steps;
        o->steps_failed = s->steps_failed;
        o->buffers = s->reg.n;
        o->buffer_bytes = s->reg.bytes;
        o->connected_s = (now - s->connected_ns) / 1e9;
        o->idle_s = s->last_step_ns ? (now - s->last_step_ns) / 1e9 : NAN;
        r->buffers += s->reg.n;
        r->buffer_bytes += s->reg.bytes;
        r->busy_sessions += o->busy;
    }
    r->n_sessions = i;
    i = 0;
    for (dc_ledger_account *acct = srv->ledger.accounts; acct && i < srv->ledger.n_accounts;
         acct = acct->next, i++) {
        dc_report_account *o = &r->accounts[i];
        o->uid = acct->uid;
        memcpy(o->job_id, acct->job_id, sizeof o->job_id);
        o->sessions = acct->sessions;
        o->steps = acct->steps;
        o->shares = acct->shares;
        o->folded_steps = acct->folded_steps;
        o->eps = acct->eps;
        o->delta = acct->delta;
        o->best_order = acct->best_order;
        o->budget_eps = acct->budget_eps;
        o->on_disk = r->persistent && acct->saved_gen >= acct->gen;
        o->insecure = acct->insecure;
        o->n_hist = acct->n_hist;
        for (size_t k = 0; k < acct->n_hist; k++) {
            o->hist[k].q = acct->hist[k].q;
            o->hist[k].sigma = acct->hist[k].sigma;
            o->hist[k].steps = acct->hist[k].steps;
        }
    }
    r->n_accounts = i;
    r->metrics = srv->metrics;
    return r;
}

void dc_report_free(dc_report *r) {
    if (!r) return;
    free(r->sessions);
    free(r->accounts);
    free(r->norm_groups);
    free(r);
}

dc_view dc_report_view(const dc_report *r, const dc_status_viewer *v) {
    if (!v->known) return DC_VIEW_AGGREGATE;
    if (v->uid == 0 || v->uid == r->daemon_uid) return DC_VIEW_ALL;
    if (r->ops_gid >= 0) {
        if (v->gid == (uint32_t)r->ops_gid) return DC_VIEW_ALL;
        for (size_t i = 0; i < v->n_groups; i++)
            if (v->groups[i] == (uint32_t)r->ops_gid) return DC_VIEW_ALL;
    }
    return DC_VIEW_OWN;
}

/* Whether a caller with `view` (and uid) sees something of `owner`. */
static bool shown(dc_view view, uint32_t uid, uint32_t owner) {
    return view == DC_VIEW_ALL || (view == DC_VIEW_OWN && uid == owner);
}

static void render_status(const dc_report *r, dc_view view, uint32_t uid, dc_sbuf *b) {
    static const char *const views[] = {"all", "own", "aggregate"};
    bool first;
    size_t n;

    dc_sbuf_printf(b,
                   "{\"daemon\":{\"version\":\"%s\",\"pid\":%d,\"uptime_s\":%.3f,"
                   "\"started\":%lld,",
                   DPCLIP_VERSION, r->pid, r->uptime_s, (long long)r->started);
    dc_sbuf_puts(b, "\"config_file\":");
    dc_sbuf_json_str(b, r->config_file);
    dc_sbuf_puts(b, ",\"socket\":");
    dc_sbuf_json_str(b, r->socket);
    /* insecure: --insecure-fixed-seed, predictable noise: nothing it
     * computes is private. */
    dc_sbuf_printf(b,
                   ",\"socket_activated\":%s,\"log_level\":\"%s\",\"stopping\":%s,"
                   "\"insecure\":%s},",
                   r->socket_activated ? "true" : "false", r->log_level,
                   r->stopping ? "true" : "false", r->insecure ? "true" : "false");
    /* What this caller is shown (docs/operations.md, "Who sees what"). */
    dc_sbuf_printf(b, "\"view\":\"%s\",", views[view]);
    if (view == DC_VIEW_OWN) dc_sbuf_printf(b, "\"view_uid\":%u,", uid);

    dc_sbuf_printf(b, "\"backends\":[{\"backend\":\"cpu\",\"workers\":%d,\"busy\":%d}",
                   r->cpu_workers, r->cpu_busy);
    for (int i = 0; i < r->n_gpus; i++) {
        dc_sbuf_printf(b, ",{\"backend\":\"cuda\",\"index\":%d,\"name\":", i);
        dc_sbuf_json_str(b, r->gpu_names[i]);
        dc_sbuf_puts(b, ",\"uuid\":");
        dc_sbuf_json_str(b, r->gpu_uuids[i]);
        dc_sbuf_printf(b, ",\"busy\":%d,\"workspace_bytes\":%llu,\"kept_bytes\":%llu}",
                       r->gpu_busy[i], (unsigned long long)r->gpu_workspace[i],
                       (unsigned long long)r->gpu_kept[i]);
    }
    dc_sbuf_printf(b, "],\"mps_active\":%s,", r->mps_active ? "true" : "false");
    json_limits(b, &r->cfg);
    dc_sbuf_puts(b, "\"access\":{\"allowed_uids\":");
    json_ids(b, view == DC_VIEW_ALL ? r->allowed_uids : NULL,
             view == DC_VIEW_ALL ? r->n_allowed_uids : 0);
    dc_sbuf_puts(b, ",\"allowed_gids\":");
    json_ids(b, view == DC_VIEW_ALL ? r->allowed_gids : NULL,
             view == DC_VIEW_ALL ? r->n_allowed_gids : 0);
    dc_sbuf_puts(b, "},\"sessions\":[");
    first = true;
    for (size_t i = 0; i < r->n_sessions; i++) {
        const dc_report_session *s = &r->sessions[i];
        if (!shown(view, uid, s->uid)) continue;
        dc_sbuf_printf(b, "%s{\"id\":%llu,\"pid\":%d,\"uid\":%u,\"gid\":%u,\"client\":",
                       first ? "" : ",", (unsigned long long)s->id, s->pid, s->uid, s->gid);
        dc_sbuf_json_str(b, s->client);
        dc_sbuf_puts(b, ",\"job\":");
        dc_sbuf_json_str(b, s->job_id);
        dc_sbuf_printf(b,
                       ",\"hello\":%s,\"steps\":%llu,\"steps_failed\":%llu,\"buffers\":%zu,"
                       "\"buffer_bytes\":%llu,\"busy\":%s,\"connected_s\":%.3f,\"idle_s\":",
                       s->hello ? "true" : "false", (unsigned long long)s->steps,
                       (unsigned long long)s->steps_failed, s->buffers,
                       (unsigned long long)s->buffer_bytes, s->busy ? "true" : "false",
                       s->connected_s);
        dc_sbuf_json_num(b, s->idle_s);
        dc_sbuf_puts(b, "}");
        first = false;
    }
    /* Groups the daemon knows: the sessions of one job (uid + job id) on this
     * node, i.e. a job's data-parallel ranks here. Model-parallel ranks
     * whose norms are summed are under norm_groups. */
    dc_sbuf_puts(b, "],\"groups\":[");
    first = true;
    for (size_t i = 0; i < r->n_sessions; i++) {
        const dc_report_session *s = &r->sessions[i];
        bool seen = false, first_id = true;
        uint64_t steps = 0;
        int busy = 0;
        if (!s->hello || !shown(view, uid, s->uid)) continue;
        for (size_t k = 0; k < i && !seen; k++)
            seen = r->sessions[k].hello && r->sessions[k].uid == s->uid &&
                   strcmp(r->sessions[k].job_id, s->job_id) == 0;
        if (seen) continue; /* listed with its first session */
        dc_sbuf_printf(b, "%s{\"kind\":\"job\",\"uid\":%u,\"job\":", first ? "" : ",", s->uid);
        dc_sbuf_json_str(b, s->job_id);
        dc_sbuf_puts(b, ",\"sessions\":[");
        for (size_t k = i; k < r->n_sessions; k++) {
            const dc_report_session *t = &r->sessions[k];
            if (!t->hello || t->uid != s->uid || strcmp(t->job_id, s->job_id) != 0) continue;
            dc_sbuf_printf(b, "%s%llu", first_id ? "" : ",", (unsigned long long)t->id);
            steps += t->steps;
            busy += t->busy;
            first_id = false;
        }
        dc_sbuf_printf(b, "],\"steps\":%llu,\"busy\":%d}", (unsigned long long)steps, busy);
        first = false;
    }
    /* Norm groups: model-parallel ranks whose norms are summed */
    dc_sbuf_puts(b, "],\"norm_groups\":[");
    first = true;
    for (size_t i = 0; i < r->n_norm_groups; i++) {
        const dc_group_info *g = &r->norm_groups[i];
        if (!shown(view, uid, g->uid)) continue;
        dc_sbuf_printf(b, "%s{\"id\":%llu,\"uid\":%u,\"name\":", first ? "" : ",",
                       (unsigned long long)g->id, g->uid);
        dc_sbuf_json_str(b, g->name);
        dc_sbuf_printf(b,
                       ",\"size\":%u,\"joined\":%u,\"waiting\":%u,\"clipping\":\"%s\","
                       "\"state\":\"%s\",\"step\":%llu,\"reductions\":%llu,"
                       "\"last_wait_ms\":%.3f,\"daemons\":%u,\"daemon_rank\":%u,"
                       "\"local_members\":%u,\"link\":\"%s\",\"exchanges\":%llu,"
                       "\"exchanges_polled\":%llu,\"last_exchange_ms\":%.3f,\"why\":",
                       g->size, g->joined, g->waiting,
                       g->clipping == DC_GROUP_WISE ? "GROUP_WISE" : "NORM_REDUCE",
                       g->dissolved                ? "dissolved"
                       : g->joined < g->local_size ? "forming"
                                                   : "ready",
                       (unsigned long long)g->step, (unsigned long long)g->reductions,
                       g->last_wait_ns / 1e6, g->daemons, g->daemon_rank, g->local_size,
                       dc_group_link_name(g->link), (unsigned long long)g->exchanges,
                       (unsigned long long)g->exchanges_polled, g->last_exchange_ns / 1e6);
        dc_sbuf_json_str(b, g->why);
        dc_sbuf_puts(b, "}");
        first = false;
    }
    dc_sbuf_puts(b, "],\"ledger\":{\"dir\":");
    dc_sbuf_json_str(b, view == DC_VIEW_ALL ? r->ledger_dir : "");
    dc_sbuf_printf(b,
                   ",\"persistent\":%s,\"delta\":%.17g,\"budget_epsilon\":%.17g,"
                   "\"budget_delta\":%.17g,\"require_sample_rate\":%s,"
                   "\"max_jobs_per_uid\":%u,\"job_idle_s\":%u,\"writes_in_flight\":%d,"
                   "\"n_jobs\":%zu,\"jobs\":[",
                   r->persistent ? "true" : "false", r->delta, r->budget_epsilon, r->budget_delta,
                   r->require_sample_rate ? "true" : "false", r->max_jobs_per_uid, r->job_idle_s,
                   r->writes_in_flight, r->n_accounts);
    first = true;
    for (size_t i = 0; i < r->n_accounts; i++) {
        const dc_report_account *a = &r->accounts[i];
        if (!shown(view, uid, a->uid)) continue;
        dc_sbuf_printf(b, "%s{\"uid\":%u,\"job\":", first ? "" : ",", a->uid);
        dc_sbuf_json_str(b, a->job_id);
        dc_sbuf_printf(b,
                       ",\"sessions\":%d,\"steps\":%llu,\"shares\":%llu,\"epsilon\":", a->sessions,
                       (unsigned long long)a->steps, (unsigned long long)a->shares);
        dc_sbuf_json_num(b, a->eps);
        dc_sbuf_printf(b, ",\"epsilon_infinite\":%s,\"delta\":%.17g,\"best_order\":",
                       isinf(a->eps) ? "true" : "false", a->delta);
        dc_sbuf_json_num(b, a->best_order);
        dc_sbuf_printf(b,
                       ",\"budget_epsilon\":%.17g,\"on_disk\":%s,\"insecure\":%s,"
                       "\"folded_steps\":%llu,\"history\":[",
                       a->budget_eps, a->on_disk ? "true" : "false", a->insecure ? "true" : "false",
                       (unsigned long long)a->folded_steps);
        for (size_t k = 0; k < a->n_hist; k++)
            dc_sbuf_printf(b, "%s{\"sample_rate\":%.17g,\"noise_multiplier\":%.17g,\"steps\":%llu}",
                           k ? "," : "", a->hist[k].q, a->hist[k].sigma,
                           (unsigned long long)a->hist[k].steps);
        dc_sbuf_puts(b, "]}");
        first = false;
    }
    n = 0;
    for (size_t i = 0; i < r->n_sessions; i++) n += shown(view, uid, r->sessions[i].uid);
    /* samples and layers: only for the full view (batch sizes, see report.h) */
    dc_sbuf_printf(b,
                   "]},\"totals\":{\"sessions_open\":%zu,\"sessions\":%llu,\"steps_ok\":%llu,"
                   "\"steps_failed\":%llu",
                   view == DC_VIEW_AGGREGATE ? r->n_sessions : n,
                   (unsigned long long)r->metrics.sessions_total,
                   (unsigned long long)r->metrics.steps_ok,
                   (unsigned long long)r->metrics.steps_failed);
    if (view == DC_VIEW_ALL)
        dc_sbuf_printf(b, ",\"samples\":%llu,\"layers\":%llu",
                       (unsigned long long)r->metrics.samples,
                       (unsigned long long)r->metrics.layers);
    dc_sbuf_puts(b, "}}\n");
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

/* One gauge sample per ledger account the caller may see, labelled uid and
 * job (its job id). */
static void account_gauge(dc_sbuf *b, const dc_report *r, dc_view view, uint32_t uid,
                          const char *name, const char *help, int which) {
    dc_prom_head(b, name, "gauge", help);
    for (size_t i = 0; i < r->n_accounts; i++) {
        const dc_report_account *a = &r->accounts[i];
        double v = which == 0   ? a->eps
                   : which == 1 ? (double)a->steps
                   : which == 2 ? a->delta
                                : a->budget_eps;
        if (!shown(view, uid, a->uid) || (which == 3 && a->budget_eps <= 0)) continue;
        dc_sbuf_printf(b, "%s{uid=\"%u\",job=", name, a->uid);
        dc_sbuf_prom_str(b, a->job_id);
        dc_sbuf_puts(b, "} ");
        dc_sbuf_prom_num(b, v);
        dc_sbuf_puts(b, "\n");
    }
}

static void render_metrics(const dc_report *r, dc_view view, uint32_t uid, dc_sbuf *b) {
    const dc_metrics *m = &r->metrics;
    char labels[64];

    dc_prom_head(b, "dpclip_build_info", "gauge", "dpclipd version");
    dc_sbuf_printf(b, "dpclip_build_info{version=\"%s\"} 1\n", DPCLIP_VERSION);
    gauge(b, "dpclip_uptime_seconds", "Seconds since the daemon started", r->uptime_s);
    gauge(b, "dpclip_insecure",
          "1 when the daemon runs with --insecure-fixed-seed: its noise is "
          "predictable and nothing it computes is private",
          r->insecure ? 1 : 0);

    dc_prom_head(b, "dpclip_requests_total", "counter", "Requests received, by type");
    for (int i = 0; i < DC_REQ_N; i++)
        dc_sbuf_printf(b, "dpclip_requests_total{type=\"%s\"} %llu\n", dc_req_names[i],
                       (unsigned long long)m->requests[i]);
    dc_prom_head(b, "dpclip_errors_total", "counter",
                 "Error replies (refused requests and failed steps), by code");
    for (int i = DC_EINVAL; i < DC_CODE_N; i++)
        dc_sbuf_printf(b, "dpclip_errors_total{code=\"%s\"} %llu\n", dc_code_name(i),
                       (unsigned long long)m->errors[i]);
    dc_prom_head(b, "dpclip_steps_total", "counter", "ClipSteps that ran, by result");
    dc_sbuf_printf(b,
                   "dpclip_steps_total{result=\"ok\"} %llu\ndpclip_steps_total{result=\"failed\"}"
                   " %llu\n",
                   (unsigned long long)m->steps_ok, (unsigned long long)m->steps_failed);
    counter(b, "dpclip_layers_total", "Layers in successful steps", m->layers);
    if (view == DC_VIEW_ALL) {
        /* Scraped every step, these give jobs' exact batch sizes: ops only. */
        counter(b, "dpclip_samples_total", "Samples in successful steps", m->samples);
        counter(b, "dpclip_bytes_referenced_total",
                "Bytes of input tensors (activations, gradients) successful steps named",
                m->bytes_referenced);
    }
    dc_prom_head(b, "dpclip_compute_seconds_total", "counter", "Backend time of successful steps");
    dc_sbuf_printf(b, "dpclip_compute_seconds_total %.9f\n", m->compute_ns / 1e9);
    counter(b, "dpclip_sessions_total", "Connections accepted", m->sessions_total);
    counter(b, "dpclip_sessions_refused_total",
            "Connections refused: at accept, past limits.max_connections or with no file "
            "descriptors left; at Hello, by [access]",
            m->sessions_refused);
    counter(b, "dpclip_budget_refusals_total", "Steps refused by a privacy budget",
            m->budget_refusals);
    counter(b, "dpclip_norm_groups_formed_total", "Norm groups formed", r->groups_formed);
    counter(b, "dpclip_norm_groups_dissolved_total",
            "Norm groups dissolved (a member left or timed out)", r->groups_dissolved);
    counter(b, "dpclip_norm_group_reductions_total", "Group steps whose norms were summed",
            r->group_reductions);
    counter(b, "dpclip_norm_group_timeouts_total", "Group steps a member did not arrive for",
            r->group_timeouts);
    counter(b, "dpclip_norm_group_fused_total",
            "Group steps whose members' steps ran as one fused step (groups.fuse)", r->group_fused);
    counter(b, "dpclip_norm_group_exchanges_total",
            "Cross-daemon exchanges of group norm totals (NCCL)", r->group_exchanges);
    counter(
        b, "dpclip_norm_group_exchanges_polled_total",
        "Of them, exchanges that found their link's thread polling, not asleep (daemon.spin_us)",
        r->group_exchanges_polled);
    counter(b, "dpclip_norm_group_link_failures_total",
            "Cross-daemon group links that failed (timeout, peer gone, mismatch)",
            r->group_link_failures);
    dc_prom_head(b, "dpclip_ledger_writes_total", "counter", "Crash-safe ledger file writes");
    dc_sbuf_printf(b,
                   "dpclip_ledger_writes_total{result=\"ok\"} %llu\n"
                   "dpclip_ledger_writes_total{result=\"error\"} %llu\n",
                   (unsigned long long)m->ledger_writes,
                   (unsigned long long)m->ledger_write_errors);
    dc_prom_head(b, "dpclip_reloads_total", "counter", "Configuration reloads (SIGHUP)");
    dc_sbuf_printf(b,
                   "dpclip_reloads_total{result=\"ok\"} %llu\n"
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

    gauge(b, "dpclip_sessions", "Open sessions", (double)r->n_sessions);
    gauge(b, "dpclip_steps_in_flight", "Sessions with a step accepted and not answered",
          (double)r->busy_sessions);
    gauge(b, "dpclip_buffers", "Registered buffers", (double)r->buffers);
    gauge(b, "dpclip_buffer_bytes", "Bytes of registered buffers", (double)r->buffer_bytes);
    dc_prom_head(b, "dpclip_queue_depth", "gauge", "Tasks submitted to a worker pool, not done");
    dc_sbuf_printf(b, "dpclip_queue_depth{pool=\"cpu\"} %d\n", r->cpu_busy);
    for (int i = 0; i < r->n_gpus; i++)
        dc_sbuf_printf(b, "dpclip_queue_depth{pool=\"cuda:%d\"} %d\n", i, r->gpu_busy[i]);
    dc_prom_head(b, "dpclip_gpu_workspace_bytes", "gauge",
                 "Device workspace of each GPU's backend");
    for (int i = 0; i < r->n_gpus; i++)
        dc_sbuf_printf(b, "dpclip_gpu_workspace_bytes{device=\"%d\"} %llu\n", i,
                       (unsigned long long)r->gpu_workspace[i]);
    dc_prom_head(b, "dpclip_gpu_kept_bytes", "gauge",
                 "Kept per-sample gradients of norm phases on each GPU, outside its workspace");
    for (int i = 0; i < r->n_gpus; i++)
        dc_sbuf_printf(b, "dpclip_gpu_kept_bytes{device=\"%d\"} %llu\n", i,
                       (unsigned long long)r->gpu_kept[i]);
    gauge(b, "dpclip_mps_active", "1 when the CUDA MPS control daemon serves this node",
          r->mps_active ? 1 : 0);
    gauge(b, "dpclip_ledger_jobs", "Job accounts in the privacy ledger (in memory)",
          (double)r->n_accounts);
    if (view == DC_VIEW_AGGREGATE) return;
    account_gauge(b, r, view, uid, "dpclip_job_epsilon",
                  "Epsilon a job has spent, at dpclip_job_delta", 0);
    account_gauge(b, r, view, uid, "dpclip_job_steps", "Steps a job has spent", 1);
    account_gauge(b, r, view, uid, "dpclip_job_delta", "Delta at which a job's epsilon is reported",
                  2);
    account_gauge(b, r, view, uid, "dpclip_job_budget_epsilon",
                  "A job's own budget, where it set one", 3);
}

void dc_report_status(const dc_report *r, dc_view view, uint32_t uid, dc_sbuf *b) {
    render_status(r, view, uid, b);
}

void dc_report_metrics(const dc_report *r, dc_view view, uint32_t uid, dc_sbuf *b) {
    render_metrics(r, view, uid, b);
}

/* --- the provider (HTTP threads render, release) ---------------------------------------- */

static void render(const void *snap, const dc_status_viewer *v, bool metrics, dc_sbuf *out) {
    const dc_report *r = snap;
    dc_view view = dc_report_view(r, v);
    if (metrics) render_metrics(r, view, v->uid, out);
    else render_status(r, view, v->uid, out);
}

static void release(void *snap) { dc_report_free(snap); }

const dc_status_provider dc_server_status = {snapshot, render, release};
