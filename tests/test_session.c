/* A session's life as its client and the operator see it: on SIGTERM every
 * session gets a notice (Error{UNAVAILABLE, field "daemon"} with id 0)
 * before its connection closes, and at the default log level (info) the
 * daemon logs each session's hello and close and each failed step, naming
 * the session, the error's code and field. */
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>

#include "harness.h"
#include "service.h"

/* Starts a harness daemon whose log (stderr) goes to <TMPDIR>/name. */
static void start_logged(dc_harness *h, const char *args, char *log, size_t n) {
    int saved, fd;
    snprintf(log, n, "%s/dpclip-session-log.XXXXXX",
             getenv("TMPDIR") && getenv("TMPDIR")[0] ? getenv("TMPDIR") : "/tmp");
    fd = mkstemp(log);
    assert_true(fd >= 0);
    saved = dup(2);
    assert_true(saved >= 0);
    assert_int_equal(dup2(fd, 2), 2);
    close(fd);
    fd = dc_harness_start(h, args);
    dup2(saved, 2);
    close(saved);
    assert_int_equal(fd, 0);
}

/* The log so far (malloc'd). */
static char *read_log(const char *path) {
    FILE *f = fopen(path, "r");
    char *text = calloc(1, 1 << 20);
    size_t got;
    assert_non_null(f);
    assert_non_null(text);
    got = fread(text, 1, (1 << 20) - 1, f);
    text[got] = '\0';
    fclose(f);
    return text;
}

/* Waits (generously: up to 20 s) for a log line holding every one of the
 * NULL-terminated words; returns the log. */
static char *wait_log_line(const char *path, ...) {
    for (int tries = 0;; tries++) {
        char *text = read_log(path), *line = text;
        while (line && *line) {
            char *eol = strchr(line, '\n'), save = 0;
            const char *w;
            bool all = true;
            va_list ap;
            if (eol) {
                save = *eol;
                *eol = '\0';
            }
            va_start(ap, path);
            while ((w = va_arg(ap, const char *)))
                if (!strstr(line, w)) all = false;
            va_end(ap);
            if (eol) *eol = save;
            if (all) return text;
            line = eol ? eol + 1 : NULL;
        }
        if (tries == 400) {
            fprintf(stderr, "the log lacks a line; it has:\n%s", text);
            free(text);
            fail();
        }
        free(text);
        usleep(50000);
    }
}

static dpclip_client *connect_job(const dc_harness *h, const char *job, uint64_t *id) {
    dpclip_client *c = NULL;
    dpclip_connect_opts o = {.client_name = "session-test", .job_id = job};
    dpclip_daemon_info info;
    assert_int_equal(dpclip_connect(h->sock, &o, &c), 0);
    assert_int_equal(dpclip_daemon_info_get(c, &info), 0);
    *id = info.session_id;
    return c;
}

static void test_logs_at_info(void **state) {
    dc_harness h;
    char log[400], sess[2][32], *text;
    uint64_t id[2];
    dpclip_client *c[2];
    dc_shm_step s[2];
    dpclip_result res;
    (void)state;
    start_logged(&h, "--workers 1 --log-level info", log, sizeof log);
    c[0] = connect_job(&h, "log-job-a", &id[0]);
    c[1] = connect_job(&h, "log-job-b", &id[1]);
    for (int i = 0; i < 2; i++) {
        snprintf(sess[i], sizeof sess[i], "session %llu:", (unsigned long long)id[i]);
        assert_int_equal(dc_service_step_init(&s[i], c[i], 4, 1.0f, 0.01, 7 + i), 0);
    }
    /* a step that runs and fails (a non-finite input) ... */
    ((float *)s[0].ref.layers[0].input.data)[1] = NAN;
    assert_int_equal(dpclip_run(c[0], s[0].step, &res), DPCLIP_ENONFINITE);
    /* ... and one refused before it runs (a buffer that is not registered) */
    assert_int_equal(dc_shm_step_wire_buffer(&s[1], 999999), 0);
    assert_int_equal(dpclip_run(c[1], s[1].step, &res), DPCLIP_ENOTFOUND);
    for (int i = 0; i < 2; i++) dc_shm_step_free(&s[i]);
    dpclip_disconnect(c[0]);
    dpclip_disconnect(c[1]);

    text = wait_log_line(log, sess[0], "hello from", "log-job-a", (char *)NULL);
    free(text);
    text = wait_log_line(log, sess[0], "step failed", "non_finite", "activations", (char *)NULL);
    free(text);
    text = wait_log_line(log, sess[1], "step failed", "not_found", "buffer_id", (char *)NULL);
    free(text);
    for (int i = 0; i < 2; i++) {
        text = wait_log_line(log, sess[i], "closed after", (char *)NULL);
        free(text);
    }
    assert_int_equal(dc_harness_stop(&h), 0);
    unlink(log);
}

/* SIGTERM: every session, with or without a Hello, gets the notice, then
 * the connection closes. */
static void test_shutdown_notice(void **state) {
    dc_harness h;
    int fd[2];
    (void)state;
    assert_int_equal(dc_harness_start(&h, "--workers 1"), 0);
    fd[0] = dc_raw_connect(h.sock);
    fd[1] = dc_raw_connect(h.sock);
    assert_true(fd[0] >= 0 && fd[1] >= 0);
    assert_int_equal(dc_raw_hello(fd[0], 1), 0);
    assert_int_equal(kill(h.pid, SIGTERM), 0);
    for (int i = 0; i < 2; i++) {
        Dpclip__Reply *r = dc_raw_read_reply(fd[i], 20000);
        const Dpclip__Error *e = dc_raw_error(r);
        assert_non_null(e);
        assert_int_equal(r->id, 0);
        assert_int_equal(e->code, DPCLIP__ERROR_CODE__UNAVAILABLE);
        assert_string_equal(e->field, "daemon");
        assert_string_equal(e->message, "dpclipd is shutting down");
        dpclip__reply__free_unpacked(r, NULL);
        assert_int_equal(dc_raw_wait_eof(fd[i], 20000), 1);
        close(fd[i]);
    }
    assert_int_equal(dc_harness_join(&h), 0);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_logs_at_info),
        cmocka_unit_test(test_shutdown_notice),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
