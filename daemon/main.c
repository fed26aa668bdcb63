/* dpclipd: the per-node DP clipping daemon. Parses flags, sets up the
 * server on a libuv loop and runs it until SIGTERM/SIGINT. */
#include <cblas.h>
#include <errno.h>
#include <getopt.h>
#include <limits.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "dc_frame.h"
#include "log.h"
#include "server.h"

static void usage(FILE *f) {
    fprintf(f,
            "usage: dpclipd [options]\n"
            "  --socket PATH          listening socket (default $DPCLIP_SOCKET or "
            "/run/dpclip/dpclipd.sock)\n"
            "  --socket-mode OCTAL    permissions of the socket file (default 0660)\n"
            "  --workers N            CPU worker threads (default: number of CPUs)\n"
            "  --blas-threads N       BLAS threads per step (default 1)\n"
            "  --max-batch N          largest batch a step may have (default %u)\n"
            "  --max-layers N         most layers in one step (default %u)\n"
            "  --max-frame BYTES      largest request frame (default %u)\n"
            "  --max-buffers N        buffers one session may register (default 4096)\n"
"  --spin-us N            idle workers and the loop poll N us before sleeping\n"
            "                         (default 50; 0 = always sleep)\n"
            "  --no-gpu               do not use GPUs even when present\n"
            "  --log-level LEVEL      error, warn, info (default) or debug\n"
            "  --ready-fd FD          write READY to FD once listening, then close it\n"
            "  --insecure-fixed-seed SEED\n"
            "                         TESTS ONLY: seed the noise generator with SEED instead\n"
            "                         of getrandom(); the noise is then predictable and the\n"
            "                         training is NOT private\n"
            "  --version, --help\n",
            DC_DEFAULT_MAX_BATCH, DC_DEFAULT_MAX_LAYERS, DC_DEFAULT_MAX_FRAME);
}

static int parse_u64(const char *flag, const char *s, int base, unsigned long long lo,
                     unsigned long long hi, unsigned long long *out) {
    char *end;
    unsigned long long v;
    errno = 0;
    v = strtoull(s, &end, base);
    if (errno || end == s || *end || s[0] == '-' || v < lo || v > hi) {
        fprintf(stderr, "dpclipd: %s: '%s' is not a number in [%llu, %llu]\n", flag, s, lo, hi);
        return -1;
    }
    *out = v;
    return 0;
}

int main(int argc, char **argv) {
    enum { O_SOCKET = 1, O_MODE, O_WORKERS, O_BLAS, O_BATCH, O_LAYERS, O_FRAME, O_BUFFERS,
           O_LOG, O_READY, O_SEED, O_VERSION, O_HELP, O_NOGPU, O_SPIN };
    static const struct option opts[] = {
        {"socket", required_argument, NULL, O_SOCKET},
        {"socket-mode", required_argument, NULL, O_MODE},
        {"workers", required_argument, NULL, O_WORKERS},
        {"blas-threads", required_argument, NULL, O_BLAS},
        {"max-batch", required_argument, NULL, O_BATCH},
        {"max-layers", required_argument, NULL, O_LAYERS},
        {"max-frame", required_argument, NULL, O_FRAME},
        {"max-buffers", required_argument, NULL, O_BUFFERS},
        {"log-level", required_argument, NULL, O_LOG},
        {"no-gpu", no_argument, NULL, O_NOGPU},
        {"spin-us", required_argument, NULL, O_SPIN},
        {"ready-fd", required_argument, NULL, O_READY},
        {"insecure-fixed-seed", required_argument, NULL, O_SEED},
        {"version", no_argument, NULL, O_VERSION},
        {"help", no_argument, NULL, O_HELP},
        {NULL, 0, NULL, 0}};
    dc_server_config cfg;
    dc_server srv;
    dc_err err;
    uv_loop_t loop;
    unsigned long long v;
    long ncpu = sysconf(_SC_NPROCESSORS_ONLN);
    int blas_threads = 1, c, rc;

    memset(&cfg, 0, sizeof cfg);
    cfg.socket_path = getenv("DPCLIP_SOCKET");
    if (!cfg.socket_path || !cfg.socket_path[0]) cfg.socket_path = "/run/dpclip/dpclipd.sock";
    cfg.socket_mode = 0660;
    cfg.workers = ncpu > 0 ? (int)ncpu : 1;
    cfg.limits.max_batch = DC_DEFAULT_MAX_BATCH;
    cfg.limits.max_layers = DC_DEFAULT_MAX_LAYERS;
    cfg.limits.max_frame = DC_DEFAULT_MAX_FRAME;
    cfg.max_buffers = 4096;
    cfg.ready_fd = -1;
    cfg.use_gpu = true;
    cfg.spin_ns = 50000;

    while ((c = getopt_long(argc, argv, "", opts, NULL)) != -1) {
        switch (c) {
        case O_SOCKET: cfg.socket_path = optarg; break;
        case O_MODE:
            if (parse_u64("--socket-mode", optarg, 8, 0, 0777, &v)) return 2;
            cfg.socket_mode = (unsigned)v;
            break;
        case O_WORKERS:
            if (parse_u64("--workers", optarg, 10, 1, 256, &v)) return 2;
            cfg.workers = (int)v;
            break;
        case O_BLAS:
            if (parse_u64("--blas-threads", optarg, 10, 1, 256, &v)) return 2;
            blas_threads = (int)v;
            break;
        case O_BATCH:
            if (parse_u64("--max-batch", optarg, 10, 1, 1u << 24, &v)) return 2;
            cfg.limits.max_batch = (uint32_t)v;
            break;
        case O_LAYERS:
            if (parse_u64("--max-layers", optarg, 10, 1, 1u << 20, &v)) return 2;
            cfg.limits.max_layers = (uint32_t)v;
            break;
        case O_FRAME:
            if (parse_u64("--max-frame", optarg, 10, 64, 1u << 30, &v)) return 2;
            cfg.limits.max_frame = (uint32_t)v;
            break;
        case O_BUFFERS:
            if (parse_u64("--max-buffers", optarg, 10, 1, 1u << 20, &v)) return 2;
            cfg.max_buffers = (uint32_t)v;
            break;
        case O_LOG:
            if ((rc = dc_log_parse_level(optarg)) < 0) {
                fprintf(stderr, "dpclipd: --log-level: unknown level '%s'\n", optarg);
                return 2;
            }
            dc_log_set_level((dc_log_level)rc);
            break;
        case O_READY:
            if (parse_u64("--ready-fd", optarg, 10, 0, INT_MAX, &v)) return 2;
            cfg.ready_fd = (int)v;
            break;
        case O_SEED:
            if (parse_u64("--insecure-fixed-seed", optarg, 0, 0, UINT64_MAX, &v)) return 2;
            cfg.fixed_seed = true;
            cfg.seed = v;
            break;
        case O_NOGPU: cfg.use_gpu = false; break;
        case O_SPIN:
            if (parse_u64("--spin-us", optarg, 10, 0, 100000, &v)) return 2;
            cfg.spin_ns = v * 1000;
            break;
        case O_VERSION: printf("dpclipd %s\n", DPCLIP_VERSION); return 0;
        case O_HELP: usage(stdout); return 0;
        default: usage(stderr); return 2;
        }
    }
    if (optind < argc) {
        fprintf(stderr, "dpclipd: unexpected argument '%s'\n", argv[optind]);
        usage(stderr);
        return 2;
    }

    /* Replies to vanished clients must fail with EPIPE, not kill us. */
    signal(SIGPIPE, SIG_IGN);
    /* Steps run concurrently on the workers; BLAS threads per call on top of
     * that would oversubscribe the cores. */
    openblas_set_num_threads(blas_threads);

    if (uv_loop_init(&loop) != 0) {
        fprintf(stderr, "dpclipd: cannot create the event loop\n");
        return 1;
    }
    if (dc_server_init(&srv, &loop, &cfg, &err) != 0) {
        dc_log_error("%s%s%s", err.field[0] ? err.field : "", err.field[0] ? ": " : "", err.msg);
        uv_run(&loop, UV_RUN_NOWAIT);
        uv_loop_close(&loop);
        return 1;
    }
    uv_run(&loop, UV_RUN_DEFAULT);
    rc = uv_loop_close(&loop);
    if (rc != 0) dc_log_warn("loop closed with handles still open");
    return 0;
}
