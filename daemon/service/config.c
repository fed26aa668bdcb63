#include "config.h"

#include <errno.h>
#include <grp.h>
#include <limits.h>
#include <math.h>
#include <pwd.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "backend.h"
#include "dc_frame.h"
#include "dc_install.h"

/* --- the settings table ------------------------------------------------------ */

typedef enum key_type {
    T_PATH,      /* char[], absolute path (or "" where allowed) */
    T_GROUP,     /* char[], group name or number, "" = unset */
    T_MODE,      /* unsigned, octal permission bits */
    T_UINT,      /* uint32_t / int in [lo, hi] */
    T_SIZE,      /* uint64_t bytes: a whole number with an optional K, M, G or T (powers of 1024) */
    T_SIZE_AUTO, /* T_SIZE, or "auto" (DC_SAMPLE_GRADS_AUTO: the daemon sizes it per GPU) */
    T_INT,
    T_BOOL,
    T_LEVEL,  /* dc_log_level */
    T_DOUBLE, /* in [lo, hi] */
    T_UIDS,   /* list of users (names or numbers) */
    T_GIDS    /* list of groups */
} key_type;

typedef struct key_def {
    const char *section, *key;
    const char *flag; /* long option, or NULL */
    key_type type;
    size_t off, size;
    double lo, hi;
    bool reload; /* SIGHUP may change it in a running daemon */
    const char *help;
} key_def;

#define F(field) offsetof(dc_config, field), sizeof(((dc_config *)0)->field)

static const key_def KEYS[] = {
    {"daemon", "socket", "socket", T_PATH, F(socket), 0, 0, false,
     "Unix socket trainers connect to"},
    {"daemon", "socket_mode", "socket-mode", T_MODE, F(socket_mode), 0, 0777, false,
     "permissions of the socket file"},
    {"daemon", "socket_group", "socket-group", T_GROUP, F(socket_group), 0, 0, false,
     "group of the socket file (the trainers' group); empty = the daemon's"},
    {"daemon", "workers", "workers", T_INT, F(workers), 0, 256, false,
     "CPU worker threads; 0 = one per CPU"},
    {"daemon", "blas_threads", "blas-threads", T_INT, F(blas_threads), 1, 256, false,
     "BLAS threads inside one CPU step"},
    {"daemon", "spin_us", "spin-us", T_UINT, F(spin_us), 0, 100000, false,
     "idle workers and the loop poll this long before sleeping"},
    {"daemon", "gpu", NULL, T_BOOL, F(gpu), 0, 0, false,
     "serve CUDA buffers on the GPUs found (--no-gpu: false)"},
    {"daemon", "log_level", "log-level", T_LEVEL, F(log_level), 0, 0, true,
     "error, warn, info or debug"},
    {"gpu", "workspace", "gpu-workspace", T_SIZE, F(gpu_workspace), 0, 0, false,
     "device workspace preallocated per GPU (K/M/G suffixes); a larger step grows it once"},
    {"gpu", "workspace_max", "gpu-workspace-max", T_SIZE, F(gpu_workspace_max), 0, 0, false,
     "most device workspace per GPU; a step needing more fails (0 = no cap)"},
    {"gpu", "sample_grads_max", "gpu-sample-grads-max", T_SIZE_AUTO, F(gpu_sample_grads_max), 0, 0,
     false,
     "most device workspace per GPU keeping per-sample gradients, so that clipped sums "
     "cost a pass over memory, not a GEMM (0 = none; auto = 1/8 of each GPU's memory)"},
    {"gpu", "idle_release_s", "gpu-idle-release-s", T_UINT, F(gpu_idle_release_s), 0, 604800, true,
     "a GPU without work this long gives back the workspace and kept per-sample gradients it "
     "grew beyond gpu.workspace (0 = never)"},
    {"limits", "max_batch", "max-batch", T_UINT, F(max_batch), 1, 1u << 24, true,
     "largest batch a step may declare"},
    {"limits", "max_layers", "max-layers", T_UINT, F(max_layers), 1, 1u << 20, true,
     "most layers in one step"},
    {"limits", "max_frame", "max-frame", T_UINT, F(max_frame), 64, 1u << 30, false,
     "largest request frame in bytes"},
    {"limits", "max_buffers", "max-buffers", T_UINT, F(max_buffers), 1, 1u << 20, true,
     "buffers one session may hold registered"},
    {"limits", "max_events", "max-events", T_UINT, F(max_events), 1, 1u << 20, true,
     "CUDA IPC events one session may hold registered"},
    {"limits", "max_step_samples", NULL, T_UINT, F(max_step_samples), 1, 1u << 31, true,
     "most layers x batch in one step (its per-sample norm tables and reply)"},
    {"limits", "max_step_memory", NULL, T_SIZE, F(max_step_memory), 1 << 20, 0, true,
     "most host memory one step may need: tables, reply and CPU scratch (K/M/G suffixes)"},
    {"limits", "max_step_gflop", NULL, T_UINT, F(max_step_gflop), 1, 1u << 31, true,
     "most work in one host-memory step, in GFLOP (CPU backend: about 0.1 s per 10)"},
    {"limits", "max_gpu_step_gflop", NULL, T_UINT, F(max_gpu_step_gflop), 1, 1u << 31, true,
     "most work in one GPU step, in GFLOP"},
    {"limits", "max_connections", NULL, T_UINT, F(max_connections), 1, 1u << 20, true,
     "connections open at once; more are refused"},
    {"limits", "handshake_timeout", NULL, T_DOUBLE, F(handshake_timeout), 0.001, 3600, true,
     "seconds a connection has to say Hello"},
    {"limits", "idle_timeout", NULL, T_DOUBLE, F(idle_timeout), 0, 1e7, true,
     "seconds a session may go without a request or a step in flight; 0 = no limit"},
    {"limits", "max_connections_per_uid", NULL, T_UINT, F(max_connections_per_uid), 1, 1u << 20,
     true,
     "connections one user (uid) may have open at once, so that one user cannot take every "
     "connection from the others"},
    {"limits", "max_buffers_total", NULL, T_UINT, F(max_buffers_total), 1, 1u << 24, true,
     "buffers all sessions together may hold registered"},
    {"limits", "max_buffers_per_uid", NULL, T_UINT, F(max_buffers_per_uid), 1, 1u << 24, true,
     "buffers all sessions of one user (uid) together may hold registered"},
    {"limits", "max_mapped_bytes", NULL, T_SIZE, F(max_mapped_bytes), 0, 0, true,
     "shared memory all sessions together may have mapped (K/M/G/T; 0 = no cap)"},
    {"limits", "max_mapped_bytes_per_uid", NULL, T_SIZE, F(max_mapped_bytes_per_uid), 0, 0, true,
     "shared memory all sessions of one user (uid) may have mapped (K/M/G/T; 0 = no cap)"},
    {"limits", "max_pass_memory", NULL, T_SIZE, F(max_pass_memory), 0, 0, true,
     "host memory all sessions' norm passes (steps in phases) may hold between their steps "
     "(K/M/G)"},
    {"limits", "max_pass_memory_per_uid", NULL, T_SIZE, F(max_pass_memory_per_uid), 0, 0, true,
     "host memory the norm passes of one user's (uid's) sessions may hold (K/M/G)"},
    {"limits", "max_micro_batches", NULL, T_UINT, F(max_micro_batches), 1, 1u << 30, true,
     "micro-batches in one logical step (gradient accumulation)"},
    {"limits", "max_accumulator_memory", NULL, T_SIZE, F(max_accumulator_memory), 0, 0, true,
     "memory all sessions' logical steps may hold in accumulators, host and device (K/M/G/T)"},
    {"limits", "max_accumulator_memory_per_uid", NULL, T_SIZE, F(max_accumulator_memory_per_uid), 0,
     0, true, "memory the logical steps of one user's (uid's) sessions may hold in accumulators"},
    {"limits", "logical_step_timeout", NULL, T_DOUBLE, F(logical_step_timeout), 1, 1e7, true,
     "seconds a logical step may stay open before its commit; then it is aborted"},
    {"limits", "max_reply_queue", NULL, T_SIZE, F(max_reply_queue), 0, 0, true,
     "unsent reply bytes a session may have before its next request waits"},
    {"limits", "max_group_size", NULL, T_UINT, F(max_group_size), 1, 1u << 16, true,
     "members of one norm group"},
    {"limits", "max_group_links", NULL, T_UINT, F(max_group_links), 0, 4096, true,
     "norm groups across daemons (each an NCCL communicator and a thread) held at once; "
     "0 = none"},
    {"limits", "max_group_timeout_ms", NULL, T_UINT, F(max_group_timeout_ms), 1, 86400000, true,
     "longest wait for a group's members a join may ask for (JoinGroup.timeout_ms)"},
    {"groups", "timeout_ms", "group-timeout-ms", T_UINT, F(group_timeout_ms), 1, 86400000, true,
     "how long a grouped step waits for the group's other members (a join may ask for another)"},
    {"groups", "fuse", NULL, T_BOOL, F(group_fuse), 0, 0, true,
     "run a one-daemon group's steps on one device as one fused step (false: each member's "
     "norm and clip phases apart)"},
    {"access", "allowed_uids", NULL, T_UIDS, F(allowed_uids), 0, 0, true,
     "users (names or uids) allowed to connect; empty = anyone who can open the socket"},
    {"access", "allowed_groups", NULL, T_GIDS, F(allowed_gids), 0, 0, true,
     "groups (names or gids) whose members may connect"},
    {"status", "socket", "status-socket", T_PATH, F(status_socket), 0, 0, false,
     "HTTP status socket; empty = <socket without .sock>-status.sock, none = off"},
    {"status", "socket_mode", NULL, T_MODE, F(status_mode), 0, 0777, false,
     "permissions of the status socket"},
    {"status", "socket_group", NULL, T_GROUP, F(status_group), 0, 0, false,
     "group of the status socket"},
    {"status", "tcp_port", "status-port", T_UINT, F(status_port), 0, 65535, false,
     "also serve status on 127.0.0.1:PORT; 0 = off"},
    {"status", "max_connections", NULL, T_UINT, F(status_max_connections), 1, 65536, false,
     "status connections open at once (each socket); more are refused"},
    {"status", "timeout_s", NULL, T_UINT, F(status_timeout_s), 1, 3600, false,
     "a status connection silent this long is closed"},
    {"status", "ops_group", NULL, T_GROUP, F(status_ops_group), 0, 0, true,
     "group whose members see every job on the status socket; others see their own"},
    {"ledger", "dir", "ledger-dir", T_PATH, F(ledger_dir), 0, 0, false,
     "privacy ledger directory; empty = in memory only"},
    {"ledger", "delta", NULL, T_DOUBLE, F(delta), 1e-300, 0.5, true,
     "delta at which a job's epsilon is reported unless the job gives one"},
    {"ledger", "budget_epsilon", "budget-epsilon", T_DOUBLE, F(budget_epsilon), 0, 1e6, true,
     "refuse steps that would take a job past this epsilon (at budget_delta); 0 = none"},
    {"ledger", "budget_delta", NULL, T_DOUBLE, F(budget_delta), 1e-300, 0.5, true,
     "delta of the node-wide budget"},
    {"ledger", "require_sample_rate", NULL, T_BOOL, F(require_sample_rate), 0, 0, true,
     "refuse steps that do not state their sample rate (else counted as rate 1)"},
    {"ledger", "max_jobs_per_uid", NULL, T_UINT, F(ledger_max_jobs_per_uid), 0, 1u << 20, true,
     "accounts one uid may hold in the ledger's memory (jobs with sessions or recent steps)"},
    {"ledger", "job_idle_s", NULL, T_UINT, F(ledger_job_idle_s), 0, 1u << 30, true,
     "an account without sessions leaves memory this long after its last step (in memory "
     "only: forgotten; 0 = never)"},
};
#define N_KEYS (sizeof KEYS / sizeof KEYS[0])
_Static_assert(N_KEYS <= DC_CONFIG_KEYS_MAX, "DC_CONFIG_KEYS_MAX: the command line's option table");

void dc_config_defaults(dc_config *c) {
    const char *env = getenv("DPCLIP_SOCKET");
    memset(c, 0, sizeof *c);
    snprintf(c->socket, sizeof c->socket, "%s",
             env && env[0] && strlen(env) < sizeof c->socket ? env : "/run/dpclip/dpclipd.sock");
    c->socket_mode = 0660;
    c->workers = 0;
    c->blas_threads = 1;
    c->spin_us = 50;
    c->gpu = true;
    c->gpu_workspace = (uint64_t)256 << 20;
    c->gpu_sample_grads_max = DC_SAMPLE_GRADS_AUTO;
    c->gpu_idle_release_s = 300;
    c->log_level = DC_LOG_INFO;
    c->max_batch = DC_DEFAULT_MAX_BATCH;
    c->max_layers = DC_DEFAULT_MAX_LAYERS;
    c->max_frame = DC_DEFAULT_MAX_FRAME;
    c->max_buffers = 4096;
    c->max_events = 4096;
    c->max_step_samples = 1u << 22;
    c->max_step_memory = (uint64_t)2 << 30;
    c->max_step_gflop = 500;
    c->max_gpu_step_gflop = 2000000;
    c->max_connections = 1024;
    c->max_connections_per_uid = 256;
    c->handshake_timeout = 10;
    c->max_buffers_total = 16384;
    c->max_buffers_per_uid = 8192;
    c->max_mapped_bytes = (uint64_t)1 << 40;
    c->max_mapped_bytes_per_uid = (uint64_t)1 << 39;
    c->max_pass_memory = (uint64_t)4 << 30;
    c->max_pass_memory_per_uid = (uint64_t)1 << 30;
    c->max_micro_batches = 65536;
    c->max_accumulator_memory = (uint64_t)256 << 30;
    c->max_accumulator_memory_per_uid = (uint64_t)128 << 30;
    c->logical_step_timeout = 3600;
    c->max_reply_queue = 8u << 20;
    c->max_group_size = 256;
    c->max_group_links = 16;
    c->max_group_timeout_ms = 600000;
    c->group_timeout_ms = 60000;
    c->group_fuse = true;
    c->status_mode = 0660;
    c->status_max_connections = 256;
    c->status_timeout_s = 5;
    c->delta = 1e-5;
    c->budget_delta = 1e-5;
    c->ledger_max_jobs_per_uid = 64;
    c->ledger_job_idle_s = 86400;
    c->ready_fd = -1;
}

/* --- values -------------------------------------------------------------------- */

static const key_def *find_key(const char *section, const char *key, bool *section_known) {
    *section_known = false;
    for (size_t i = 0; i < N_KEYS; i++) {
        if (strcmp(KEYS[i].section, section) != 0) continue;
        *section_known = true;
        if (strcmp(KEYS[i].key, key) == 0) return &KEYS[i];
    }
    return NULL;
}

int dc_config_parse_ull(const char *s, int base, unsigned long long *out) {
    char *end;
    errno = 0;
    if (!s[0] || s[0] == '-' || s[0] == '+') return -1;
    *out = strtoull(s, &end, base);
    return errno || *end ? -1 : 0;
}

static int parse_bool(const char *s, bool *out) {
    static const char *yes[] = {"true", "yes", "on", "1"}, *no[] = {"false", "no", "off", "0"};
    for (int i = 0; i < 4; i++) {
        if (strcasecmp(s, yes[i]) == 0) return *out = true, 0;
        if (strcasecmp(s, no[i]) == 0) return *out = false, 0;
    }
    return -1;
}

int dc_config_group_id(const char *name, uint32_t *gid) {
    unsigned long long v;
    struct group gr, *res = NULL;
    char buf[4096];
    if (dc_config_parse_ull(name, 10, &v) == 0) {
        if (v > UINT32_MAX - 1) return -1;
        *gid = (uint32_t)v;
        return 0;
    }
    if (getgrnam_r(name, &gr, buf, sizeof buf, &res) != 0 || !res) return -1;
    *gid = (uint32_t)res->gr_gid;
    return 0;
}

static int user_id(const char *name, uint32_t *uid) {
    unsigned long long v;
    struct passwd pw, *res = NULL;
    char buf[4096];
    if (dc_config_parse_ull(name, 10, &v) == 0) {
        if (v > UINT32_MAX - 1) return -1;
        *uid = (uint32_t)v;
        return 0;
    }
    if (getpwnam_r(name, &pw, buf, sizeof buf, &res) != 0 || !res) return -1;
    *uid = (uint32_t)res->pw_uid;
    return 0;
}

/* A list of names or numbers separated by commas and/or blanks. */
static int parse_ids(const char *value, bool users, uint32_t *ids, size_t *n, const char *where,
                     const key_def *k, dc_err *err) {
    char buf[1024], *save = NULL;
    size_t cnt = 0;
    if (strlen(value) >= sizeof buf)
        return dc_err_set(err, DC_EINVAL, k->key, "%s: %s.%s: list too long", where, k->section,
                          k->key);
    snprintf(buf, sizeof buf, "%s", value);
    for (char *t = strtok_r(buf, ", \t", &save); t; t = strtok_r(NULL, ", \t", &save)) {
        uint32_t id;
        if (cnt == DC_CONFIG_MAX_IDS)
            return dc_err_set(err, DC_EINVAL, k->key, "%s: %s.%s: more than %d entries", where,
                              k->section, k->key, DC_CONFIG_MAX_IDS);
        if ((users ? user_id(t, &id) : dc_config_group_id(t, &id)) != 0)
            return dc_err_set(err, DC_EINVAL, k->key, "%s: %s.%s: no such %s '%s'", where,
                              k->section, k->key, users ? "user" : "group", t);
        ids[cnt++] = id;
    }
    *n = cnt;
    return 0;
}

static int set_value(dc_config *c, const key_def *k, const char *value, const char *where,
                     dc_err *err) {
    char *p = (char *)c + k->off;
    unsigned long long u;
    const char *what = NULL;

    if (k->type == T_SIZE_AUTO && strcmp(value, "auto") == 0) {
        *(uint64_t *)p = DC_SAMPLE_GRADS_AUTO;
        return 0;
    }
    switch (k->type) {
    case T_PATH:
        if (strlen(value) >= k->size) {
            what = "path too long";
            break;
        }
        if (value[0] && value[0] != '/' && strcmp(value, "none") != 0) {
            what = "must be an absolute path";
            break;
        }
        snprintf(p, k->size, "%s", value);
        return 0;
    case T_GROUP: {
        uint32_t gid;
        if (strlen(value) >= k->size) {
            what = "name too long";
            break;
        }
        if (value[0] && dc_config_group_id(value, &gid) != 0)
            return dc_err_set(err, DC_EINVAL, k->key, "%s: %s.%s: no such group '%s'", where,
                              k->section, k->key, value);
        snprintf(p, k->size, "%s", value);
        return 0;
    }
    case T_MODE:
        if (dc_config_parse_ull(value, 8, &u) || u > (unsigned long long)k->hi) {
            what = "expected octal permission bits such as 0660";
            break;
        }
        *(unsigned *)p = (unsigned)u;
        return 0;
    case T_UINT:
    case T_INT:
        if (dc_config_parse_ull(value, 10, &u) || u < (unsigned long long)k->lo ||
            u > (unsigned long long)k->hi)
            return dc_err_set(err, DC_EINVAL, k->key,
                              "%s: %s.%s: '%s' is not a whole number in [%.0f, %.0f]", where,
                              k->section, k->key, value, k->lo, k->hi);
        if (k->type == T_UINT) *(uint32_t *)p = (uint32_t)u;
        else *(int *)p = (int)u;
        return 0;
    case T_SIZE_AUTO:
    case T_SIZE: {
        static const char units[] = "KMGT";
        char num[32];
        size_t n = strlen(value);
        int shift = 0;
        if (n == 0 || n >= sizeof num) {
            what = "expected bytes, e.g. 268435456, 256M or 1G";
            break;
        }
        memcpy(num, value, n + 1);
        const char last = num[n - 1];
        const char *unit = (last >= 'a' && last <= 'z') || (last >= 'A' && last <= 'Z')
                               ? strchr(units, last & ~0x20)
                               : NULL;
        if (unit) {
            shift = 10 * (int)(unit - units + 1);
            num[--n] = '\0';
        }
        if (dc_config_parse_ull(num, 10, &u) != 0 || (shift && u > (UINT64_MAX >> shift)) ||
            (k->type == T_SIZE_AUTO && (uint64_t)u << shift == DC_SAMPLE_GRADS_AUTO)) {
            what = k->type == T_SIZE_AUTO
                       ? "expected auto or bytes, e.g. 268435456, 256M or 1G (whole number, "
                         "below 2^64 - 1)"
                       : "expected bytes, e.g. 268435456, 256M or 1G (whole number, no overflow)";
            break;
        }
        *(uint64_t *)p = (uint64_t)u << shift;
        return 0;
    }
    case T_BOOL:
        if (parse_bool(value, (bool *)p)) {
            what = "expected true or false";
            break;
        }
        return 0;
    case T_LEVEL: {
        int lv = dc_log_parse_level(value);
        if (lv < 0) {
            what = "expected error, warn, info or debug";
            break;
        }
        *(dc_log_level *)p = (dc_log_level)lv;
        return 0;
    }
    case T_DOUBLE: {
        char *end;
        double d;
        errno = 0;
        d = strtod(value, &end);
        if (errno || end == value || *end || !isfinite(d) || (d < k->lo && d != 0.0) || d > k->hi ||
            (d == 0.0 && k->lo > 0))
            return dc_err_set(err, DC_EINVAL, k->key,
                              "%s: %s.%s: '%s' is not a number in %s[%g, %g]", where, k->section,
                              k->key, value, k->lo > 0 ? "" : "{0} or ", k->lo > 0 ? k->lo : 0.0,
                              k->hi);
        *(double *)p = d;
        return 0;
    }
    case T_UIDS: return parse_ids(value, true, c->allowed_uids, &c->n_allowed_uids, where, k, err);
    case T_GIDS: return parse_ids(value, false, c->allowed_gids, &c->n_allowed_gids, where, k, err);
    }
    return dc_err_set(err, DC_EINVAL, k->key, "%s: %s.%s: bad value '%s': %s", where, k->section,
                      k->key, value, what ? what : "invalid");
}

int dc_config_set(dc_config *c, const char *section, const char *key, const char *value,
                  const char *where, dc_err *err) {
    bool known;
    const key_def *k = find_key(section, key, &known);
    if (!k) {
        if (!known)
            return dc_err_set(err, DC_EINVAL, section, "%s: unknown section [%s]", where, section);
        return dc_err_set(err, DC_EINVAL, key, "%s: unknown key '%s' in [%s]", where, key, section);
    }
    return set_value(c, k, value, where, err);
}

/* --- flags (the command line itself is config_args.c) ----------------------- */

const char *dc_config_default_path(void) {
    static char path[DC_CONFIG_PATH_MAX];
    if (!path[0]) dc_install_config_path(DPCLIP_SBINDIR, path, sizeof path);
    return path;
}

void dc_config_usage_keys(FILE *f) {
    for (size_t i = 0; i < N_KEYS; i++) {
        char opt[64];
        if (!KEYS[i].flag) continue;
        snprintf(opt, sizeof opt, "--%s %s", KEYS[i].flag,
                 KEYS[i].type == T_PATH   ? "PATH"
                 : KEYS[i].type == T_MODE ? "OCTAL"
                                          : "N");
        if (KEYS[i].type == T_LEVEL) snprintf(opt, sizeof opt, "--%s LEVEL", KEYS[i].flag);
        if (KEYS[i].type == T_GROUP) snprintf(opt, sizeof opt, "--%s GROUP", KEYS[i].flag);
        if (KEYS[i].type == T_DOUBLE) snprintf(opt, sizeof opt, "--%s X", KEYS[i].flag);
        fprintf(f, "  %-22s %s (%s.%s)\n", opt, KEYS[i].help, KEYS[i].section, KEYS[i].key);
    }
}

const char *dc_config_key_flag(size_t i) { return i < N_KEYS ? KEYS[i].flag : NULL; }

int dc_config_set_flag(dc_config *c, const char *flag, const char *arg, dc_err *err) {
    for (size_t i = 0; i < N_KEYS; i++)
        if (KEYS[i].flag && strcmp(KEYS[i].flag, flag) == 0) {
            char where[80];
            snprintf(where, sizeof where, "--%s", flag);
            return set_value(c, &KEYS[i], arg, where, err);
        }
    return dc_err_set(err, DC_EINTERNAL, flag, "unhandled flag --%s", flag);
}

/* --- checks and listing ------------------------------------------------------- */

void dc_config_status_path(const dc_config *c, char *out, size_t n) {
    size_t len;
    if (strcmp(c->status_socket, "none") == 0) {
        snprintf(out, n, "%s", "");
        return;
    }
    if (c->status_socket[0]) {
        snprintf(out, n, "%s", c->status_socket);
        return;
    }
    len = strlen(c->socket);
    if (len > 5 && strcmp(c->socket + len - 5, ".sock") == 0) len -= 5;
    snprintf(out, n, "%.*s-status.sock", (int)len, c->socket);
}

int dc_config_validate(const dc_config *c, dc_err *err) {
    char st[128];
    if (!c->socket[0] || strcmp(c->socket, "none") == 0)
        return dc_err_set(err, DC_EINVAL, "socket", "daemon.socket: a socket path is required");
    dc_config_status_path(c, st, sizeof st);
    if (strlen(st) >= sizeof c->status_socket)
        return dc_err_set(err, DC_EINVAL, "socket",
                          "status.socket: '%s' is too long for a Unix "
                          "socket path",
                          st);
    if (st[0] && strcmp(st, c->socket) == 0)
        return dc_err_set(err, DC_EINVAL, "socket",
                          "status.socket must differ from "
                          "daemon.socket (%s)",
                          st);
    if (strcmp(c->ledger_dir, "none") == 0)
        return dc_err_set(err, DC_EINVAL, "dir",
                          "ledger.dir: use an empty value for an "
                          "in-memory ledger");
    if (c->gpu_workspace_max && c->gpu_workspace > c->gpu_workspace_max)
        return dc_err_set(err, DC_EINVAL, "workspace",
                          "gpu.workspace (%llu bytes) is over gpu.workspace_max (%llu bytes)",
                          (unsigned long long)c->gpu_workspace,
                          (unsigned long long)c->gpu_workspace_max);
    if (c->group_timeout_ms > c->max_group_timeout_ms)
        return dc_err_set(err, DC_EINVAL, "timeout_ms",
                          "groups.timeout_ms (%u) is over limits.max_group_timeout_ms (%u)",
                          c->group_timeout_ms, c->max_group_timeout_ms);
    if (c->budget_epsilon > 0 && !c->ledger_dir[0])
        return dc_err_set(err, DC_EINVAL, "budget_epsilon",
                          "ledger.budget_epsilon needs ledger.dir: a budget kept only in memory "
                          "starts again from zero at every restart");
    return 0;
}

/* Bytes, with the largest exact K/M/G/T unit. */
static void print_size(FILE *f, uint64_t v) {
    static const char units[] = "KMGT";
    int i = -1;
    while (i < 3 && v && (v & 1023) == 0) {
        v >>= 10;
        i++;
    }
    if (i >= 0) fprintf(f, "%llu%c", (unsigned long long)v, units[i]);
    else fprintf(f, "%llu", (unsigned long long)v);
}

/* The shortest form that reads back as the same double (1e-05, not
 * 1.0000000000000001e-05): the printed config is meant to be read. */
static void print_double(FILE *f, double v) {
    char buf[40];
    if (v == floor(v) && fabs(v) < 1e15) { /* seconds and the like: 10, not 1e+01 */
        fprintf(f, "%.0f", v);
        return;
    }
    for (int prec = 1; prec <= 17; prec++) {
        snprintf(buf, sizeof buf, "%.*g", prec, v);
        if (strtod(buf, NULL) == v) break;
    }
    fputs(buf, f);
}

static void print_ids(FILE *f, const uint32_t *ids, size_t n) {
    for (size_t i = 0; i < n; i++) fprintf(f, "%s%u", i ? ", " : "", ids[i]);
}

void dc_config_print(const dc_config *c, FILE *f) {
    static const char *levels[] = {"error", "warn", "info", "debug"};
    const char *section = "";
    fprintf(f, "# dpclipd effective configuration%s%s\n", c->config_path[0] ? " from " : "",
            c->config_path);
    for (size_t i = 0; i < N_KEYS; i++) {
        const key_def *k = &KEYS[i];
        const char *p = (const char *)c + k->off;
        if (strcmp(section, k->section) != 0) {
            fprintf(f, "\n[%s]\n", k->section);
            section = k->section;
        }
        fprintf(f, "# %s%s\n%s = ", k->help, k->reload ? "" : " (restart to change)", k->key);
        switch (k->type) {
        case T_PATH:
        case T_GROUP: fprintf(f, "%s", p); break;
        case T_MODE: fprintf(f, "%04o", *(const unsigned *)p); break;
        case T_UINT: fprintf(f, "%u", *(const uint32_t *)p); break;
        case T_SIZE: print_size(f, *(const uint64_t *)p); break;
        case T_SIZE_AUTO:
            if (*(const uint64_t *)p == DC_SAMPLE_GRADS_AUTO) fputs("auto", f);
            else print_size(f, *(const uint64_t *)p);
            break;
        case T_INT: fprintf(f, "%d", *(const int *)p); break;
        case T_BOOL: fprintf(f, "%s", *(const bool *)p ? "true" : "false"); break;
        case T_LEVEL: fprintf(f, "%s", levels[*(const dc_log_level *)p]); break;
        case T_DOUBLE: print_double(f, *(const double *)p); break;
        case T_UIDS: print_ids(f, c->allowed_uids, c->n_allowed_uids); break;
        case T_GIDS: print_ids(f, c->allowed_gids, c->n_allowed_gids); break;
        }
        fputc('\n', f);
    }
}

/* Settings outside [limits] that bound what a client can make the daemon
 * hold: device workspace, how long a grouped step or a status connection is
 * held, status connections, ledger accounts. */
static const char *const OTHER_LIMITS[] = {"gpu.workspace_max", "gpu.sample_grads_max",
                                           "groups.timeout_ms", "status.max_connections",
                                           "status.timeout_s",  "ledger.max_jobs_per_uid",
                                           "ledger.job_idle_s"};

bool dc_config_key(size_t i, const char **section, const char **key) {
    if (i >= N_KEYS) return false;
    *section = KEYS[i].section;
    *key = KEYS[i].key;
    return true;
}

int dc_config_key_index(const char *section, const char *key) {
    bool known;
    const key_def *k = find_key(section, key, &known);
    return k ? (int)(k - KEYS) : -1;
}

size_t dc_config_n_keys(void) { return N_KEYS; }

bool dc_config_number(const dc_config *c, size_t i, char *out, size_t n) {
    const char *p;
    if (i >= N_KEYS) return false;
    p = (const char *)c + KEYS[i].off;
    switch (KEYS[i].type) {
    case T_UINT: snprintf(out, n, "%u", *(const uint32_t *)p); return true;
    case T_INT: snprintf(out, n, "%d", *(const int *)p); return true;
    case T_SIZE: snprintf(out, n, "%llu", (unsigned long long)*(const uint64_t *)p); return true;
    case T_SIZE_AUTO: /* a JSON string for auto: each GPU resolves it (its log says to what) */
        if (*(const uint64_t *)p == DC_SAMPLE_GRADS_AUTO) snprintf(out, n, "\"auto\"");
        else snprintf(out, n, "%llu", (unsigned long long)*(const uint64_t *)p);
        return true;
    case T_DOUBLE: snprintf(out, n, "%.17g", *(const double *)p); return true;
    default: return false;
    }
}

bool dc_config_is_limit(size_t i) {
    char name[64];
    if (i >= N_KEYS) return false;
    if (strcmp(KEYS[i].section, "limits") == 0) return true;
    snprintf(name, sizeof name, "%s.%s", KEYS[i].section, KEYS[i].key);
    for (size_t k = 0; k < sizeof OTHER_LIMITS / sizeof OTHER_LIMITS[0]; k++)
        if (strcmp(OTHER_LIMITS[k], name) == 0) return true;
    return false;
}

int dc_config_restart_needed(const dc_config *old, const dc_config *cur,
                             void (*note)(void *arg, const char *name), void *arg) {
    int n = 0;
    for (size_t i = 0; i < N_KEYS; i++) {
        const key_def *k = &KEYS[i];
        if (k->reload) continue;
        if (memcmp((const char *)old + k->off, (const char *)cur + k->off, k->size) != 0) {
            char name[64];
            snprintf(name, sizeof name, "%s.%s", k->section, k->key);
            if (note) note(arg, name);
            n++;
        }
    }
    return n;
}
