/* Hostile clients against norm groups and steps in phases
 * (daemon/protocol/group.c, session_group.c, step_fuse.c, step_pass.c): a
 * client that speaks the protocol but lies, leaves at the worst moment, or
 * holds what it can. Each case once crashed, hung or locked out other users
 * (issue 37); each now gets an error naming the field or the setting, and
 * the daemon keeps serving. Raw wire, so every field is the test's to set. */
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <poll.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>

#include "harness.h"
#include "hostile.h"

/* Every step here: one Linear, T = 2, d = 3, p = 2, f32, activations at 0
 * and output grads after them, in a zeroed buffer of BUF bytes. */
#define T_ 2
#define D_ 3
#define P_ 2
#define BUF 4096u

static dc_harness g_h;

static void sleep_ms(int ms) {
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

/* A connection after Hello (job `job`), with one zeroed buffer: its id. */
static int open_member(const char *job, uint64_t *buf) {
    Dpclip__Request req = DPCLIP__REQUEST__INIT;
    Dpclip__Hello hello = DPCLIP__HELLO__INIT;
    Dpclip__Reply *r;
    int fd = dc_raw_connect(g_h.sock);
    assert_true(fd >= 0);
    hello.protocol_version = 1;
    hello.client_name = "hostile-groups";
    hello.job_id = (char *)job;
    req.id = 1;
    req.body_case = DPCLIP__REQUEST__BODY_HELLO;
    req.hello = &hello;
    assert_int_equal(dc_raw_send_request(fd, &req), 0);
    r = dc_raw_read_reply(fd, 10000);
    assert_non_null(r);
    assert_int_equal(r->body_case, DPCLIP__REPLY__BODY_HELLO);
    dpclip__reply__free_unpacked(r, NULL);
    if (buf) {
        *buf = dc_raw_register_memfd(fd, 2, BUF, NULL);
        assert_true(*buf != 0);
    }
    return fd;
}

static void send_join(int fd, uint64_t id, const char *name, uint32_t rank, uint32_t size,
                      uint32_t timeout_ms) {
    Dpclip__Request req = DPCLIP__REQUEST__INIT;
    Dpclip__JoinGroup j = DPCLIP__JOIN_GROUP__INIT;
    j.name = (char *)name;
    j.rank = rank;
    j.size = size;
    j.timeout_ms = timeout_ms;
    req.id = id;
    req.body_case = DPCLIP__REQUEST__BODY_JOIN_GROUP;
    req.join_group = &j;
    assert_int_equal(dc_raw_send_request(fd, &req), 0);
}

typedef struct step_terms {
    uint32_t B;
    float sigma;
    double q;
    uint64_t group_step;
    Dpclip__StepPhase phase;
    uint64_t act_offset; /* to break a reference */
    int layers;          /* copies of the layer (0 = 1) */
} step_terms;

static void send_step(int fd, uint64_t id, uint64_t buf, const step_terms *t) {
    Dpclip__Request req = DPCLIP__REQUEST__INIT;
    Dpclip__ClipStep cs = DPCLIP__CLIP_STEP__INIT;
    Dpclip__ClipConfig cc = DPCLIP__CLIP_CONFIG__INIT;
    Dpclip__Layer ly[64], *lp[64];
    Dpclip__LinearLayer lin = DPCLIP__LINEAR_LAYER__INIT;
    Dpclip__TensorRef a = DPCLIP__TENSOR_REF__INIT, g = DPCLIP__TENSOR_REF__INIT;
    int64_t as[3] = {t->B, T_, D_}, gs[3] = {t->B, T_, P_};
    int n = t->layers ? t->layers : 1;
    assert_true(n <= 64);
    a.buffer_id = g.buffer_id = buf;
    a.offset = t->act_offset;
    a.dtype = g.dtype = DPCLIP__DTYPE__F32;
    a.n_shape = g.n_shape = 3;
    a.shape = as;
    g.shape = gs;
    g.offset = (uint64_t)t->B * T_ * D_ * 4;
    lin.activations = &a;
    lin.output_grad = &g;
    for (int l = 0; l < n; l++) {
        dpclip__layer__init(&ly[l]);
        ly[l].name = "fc";
        ly[l].kind_case = DPCLIP__LAYER__KIND_LINEAR;
        ly[l].linear = &lin;
        lp[l] = &ly[l];
    }
    cc.max_grad_norm = 1.0f;
    cc.loss_reduction = DPCLIP__LOSS_REDUCTION__SUM;
    cs.batch_size = t->B;
    cs.n_layers = (size_t)n;
    cs.layers = lp;
    cs.clip = &cc;
    cs.noise_multiplier = t->sigma;
    cs.sample_rate = t->q;
    cs.group_step = t->group_step;
    cs.phase = t->phase;
    req.id = id;
    req.body_case = DPCLIP__REQUEST__BODY_CLIP_STEP;
    req.clip_step = &cs;
    assert_int_equal(dc_raw_send_request(fd, &req), 0);
}

/* The next reply: its body case; an Error's field is copied to field[128]. */
static int reply_of(int fd, uint64_t id, char *field) {
    Dpclip__Reply *r = dc_raw_read_reply(fd, 20000);
    int body;
    assert_non_null(r);
    assert_int_equal(r->id, id);
    body = r->body_case;
    if (field) field[0] = '\0';
    if (body == DPCLIP__REPLY__BODY_ERROR) {
        assert_true(r->error->message && r->error->message[0]);
        if (field) snprintf(field, 128, "%s", r->error->field ? r->error->field : "");
    }
    dpclip__reply__free_unpacked(r, NULL);
    return body;
}

static void expect_ok(int fd, uint64_t id, int body) {
    char field[128];
    int got = reply_of(fd, id, field);
    if (got != body) print_message("request %llu: error on %s\n", (unsigned long long)id, field);
    assert_int_equal(got, body);
}

static void expect_error(int fd, uint64_t id, const char *field) {
    char f[128];
    assert_int_equal(reply_of(fd, id, f), DPCLIP__REPLY__BODY_ERROR);
    if (strstr(f, field) == NULL) print_message("error field '%s', expected '%s'\n", f, field);
    assert_non_null(strstr(f, field));
}

/* The next reply is a ClipStepReply: the job's epsilon it reports. */
static double step_eps(int fd, uint64_t id) {
    Dpclip__Reply *r = dc_raw_read_reply(fd, 20000);
    double eps;
    assert_non_null(r);
    assert_int_equal(r->id, id);
    if (r->body_case != DPCLIP__REPLY__BODY_CLIP_STEP)
        print_message("request %llu: %s\n", (unsigned long long)id,
                      dc_raw_error(r) ? dc_raw_error(r)->message : "?");
    assert_int_equal(r->body_case, DPCLIP__REPLY__BODY_CLIP_STEP);
    eps = r->clip_step->epsilon;
    dpclip__reply__free_unpacked(r, NULL);
    return eps;
}

/* The daemon is alive and serves a newcomer. */
static void daemon_serves(void) {
    Dpclip__Request req = DPCLIP__REQUEST__INIT;
    Dpclip__Ping ping = DPCLIP__PING__INIT;
    int fd;
    assert_true(dc_harness_alive(&g_h));
    fd = open_member("newcomer", NULL);
    ping.nonce = 7;
    req.id = 9;
    req.body_case = DPCLIP__REQUEST__BODY_PING;
    req.ping = &ping;
    assert_int_equal(dc_raw_send_request(fd, &req), 0);
    expect_ok(fd, 9, DPCLIP__REPLY__BODY_PONG);
    close(fd);
}

static int start(const char *args) { return dc_harness_start(&g_h, args); }
static int stop(void **state) {
    (void)state;
    return dc_harness_stop(&g_h) == 0 ? 0 : -1;
}
static int setup(void **state) {
    (void)state;
    return start("--workers 2 --max-batch 64");
}
/* Each case on a daemon of its own: one crash must not hide the others. */
#define CASE(f) cmocka_unit_test_setup_teardown(f, setup, stop)

/* A request stuck behind a step that cannot finish is logged: rank 0 of 2
 * takes a step that waits for rank 1 (who never comes, within a long group
 * timeout) and then sends a Ping, which waits behind it; the daemon logs
 * once, naming the session and the request, and the docs' rule
 * (dc_session_check_stall, after DC_SESSION_STALL_NS and a tick). A step
 * sent ahead behind it is not such a request. */
static void test_request_stalled_behind_step_logged(void **state) {
    (void)state;
    char log_path[64];
    uint64_t buf;
    assert_int_equal(dc_hostile_harness_logged(&g_h, "--workers 2", log_path), 0);
    int fd = open_member("stall", &buf);
    step_terms t = {.B = 2};
    send_join(fd, 3, "stall", 0, 2, 60000);
    expect_ok(fd, 3, DPCLIP__REPLY__BODY_JOIN_GROUP);
    send_step(fd, 4, buf, &t);
    t.group_step = 2;
    send_step(fd, 5, buf, &t); /* the next step, sent ahead: not a stall */
    sleep_ms(16000);           /* past the stall time and a tick: still quiet */
    char *log = dc_hostile_read_file(log_path);
    assert_non_null(log);
    assert_null(strstr(log, "waits behind its step"));
    free(log);
    Dpclip__Request req = DPCLIP__REQUEST__INIT;
    Dpclip__Ping ping = DPCLIP__PING__INIT;
    req.id = 6;
    req.body_case = DPCLIP__REQUEST__BODY_PING;
    req.ping = &ping;
    /* behind step 5, which waits behind step 4: the tick after step 5 has
     * run for the stall time */
    assert_int_equal(dc_raw_send_request(fd, &req), 0);
    const char *want = "a ping request waits behind its step in flight";
    int found = 0;
    for (int i = 0; i < 300 && !found; i++) {
        sleep_ms(100);
        log = dc_hostile_read_file(log_path);
        found = log && strstr(log, want) && strstr(log, "A member never blocks mid-schedule");
        if (found) { /* once a step */
            sleep_ms(6000);
            free(log);
            log = dc_hostile_read_file(log_path);
            const char *first = strstr(log, want);
            assert_null(strstr(first + 1, want));
        }
        free(log);
    }
    assert_true(found);
    close(fd);
    unlink(log_path);
    daemon_serves();
}

/* --- critical ------------------------------------------------------------- */

/* A member joins (reply unread), sends a step whose (q, sigma) is new to the
 * ledger, so that it waits for its curve off the loop, and closes at once:
 * the session leaves its group while the step waits. The step must not run
 * on the group it no longer has (once a NULL dereference). */
static void test_leave_while_step_waits_on_ledger(void **state) {
    (void)state;
    for (int i = 0; i < 40; i++) {
        uint64_t buf;
        char name[32];
        int fd = open_member("ledger-wait", &buf);
        step_terms t = {.B = 2, .sigma = 1.0f, .q = 0.001 * (i + 1) + 0.0001 * i};
        snprintf(name, sizeof name, "lw%d", i);
        send_join(fd, 3, name, 0, 1, 0);
        send_step(fd, 4, buf, &t);
        close(fd); /* the join's reply unread: the daemon sees a reset */
        if (i % 8 == 7) sleep_ms(20);
    }
    sleep_ms(300);
    daemon_serves();
}

/* Rank 0 of 2 takes a step (it waits for rank 1) with a short timeout and
 * closes or half-closes its socket: its leave and the group's timeout must
 * not both free the group (once a libuv assertion on a second close). */
static void test_close_while_group_times_out(void **state) {
    (void)state;
    for (int i = 0; i < 8; i++) {
        uint64_t buf;
        char name[32];
        int fd = open_member("timeout", &buf);
        step_terms t = {.B = 2};
        snprintf(name, sizeof name, "to%d", i);
        send_join(fd, 3, name, 0, 2, 300);
        expect_ok(fd, 3, DPCLIP__REPLY__BODY_JOIN_GROUP);
        send_step(fd, 4, buf, &t);
        sleep_ms(i % 2 ? 250 : 50);
        if (i % 4 < 2) {
            shutdown(fd, SHUT_WR);
            /* the step fails (the member left, or the group timed out) */
            expect_error(fd, 4, "join_group");
        }
        close(fd);
    }
    sleep_ms(500);
    daemon_serves();
}

/* Group steps never wrap into "no step in progress": 2^64 - 1 is refused,
 * and members that then disagree on the batch are refused too, naming the
 * field, instead of the fused step writing one member's batch into the
 * other's tables (once a heap overflow into another session's memory). */
static void test_group_step_wrap_and_batch_mismatch(void **state) {
    uint64_t buf[2];
    int fd[2];
    (void)state;
    for (int k = 0; k < 2; k++) {
        fd[k] = open_member("wrap", &buf[k]);
        send_join(fd[k], 3, "wrap", (uint32_t)k, 2, 5000);
        expect_ok(fd[k], 3, DPCLIP__REPLY__BODY_JOIN_GROUP);
    }
    for (int k = 0; k < 2; k++) {
        step_terms t = {.B = 4, .group_step = UINT64_MAX};
        send_step(fd[k], 4, buf[k], &t);
        expect_error(fd[k], 4, "clip_step.group_step");
    }
    for (int k = 0; k < 2; k++) {
        step_terms t = {.B = k ? 4 : 8};
        send_step(fd[k], 5, buf[k], &t);
    }
    for (int k = 0; k < 2; k++) expect_error(fd[k], 5, "batch_size");
    /* the group goes on: the next step, agreed, is exact (zeros: norms 0) */
    for (int k = 0; k < 2; k++) {
        step_terms t = {.B = 4};
        send_step(fd[k], 6, buf[k], &t);
    }
    for (int k = 0; k < 2; k++) expect_ok(fd[k], 6, DPCLIP__REPLY__BODY_CLIP_STEP);
    for (int k = 0; k < 2; k++) close(fd[k]);
    daemon_serves();
}

/* Rank 1 waits in group step 1 with a JoinGroup queued behind its step;
 * rank 0 jumps to group step 2, which gives step 1 up. Rank 1's failure
 * reply lets its join run at once, inside rank 0's delivery: it leaves,
 * and the group dissolves under that delivery. Rank 0's step must fail
 * too (it once waited in the dissolved group forever, holding its session
 * past its client's end: found by fuzz_group). */
static void test_group_dissolved_during_delivery(void **state) {
    uint64_t buf[2];
    int fd[2];
    (void)state;
    for (int k = 0; k < 2; k++) {
        fd[k] = open_member("abandon", &buf[k]);
        send_join(fd[k], 3, "abandon", (uint32_t)k, 2, 5000);
        expect_ok(fd[k], 3, DPCLIP__REPLY__BODY_JOIN_GROUP);
    }
    step_terms t1 = {.B = 2, .group_step = 1}, t2 = {.B = 2, .group_step = 2};
    send_step(fd[1], 4, buf[1], &t1);
    send_join(fd[1], 5, "abandon", 1, 2, 5000);
    sleep_ms(100); /* rank 1's step waits in the group */
    send_step(fd[0], 4, buf[0], &t2);
    expect_error(fd[1], 4, "clip_step.group_step");
    expect_ok(fd[1], 5, DPCLIP__REPLY__BODY_JOIN_GROUP);
    expect_error(fd[0], 4, "join_group"); /* dissolved */
    for (int k = 0; k < 2; k++) close(fd[k]);
    daemon_serves();
}

/* --- high ------------------------------------------------------------------- */

/* JoinGroup.timeout_ms has a maximum (limits.max_group_timeout_ms). */
static void test_join_timeout_bounded(void **state) {
    int fd = open_member("bounded", NULL);
    (void)state;
    send_join(fd, 3, "bounded", 0, 2, UINT32_MAX);
    expect_error(fd, 3, "join_group.timeout_ms");
    close(fd);
}

/* Members of never-formed groups that send a step and exit (or shut down
 * their side) hold no connection slot afterwards: a daemon of 6
 * connections serves a newcomer after 12 of them. */
static void test_zombie_members_release_slots(void **state) {
    (void)state;
    assert_int_equal(stop(NULL), 0);
    assert_int_equal(start("--workers 2 --set limits.max_connections=6"), 0);
    for (int i = 0; i < 12; i++) {
        uint64_t buf;
        char name[32];
        int fd = open_member("zombie", &buf);
        step_terms t = {.B = 2};
        snprintf(name, sizeof name, "z%d", i);
        send_join(fd, 3, name, 0, 2, 500000);
        expect_ok(fd, 3, DPCLIP__REPLY__BODY_JOIN_GROUP);
        send_step(fd, 4, buf, &t);
        if (i % 2) {
            shutdown(fd, SHUT_WR); /* its answer still comes: the step fails */
            expect_error(fd, 4, "join_group");
        }
        close(fd);
        sleep_ms(30);
    }
    sleep_ms(200);
    daemon_serves();
}

/* Norm passes held between steps count against limits.max_pass_memory_per_uid
 * and limits.max_pass_memory: a pass past either is refused naming it, a
 * pass dropped gives its bytes back. */
static void test_pass_memory_capped(void **state) {
    uint64_t buf[3];
    int fd[3];
    (void)state;
    assert_int_equal(stop(NULL), 0);
    /* one pass of 32 layers x 16 samples is ~10 KiB: two fit the uid's cap */
    assert_int_equal(start("--workers 2 --set limits.max_pass_memory_per_uid=24K "
                           "--set limits.max_pass_memory=1M"),
                     0);
    for (int k = 0; k < 3; k++) fd[k] = open_member("passes", &buf[k]);
    for (int k = 0; k < 3; k++) {
        step_terms t = {.B = 16, .phase = DPCLIP__STEP_PHASE__STEP_NORMS, .layers = 32};
        send_step(fd[k], 4, buf[k], &t);
        if (k < 2) expect_ok(fd[k], 4, DPCLIP__REPLY__BODY_CLIP_STEP);
        else expect_error(fd[k], 4, "limits.max_pass_memory_per_uid");
    }
    /* a whole step ends session 0's pass: session 2's is taken now */
    {
        step_terms w = {.B = 2},
                   t = {.B = 16, .phase = DPCLIP__STEP_PHASE__STEP_NORMS, .layers = 32};
        send_step(fd[0], 5, buf[0], &w);
        expect_ok(fd[0], 5, DPCLIP__REPLY__BODY_CLIP_STEP);
        send_step(fd[2], 5, buf[2], &t);
        expect_ok(fd[2], 5, DPCLIP__REPLY__BODY_CLIP_STEP);
    }
    for (int k = 0; k < 3; k++) close(fd[k]);
    assert_int_equal(stop(NULL), 0);
    assert_int_equal(start("--workers 2 --set limits.max_pass_memory=12K"), 0);
    fd[0] = open_member("passes", &buf[0]);
    {
        step_terms t = {.B = 16, .phase = DPCLIP__STEP_PHASE__STEP_NORMS, .layers = 32};
        send_step(fd[0], 4, buf[0], &t);
        expect_ok(fd[0], 4, DPCLIP__REPLY__BODY_CLIP_STEP);
        fd[1] = open_member("passes", &buf[1]);
        send_step(fd[1], 4, buf[1], &t);
        expect_error(fd[1], 4, "limits.max_pass_memory");
    }
    close(fd[0]);
    close(fd[1]);
    daemon_serves();
}

/* --- medium: one user cannot lock out another ------------------------------- */

/* Runs `fn` in a child as uid 65534; its exit status (0 = passed). */
static int as_nobody(int (*fn)(void)) {
    pid_t pid = fork();
    int st;
    if (pid == 0) {
        if (setgid(65534) != 0 || setuid(65534) != 0) _exit(99);
        _exit(fn());
    }
    if (pid < 0 || waitpid(pid, &st, 0) != pid) return -1;
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

/* A child's check: it connects, says Hello and registers a buffer. */
static int nobody_is_served(void) {
    int fd = dc_raw_connect(g_h.sock);
    uint64_t buf;
    if (fd < 0) return 1;
    if (dc_raw_hello(fd, 1) != 0) return 2;
    buf = dc_raw_register_memfd(fd, 2, BUF, NULL);
    close(fd);
    return buf ? 0 : 3;
}

/* The per-uid shares of connections and buffers: uid 0 fills its own and is
 * refused naming the setting; another uid is still served. Needs root (to
 * be another uid). */
static void test_one_uid_cannot_lock_out_another(void **state) {
    int fds[8], n = 0;
    (void)state;
    if (geteuid() != 0) {
        print_message("skipped: needs root to connect as a second uid\n");
        skip();
    }
    assert_int_equal(stop(NULL), 0);
    assert_int_equal(start("--workers 2 --socket-mode 0666 --set limits.max_connections=16 "
                           "--set limits.max_connections_per_uid=4 "
                           "--set limits.max_buffers_total=32 --set limits.max_buffers_per_uid=6"),
                     0);
    assert_int_equal(chmod(g_h.dir, 0755), 0);
    /* connections: the fifth of uid 0 is refused, naming the setting */
    for (; n < 4; n++) fds[n] = open_member("lock", NULL);
    {
        int fd = dc_raw_connect(g_h.sock);
        Dpclip__Reply *r;
        assert_true(fd >= 0);
        r = dc_raw_read_reply(fd, 5000);
        assert_non_null(r);
        assert_non_null(dc_raw_error(r));
        assert_string_equal(dc_raw_error(r)->field, "limits.max_connections_per_uid");
        dpclip__reply__free_unpacked(r, NULL);
        close(fd);
    }
    assert_int_equal(as_nobody(nobody_is_served), 0);
    /* buffers: uid 0's sessions hold 6, the seventh is refused */
    for (int i = 0; i < 6; i++)
        assert_true(dc_raw_register_memfd(fds[i % 4], 10 + (uint64_t)i, BUF, NULL) != 0);
    {
        Dpclip__Request req = DPCLIP__REQUEST__INIT;
        (void)req;
        assert_int_equal(dc_raw_register_memfd(fds[0], 20, BUF, NULL), 0);
    }
    assert_int_equal(as_nobody(nobody_is_served), 0);
    for (int i = 0; i < n; i++) close(fds[i]);
}

/* --- low --------------------------------------------------------------------- */

/* JoinGroupReply.members counts the members joined, this one included. */
static void test_join_reply_counts_members(void **state) {
    int fd[2];
    (void)state;
    for (int k = 0; k < 2; k++) {
        Dpclip__Reply *r;
        fd[k] = open_member("members", NULL);
        send_join(fd[k], 3, "members", (uint32_t)k, 3, 0);
        r = dc_raw_read_reply(fd[k], 10000);
        assert_non_null(r);
        assert_int_equal(r->body_case, DPCLIP__REPLY__BODY_JOIN_GROUP);
        assert_int_equal(r->join_group->members, (uint32_t)k + 1);
        dpclip__reply__free_unpacked(r, NULL);
    }
    for (int k = 0; k < 2; k++) close(fd[k]);
}

/* A member's refused step spends its group step: its next good step runs,
 * instead of failing again with the old error. */
static void test_refused_step_spends_its_number(void **state) {
    uint64_t buf;
    int fd = open_member("spend", &buf);
    step_terms bad = {.B = 2, .act_offset = BUF}, good = {.B = 2};
    (void)state;
    send_join(fd, 3, "spend", 0, 1, 0);
    expect_ok(fd, 3, DPCLIP__REPLY__BODY_JOIN_GROUP);
    send_step(fd, 4, buf, &bad);
    expect_error(fd, 4, "activations");
    send_step(fd, 5, buf, &good);
    expect_ok(fd, 5, DPCLIP__REPLY__BODY_CLIP_STEP);
    close(fd);
}

/* A JoinGroup refused on its own terms (size 0) leaves the session's group
 * as it was: the members' next step runs. */
static void test_refused_join_keeps_group(void **state) {
    uint64_t buf[2];
    int fd[2];
    (void)state;
    for (int k = 0; k < 2; k++) {
        fd[k] = open_member("keep", &buf[k]);
        send_join(fd[k], 3, "keep", (uint32_t)k, 2, 5000);
        expect_ok(fd[k], 3, DPCLIP__REPLY__BODY_JOIN_GROUP);
    }
    send_join(fd[0], 4, "keep", 0, 0, 0);
    expect_error(fd[0], 4, "join_group.size");
    for (int k = 0; k < 2; k++) {
        step_terms t = {.B = 2};
        send_step(fd[k], 5, buf[k], &t);
    }
    for (int k = 0; k < 2; k++) expect_ok(fd[k], 5, DPCLIP__REPLY__BODY_CLIP_STEP);
    for (int k = 0; k < 2; k++) close(fd[k]);
    daemon_serves();
}

/* --- coverage: a member's step is covered by exactly one leader charge ----- */

static void send_join_wise(int fd, uint64_t id, const char *name, uint32_t rank, uint32_t size) {
    Dpclip__Request req = DPCLIP__REQUEST__INIT;
    Dpclip__JoinGroup j = DPCLIP__JOIN_GROUP__INIT;
    j.name = (char *)name;
    j.rank = rank;
    j.size = size;
    j.clipping = DPCLIP__GROUP_CLIPPING__GROUP_WISE;
    req.id = id;
    req.body_case = DPCLIP__REQUEST__BODY_JOIN_GROUP;
    req.join_group = &j;
    assert_int_equal(dc_raw_send_request(fd, &req), 0);
}

/* GROUP_WISE: a member that joins again (its step counter starts over) is
 * not covered again by the leader's past charges: each of its replayed
 * steps moves the job's epsilon (once: 60 uncharged member steps after 20
 * charged). */
static void test_group_wise_rejoin_not_recovered(void **state) {
    uint64_t buf[2], id = 10;
    int fd[2];
    double eps = 0.0, e;
    step_terms t = {.B = 2, .sigma = 1.0f, .q = 0.1};
    (void)state;
    for (int k = 0; k < 2; k++) {
        fd[k] = open_member("rejoin", &buf[k]);
        send_join_wise(fd[k], 3, "rejoin", (uint32_t)k, 2);
        expect_ok(fd[k], 3, DPCLIP__REPLY__BODY_JOIN_GROUP);
    }
    for (int i = 0; i < 5; i++, id++) { /* the leader charges steps 1-5 */
        send_step(fd[0], id, buf[0], &t);
        eps = step_eps(fd[0], id);
    }
    for (int i = 0; i < 5; i++, id++) { /* the member's steps 1-5: covered */
        send_step(fd[1], id, buf[1], &t);
        assert_true(step_eps(fd[1], id) == eps);
    }
    for (int round = 0; round < 2; round++) { /* joins again, replays 1-5 */
        send_join_wise(fd[1], id, "rejoin", 1, 2);
        expect_ok(fd[1], id++, DPCLIP__REPLY__BODY_JOIN_GROUP);
        for (int i = 0; i < 5; i++, id++) {
            send_step(fd[1], id, buf[1], &t);
            e = step_eps(fd[1], id);
            assert_true(e > eps);
            eps = e;
        }
    }
    for (int k = 0; k < 2; k++) close(fd[k]);
}

/* GROUP_WISE: a leader's charge at a far group step covers that step only,
 * not every step below it (once: one charge at 2^64 - 1 covered 50
 * uncharged member releases). */
static void test_group_wise_jump_covers_one_step(void **state) {
    uint64_t buf[2], id = 10;
    int fd[2];
    double eps, e;
    step_terms t = {.B = 2, .sigma = 1.0f, .q = 0.1};
    (void)state;
    for (int k = 0; k < 2; k++) {
        fd[k] = open_member("jump", &buf[k]);
        send_join_wise(fd[k], 3, "jump", (uint32_t)k, 2);
        expect_ok(fd[k], 3, DPCLIP__REPLY__BODY_JOIN_GROUP);
    }
    t.group_step = (uint64_t)1 << 62;
    send_step(fd[0], id, buf[0], &t);
    eps = step_eps(fd[0], id++);
    t.group_step = 0;
    for (int i = 0; i < 20; i++, id++) {
        send_step(fd[1], id, buf[1], &t);
        e = step_eps(fd[1], id);
        assert_true(e > eps);
        eps = e;
    }
    for (int k = 0; k < 2; k++) close(fd[k]);
}

/* NORM_REDUCE: a member in another job than the leader's is charged to its
 * own job, once per group step (once: never charged at all). */
static void test_member_of_other_job_charged(void **state) {
    uint64_t buf[2];
    int fd[2];
    double prev = 0.0;
    step_terms t = {.B = 2, .sigma = 1.0f, .q = 0.1};
    (void)state;
    fd[0] = open_member("job-a", &buf[0]);
    fd[1] = open_member("job-b", &buf[1]);
    for (int k = 0; k < 2; k++) {
        send_join(fd[k], 3, "other-job", (uint32_t)k, 2, 5000);
        expect_ok(fd[k], 3, DPCLIP__REPLY__BODY_JOIN_GROUP);
    }
    for (uint64_t id = 4; id < 7; id++) {
        double e[2];
        for (int k = 0; k < 2; k++) send_step(fd[k], id, buf[k], &t);
        for (int k = 0; k < 2; k++) e[k] = step_eps(fd[k], id);
        assert_true(e[1] > prev && isfinite(e[1]));
        assert_true(e[1] == e[0]); /* one charge each, same terms */
        prev = e[1];
    }
    for (int k = 0; k < 2; k++) close(fd[k]);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        CASE(test_leave_while_step_waits_on_ledger),
        CASE(test_close_while_group_times_out),
        CASE(test_group_step_wrap_and_batch_mismatch),
        CASE(test_group_dissolved_during_delivery),
        CASE(test_join_timeout_bounded),
        CASE(test_zombie_members_release_slots),
        CASE(test_pass_memory_capped),
        CASE(test_one_uid_cannot_lock_out_another),
        CASE(test_join_reply_counts_members),
        CASE(test_refused_step_spends_its_number),
        CASE(test_refused_join_keeps_group),
        CASE(test_group_wise_rejoin_not_recovered),
        CASE(test_group_wise_jump_covers_one_step),
        CASE(test_member_of_other_job_charged),
        cmocka_unit_test_teardown(test_request_stalled_behind_step_logged, stop),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
