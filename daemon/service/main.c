/* dpclipd: the per-node DP clipping daemon. Builds its configuration (file,
 * then flags: config.h), sets up the server on a libuv loop and runs it
 * until SIGTERM/SIGINT; SIGHUP rebuilds the configuration the same way and
 * applies it. */
#include <cblas.h>
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "config.h"
#include "log.h"
#include "server.h"

/* The directory of the built-in socket (config.c), made by tmpfiles.d. */
#define DC_SOCKET_DIR "/run/dpclip"

typedef struct args {
    int argc;
    char **argv;
} args;

/* The reload callback: the same sequence as at start-up, same argv. */
static int rebuild_config(void *arg, dc_config *out, dc_err *err) {
    args *a = arg;
    dc_config_action act;
    int rc = dc_config_from_args(out, a->argc, a->argv, &act, err);
    /* Test-only and one-shot settings stay as they were at start. */
    out->ready_fd = -1;
    return rc;
}

/* The socket's directory is usually made by systemd (RuntimeDirectory=,
 * tmpfiles.d): someone trying dpclipd by hand needs to hear how to get one,
 * or how to do without, rather than "No such file or directory". 1 if it
 * logged the reason (a missing or unwritable directory), 0 if not. */
static int explain_socket_dir(const dc_config *cfg, const dc_err *err) {
    char dir[sizeof cfg->socket], *slash;
    struct stat st;

    if (strcmp(err->field, "socket") != 0 || err->code != DC_EUNAVAIL) return 0;
    snprintf(dir, sizeof dir, "%s", cfg->socket);
    if (!(slash = strrchr(dir, '/'))) return 0;
    slash[slash == dir] = '\0'; /* "/" stays */
    if (stat(dir, &st) != 0 && errno == ENOENT) {
        if (strcmp(dir, DC_SOCKET_DIR) == 0)
            dc_log_error("daemon.socket: cannot create %s: %s does not exist. Run dpclipd with "
                         "--socket PATH in a directory you can write (and trainers with "
                         "DPCLIP_SOCKET=PATH), or create %s with `sudo systemd-tmpfiles "
                         "--create` (cmake --install puts dpclip's tmpfiles.d entry in place; "
                         "`sudo systemd-sysusers` first makes its user)",
                         cfg->socket, dir, dir);
        else
            dc_log_error("daemon.socket: cannot create %s: %s does not exist. Create it, or "
                         "run dpclipd with --socket PATH in a directory you can write (and "
                         "trainers with DPCLIP_SOCKET=PATH)",
                         cfg->socket, dir);
        return 1;
    }
    if (access(dir, W_OK | X_OK) != 0 && errno == EACCES) {
        dc_log_error("daemon.socket: cannot create %s: this user may not create files in %s%s. "
                     "Run dpclipd with --socket PATH in a directory you can write (and "
                     "trainers with DPCLIP_SOCKET=PATH)%s",
                     cfg->socket, dir,
                     strcmp(dir, DC_SOCKET_DIR) == 0 ? " (it is the service's)" : "",
                     strcmp(dir, DC_SOCKET_DIR) == 0
                         ? ", or run the installed service: `sudo systemctl start dpclipd.socket`"
                         : "");
        return 1;
    }
    return 0;
}

int main(int argc, char **argv) {
    static args a;
    dc_config cfg;
    dc_config_action act;
    dc_server srv;
    dc_err err;
    uv_loop_t loop;
    int rc;

    a.argc = argc;
    a.argv = argv;
    if (dc_config_from_args(&cfg, argc, argv, &act, &err) != 0) {
        fprintf(stderr, "dpclipd: %s\n", err.msg);
        if (act == DC_CONFIG_RUN && strstr(err.msg, "unknown option")) dc_config_usage(stderr);
        return act == DC_CONFIG_CHECK ? 1 : 2;
    }
    switch (act) {
    case DC_CONFIG_HELP: dc_config_usage(stdout); return 0;
    case DC_CONFIG_VERSION: printf("dpclipd %s\n", DPCLIP_VERSION); return 0;
    case DC_CONFIG_CHECK: dc_config_print(&cfg, stdout); return fflush(stdout) == 0 ? 0 : 1;
    case DC_CONFIG_RUN: break;
    }
    dc_log_set_level(cfg.log_level);

    /* Replies to vanished clients must fail with EPIPE, not kill us. */
    signal(SIGPIPE, SIG_IGN);
    /* Steps run concurrently on the workers; BLAS threads per call on top of
     * that would oversubscribe the cores. */
    openblas_set_num_threads(cfg.blas_threads);

    if (uv_loop_init(&loop) != 0) {
        fprintf(stderr, "dpclipd: cannot create the event loop\n");
        return 1;
    }
    if (dc_server_init(&srv, &loop, &cfg, rebuild_config, &a, &err) != 0) {
        if (!explain_socket_dir(&cfg, &err))
            dc_log_error("%s%s%s", err.field[0] ? err.field : "", err.field[0] ? ": " : "",
                         err.msg);
        uv_run(&loop, UV_RUN_NOWAIT);
        uv_loop_close(&loop);
        return 1;
    }
    uv_run(&loop, UV_RUN_DEFAULT);
    dc_server_free(&srv);
    rc = uv_loop_close(&loop);
    if (rc != 0) dc_log_warn("loop closed with handles still open");
    return 0;
}
