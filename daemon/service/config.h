/* dpclipd's configuration: every setting the daemon has, from built-in
 * defaults, then $DPCLIP_SOCKET, then the config file (INI, parsed by inih),
 * then command-line flags (which therefore always win, also across SIGHUP
 * reloads: main.c re-applies the same argv on top of the re-read file).
 *
 * The settings are described once, in a table (config.c), that drives the
 * file parser, the flags, the validation and `--check-config`'s listing.
 * Unknown sections or keys, keys given twice, and bad values are errors
 * naming the file, the line and the key.
 *
 * Ownership: a dc_config is a plain value (fixed-size strings, no pointers):
 * copy it freely. */
#ifndef DC_CONFIG_H
#define DC_CONFIG_H

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>

#include "dc_err.h"
#include "log.h"

/* Where the file is looked for without --config: the config of the install
 * this dpclipd belongs to (dc_install.h: also after `cmake --install
 * --prefix X`), else the build's sysconfdir. */
const char *dc_config_default_path(void);
#define DC_CONFIG_MAX_IDS 64
#define DC_CONFIG_PATH_MAX 256

typedef struct dc_config {
    /* [daemon] */
    char socket[108]; /* sun_path size */
    unsigned socket_mode;
    char socket_group[64]; /* "" = the daemon's own group */
    int workers;           /* 0 = number of CPUs */
    int blas_threads;
    uint32_t spin_us;
    bool gpu;
    uint64_t gpu_workspace;        /* bytes preallocated per GPU backend */
    uint64_t gpu_workspace_max;    /* a step needing more fails; 0 = no cap */
    uint64_t gpu_sample_grads_max; /* workspace keeping per-sample gradients; 0 = none,
                                      DC_SAMPLE_GRADS_AUTO = a share of each GPU's memory */
    uint32_t gpu_idle_release_s;   /* an idle GPU's grown memory given back; 0 = never */
    dc_log_level log_level;
    /* [limits] */
    uint32_t max_batch, max_layers, max_frame, max_buffers;
    uint32_t max_events;         /* CUDA IPC events one session may hold registered */
    uint32_t max_step_samples;   /* layers x batch of one step (per-sample tables) */
    uint64_t max_step_memory;    /* host bytes one step may make the daemon hold */
    uint32_t max_step_gflop;     /* work of one host-memory (CPU) step */
    uint32_t max_gpu_step_gflop; /* work of one GPU step */
    /* What clients can make the daemon hold (session_io.c, server.c). */
    uint32_t max_connections;
    uint32_t max_connections_per_uid;  /* one user's share of them */
    double handshake_timeout;          /* s from accept to Hello */
    double idle_timeout;               /* s without a request or a step; 0 = never */
    uint32_t max_buffers_total;        /* all sessions' buffers */
    uint32_t max_buffers_per_uid;      /* one user's sessions' buffers */
    uint64_t max_mapped_bytes;         /* all sessions' shared memory mapped; 0 = no cap */
    uint64_t max_mapped_bytes_per_uid; /* one user's; 0 = no cap */
    uint64_t max_pass_memory;          /* all sessions' norm passes (step_pass.h) */
    uint64_t max_pass_memory_per_uid;
    /* Logical steps (step_logical.h): micro-batches of one, its
     * accumulators' bytes (all sessions', one user's), seconds open. */
    uint32_t max_micro_batches;
    uint64_t max_accumulator_memory, max_accumulator_memory_per_uid;
    double logical_step_timeout;
    uint64_t max_reply_queue;      /* a session's unsent reply bytes before it waits */
    uint32_t max_group_size;       /* members of one norm group */
    uint32_t max_group_links;      /* cross-daemon groups (NCCL links) held at once */
    uint32_t max_group_timeout_ms; /* the longest JoinGroup.timeout_ms */
    /* [groups] */
    uint32_t group_timeout_ms; /* a grouped step waits this long for the others */
    bool group_fuse;           /* one-daemon groups' steps on one device run fused */
    /* [access]: empty lists = whoever can open the socket */
    uint32_t allowed_uids[DC_CONFIG_MAX_IDS];
    size_t n_allowed_uids;
    uint32_t allowed_gids[DC_CONFIG_MAX_IDS];
    size_t n_allowed_gids;
    /* [status] */
    char status_socket[108]; /* "" = derived from socket; "none" = off */
    unsigned status_mode;
    char status_group[64];
    uint32_t status_port; /* TCP on 127.0.0.1; 0 = off */
    uint32_t status_max_connections, status_timeout_s;
    char status_ops_group[64]; /* sees every job in /status; "" = root and the daemon only */
    /* [ledger] */
    char ledger_dir[DC_CONFIG_PATH_MAX]; /* "" = in memory only (lost at exit) */
    double delta;                        /* delta at which a job's eps is reported */
    double budget_epsilon;               /* 0 = no node-wide budget per job */
    double budget_delta;
    bool require_sample_rate;         /* refuse steps that do not give one */
    uint32_t ledger_max_jobs_per_uid; /* accounts one uid may hold in memory; 0 = no cap */
    uint32_t ledger_job_idle_s;       /* unused accounts leave memory after this; 0 = never */

    /* Flags only (not in the file). */
    char config_path[DC_CONFIG_PATH_MAX]; /* the file read, "" = none */
    int ready_fd;                         /* -1 = none */
    bool fixed_seed;
    uint64_t seed;
} dc_config;

/* What the command line asked for besides settings. */
typedef enum dc_config_action {
    DC_CONFIG_RUN = 0,
    DC_CONFIG_CHECK, /* --check-config: validate, print, exit */
    DC_CONFIG_HELP,
    DC_CONFIG_VERSION
} dc_config_action;

/* Built-in defaults (socket from $DPCLIP_SOCKET when set). */
void dc_config_defaults(dc_config *c);

/* Applies one setting, as the file or --set would: section/key/value.
 * `where` prefixes error messages (e.g. "dpclipd.conf:12"). */
int dc_config_set(dc_config *c, const char *section, const char *key, const char *value,
                  const char *where, dc_err *err);

/* Reads an INI file on top of *c. Each key may appear once. */
int dc_config_load_file(dc_config *c, const char *path, dc_err *err);
/* Same, from a string (tests); `name` stands for the file in messages. */
int dc_config_load_string(dc_config *c, const char *text, const char *name, dc_err *err);

/* The whole sequence (config_args.c): defaults, the file (--config PATH,
 * else the default path if it exists), then every flag. Usable again at
 * reload time with the same argv (getopt state is reset). */
int dc_config_from_args(dc_config *c, int argc, char **argv, dc_config_action *action, dc_err *err);

/* The settings' flags (config.c's table, for the command line): setting i's
 * long option or NULL; one applied by its name (without "--"); their usage
 * lines. At most DC_CONFIG_KEYS_MAX settings. */
#define DC_CONFIG_KEYS_MAX 128
const char *dc_config_key_flag(size_t i);
int dc_config_set_flag(dc_config *c, const char *flag, const char *arg, dc_err *err);
void dc_config_usage_keys(FILE *f);
/* A whole decimal (base 10) or C-style (base 0) number without a sign: 0,
 * or -1 where s is not one. */
int dc_config_parse_ull(const char *s, int base, unsigned long long *out);

/* Cross-field checks (paths, groups that must exist, ...). */
int dc_config_validate(const dc_config *c, dc_err *err);

/* The effective status socket path ("" when disabled). */
void dc_config_status_path(const dc_config *c, char *out, size_t n);

/* Writes the effective configuration as a config file. */
void dc_config_print(const dc_config *c, FILE *f);
void dc_config_usage(FILE *f);

/* Which settings a reload may change in a running daemon. For each setting
 * that differs between old and new but needs a restart, calls
 * note(arg, "section.key"); returns how many such settings differ. */
int dc_config_restart_needed(const dc_config *old, const dc_config *cur,
                             void (*note)(void *arg, const char *name), void *arg);

/* The settings table, for listings and tests. dc_config_key: section and
 * key of setting i, false past the end. dc_config_number: its value in c as
 * JSON number text (the string "auto" for a size the daemon picks per GPU),
 * false when it is not a number. dc_config_is_limit:
 * whether it bounds what a client can make the daemon hold (every [limits]
 * key, and a few elsewhere such as ledger.max_jobs_per_uid): /status lists
 * these under "limits". */
bool dc_config_key(size_t i, const char **section, const char **key);
/* The index of setting section.key (as dc_config_key numbers them), -1 if
 * there is none; how many settings there are (config_file.c counts each). */
int dc_config_key_index(const char *section, const char *key);
size_t dc_config_n_keys(void);
bool dc_config_number(const dc_config *c, size_t i, char *out, size_t n);
bool dc_config_is_limit(size_t i);

/* Resolves a group name or number: 0 and *gid set, or -1. */
int dc_config_group_id(const char *name, uint32_t *gid);

#endif
