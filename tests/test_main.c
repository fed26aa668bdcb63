/* dpclipd as a command, the first time someone runs it by hand: a socket
 * whose directory is missing (bare `dpclipd` on a machine where systemd
 * has not made /run/dpclip) or not writable gets an error that says what
 * to do (--socket, systemd-tmpfiles), not just "No such file or
 * directory". */
#include <errno.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmocka.h>

#include "service.h"

static char g_tmp[300];

static int setup(void **state) {
    (void)state;
    snprintf(g_tmp, sizeof g_tmp, "%s/dpclip-main.XXXXXX",
             getenv("TMPDIR") && getenv("TMPDIR")[0] ? getenv("TMPDIR") : "/tmp");
    return mkdtemp(g_tmp) ? 0 : -1;
}

static int teardown(void **state) {
    char cmd[800];
    (void)state;
    snprintf(cmd, sizeof cmd, "chmod -R u+rwx '%s'; rm -rf '%s'", g_tmp, g_tmp);
    return system(cmd) == 0 ? 0 : -1;
}

/* Runs dpclipd with args (no config file, no GPU, an in-memory ledger):
 * its exit status, and what it printed in out. */
static int run_daemon(const char *env, const char *args, char *out, size_t n) {
    char cmd[1200];
    snprintf(cmd, sizeof cmd,
             "%s '%s' --config /dev/null --no-gpu --ledger-dir '' --workers 1 "
             "%s 2>&1 </dev/null",
             env, DPCLIPD_PATH, args);
    int rc = dc_sh(cmd, out, n);
    assert_int_not_equal(rc, DC_SH_NOSTART);
    return rc;
}

/* The socket's directory does not exist: the error names it and says how
 * to run the daemon anyway. */
static void test_socket_dir_missing(void **state) {
    char args[600], dir[400], out[4096];
    (void)state;
    snprintf(dir, sizeof dir, "%s/no-such-dir", g_tmp);
    snprintf(args, sizeof args, "--socket '%s/d.sock'", dir);
    assert_int_equal(run_daemon("", args, out, sizeof out), 1);
    printf("%s", out);
    assert_non_null(strstr(out, dir));
    assert_non_null(strstr(out, "does not exist"));
    assert_non_null(strstr(out, "--socket PATH"));
    assert_non_null(strstr(out, "DPCLIP_SOCKET"));
    assert_null(strstr(out, "No such file or directory"));
}

/* Bare `dpclipd` where systemd has not made /run/dpclip: also how to get
 * the directory the default socket lives in. */
static void test_bare_dpclipd(void **state) {
    char out[4096];
    struct stat st;
    (void)state;
    if (stat("/run/dpclip", &st) == 0) {
        printf("test_main: /run/dpclip exists here: bare dpclipd not run\n");
        skip();
    }
    assert_int_equal(run_daemon("env -u DPCLIP_SOCKET", "", out, sizeof out), 1);
    printf("%s", out);
    assert_non_null(strstr(out, "/run/dpclip does not exist"));
    assert_non_null(strstr(out, "--socket PATH"));
    assert_non_null(strstr(out, "systemd-tmpfiles --create"));
}

/* A directory this user may not write (/run/dpclip belongs to the service's
 * user once systemd-tmpfiles made it). */
static void test_socket_dir_not_writable(void **state) {
    char args[600], dir[400], out[4096];
    (void)state;
    if (geteuid() == 0) {
        printf("test_main: running as root (it may write anywhere): not checked\n");
        skip();
    }
    snprintf(dir, sizeof dir, "%s/read-only", g_tmp);
    assert_int_equal(mkdir(dir, 0500), 0);
    snprintf(args, sizeof args, "--socket '%s/d.sock'", dir);
    assert_int_equal(run_daemon("", args, out, sizeof out), 1);
    printf("%s", out);
    assert_non_null(strstr(out, "may not create files in"));
    assert_non_null(strstr(out, "--socket PATH"));
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_socket_dir_missing),
        cmocka_unit_test(test_bare_dpclipd),
        cmocka_unit_test(test_socket_dir_not_writable),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
