/* What the status endpoint serves (report.c), in two halves: the loop thread
 * copies the server's state into a dc_report (plain copies, no formatting,
 * no pointers into the server), and an HTTP thread renders /status (JSON)
 * or /metrics (Prometheus text) from it for one caller.
 *
 * Who sees what (docs/operations.md, "Who sees what"):
 *   - DC_VIEW_ALL: root, the daemon's own user, and members of
 *     status.ops_group on the Unix socket: everything.
 *   - DC_VIEW_OWN: any other caller on the Unix socket: the daemon's own
 *     state and node-wide counters, and only its own uid's sessions, groups
 *     and ledger accounts (client names, pids, job ids and epsilons of other
 *     users stay hidden).
 *   - DC_VIEW_AGGREGATE: TCP callers (127.0.0.1 cannot tell users apart):
 *     node-wide counts only, no session, job or per-job series.
 * Counters that add up batch sizes (samples, bytes referenced) give a
 * job's exact Poisson batch sizes to whoever scrapes them every step: only
 * DC_VIEW_ALL gets them. */
#ifndef DC_REPORT_H
#define DC_REPORT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "config.h"
#include "gpu.h"
#include "group.h"
#include "ledger.h"
#include "metrics.h"
#include "status.h"

typedef enum dc_view { DC_VIEW_ALL = 0, DC_VIEW_OWN, DC_VIEW_AGGREGATE } dc_view;

typedef struct dc_report_session {
    uint64_t id;
    int pid;
    uint32_t uid, gid;
    char client[64], job_id[64];
    bool hello, busy;
    uint64_t steps, steps_failed;
    size_t buffers;
    uint64_t buffer_bytes;
    double connected_s, idle_s; /* idle_s NaN: no step yet */
} dc_report_session;

typedef struct dc_report_account {
    uint32_t uid;
    char job_id[DC_LEDGER_JOB_ID_MAX];
    int sessions;
    uint64_t steps, shares, folded_steps;
    double eps, delta, best_order, budget_eps;
    bool on_disk, insecure;
    size_t n_hist;
    struct {
        double q, sigma;
        uint64_t steps;
    } hist[DC_LEDGER_HIST_MAX];
} dc_report_account;

typedef struct dc_report {
    /* the daemon */
    int pid;
    uint32_t daemon_uid;
    int64_t ops_gid; /* status.ops_group; -1 = none */
    double uptime_s;
    int64_t started;
    char config_file[DC_CONFIG_PATH_MAX], socket[108];
    bool socket_activated, stopping, insecure;
    const char *log_level; /* static string */
    int cpu_workers, cpu_busy;
    int n_gpus;
    char gpu_names[DC_MAX_GPUS][64];
    char gpu_uuids[DC_MAX_GPUS][DC_GPU_UUID_STR]; /* "" where unknown */
    int gpu_busy[DC_MAX_GPUS];
    uint64_t gpu_workspace[DC_MAX_GPUS]; /* as the GPU's worker published it */
    uint64_t gpu_kept[DC_MAX_GPUS];      /* its kept stores' bytes */
    bool mps_active;
    dc_config cfg; /* the settings in effect (limits: every dc_config_is_limit) */
    uint32_t allowed_uids[DC_CONFIG_MAX_IDS], allowed_gids[DC_CONFIG_MAX_IDS];
    size_t n_allowed_uids, n_allowed_gids;
    /* the ledger */
    char ledger_dir[256];
    bool persistent, require_sample_rate;
    double delta, budget_epsilon, budget_delta;
    uint32_t max_jobs_per_uid, job_idle_s;
    int writes_in_flight;
    /* sessions, ledger accounts, counters */
    dc_report_session *sessions;
    size_t n_sessions;
    dc_report_account *accounts;
    size_t n_accounts;
    uint64_t buffers, buffer_bytes, busy_sessions;
    dc_metrics metrics;
    /* norm groups */
    dc_group_info *norm_groups;
    size_t n_norm_groups;
    uint64_t groups_formed, groups_dissolved, group_reductions, group_timeouts;
    uint64_t group_fused;
    uint64_t group_exchanges, group_exchanges_polled, group_link_failures;
} dc_report;

/* The view a caller gets of report r (its ops group and daemon uid). */
dc_view dc_report_view(const dc_report *r, const dc_status_viewer *v);
/* The bodies, for `view` (uid: the caller's, for DC_VIEW_OWN). */
void dc_report_status(const dc_report *r, dc_view view, uint32_t uid, dc_sbuf *b);
void dc_report_metrics(const dc_report *r, dc_view view, uint32_t uid, dc_sbuf *b);
void dc_report_free(dc_report *r);

/* The status endpoint's provider over a dc_server (snapshots on its loop). */
extern const dc_status_provider dc_server_status;

#endif
