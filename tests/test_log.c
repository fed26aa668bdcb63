/* daemon/infra/log.c: one event is one line. Client-chosen strings inside a
 * message (a Hello's client name or job id) cannot forge lines or terminal
 * escapes: control bytes and backslashes come out as C escapes. A condition
 * that recurs gets at most one line per period. */
#include <fcntl.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

#include "log.h"

/* Runs one dc_log call with stderr in a temp file; returns what it wrote
 * (malloc'd). */
static char *logged(const char *client) {
    char path[] = "/tmp/dpclip-log.XXXXXX";
    int fd = mkstemp(path), saved = dup(STDERR_FILENO);
    char *out = calloc(1, 8192);
    ssize_t n;
    assert_true(fd >= 0 && saved >= 0 && out);
    unlink(path);
    fflush(stderr);
    assert_true(dup2(fd, STDERR_FILENO) >= 0);
    dc_log_info("session 1: hello from client '%s' job '%s'", client, "j\\ob");
    fflush(stderr);
    assert_true(dup2(saved, STDERR_FILENO) >= 0);
    close(saved);
    n = pread(fd, out, 8191, 0);
    assert_true(n > 0);
    close(fd);
    return out;
}

static int count_lines(const char *s) {
    int n = 0;
    for (; *s; s++) n += *s == '\n';
    return n;
}

static void test_forged_line(void **state) {
    (void)state;
    char *out = logged("evil\ndpclipd[error]: ledger lost\r\x1b[2J\x7f");
    /* one event, one line, ending the message */
    assert_int_equal(count_lines(out), 1);
    assert_true(out[strlen(out) - 1] == '\n');
    assert_null(strstr(out, "\ndpclipd[error]"));
    assert_non_null(strstr(out, "client 'evil\\ndpclipd[error]: ledger lost\\r\\x1b[2J\\x7f'"));
    /* a backslash is escaped too: "\n" typed by the client stays told apart */
    assert_non_null(strstr(out, "job 'j\\\\ob'"));
    free(out);
}

static void test_plain_text_unchanged(void **state) {
    (void)state;
    char *out = logged("trainer-0 (rank 3/8) é");
    assert_non_null(strstr(out, "dpclipd[info]: session 1: hello from client 'trainer-0 (rank "
                                "3/8) é' job 'j\\\\ob'\n"));
    free(out);
}

static void test_long_message(void **state) {
    (void)state;
    char big[3000];
    memset(big, '\n', sizeof big - 1);
    big[sizeof big - 1] = '\0';
    /* truncated, but still one line */
    char *out = logged(big);
    assert_int_equal(count_lines(out), 1);
    assert_true(strlen(out) > 1000);
    free(out);
}

/* An escape is never cut in half at the end of the buffer. */
static void test_escape_bounds(void **state) {
    (void)state;
    char out[8];
    assert_int_equal(dc_log_escape(out, 6,
                                   "ab\x01"
                                   "cd"),
                     2); /* "ab\x01" needs 7 bytes */
    assert_string_equal(out, "ab");
    assert_int_equal(dc_log_escape(out, sizeof out, "a\x02"), 5);
    assert_string_equal(out, "a\\x02");
    assert_int_equal(dc_log_escape(out, sizeof out, "\\\\\\\\"), 6);
    assert_string_equal(out, "\\\\\\\\\\\\");
    assert_int_equal(dc_log_escape(out, 1, "x"), 0);
    assert_string_equal(out, "");
}

/* A recurring condition gets one line per period, and the next line says
 * how many were held back. */
static void test_rate_limit(void **state) {
    (void)state;
    dc_log_limit l = {0};
    uint64_t skipped = 99;
    const uint64_t period = 10;
    assert_true(dc_log_limit_pass(&l, 1000, period, &skipped));
    assert_int_equal(skipped, 0);
    for (uint64_t t = 1000; t < 1010; t++) assert_false(dc_log_limit_pass(&l, t, period, &skipped));
    assert_true(dc_log_limit_pass(&l, 1010, period, &skipped));
    assert_int_equal(skipped, 10);
    assert_false(dc_log_limit_pass(&l, 1011, period, &skipped));
    assert_true(dc_log_limit_pass(&l, 5000, period, &skipped));
    assert_int_equal(skipped, 1);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_forged_line),  cmocka_unit_test(test_plain_text_unchanged),
        cmocka_unit_test(test_long_message), cmocka_unit_test(test_escape_bounds),
        cmocka_unit_test(test_rate_limit),
    };
    dc_log_set_level(DC_LOG_INFO);
    return cmocka_run_group_tests(tests, NULL, NULL);
}
