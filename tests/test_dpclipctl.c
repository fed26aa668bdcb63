/* dpclipctl against a real dpclipd, the first time someone uses it: it
 * finds the status socket from $DPCLIP_SOCKET (the trainers' setting) and
 * from the daemon's config file; pointed at the wrong socket it says what
 * is wrong in its own words (not curl's "localhost port 80" or "HTTP/0.9");
 * names cut to fit a column are marked, client-chosen names cannot write
 * control bytes to the terminal, and the headers say what each column
 * holds. (test_status checks the tables' numbers.) */
#include <errno.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmocka.h>

#include "harness.h"
#include "service.h"

static dc_harness g_h;
static char g_status[400];

static int group_setup(void **state) {
    (void)state;
    if (dc_harness_start(&g_h, "--workers 1")) return -1;
    dc_harness_status_path(&g_h, g_status, sizeof g_status);
    return 0;
}

static int group_teardown(void **state) {
    (void)state;
    return g_h.pid && dc_harness_stop(&g_h) != 0 ? -1 : 0;
}

/* Runs `env dpclipctl args` (env: a prefix such as "env -u X", may be "");
 * its exit status, and stdout and stderr in out. */
static int ctl(const char *env, const char *args, char *out, size_t n) {
#ifdef DPCLIPCTL_PATH
    char cmd[1600];
    snprintf(cmd, sizeof cmd, "%s %s %s 2>&1", env, DPCLIPCTL_PATH, args);
    int rc = dc_sh(cmd, out, n);
    assert_int_not_equal(rc, DC_SH_NOSTART);
    return rc;
#else
    (void)env;
    (void)args;
    (void)out;
    (void)n;
    printf("test_dpclipctl: SKIPPED: dpclipctl not built (needs libcurl and jansson)\n");
    skip();
    return -1;
#endif
}

/* The daemon's own status output: dpclipctl reached it. */
static void assert_reached(const char *out) {
    if (!strstr(out, "dpclipd " DPCLIP_VERSION)) fprintf(stderr, "dpclipctl said:\n%s", out);
    assert_non_null(strstr(out, "dpclipd " DPCLIP_VERSION));
}

/* curl's words for these failures, which say nothing to a dpclip user. */
static void assert_no_curl_words(const char *out) {
    assert_null(strstr(out, "port 80"));
    assert_null(strstr(out, "HTTP/0.9"));
    assert_null(strstr(out, "Couldn't connect"));
}

static void test_socket_from_environment(void **state) {
    char env[600], out[16384];
    (void)state;
    /* The trainers' setting names the daemon; its status socket is beside. */
    snprintf(env, sizeof env, "env -u DPCLIP_STATUS_SOCKET DPCLIP_SOCKET='%s'", g_h.sock);
    assert_int_equal(ctl(env, "status", out, sizeof out), 0);
    assert_reached(out);
    /* ... and DPCLIP_STATUS_SOCKET still names the status socket itself. */
    snprintf(env, sizeof env, "env DPCLIP_SOCKET=/nonexistent/d.sock DPCLIP_STATUS_SOCKET='%s'",
             g_status);
    assert_int_equal(ctl(env, "status", out, sizeof out), 0);
    assert_reached(out);
}

/* get PATH: the path is joined to the base with one slash, with or without
 * its own; a path the daemon does not serve is named in the error with the
 * socket, not glued onto the socket's file name. */
static void test_get_joins_the_path(void **state) {
    char args[600], out[16384], bad[700];
    (void)state;
    snprintf(args, sizeof args, "--socket '%s' get /status", g_status);
    assert_int_equal(ctl("", args, out, sizeof out), 0);
    assert_non_null(strstr(out, "\"sessions\""));
    snprintf(args, sizeof args, "--socket '%s' get status", g_status);
    assert_int_equal(ctl("", args, out, sizeof out), 0);
    assert_non_null(strstr(out, "\"sessions\""));
    snprintf(args, sizeof args, "--socket '%s' get /nope", g_status);
    assert_int_not_equal(ctl("", args, out, sizeof out), 0);
    assert_non_null(strstr(out, "GET /nope from "));
    assert_non_null(strstr(out, "HTTP 404"));
    snprintf(bad, sizeof bad, "%s/nope", g_status);
    assert_null(strstr(out, bad));
}

/* Writes text to <harness dir>/name; its path in path. */
static void write_conf(const char *name, const char *text, char *path, size_t n) {
    FILE *f;
    snprintf(path, n, "%s/%s", g_h.dir, name);
    f = fopen(path, "w");
    assert_non_null(f);
    assert_int_equal(fputs(text, f) >= 0, 1);
    assert_int_equal(fclose(f), 0);
}

static void test_socket_from_config(void **state) {
    char text[1200], conf[600], args[800], out[16384];
    const char *env = "env -u DPCLIP_SOCKET -u DPCLIP_STATUS_SOCKET";
    (void)state;
    /* daemon.socket: its status socket is derived as the daemon does */
    snprintf(text, sizeof text, "[daemon]\nsocket = %s\nworkers = 1\n", g_h.sock);
    write_conf("by-socket.conf", text, conf, sizeof conf);
    snprintf(args, sizeof args, "--config '%s' status", conf);
    assert_int_equal(ctl(env, args, out, sizeof out), 0);
    assert_reached(out);
    /* status.socket wins */
    snprintf(text, sizeof text, "[daemon]\nsocket = /nonexistent/d.sock\n[status]\nsocket = %s\n",
             g_status);
    write_conf("by-status.conf", text, conf, sizeof conf);
    snprintf(args, sizeof args, "--config '%s' sessions", conf);
    assert_int_equal(ctl(env, args, out, sizeof out), 0);
    assert_non_null(strstr(out, "CLIENT"));
    /* a status socket turned off is said to be, naming the file */
    write_conf("off.conf", "[status]\nsocket = none\n", conf, sizeof conf);
    snprintf(args, sizeof args, "--config '%s' status", conf);
    assert_int_equal(ctl(env, args, out, sizeof out), 1);
    assert_non_null(strstr(out, "status.socket = none"));
    assert_non_null(strstr(out, conf));
    /* a config file that is not there is an error when named */
    assert_int_equal(ctl(env, "--config /nonexistent/dpclipd.conf status", out, sizeof out), 2);
    assert_non_null(strstr(out, "/nonexistent/dpclipd.conf"));
}

static void test_wrong_socket(void **state) {
    char args[800], path[400], env[600], out[16384];
    struct sockaddr_un a;
    FILE *f;
    int fd;
    (void)state;
    /* the trainers' socket: dpclipd's, but not its status socket */
    snprintf(args, sizeof args, "--socket '%s' status", g_h.sock);
    assert_int_equal(ctl("", args, out, sizeof out), 1);
    printf("%s", out);
    assert_no_curl_words(out);
    assert_non_null(strstr(out, "trainers' socket"));
    assert_non_null(strstr(out, g_status)); /* where the status socket is */
    /* nothing there */
    snprintf(path, sizeof path, "%s/missing.sock", g_h.dir);
    snprintf(args, sizeof args, "--socket '%s' status", path);
    assert_int_equal(ctl("", args, out, sizeof out), 1);
    printf("%s", out);
    assert_no_curl_words(out);
    assert_non_null(strstr(out, path));
    assert_non_null(strstr(out, "no such socket"));
    /* ... and where the path came from */
    snprintf(env, sizeof env, "env -u DPCLIP_STATUS_SOCKET DPCLIP_SOCKET='%s/missing.sock'",
             g_h.dir);
    assert_int_equal(ctl(env, "status", out, sizeof out), 1);
    printf("%s", out);
    assert_non_null(strstr(out, "$DPCLIP_SOCKET"));
    /* a socket file nobody listens on (a daemon that was killed) */
    snprintf(path, sizeof path, "%s/stale.sock", g_h.dir);
    memset(&a, 0, sizeof a);
    a.sun_family = AF_UNIX;
    assert_true(strlen(path) < sizeof a.sun_path);
    memcpy(a.sun_path, path, strlen(path) + 1);
    fd = socket(AF_UNIX, SOCK_STREAM, 0);
    assert_true(fd >= 0);
    assert_int_equal(bind(fd, (struct sockaddr *)&a, sizeof a), 0);
    close(fd);
    snprintf(args, sizeof args, "--socket '%s' status", path);
    assert_int_equal(ctl("", args, out, sizeof out), 1);
    printf("%s", out);
    assert_no_curl_words(out);
    assert_non_null(strstr(out, "nothing is listening"));
    /* not a socket at all */
    snprintf(path, sizeof path, "%s/plain-file", g_h.dir);
    f = fopen(path, "w");
    assert_non_null(f);
    fclose(f);
    snprintf(args, sizeof args, "--socket '%s' status", path);
    assert_int_equal(ctl("", args, out, sizeof out), 1);
    assert_non_null(strstr(out, "not a socket"));
}

/* The cell holding (the start of) name in out: it is cut and marked, never
 * the name's start silently shortened. */
static void assert_cut_marked(const char *out, const char *name, int times) {
    char prefix[9], cell[128];
    const char *p = out;
    int seen = 0;
    snprintf(prefix, sizeof prefix, "%s", name);
    assert_null(strstr(out, name)); /* too long for any column */
    while ((p = strstr(p, prefix))) {
        size_t len;
        assert_int_equal(sscanf(p, "%127s", cell), 1);
        len = strlen(cell);
        if (cell[len - 1] != '~') fprintf(stderr, "cut without a mark: '%s'\n", cell);
        assert_int_equal(cell[len - 1], '~');
        assert_memory_equal(cell, name, len - 1);
        seen++;
        p += len;
    }
    assert_int_equal(seen, times);
}

static void test_tables(void **state) {
    static const char job[] = "a-job-id-much-longer-than-the-tables-give-it-0123456789";
    static const char client[] = "a-client-name-longer-than-its-column";
    char out[65536], args[600], *hdr, *eol;
    dpclip_client *c = NULL;
    dpclip_connect_opts o = {.client_name = client, .job_id = job};
    dpclip_connect_opts evil = {.client_name = "evil\x1b]0;pwned\x07\x1b[2J", .job_id = "e"};
    dpclip_client *e = NULL;
    (void)state;
    assert_int_equal(dpclip_connect(g_h.sock, &o, &c), 0);
    assert_int_equal(dpclip_connect(g_h.sock, &evil, &e), 0);
    snprintf(args, sizeof args, "--socket '%s' sessions", g_status);
    assert_int_equal(ctl("", args, out, sizeof out), 0);
    printf("%s", out);
    /* the sessions table and the groups table: the job id cut in both */
    assert_cut_marked(out, job, 2);
    assert_cut_marked(out, client, 1);
    /* the terminal gets no escape sequence from a client's name */
    assert_null(strchr(out, '\x1b'));
    assert_null(strchr(out, '\x07'));
    assert_non_null(strstr(out, "evil"));
    /* the groups' session column holds ids, the ledger's a count */
    hdr = strstr(out, "\nGROUP");
    assert_non_null(hdr);
    eol = strchr(hdr + 1, '\n');
    assert_non_null(eol);
    *eol = '\0';
    assert_non_null(strstr(hdr, "SESSION IDS"));
    snprintf(args, sizeof args, "--socket '%s' ledger", g_status);
    assert_int_equal(ctl("", args, out, sizeof out), 0);
    printf("%s", out);
    assert_cut_marked(out, job, 1);
    assert_non_null(strstr(out, "OPEN SESSIONS"));
    dpclip_disconnect(e);
    dpclip_disconnect(c);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_socket_from_environment),
        cmocka_unit_test(test_socket_from_config),
        cmocka_unit_test(test_wrong_socket),
        cmocka_unit_test(test_get_joins_the_path),
        cmocka_unit_test(test_tables),
    };
#ifndef DPCLIP_HAVE_MHD
    printf("test_dpclipctl: SKIPPED: dpclipd was built without libmicrohttpd (no status socket)\n");
    return DC_TEST_SKIP;
#endif
    return cmocka_run_group_tests(tests, group_setup, group_teardown);
}
