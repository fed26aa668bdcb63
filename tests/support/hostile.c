/* The hostile-input tests' fixture (tests/test_hostile*.c): a daemon with
 * small limits, a well-behaved client that keeps running exact steps during
 * the attacks, and helpers to speak the raw protocol. */
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>

#include "dc_frame.h"
#include "hostile.h"

dc_harness dc_hostile_h;
const dpclip_clip_config dc_hostile_sum = {.max_grad_norm = 1.0f, .reduction = DPCLIP_SUM};

/* --- the well-behaved client ---------------------------------------------- */

static pthread_t g_good;
static atomic_int g_stop;
static atomic_int g_good_ok, g_good_bad, g_good_failed;
static atomic_ullong g_good_buf; /* its buffer id, for the foreign-id test */
static char g_good_why[256];

static void *good_client(void *arg) {
    (void)arg;
    const uint32_t B = 8;
    dpclip_clip_config cfg = {.max_grad_norm = 1.0f, .reduction = DPCLIP_MEAN};
    dc_test_layer_spec lin = {DC_LAYER_LINEAR, B, 5, 12, 8, DC_F32, 1, DC_ALGO_AUTO, 1, 0};
    dc_test_layer_spec emb = {DC_LAYER_EMBEDDING, B, 5, 6, 17, DC_F32, 0, DC_ALGO_AUTO, 1, 0};
    dc_test_layer_spec ln = {DC_LAYER_LAYERNORM, B, 5, 12, 0, DC_BF16, 1, DC_ALGO_AUTO, 1, 0};
    dpclip_client *c = NULL;
    dc_test_rng r;
    dc_shm_step s;

    dc_test_rng_seed(&r, 4242);
    if (dpclip_connect(dc_hostile_h.sock, NULL, &c) || dc_shm_step_init(&s, c, 1u << 20, B, &cfg) ||
        dc_shm_step_add(&s, &lin, &r, 1.0f) < 0 || dc_shm_step_add(&s, &emb, &r, 1.0f) < 0 ||
        dc_shm_step_add(&s, &ln, &r, 1.0f) < 0 || dc_shm_step_add_outputs(&s, 1, 1)) {
        snprintf(g_good_why, sizeof g_good_why, "setup: %s", dpclip_errmsg(c));
        g_good_failed++;
        atomic_store(&g_good_buf, 1); /* unblock the waiter */
        dpclip_disconnect(c);
        return NULL;
    }
    cfg.max_grad_norm = (float)dc_shm_step_median_norm(&s);
    dc_shm_step_set_config(&s, &cfg);
    atomic_store(&g_good_buf, s.buf_id);
    while (!atomic_load(&g_stop)) {
        dpclip_result res;
        dc_shm_step_refill(&s, &r);
        if (dpclip_run(c, s.step, &res)) {
            snprintf(g_good_why, sizeof g_good_why, "run: %s", dpclip_errmsg(c));
            g_good_failed++;
            break;
        }
        if (dc_shm_step_check(&s, &res, dc_test_rtol(DC_BF16), 1e-7) > 1.0) g_good_bad++;
        else g_good_ok++;
        dpclip_result_free(&res);
    }
    dc_shm_step_free(&s);
    dpclip_disconnect(c);
    return NULL;
}

static char g_log[64]; /* the fixture daemon's stderr, if captured */

int dc_hostile_harness_logged(dc_harness *h, const char *args, char *log_path) {
    int fd, saved, rc;
    snprintf(log_path, 64, "/tmp/dpclip-hostile-log.XXXXXX");
    if ((fd = mkstemp(log_path)) < 0) return -1;
    /* the daemon inherits our stderr when the harness forks it */
    fflush(stderr);
    saved = dup(STDERR_FILENO);
    dup2(fd, STDERR_FILENO);
    close(fd);
    rc = dc_harness_start(h, args);
    fflush(stderr);
    dup2(saved, STDERR_FILENO);
    close(saved);
    return rc;
}

char *dc_hostile_read_file(const char *path) {
    FILE *f = fopen(path, "re");
    char *buf = NULL;
    size_t len = 0, cap = 0, n;
    if (!f) return NULL;
    do {
        if (cap - len < 4096) {
            char *nb = realloc(buf, cap = cap * 2 + 8192);
            if (!nb) break;
            buf = nb;
        }
        n = fread(buf + len, 1, cap - len - 1, f);
        len += n;
    } while (n > 0);
    fclose(f);
    if (buf) buf[len] = '\0';
    return buf;
}

char *dc_hostile_log(void) {
    char *s = g_log[0] ? dc_hostile_read_file(g_log) : NULL;
    return s ? s : strdup("");
}

/* The good client, once the daemon runs. */
static int start_good(void) {
    if (pthread_create(&g_good, NULL, good_client, NULL)) return -1;
    while (!dc_hostile_good_buffer()) {
        struct timespec ts = {0, 1000000};
        nanosleep(&ts, NULL);
    }
    return 0;
}

int dc_hostile_setup(void **state) {
    (void)state;
    char args[128];
    snprintf(args, sizeof args, "--workers 2 --max-batch %d --max-frame %d", DC_HOSTILE_MAX_BATCH,
             DC_HOSTILE_MAX_FRAME);
    if (dc_harness_start(&dc_hostile_h, args)) return -1;
    return start_good();
}

int dc_hostile_start_logged(const char *args) {
    if (dc_hostile_harness_logged(&dc_hostile_h, args, g_log)) return -1;
    return start_good();
}

int dc_hostile_teardown(void **state) {
    (void)state;
    if (!atomic_load(&g_stop)) { /* a test failed before stopping it */
        atomic_store(&g_stop, 1);
        pthread_join(g_good, NULL);
        if (g_log[0]) {
            char *log = dc_hostile_log();
            fprintf(stderr, "--- the daemon's log ---\n%s--- end of the log ---\n", log);
            free(log);
        }
    }
    /* normally stopped (and checked) by test_clean_shutdown; this only
     * cleans up after a failure */
    if (dc_hostile_h.pid) dc_harness_stop(&dc_hostile_h);
    if (g_log[0]) unlink(g_log);
    g_log[0] = '\0';
    return 0;
}

/* --- helpers ----------------------------------------------------------------- */

int dc_hostile_raw_hello(void) {
    int fd = dc_raw_connect(dc_hostile_h.sock);
    assert_true(fd >= 0);
    assert_int_equal(dc_raw_hello(fd, 1), 0);
    return fd;
}

void dc_hostile_send_frame(int fd, uint32_t len, const void *body, size_t n) {
    uint8_t hdr[4];
    dc_frame_put_len(hdr, len);
    assert_int_equal(dc_raw_send(fd, hdr, 4), 0);
    if (n) assert_int_equal(dc_raw_send(fd, body, n), 0);
}

/* Reads one reply and checks it is an Error with `code` whose field
 * contains `field` (NULL: any). */
void dc_hostile_expect_error(int fd, Dpclip__ErrorCode code, const char *field) {
    Dpclip__Reply *r = dc_raw_read_reply(fd, 10000);
    const Dpclip__Error *e = dc_raw_error(r);
    if (!e)
        fprintf(stderr, "expected an error %d, got %s\n", (int)code, r ? "another reply" : "EOF");
    assert_non_null(e);
    if (e->code != code || (field && !strstr(e->field, field)))
        fprintf(stderr, "got error %d field '%s': %s\n", (int)e->code, e->field, e->message);
    assert_int_equal(e->code, code);
    if (field) assert_non_null(strstr(e->field, field));
    assert_true(strlen(e->message) > 0);
    dpclip__reply__free_unpacked(r, NULL);
}

void dc_hostile_expect_pong(int fd, uint64_t id) {
    Dpclip__Request req = DPCLIP__REQUEST__INIT;
    Dpclip__Ping ping = DPCLIP__PING__INIT;
    Dpclip__Reply *r;
    ping.nonce = id * 7;
    req.id = id;
    req.body_case = DPCLIP__REQUEST__BODY_PING;
    req.ping = &ping;
    assert_int_equal(dc_raw_send_request(fd, &req), 0);
    r = dc_raw_read_reply(fd, 10000);
    assert_non_null(r);
    assert_int_equal(r->body_case, DPCLIP__REPLY__BODY_PONG);
    assert_int_equal(r->id, id);
    assert_int_equal(r->pong->nonce, id * 7);
    dpclip__reply__free_unpacked(r, NULL);
}

int dc_hostile_ends_with(const char *s, const char *suffix) {
    size_t a = strlen(s), b = strlen(suffix);
    return a >= b && strcmp(s + a - b, suffix) == 0;
}

dpclip_client *dc_hostile_connect(void) {
    dpclip_client *c = NULL;
    dpclip_connect_opts o = {.client_name = "hostile"};
    assert_int_equal(dpclip_connect(dc_hostile_h.sock, &o, &c), 0);
    return c;
}

dc_lin_desc dc_hostile_lin_on(uint64_t buf, uint32_t B, int64_t T, int64_t d, int64_t p) {
    dc_lin_desc x;
    memset(&x, 0, sizeof x);
    x.B = B;
    x.l.name = "victim";
    x.l.activations = (dpclip_tensor){buf, 0, DPCLIP_F32, 3, {B, T, d}};
    x.l.output_grad = (dpclip_tensor){buf, (uint64_t)(B * T * d * 4), DPCLIP_F32, 3, {B, T, p}};
    return x;
}

/* Runs a one-layer step and returns the status; the handle keeps errfield. */
int dc_hostile_run_linear(dpclip_client *c, const dc_lin_desc *x) {
    dpclip_clip_config cfg = dc_hostile_sum;
    dpclip_step *s = dpclip_step_new(x->B, &cfg);
    dpclip_result res;
    int rc;
    assert_non_null(s);
    assert_int_equal(dpclip_step_add_linear(s, &x->l), 0);
    rc = dpclip_run(c, s, &res);
    dpclip_result_free(&res);
    dpclip_step_free(s);
    return rc;
}

/* --- after all that ------------------------------------------------------- */

uint64_t dc_hostile_good_buffer(void) { return atomic_load(&g_good_buf); }

void dc_hostile_survivors(void **state) {
    (void)state;
    int before = atomic_load(&g_good_ok);
    struct timespec ts = {0, 5 * 1000 * 1000};
    dpclip_client *c;
    dc_shm_step s;
    dc_test_rng r;
    dpclip_result res;
    dpclip_clip_config cfg = dc_hostile_sum;
    dc_test_layer_spec lin = {DC_LAYER_LINEAR, 5, 4, 6, 7, DC_F32, 1, DC_ALGO_AUTO, 1, 0};

    /* the good client keeps making progress (bounded wait, not a timing check) */
    for (int i = 0;
         i < 12000 && atomic_load(&g_good_ok) < before + 20 && !atomic_load(&g_good_failed); i++)
        nanosleep(&ts, NULL);
    atomic_store(&g_stop, 1);
    pthread_join(g_good, NULL);
    if (g_good_failed || g_good_bad)
        fprintf(stderr, "good client: %d ok, %d wrong, %d failed (%s)\n", (int)g_good_ok,
                (int)g_good_bad, (int)g_good_failed, g_good_why);
    assert_int_equal(atomic_load(&g_good_failed), 0);
    assert_int_equal(atomic_load(&g_good_bad), 0);
    assert_true(atomic_load(&g_good_ok) >= before + 20);
    fprintf(stderr, "good client: %d exact steps during the attacks\n", (int)g_good_ok);

    /* the daemon is alive and serves a newcomer */
    assert_true(dc_harness_alive(&dc_hostile_h));
    c = dc_hostile_connect();
    dc_test_rng_seed(&r, 6);
    assert_int_equal(dc_shm_step_init(&s, c, 1u << 20, 5, &cfg), 0);
    assert_int_equal(dc_shm_step_add(&s, &lin, &r, 1.0f), 0);
    assert_int_equal(dpclip_run(c, s.step, &res), 0);
    assert_true(dc_shm_step_check(&s, &res, dc_test_rtol(DC_F32), 1e-7) <= 1.0);
    dpclip_result_free(&res);
    dc_shm_step_free(&s);
    dpclip_disconnect(c);
}

/* SIGTERM: the daemon finishes, exits 0 and removes its socket (cmocka
 * does not count a failing group teardown, so this is a test). */
void dc_hostile_clean_shutdown(void **state) {
    (void)state;
    assert_int_equal(dc_harness_stop(&dc_hostile_h), 0);
}
