/* libFuzzer target: sessions through norm groups and phased steps, in
 * process: up to four clients of one daemon joining groups, stepping
 * (grouped, phased, with new sample rates that make a step wait on the
 * ledger), closing or shutting down their side, and the loop run for a few
 * milliseconds between, so that groups time out in the middle of it all
 * (daemon/protocol/group.c, session_group.c, step_fuse.c, step_pass.c,
 * session_io.c's lifecycle). Its first finds were the join/step/close and
 * timeout/close interleavings of issue 37.
 *
 * One server for the whole run (one CPU worker, in-memory ledger, group
 * timeouts of milliseconds). The input is a list of 4-byte operations
 * [op, a, b, c]: op's low 2 bits pick the client, (op >> 2) % 8 the action:
 *   0 connect: Hello (job "fz" + a % 2) and a zeroed 4 KiB buffer;
 *   1 join: group "g" + a % 3, rank b % 4, size c % 5 (0 is refused), a
 *     timeout of 0 (groups.timeout_ms), 2, 8 ms or one over the maximum,
 *     NORM_REDUCE or GROUP_WISE;
 *   2 step: batch 1 + a % 8, sigma 0/0.5/1/2, a sample rate that is 0, 1
 *     or new to the ledger, group_step 0 (next), the client's next, its
 *     last, 2^62, 2^62 + 1 or 2^64 - 1, phase WHOLE/NORMS/SUMS, 1-3
 *     layers, replicated or not; with c's top bit, a micro-batch of a
 *     logical step (b's bit 5: it commits; b's bit 6: a new logical step,
 *     or the id out of turn with bit 7);
 *   3 close; 4 shut down the writing side; 5 run the loop a % 16 ms;
 *   6 read what replies there are; 7 a ping.
 *
 * Oracles, besides the sanitizers: once every client has closed, every
 * session and every group is gone within a bound (a session outliving its
 * client, or a group never freed, aborts), and the daemon still serves a
 * newcomer's ping. FG_DEBUG=1 in the environment logs the daemon at
 * debug level (reproducing a finding). */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "dc_frame.h"
#include "dpclip.pb-c.h"
#include "group.h"
#include "server.h"
#include "session.h"

#define FG_CLIENTS 4
#define FG_MAX_OPS 64
#define FG_BUFFER_BYTES 4096u

int LLVMFuzzerInitialize(int *argc, char ***argv);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static uv_loop_t g_loop;
static dc_server g_srv;
static dc_config g_cfg;
static char g_dir[64];

typedef struct fg_client {
    int fd;       /* -1: none */
    uint64_t buf; /* its buffer's id, 0 = none */
    uint64_t next_id;
    uint64_t group_step;
    uint64_t logical_id; /* its logical step (ClipStep.logical), and the next micro-batch */
    uint32_t micro;
} fg_client;

static fg_client g_c[FG_CLIENTS];
static uint32_t g_rate; /* new sample rates for the ledger */

static void fg_cleanup(void) {
    unlink(g_cfg.socket);
    rmdir(g_dir);
}

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    dc_err err;
    (void)argc;
    (void)argv;
    snprintf(g_dir, sizeof g_dir, "%s/dpclip-fuzzg-XXXXXX",
             getenv("TMPDIR") && strlen(getenv("TMPDIR")) < 32 ? getenv("TMPDIR") : "/tmp");
    if (!mkdtemp(g_dir)) {
        perror("fuzz_group: mkdtemp");
        abort();
    }
    dc_config_defaults(&g_cfg);
    snprintf(g_cfg.socket, sizeof g_cfg.socket, "%s/d.sock", g_dir);
    snprintf(g_cfg.status_socket, sizeof g_cfg.status_socket, "none");
    g_cfg.workers = 1;
    g_cfg.blas_threads = 1;
    g_cfg.spin_us = 0;
    g_cfg.gpu = false;
    g_cfg.max_batch = 64;
    g_cfg.max_layers = 16;
    g_cfg.group_timeout_ms = 5;
    g_cfg.max_group_timeout_ms = 10;
    g_cfg.max_pass_memory = 16u << 10; /* a few passes at once, then refused */
    g_cfg.ledger_dir[0] = '\0';
    g_cfg.fixed_seed = true;
    g_cfg.seed = 1;
    g_cfg.log_level = DC_LOG_ERROR;
    dc_log_set_level(getenv("FG_DEBUG") ? DC_LOG_DEBUG : DC_LOG_ERROR);
    atexit(fg_cleanup);
    if (uv_loop_init(&g_loop) || dc_server_init(&g_srv, &g_loop, &g_cfg, NULL, NULL, &err)) {
        fprintf(stderr, "fuzz_group: cannot start the server: %s\n", err.msg);
        abort();
    }
    for (int i = 0; i < FG_CLIENTS; i++) g_c[i].fd = -1;
    return 0;
}

static uint64_t now_ms(void) { return uv_hrtime() / 1000000u; }

/* The loop, without blocking, for about ms milliseconds (at least once). */
static void fg_run(unsigned ms) {
    uint64_t end = now_ms() + ms;
    do {
        uv_run(&g_loop, UV_RUN_NOWAIT);
        if (ms) {
            struct timespec ts = {0, 200000};
            nanosleep(&ts, NULL);
        }
    } while (now_ms() < end);
}

/* Sends a request (fd attached if pass >= 0) without blocking: a client
 * whose daemon does not read (its session busy) loses the request. */
static void fg_send(fg_client *c, Dpclip__Request *req, int pass) {
    size_t n;
    uint8_t *p;
    struct iovec iov;
    struct msghdr msg = {0};
    union {
        struct cmsghdr h;
        char b[CMSG_SPACE(sizeof(int))];
    } cm;
    req->id = ++c->next_id;
    n = dpclip__request__get_packed_size(req);
    if (!(p = malloc(DC_FRAME_HEADER + n))) abort();
    dc_frame_put_len(p, (uint32_t)n);
    dpclip__request__pack(req, p + DC_FRAME_HEADER);
    iov.iov_base = p;
    iov.iov_len = DC_FRAME_HEADER + n;
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    if (pass >= 0) {
        struct cmsghdr *h;
        memset(&cm, 0, sizeof cm);
        msg.msg_control = cm.b;
        msg.msg_controllen = sizeof cm.b;
        h = CMSG_FIRSTHDR(&msg);
        h->cmsg_level = SOL_SOCKET;
        h->cmsg_type = SCM_RIGHTS;
        h->cmsg_len = CMSG_LEN(sizeof(int));
        memcpy(CMSG_DATA(h), &pass, sizeof(int));
    }
    /* a frame cut short would desynchronise the stream: all or nothing */
    (void)!sendmsg(c->fd, &msg, MSG_DONTWAIT | MSG_NOSIGNAL);
    free(p);
}

static void fg_drain(fg_client *c) {
    uint8_t buf[4096];
    if (c->fd < 0) return;
    while (recv(c->fd, buf, sizeof buf, MSG_DONTWAIT) > 0) {
    }
}

static void fg_connect(fg_client *c, uint8_t a) {
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    Dpclip__Request req = DPCLIP__REQUEST__INIT;
    Dpclip__Hello hello = DPCLIP__HELLO__INIT;
    Dpclip__RegisterBuffer rb = DPCLIP__REGISTER_BUFFER__INIT;
    int mfd;
    if (c->fd >= 0) return;
    snprintf(sa.sun_path, sizeof sa.sun_path, "%s", g_cfg.socket);
    c->fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (c->fd < 0 || connect(c->fd, (struct sockaddr *)&sa, sizeof sa)) abort();
    c->next_id = 0;
    c->group_step = 0;
    c->logical_id = 0;
    c->micro = 0;
    hello.protocol_version = DC_PROTOCOL_VERSION;
    hello.client_name = "fuzz";
    hello.job_id = a % 2 ? "fz1" : "fz0";
    req.body_case = DPCLIP__REQUEST__BODY_HELLO;
    req.hello = &hello;
    fg_send(c, &req, -1);
    mfd = memfd_create("fuzzg", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    if (mfd < 0 || ftruncate(mfd, FG_BUFFER_BYTES) || fcntl(mfd, F_ADD_SEALS, F_SEAL_SHRINK))
        abort();
    rb.kind = DPCLIP__BUFFER_KIND__SHM_FD;
    rb.size = FG_BUFFER_BYTES;
    req.body_case = DPCLIP__REQUEST__BODY_REGISTER_BUFFER;
    req.register_buffer = &rb;
    fg_send(c, &req, mfd);
    close(mfd);
    /* buffer ids are daemon-wide: the one registered is the next (taken
     * up within a few turns of the loop: accept, then read) */
    {
        uint64_t before = g_srv.next_buffer_id, end = now_ms() + 2000;
        do fg_run(0);
        while (g_srv.next_buffer_id == before && now_ms() < end);
        c->buf = g_srv.next_buffer_id == before ? 0 : g_srv.next_buffer_id;
    }
}

static void fg_join(fg_client *c, uint8_t a, uint8_t b, uint8_t cc) {
    static const char *names[3] = {"g0", "g1", "g2"};
    static const uint32_t timeouts[4] = {0, 2, 8, 11};
    Dpclip__Request req = DPCLIP__REQUEST__INIT;
    Dpclip__JoinGroup j = DPCLIP__JOIN_GROUP__INIT;
    j.name = (char *)names[a % 3];
    j.rank = b % 4;
    j.size = cc % 5;
    j.timeout_ms = timeouts[(a >> 4) % 4];
    j.clipping = (b >> 4) & 1 ? DPCLIP__GROUP_CLIPPING__GROUP_WISE
                              : DPCLIP__GROUP_CLIPPING__NORM_REDUCE;
    req.body_case = DPCLIP__REQUEST__BODY_JOIN_GROUP;
    req.join_group = &j;
    fg_send(c, &req, -1);
    c->group_step = 0;
}

static void fg_step(fg_client *c, uint8_t a, uint8_t b, uint8_t cc) {
    static const float sigmas[4] = {0.0f, 0.5f, 1.0f, 2.0f};
    Dpclip__Request req = DPCLIP__REQUEST__INIT;
    Dpclip__ClipStep cs = DPCLIP__CLIP_STEP__INIT;
    Dpclip__ClipConfig cfg = DPCLIP__CLIP_CONFIG__INIT;
    Dpclip__Layer ly[3], *lp[3];
    Dpclip__LinearLayer lin = DPCLIP__LINEAR_LAYER__INIT;
    Dpclip__TensorRef act = DPCLIP__TENSOR_REF__INIT, grad = DPCLIP__TENSOR_REF__INIT;
    uint32_t B = 1 + a % 8;
    int64_t as[3] = {B, 2, 3}, gs[3] = {B, 2, 2};
    int n = 1 + (a >> 3) % 3;
    uint64_t steps[6];
    act.buffer_id = grad.buffer_id = c->buf;
    act.dtype = grad.dtype = DPCLIP__DTYPE__F32;
    act.n_shape = grad.n_shape = 3;
    act.shape = as;
    grad.shape = gs;
    grad.offset = (uint64_t)B * 2 * 3 * 4;
    lin.activations = &act;
    lin.output_grad = &grad;
    for (int l = 0; l < n; l++) {
        dpclip__layer__init(&ly[l]);
        ly[l].name = "fc";
        ly[l].kind_case = DPCLIP__LAYER__KIND_LINEAR;
        ly[l].linear = &lin;
        ly[l].replicated = (cc >> 6) & 1;
        lp[l] = &ly[l];
    }
    cfg.max_grad_norm = 1.0f;
    cfg.loss_reduction = DPCLIP__LOSS_REDUCTION__SUM;
    cs.batch_size = B;
    cs.n_layers = (size_t)n;
    cs.layers = lp;
    cs.clip = &cfg;
    cs.noise_multiplier = sigmas[b % 4];
    switch ((cc >> 2) % 3) {
    case 0: cs.sample_rate = 0.0; break;
    case 1: cs.sample_rate = 1.0; break;
    default: cs.sample_rate = 1e-4 * (double)(1 + g_rate++ % 5000); break;
    }
    steps[0] = 0;
    steps[1] = c->group_step + 1;
    steps[2] = c->group_step;
    steps[3] = DC_GROUP_STEP_MAX;
    steps[4] = DC_GROUP_STEP_MAX + 1;
    steps[5] = UINT64_MAX;
    cs.group_step = steps[(b >> 2) % 6];
    if (cs.group_step) c->group_step = cs.group_step;
    else c->group_step++;
    cs.phase = (Dpclip__StepPhase)((cc >> 4) % 3);
    Dpclip__LogicalStep lg = DPCLIP__LOGICAL_STEP__INIT;
    if (cc & 0x80) {
        if ((b >> 6) & 1 || !c->logical_id) {
            c->logical_id += (b >> 7) ? 0 : 1; /* bit 7: the same id again */
            c->micro = 0;
        }
        lg.id = c->logical_id;
        lg.micro_batch = c->micro++;
        lg.commit = (b >> 5) & 1;
        cs.logical = &lg;
    }
    req.body_case = DPCLIP__REQUEST__BODY_CLIP_STEP;
    req.clip_step = &cs;
    fg_send(c, &req, -1);
}

static void fg_ping(fg_client *c) {
    Dpclip__Request req = DPCLIP__REQUEST__INIT;
    Dpclip__Ping p = DPCLIP__PING__INIT;
    req.body_case = DPCLIP__REQUEST__BODY_PING;
    req.ping = &p;
    fg_send(c, &req, -1);
}

static void fg_close(fg_client *c) {
    if (c->fd < 0) return;
    close(c->fd);
    c->fd = -1;
    c->buf = 0;
}

/* After the input: every client gone, then every session and group. */
static void fg_settle(void) {
    uint64_t end;
    for (int i = 0; i < FG_CLIENTS; i++) fg_close(&g_c[i]);
    end = now_ms() + 5000;
    while (g_srv.n_sessions || dc_groups_count(&g_srv.groups)) {
        if (now_ms() > end) {
            fprintf(stderr, "fuzz_group: %zu sessions and %zu groups outlived their clients\n",
                    g_srv.n_sessions, dc_groups_count(&g_srv.groups));
            /* what holds each: a step in flight names its group step */
            for (dc_session *s = g_srv.sessions; s; s = s->next)
                fprintf(stderr,
                        "  session %llu: gone %d closing %d step in flight %s (group step %llu "
                        "of group %llu, logical step %llu) group %s\n",
                        (unsigned long long)s->id, s->gone, s->closing, s->call ? "yes" : "no",
                        s->call ? (unsigned long long)s->call->group_step : 0ull,
                        s->call ? (unsigned long long)s->call->group_id : 0ull,
                        s->call ? (unsigned long long)s->call->params.logical_id : 0ull,
                        s->group ? "joined" : "none");
            abort();
        }
        fg_run(1);
    }
}

/* A newcomer is served: Hello answered, and a ping. */
static void fg_newcomer(void) {
    fg_client c = {.fd = -1};
    uint8_t buf[4096];
    size_t got = 0;
    uint64_t end = now_ms() + 5000;
    fg_connect(&c, 0);
    fg_ping(&c);
    while (got < 3 * DC_FRAME_HEADER) { /* Hello, registration and Pong replies */
        ssize_t r;
        fg_run(0);
        r = recv(c.fd, buf, sizeof buf, MSG_DONTWAIT);
        if (r > 0) got += (size_t)r;
        else if (r == 0) break;
        if (now_ms() > end) break;
    }
    if (got < 3 * DC_FRAME_HEADER) {
        fprintf(stderr, "fuzz_group: the daemon did not answer a newcomer\n");
        abort();
    }
    fg_close(&c);
    fg_settle();
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    dc_err err;
    size_t ops = size / 4 < FG_MAX_OPS ? size / 4 : FG_MAX_OPS;
    g_srv.next_buffer_id = 0;
    for (size_t i = 0; i < ops; i++) {
        const uint8_t *o = data + 4 * i;
        fg_client *c = &g_c[o[0] & 3];
        unsigned action = (o[0] >> 2) % 8;
        if (action != 0 && action != 5 && c->fd < 0) continue;
        switch (action) {
        case 0: fg_connect(c, o[1]); break;
        case 1: fg_join(c, o[1], o[2], o[3]); break;
        case 2: fg_step(c, o[1], o[2], o[3]); break;
        case 3: fg_close(c); break;
        case 4: shutdown(c->fd, SHUT_WR); break;
        case 5: fg_run(o[1] % 16); break;
        case 6: fg_drain(c); break;
        default: fg_ping(c); break;
        }
        fg_run(0);
    }
    fg_settle();
    fg_newcomer();
    /* A fresh ledger per input: a budget one input lowered must not refuse
     * the next one's steps. */
    dc_ledger_close(&g_srv.ledger);
    if (dc_ledger_open(&g_srv.ledger, "", g_cfg.delta, &err)) abort();
    return 0;
}
