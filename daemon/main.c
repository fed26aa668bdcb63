/* dpclipd: the per-node DP clipping daemon. Builds its configuration (file,
 * then flags: config.h), sets up the server on a libuv loop and runs it
 * until SIGTERM/SIGINT; SIGHUP rebuilds the configuration the same way and
 * applies it. */
#include <cblas.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "config.h"
#include "log.h"
#include "server.h"

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
    case DC_CONFIG_CHECK:
        dc_config_print(&cfg, stdout);
        return fflush(stdout) == 0 ? 0 : 1;
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
        dc_log_error("%s%s%s", err.field[0] ? err.field : "", err.field[0] ? ": " : "", err.msg);
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
