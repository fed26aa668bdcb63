/* Hostile input, what clients can make the daemon hold: connections that
 * never say Hello or stall mid-frame, long frames before Hello, idle
 * sessions, too many connections, buffers and mapped bytes over the
 * daemon-wide caps, pipelined requests whose replies nobody reads, a
 * process out of file descriptors, and client strings that try to forge
 * log lines. Each limit is refused with an Error naming its setting while
 * the fixture's well-behaved client keeps running exact steps. (Framing:
 * test_hostile.c; the fixture: support/hostile.c.) */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>

#include "dc_frame.h"
#include "hostile.h"
#include "service.h"

/* The fixture's daemon: the limits under test made small. */
#define HANDSHAKE_S "2"
#define BUFFERS_TOTAL 24
#define MAPPED_BYTES (64u << 20)
#define REPLY_QUEUE (256u << 10)

static void sleep_ms(int ms) {
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

/* Hello with these names; the session id from the reply. */
static uint64_t hello_as(int fd, const char *client, const char *job) {
    Dpclip__Request req = DPCLIP__REQUEST__INIT;
    Dpclip__Hello hello = DPCLIP__HELLO__INIT;
    Dpclip__Reply *r;
    uint64_t id;
    hello.protocol_version = DC_PROTOCOL_VERSION;
    hello.client_name = (char *)client;
    hello.job_id = (char *)job;
    req.id = 1;
    req.body_case = DPCLIP__REQUEST__BODY_HELLO;
    req.hello = &hello;
    assert_int_equal(dc_raw_send_request(fd, &req), 0);
    r = dc_raw_read_reply(fd, 10000);
    assert_non_null(r);
    assert_int_equal(r->body_case, DPCLIP__REPLY__BODY_HELLO);
    id = r->hello->session_id;
    dpclip__reply__free_unpacked(r, NULL);
    return id;
}

/* RegisterBuffer of a fresh sealed memfd of `size` bytes (sparse: nothing
 * is touched); the reply. */
static Dpclip__Reply *register_memfd(int fd, uint64_t id, size_t size) {
    Dpclip__Request req = DPCLIP__REQUEST__INIT;
    Dpclip__RegisterBuffer rb = DPCLIP__REGISTER_BUFFER__INIT;
    Dpclip__Reply *r;
    int mfd = memfd_create("limits", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    assert_true(mfd >= 0);
    assert_int_equal(ftruncate(mfd, (off_t)size), 0);
    assert_int_equal(fcntl(mfd, F_ADD_SEALS, F_SEAL_SHRINK), 0);
    rb.kind = DPCLIP__BUFFER_KIND__SHM_FD;
    rb.size = size;
    req.id = id;
    req.body_case = DPCLIP__REQUEST__BODY_REGISTER_BUFFER;
    req.register_buffer = &rb;
    assert_int_equal(dc_raw_send_request_fd(fd, &req, mfd), 0);
    close(mfd);
    r = dc_raw_read_reply(fd, 10000);
    assert_non_null(r);
    return r;
}

static void release(int fd, uint64_t id, uint64_t buf) {
    Dpclip__Request req = DPCLIP__REQUEST__INIT;
    Dpclip__ReleaseBuffer rb = DPCLIP__RELEASE_BUFFER__INIT;
    Dpclip__Reply *r;
    rb.buffer_id = buf;
    req.id = id;
    req.body_case = DPCLIP__REQUEST__BODY_RELEASE_BUFFER;
    req.release_buffer = &rb;
    assert_int_equal(dc_raw_send_request(fd, &req), 0);
    r = dc_raw_read_reply(fd, 10000);
    assert_non_null(r);
    assert_int_equal(r->body_case, DPCLIP__REPLY__BODY_RELEASE_BUFFER);
    dpclip__reply__free_unpacked(r, NULL);
}

static void expect_refused_then_closed(int fd, Dpclip__ErrorCode code, const char *setting) {
    dc_hostile_expect_error(fd, code, setting);
    assert_int_equal(dc_raw_wait_eof(fd, 10000), 1);
}

/* --- client strings in the log ------------------------------------------------ */

static void test_log_injection(void **state) {
    (void)state;
    int fd = dc_raw_connect(dc_hostile_h.sock);
    char *log, *line;
    assert_true(fd >= 0);
    hello_as(fd, "evil\ndpclipd[error]: forged by a client\r", "job\x1b[2J\\n");
    dc_hostile_expect_pong(fd, 2); /* the hello line was written before its reply */
    close(fd);
    log = dc_hostile_log();
    for (line = log; line; line = strchr(line, '\n'), line = line ? line + 1 : NULL)
        assert_false(strncmp(line, "dpclipd[error]: forged", 22) == 0);
    assert_non_null(strstr(log, "client 'evil\\ndpclipd[error]: forged by a client\\r' job "
                                "'job\\x1b[2J\\\\n'"));
    free(log);
}

/* --- before Hello -------------------------------------------------------------- */

static void test_handshake_timeout(void **state) {
    (void)state;
    uint8_t part[100];
    int silent = dc_raw_connect(dc_hostile_h.sock);
    int stalled = dc_raw_connect(dc_hostile_h.sock);
    assert_true(silent >= 0 && stalled >= 0);
    /* a frame within the pre-Hello bound, never finished */
    memset(part, 0x2a, sizeof part);
    dc_hostile_send_frame(stalled, 60000, part, sizeof part);
    /* both are told, naming the setting, and closed */
    expect_refused_then_closed(silent, DPCLIP__ERROR_CODE__FAILED_PRECONDITION,
                               "limits.handshake_timeout");
    expect_refused_then_closed(stalled, DPCLIP__ERROR_CODE__FAILED_PRECONDITION,
                               "limits.handshake_timeout");
    close(silent);
    close(stalled);
}

/* Before Hello a frame may not be longer than a Hello could be: 256
 * connections stalled mid-frame of max_frame each held 270 MB. */
static void test_long_frame_before_hello(void **state) {
    (void)state;
    uint8_t *junk = calloc(1, 100000);
    int fd = dc_raw_connect(dc_hostile_h.sock);
    assert_true(fd >= 0 && junk);
    dc_hostile_send_frame(fd, 100000, NULL, 0);
    expect_refused_then_closed(fd, DPCLIP__ERROR_CODE__PROTOCOL, "frame.length");
    close(fd);
    /* after Hello the same length is within max_frame: undecodable, not refused */
    fd = dc_hostile_raw_hello();
    dc_hostile_send_frame(fd, 100000, junk, 100000);
    dc_hostile_expect_error(fd, DPCLIP__ERROR_CODE__PROTOCOL, "request");
    dc_hostile_expect_pong(fd, 3);
    close(fd);
    free(junk);
}

/* --- buffers ----------------------------------------------------------------- */

static void test_buffers_total(void **state) {
    (void)state;
    int a = dc_hostile_raw_hello(), b = dc_hostile_raw_hello();
    int ok = 0, refused = 0;
    Dpclip__Reply *r;

    /* one session takes what is left of the daemon's buffers */
    for (uint64_t i = 0; i < 2 * BUFFERS_TOTAL && !refused; i++) {
        r = register_memfd(a, 10 + i, 4096);
        if (r->body_case == DPCLIP__REPLY__BODY_REGISTER_BUFFER) {
            ok++;
        } else {
            assert_non_null(dc_raw_error(r));
            assert_int_equal(r->error->code, DPCLIP__ERROR_CODE__RESOURCE_EXHAUSTED);
            assert_string_equal(r->error->field, "limits.max_buffers_total");
            refused = 1;
        }
        dpclip__reply__free_unpacked(r, NULL);
    }
    assert_true(refused);
    assert_true(ok >= BUFFERS_TOTAL / 2 && ok < BUFFERS_TOTAL);
    /* another session is refused too, with its own requests going on */
    r = register_memfd(b, 2, 4096);
    assert_non_null(dc_raw_error(r));
    assert_string_equal(r->error->field, "limits.max_buffers_total");
    dpclip__reply__free_unpacked(r, NULL);
    dc_hostile_expect_pong(b, 3);
    /* the first session goes: its buffers are the daemon's again */
    close(a);
    for (int tries = 0;; tries++) {
        r = register_memfd(b, 4, 4096);
        int got = r->body_case == DPCLIP__REPLY__BODY_REGISTER_BUFFER;
        dpclip__reply__free_unpacked(r, NULL);
        if (got) break;
        assert_true(tries < 500);
        sleep_ms(20);
    }
    close(b);
}

static void test_mapped_bytes_total(void **state) {
    (void)state;
    int a = dc_hostile_raw_hello(), b = dc_hostile_raw_hello();
    const size_t big = MAPPED_BYTES / 8 * 5; /* two of them do not fit */
    Dpclip__Reply *r = register_memfd(a, 2, big);
    uint64_t first;

    assert_int_equal(r->body_case, DPCLIP__REPLY__BODY_REGISTER_BUFFER);
    first = r->register_buffer->buffer_id;
    dpclip__reply__free_unpacked(r, NULL);
    r = register_memfd(b, 2, big);
    assert_non_null(dc_raw_error(r));
    assert_int_equal(r->error->code, DPCLIP__ERROR_CODE__RESOURCE_EXHAUSTED);
    assert_string_equal(r->error->field, "limits.max_mapped_bytes");
    assert_non_null(strstr(r->error->message, "limits.max_mapped_bytes"));
    dpclip__reply__free_unpacked(r, NULL);
    /* released, the bytes can be mapped by the other session */
    release(a, 3, first);
    r = register_memfd(b, 3, big);
    assert_int_equal(r->body_case, DPCLIP__REPLY__BODY_REGISTER_BUFFER);
    dpclip__reply__free_unpacked(r, NULL);
    close(a);
    close(b);
}

/* --- replies nobody reads --------------------------------------------------------- */

#define PIPE_LAYERS 512
#define PIPE_STEPS 40

typedef struct pipeliner {
    int fd;
    uint8_t *frames;
    size_t len;
    int rc;
} pipeliner;

static void *pipeline_send(void *arg) {
    pipeliner *p = arg;
    p->rc = dc_raw_send(p->fd, p->frames, p->len);
    return NULL;
}

/* This session's steps so far, from /status; -1 if there is no status. */
static long session_steps(const char *client) {
    char path[300], needle[96], *body = NULL, *at;
    long steps = -1;
    dc_harness_status_path(&dc_hostile_h, path, sizeof path);
    if (dc_http(path, "GET", "/status", 10000, NULL, &body, NULL) != 200) {
        free(body);
        return -1;
    }
    snprintf(needle, sizeof needle, "\"client\":\"%s\"", client);
    if ((at = strstr(body, needle)) && (at = strstr(at, "\"steps\":")))
        steps = strtol(at + 8, NULL, 10);
    free(body);
    return steps;
}

/* 40 pipelined steps, each replying with 128 KiB of per-layer norms that the
 * client does not read: the daemon takes up requests only while less than
 * limits.max_reply_queue of replies wait (what the socket holds aside), then
 * answers all of them, in order, once the client reads. */
static void test_unread_replies(void **state) {
    (void)state;
    Dpclip__Request req = DPCLIP__REQUEST__INIT;
    Dpclip__ClipStep cs = DPCLIP__CLIP_STEP__INIT;
    Dpclip__ClipConfig cc = DPCLIP__CLIP_CONFIG__INIT;
    Dpclip__LinearLayer lin = DPCLIP__LINEAR_LAYER__INIT;
    Dpclip__TensorRef a = DPCLIP__TENSOR_REF__INIT, g = DPCLIP__TENSOR_REF__INIT;
    Dpclip__Layer *layers[PIPE_LAYERS], layer[PIPE_LAYERS];
    int64_t shape[2] = {DC_HOSTILE_MAX_BATCH, 1};
    pipeliner p = {0};
    pthread_t th;
    long steps, last = -1;
    size_t n;
    int fd = dc_raw_connect(dc_hostile_h.sock);

    assert_true(fd >= 0);
    hello_as(fd, "pipeliner", "unread");
    a.buffer_id = g.buffer_id = dc_raw_register_memfd(fd, 2, 4096, NULL);
    assert_true(a.buffer_id != 0);
    a.dtype = g.dtype = DPCLIP__DTYPE__F32;
    a.n_shape = g.n_shape = 2;
    a.shape = g.shape = shape;
    g.offset = 1024;
    lin.activations = &a;
    lin.output_grad = &g;
    for (int i = 0; i < PIPE_LAYERS; i++) {
        dpclip__layer__init(&layer[i]);
        layer[i].kind_case = DPCLIP__LAYER__KIND_LINEAR;
        layer[i].linear = &lin;
        layers[i] = &layer[i];
    }
    cc.max_grad_norm = 1.0f;
    cc.loss_reduction = DPCLIP__LOSS_REDUCTION__SUM;
    cs.batch_size = DC_HOSTILE_MAX_BATCH;
    cs.n_layers = PIPE_LAYERS;
    cs.layers = layers;
    cs.clip = &cc;
    cs.want_layer_norms = 1;
    req.body_case = DPCLIP__REQUEST__BODY_CLIP_STEP;
    req.clip_step = &cs;
    n = dpclip__request__get_packed_size(&req) + 8;
    p.frames = malloc(n * PIPE_STEPS);
    assert_non_null(p.frames);
    for (int i = 0; i < PIPE_STEPS; i++) {
        req.id = 100 + (uint64_t)i;
        size_t k = dpclip__request__pack(&req, p.frames + p.len + DC_FRAME_HEADER);
        dc_frame_put_len(p.frames + p.len, (uint32_t)k);
        p.len += DC_FRAME_HEADER + k;
    }
    p.fd = fd;
    assert_int_equal(pthread_create(&th, NULL, pipeline_send, &p), 0);

    /* until the count stops moving (it is only ever checked from above) */
    for (int still = 0, i = 0; still < 20 && i < 1000; i++) {
        sleep_ms(50);
        steps = session_steps("pipeliner");
        if (steps < 0) break;
        still = steps == last && steps > 0 ? still + 1 : 0;
        last = steps;
    }
    if (last < 0) {
        fprintf(stderr, "no /status here: how many steps ran while unread not checked\n");
    } else {
        fprintf(stderr, "%ld of %d pipelined steps ran while their replies were unread\n", last,
                PIPE_STEPS);
        assert_true(last >= 1);
        assert_true(last <= PIPE_STEPS / 2);
    }
    /* reading now, every step is answered, in order */
    for (int i = 0; i < PIPE_STEPS; i++) {
        Dpclip__Reply *r = dc_raw_read_reply(fd, 30000);
        assert_non_null(r);
        if (r->body_case != DPCLIP__REPLY__BODY_CLIP_STEP && dc_raw_error(r))
            fprintf(stderr, "step %d: %s: %s\n", i, r->error->field, r->error->message);
        assert_int_equal(r->body_case, DPCLIP__REPLY__BODY_CLIP_STEP);
        assert_int_equal(r->id, 100 + (uint64_t)i);
        assert_int_equal(r->clip_step->n_layer_norms, PIPE_LAYERS * DC_HOSTILE_MAX_BATCH);
        dpclip__reply__free_unpacked(r, NULL);
    }
    pthread_join(th, NULL);
    assert_int_equal(p.rc, 0);
    dc_hostile_expect_pong(fd, 7);
    free(p.frames);
    close(fd);
}

/* --- daemons of their own ---------------------------------------------------------- */

/* A test's own daemon, its log and ledger: own_teardown removes them also
 * after a failed assertion. */
static dc_harness g_own;
static char g_own_log[64], g_own_ledger[64];

static void rm_tree_flat(const char *dir);

static int own_teardown(void **state) {
    (void)state;
    if (g_own.pid) dc_harness_stop(&g_own);
    if (g_own_log[0]) unlink(g_own_log);
    if (g_own_ledger[0]) rm_tree_flat(g_own_ledger);
    g_own_log[0] = g_own_ledger[0] = '\0';
    return 0;
}

static void test_max_connections(void **state) {
    (void)state;
    dc_harness *h = &g_own;
    int fds[3], extra;
    assert_int_equal(
        dc_hostile_harness_logged(h, "--workers 1 --set limits.max_connections=3", g_own_log), 0);
    for (int i = 0; i < 3; i++) {
        assert_true((fds[i] = dc_raw_connect(h->sock)) >= 0);
        assert_int_equal(dc_raw_hello(fds[i], 1), 0);
    }
    extra = dc_raw_connect(h->sock);
    assert_true(extra >= 0);
    expect_refused_then_closed(extra, DPCLIP__ERROR_CODE__RESOURCE_EXHAUSTED,
                               "limits.max_connections");
    close(extra);
    {
        /* libdpclip says why */
        dpclip_client *c = NULL;
        assert_int_equal(dpclip_connect(h->sock, NULL, &c), DPCLIP_ENOSPACE);
        assert_non_null(strstr(dpclip_errmsg(c), "limits.max_connections"));
        dpclip_disconnect(c);
    }
    /* one goes: a newcomer is served (once the daemon has seen it go) */
    close(fds[0]);
    for (int tries = 0;; tries++) {
        extra = dc_raw_connect(h->sock);
        assert_true(extra >= 0);
        if (dc_raw_hello(extra, 1) == 0) break;
        close(extra);
        assert_true(tries < 500);
        sleep_ms(20);
    }
    dc_hostile_expect_pong(extra, 2);
    dc_hostile_expect_pong(fds[1], 2);
    close(extra);
    close(fds[1]);
    close(fds[2]);
    assert_int_equal(dc_harness_stop(h), 0);
}

static void test_idle_timeout(void **state) {
    (void)state;
    dc_harness *h = &g_own;
    int idle, busy;
    assert_int_equal(
        dc_hostile_harness_logged(h, "--workers 1 --set limits.idle_timeout=1.5", g_own_log), 0);
    idle = dc_raw_connect(h->sock);
    busy = dc_raw_connect(h->sock);
    assert_true(idle >= 0 && busy >= 0);
    assert_int_equal(dc_raw_hello(idle, 1), 0);
    assert_int_equal(dc_raw_hello(busy, 1), 0);
    /* requests keep a session: 3 s of pings, 0.1 s apart */
    for (int i = 0; i < 30; i++) {
        dc_hostile_expect_pong(busy, 2 + (uint64_t)i);
        sleep_ms(100);
    }
    /* the silent one was told, naming the setting, and closed */
    expect_refused_then_closed(idle, DPCLIP__ERROR_CODE__UNAVAILABLE, "limits.idle_timeout");
    dc_hostile_expect_pong(busy, 99);
    close(idle);
    close(busy);
    assert_int_equal(dc_harness_stop(h), 0);
}

static int count_fds(pid_t pid) {
    char path[64];
    struct dirent *e;
    int n = 0;
    DIR *d;
    snprintf(path, sizeof path, "/proc/%d/fd", (int)pid);
    if (!(d = opendir(path))) return -1;
    while ((e = readdir(d)))
        if (e->d_name[0] != '.') n++;
    closedir(d);
    return n;
}

static int count_lines_with(const char *text, const char *what) {
    int n = 0;
    for (const char *p = text; (p = strstr(p, what)); p += strlen(what)) n++;
    return n;
}

static void rm_tree_flat(const char *dir) {
    char path[600];
    struct dirent *e;
    DIR *d = opendir(dir);
    if (!d) return;
    while ((e = readdir(d)))
        if (e->d_name[0] != '.' || e->d_name[1] > '.') {
            snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
            unlink(path);
        }
    closedir(d);
    rmdir(dir);
}

/* A connection that may not be accepted yet (the backlog), or -1. */
static int connect_nonblocking(const char *sock) {
    struct sockaddr_un a;
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (fd < 0) return -1;
    memset(&a, 0, sizeof a);
    a.sun_family = AF_UNIX;
    if (strlen(sock) >= sizeof a.sun_path) {
        close(fd);
        return -1;
    }
    memcpy(a.sun_path, sock, strlen(sock) + 1);
    if (connect(fd, (struct sockaddr *)&a, sizeof a) != 0) {
        close(fd);
        return -1;
    }
    return fd;
}

#define FLOOD 200

/* The process out of file descriptors: connections past its reserve are
 * refused and accepting rests instead of spinning on EMFILE (it logged
 * `accept: Too many open files` 300,000 times a second); the ledger's
 * writes still find descriptors, so a trainer's noised steps still run. */
static void test_out_of_fds(void **state) {
    (void)state;
    dc_harness *h = &g_own;
    char args[400], *text;
    int flood[FLOOD], n_flood = 0, refused = 0;
    struct rlimit was, low;
    dpclip_client *c = NULL;
    dc_shm_step s;
    dpclip_result res;

    snprintf(g_own_ledger, sizeof g_own_ledger, "/tmp/dpclip-fds-ledger.XXXXXX");
    assert_non_null(mkdtemp(g_own_ledger));
    snprintf(args, sizeof args, "--workers 1 --ledger-dir %s --set limits.handshake_timeout=600",
             g_own_ledger);
    assert_int_equal(dc_hostile_harness_logged(h, args, g_own_log), 0);
    assert_int_equal(dpclip_connect(h->sock, NULL, &c), 0);
    assert_int_equal(dc_service_step_init(&s, c, 4, 1.0f, 0.01, 77), 0);
    assert_int_equal(dpclip_run(c, s.step, &res), 0);
    dpclip_result_free(&res);

    /* a few descriptors more than the daemon has open */
    assert_int_equal(prlimit(h->pid, RLIMIT_NOFILE, NULL, &was), 0);
    low = was;
    low.rlim_cur = (rlim_t)count_fds(h->pid) + 72;
    assert_int_equal(prlimit(h->pid, RLIMIT_NOFILE, &low, NULL), 0);
    for (int i = 0; i < FLOOD; i++)
        if ((flood[n_flood] = connect_nonblocking(h->sock)) >= 0) n_flood++;
    assert_true(n_flood > 72);
    /* refused ones are told (RESOURCE_EXHAUSTED naming the setting to
     * look at) and closed: wait until one is */
    for (int tries = 0; !refused && tries < 200; tries++) {
        struct pollfd pf[FLOOD];
        for (int i = 0; i < n_flood; i++) pf[i] = (struct pollfd){flood[i], POLLIN, 0};
        if (poll(pf, (nfds_t)n_flood, 50) <= 0) continue;
        for (int i = 0; i < n_flood && !refused; i++) {
            if (!(pf[i].revents & POLLIN)) continue;
            Dpclip__Reply *r = dc_raw_read_reply(flood[i], 1000);
            const Dpclip__Error *e = dc_raw_error(r);
            assert_non_null(e);
            assert_int_equal(e->code, DPCLIP__ERROR_CODE__RESOURCE_EXHAUSTED);
            assert_string_equal(e->field, "limits.max_connections");
            assert_non_null(strstr(e->message, "file descriptors"));
            dpclip__reply__free_unpacked(r, NULL);
            refused = 1;
        }
    }
    assert_true(refused);
    /* the trainer's noised steps are accounted on disk and run */
    for (int i = 0; i < 3; i++) {
        if (dpclip_run(c, s.step, &res) != 0) fail_msg("step: %s", dpclip_errmsg(c));
        dpclip_result_free(&res);
    }
    text = dc_hostile_read_file(g_own_log);
    assert_non_null(text);
    fprintf(stderr, "%d lines from accept while %d connections waited\n",
            count_lines_with(text, "accept:"), n_flood);
    assert_true(count_lines_with(text, "accept:") >= 1);
    assert_true(count_lines_with(text, "accept:") <= 3);
    free(text);

    /* the connections go and the limit comes back: a newcomer is served */
    for (int i = 0; i < n_flood; i++) close(flood[i]);
    assert_int_equal(prlimit(h->pid, RLIMIT_NOFILE, &was, NULL), 0);
    for (int tries = 0;; tries++) {
        int fd = dc_raw_connect(h->sock);
        assert_true(fd >= 0);
        int ok = dc_raw_hello(fd, 1) == 0;
        close(fd);
        if (ok) break;
        assert_true(tries < 500);
        sleep_ms(20);
    }
    assert_int_equal(dpclip_run(c, s.step, &res), 0);
    dpclip_result_free(&res);
    dc_shm_step_free(&s);
    dpclip_disconnect(c);
    assert_int_equal(dc_harness_stop(h), 0);
}

static int setup(void **state) {
    char args[400];
    (void)state;
    snprintf(args, sizeof args,
             "--workers 2 --max-batch %d --log-level info --set limits.handshake_timeout=%s "
             "--set limits.max_buffers_total=%d --set limits.max_mapped_bytes=%u "
             "--set limits.max_reply_queue=%u",
             DC_HOSTILE_MAX_BATCH, HANDSHAKE_S, BUFFERS_TOTAL, MAPPED_BYTES, REPLY_QUEUE);
    return dc_hostile_start_logged(args);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_log_injection),
        cmocka_unit_test(test_handshake_timeout),
        cmocka_unit_test(test_long_frame_before_hello),
        cmocka_unit_test(test_buffers_total),
        cmocka_unit_test(test_mapped_bytes_total),
        cmocka_unit_test(test_unread_replies),
        cmocka_unit_test_teardown(test_max_connections, own_teardown),
        cmocka_unit_test_teardown(test_idle_timeout, own_teardown),
        cmocka_unit_test_teardown(test_out_of_fds, own_teardown),
        cmocka_unit_test(dc_hostile_survivors),
        cmocka_unit_test(dc_hostile_clean_shutdown),
    };
    return cmocka_run_group_tests_name("hostile limits", tests, setup, dc_hostile_teardown);
}
