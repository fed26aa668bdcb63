/* dpclipd's configuration (daemon/service/config.c): the INI file through inih,
 * flags over the file, every bad file giving an error that names the file,
 * the line and the key, and `dpclipd --check-config` end to end. */
#include <errno.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmocka.h>

#include "service.h"

#include "backend.h"
#include "config.h"

#ifndef DPCLIPD_PATH
#error "DPCLIPD_PATH (the daemon under test) is defined by tests/CMakeLists.txt"
#endif

static char g_dir[256];

static int setup(void **state) {
    (void)state;
    /* Keep the developer's own environment out of the defaults. */
    unsetenv("DPCLIP_SOCKET");
    snprintf(g_dir, sizeof g_dir, "%s/dpclip-config.XXXXXX",
             getenv("TMPDIR") && getenv("TMPDIR")[0] ? getenv("TMPDIR") : "/tmp");
    return mkdtemp(g_dir) ? 0 : -1;
}

static int teardown(void **state) {
    char cmd[300];
    (void)state;
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", g_dir);
    return system(cmd) == 0 ? 0 : -1;
}

#ifdef DPCLIP_HAVE_INIH
/* The path is in a static buffer: copy it before the next call. */
static const char *write_conf(const char *name, const char *text) {
    static char path[400];
    FILE *f;
    snprintf(path, sizeof path, "%s/%s", g_dir, name);
    f = fopen(path, "w");
    assert_non_null(f);
    fputs(text, f);
    fclose(f);
    return path;
}
#endif

#ifdef DPCLIP_HAVE_INIH
static void test_full_file(void **state) {
    dc_config c;
    dc_err e;
    (void)state;
    dc_config_defaults(&c);
    int rc = dc_config_load_string(&c,
                                   "; comment\n"
                                   "# another\n"
                                   "[daemon]\n"
                                   "socket = /run/x/d.sock\n"
                                   "socket_mode = 0600\n"
                                   "socket_group = root\n"
                                   "workers = 3   ; inline comment\n"
                                   "blas_threads = 2\n"
                                   "spin_us = 0\n"
                                   "gpu = no\n"
                                   "log_level = debug\n"
                                   "[gpu]\n"
                                   "workspace = 512M\n"
                                   "workspace_max = 2g\n"
                                   "sample_grads_max = 0\n"
                                   "idle_release_s = 0\n"
                                   "[limits]\n"
                                   "max_batch = 512\n"
                                   "max_layers = 8\n"
                                   "max_frame = 65536\n"
                                   "max_buffers = 9\n"
                                   "max_events = 5\n"
                                   "[access]\n"
                                   "allowed_uids = root, 1234\n"
                                   "allowed_groups = 0 root\n"
                                   "[status]\n"
                                   "socket = none\n"
                                   "tcp_port = 9105\n"
                                   "[ledger]\n"
                                   "dir = /var/lib/dpclip/ledger\n"
                                   "delta = 1e-6\n"
                                   "budget_epsilon = 8\n"
                                   "budget_delta = 1e-7\n"
                                   "require_sample_rate = true\n",
                                   "t.conf", &e);
    if (rc) fprintf(stderr, "%s\n", e.msg);
    assert_int_equal(rc, 0);
    assert_string_equal(c.socket, "/run/x/d.sock");
    assert_int_equal(c.socket_mode, 0600);
    assert_string_equal(c.socket_group, "root");
    assert_int_equal(c.workers, 3);
    assert_int_equal(c.blas_threads, 2);
    assert_int_equal(c.spin_us, 0);
    assert_false(c.gpu);
    assert_int_equal(c.log_level, DC_LOG_DEBUG);
    assert_true(c.gpu_workspace == (uint64_t)512 << 20);
    assert_true(c.gpu_workspace_max == (uint64_t)2 << 30);
    assert_true(c.gpu_sample_grads_max == 0);  /* none kept */
    assert_int_equal(c.gpu_idle_release_s, 0); /* never given back */
    assert_int_equal(c.max_batch, 512);
    assert_int_equal(c.max_layers, 8);
    assert_int_equal(c.max_frame, 65536);
    assert_int_equal(c.max_buffers, 9);
    assert_int_equal(c.max_events, 5);
    assert_int_equal(c.n_allowed_uids, 2);
    assert_int_equal(c.allowed_uids[0], 0);
    assert_int_equal(c.allowed_uids[1], 1234);
    assert_int_equal(c.n_allowed_gids, 2);
    assert_int_equal(c.status_port, 9105);
    assert_string_equal(c.ledger_dir, "/var/lib/dpclip/ledger");
    assert_true(c.delta == 1e-6 && c.budget_epsilon == 8 && c.budget_delta == 1e-7);
    assert_true(c.require_sample_rate);
    assert_int_equal(dc_config_validate(&c, &e), 0);
    {
        char st[128];
        dc_config_status_path(&c, st, sizeof st);
        assert_string_equal(st, ""); /* "none": off */
    }
}

/* Each bad file gives an error naming the file, the line and what is wrong. */
static void test_bad_files(void **state) {
    static const struct {
        const char *text, *expect;
    } bad[] = {
        {"[daemon]\nworkers = 2\nbogus = 1\n", "bad.conf:3: unknown key 'bogus' in [daemon]"},
        {"[deamon]\nworkers = 2\n", "bad.conf:2: unknown section [deamon]"},
        {"[daemon]\nworkers = lots\n", "bad.conf:2: daemon.workers: 'lots' is not a whole number"},
        {"[daemon]\nworkers = -1\n", "daemon.workers: '-1'"},
        {"[daemon]\nworkers = 100000\n", "in [0, 256]"},
        {"[daemon]\nsocket_mode = 0999\n", "bad.conf:2: daemon.socket_mode: bad value '0999'"},
        {"[daemon]\ngpu = maybe\n", "expected true or false"},
        {"[daemon]\nlog_level = loud\n", "expected error, warn, info or debug"},
        {"[daemon]\nsocket = relative/path.sock\n", "must be an absolute path"},
        {"[daemon]\nsocket_group = no-such-group-dpclip\n", "no such group 'no-such-group-dpclip'"},
        {"[access]\nallowed_uids = root, no-such-user-dpclip\n",
         "no such user 'no-such-user-dpclip'"},
        {"[ledger]\ndelta = 0\n", "ledger.delta: '0' is not a number"},
        {"[ledger]\ndelta = 1e-5x\n", "ledger.delta: '1e-5x'"},
        {"[ledger]\nbudget_epsilon = nan\n", "budget_epsilon: 'nan'"},
        {"[limits]\nmax_batch = 1\nmax_batch = 2\n", "bad.conf:3: limits.max_batch is set twice"},
        {"[limits]\nmax_batch = 8\nthis line is not ini\n", "bad.conf:3: syntax error"},
        {"[limits\nmax_batch = 8\n", "bad.conf:1: syntax error"},
        {"workers = 2\n", "bad.conf:1: unknown section []"},
        {"[gpu]\nworkspace = 12Q\n", "bad.conf:2: gpu.workspace: bad value '12Q'"},
        {"[gpu]\nworkspace = -5\n", "gpu.workspace: bad value '-5'"},
        {"[gpu]\nworkspace = M\n", "gpu.workspace: bad value 'M'"},
        {"[gpu]\nworkspace_max = 99999999999T\n", "gpu.workspace_max: bad value"},
        {"[gpu]\nworkspace_max = 18446744073709551616\n", "gpu.workspace_max: bad value"},
    };
    (void)state;
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        dc_config c;
        dc_err e;
        dc_config_defaults(&c);
        int rc = dc_config_load_string(&c, bad[i].text, "bad.conf", &e);
        if (rc == 0 || !strstr(e.msg, bad[i].expect)) {
            fprintf(stderr, "case %zu: rc %d, message '%s', expected '%s'\n", i, rc,
                    rc ? e.msg : "", bad[i].expect);
            fail();
        }
    }
}

static void test_cross_checks(void **state) {
    dc_config c;
    dc_err e;
    char st[128];
    (void)state;
    dc_config_defaults(&c);
    /* the status socket is derived from the main one unless given */
    snprintf(c.socket, sizeof c.socket, "/tmp/x/d.sock");
    dc_config_status_path(&c, st, sizeof st);
    assert_string_equal(st, "/tmp/x/d-status.sock");
    snprintf(c.status_socket, sizeof c.status_socket, "/tmp/x/d.sock");
    assert_int_not_equal(dc_config_validate(&c, &e), 0);
    assert_non_null(strstr(e.msg, "must differ"));
    c.status_socket[0] = '\0';
    /* a node budget kept in memory would reset at each restart */
    c.budget_epsilon = 3;
    assert_int_not_equal(dc_config_validate(&c, &e), 0);
    assert_non_null(strstr(e.msg, "needs ledger.dir"));
    snprintf(c.ledger_dir, sizeof c.ledger_dir, "/var/lib/dpclip");
    assert_int_equal(dc_config_validate(&c, &e), 0);
    /* a preallocation over the cap */
    c.gpu_workspace = (uint64_t)1 << 30;
    c.gpu_workspace_max = (uint64_t)1 << 29;
    assert_int_not_equal(dc_config_validate(&c, &e), 0);
    assert_non_null(strstr(e.msg, "gpu.workspace_max"));
    c.gpu_workspace_max = 0; /* no cap */
    assert_int_equal(dc_config_validate(&c, &e), 0);
}

static void test_flags_override_file(void **state) {
    const char *path = write_conf("over.conf", "[daemon]\nworkers = 3\nlog_level = debug\n"
                                               "[gpu]\nworkspace = 1G\nworkspace_max = 4G\n"
                                               "[limits]\nmax_batch = 100\n");
    char *argv[] = {"dpclipd", "--max-batch",       "7",        "--config",        (char *)path,
                    "--set",   "ledger.delta=1e-9", "--no-gpu", "--gpu-workspace", "64m",
                    NULL};
    dc_config c;
    dc_config_action act;
    dc_err e;
    (void)state;
    assert_int_equal(dc_config_from_args(&c, 10, argv, &act, &e), 0);
    assert_int_equal(act, DC_CONFIG_RUN);
    assert_int_equal(c.workers, 3);   /* from the file */
    assert_int_equal(c.max_batch, 7); /* the flag wins, though it came first */
    assert_true(c.delta == 1e-9);
    assert_false(c.gpu);
    assert_true(c.gpu_workspace == (uint64_t)64 << 20);    /* the flag */
    assert_true(c.gpu_workspace_max == (uint64_t)4 << 30); /* the file */
    assert_string_equal(c.config_path, path);
    /* again, as a reload does: same result */
    {
        dc_config c2;
        assert_int_equal(dc_config_from_args(&c2, 10, argv, &act, &e), 0);
        assert_int_equal(dc_config_restart_needed(&c, &c2, NULL, NULL), 0);
        assert_int_equal(c2.max_batch, 7);
    }
}

static void note(void *arg, const char *name) {
    char *buf = arg;
    strcat(buf, name);
    strcat(buf, " ");
}

static void test_restart_needed(void **state) {
    dc_config a, b;
    char names[256] = "";
    (void)state;
    dc_config_defaults(&a);
    b = a;
    b.max_batch = 3; /* reloadable */
    b.log_level = DC_LOG_WARN;
    b.budget_epsilon = 2;
    assert_int_equal(dc_config_restart_needed(&a, &b, note, names), 0);
    b.workers = 5;
    snprintf(b.socket, sizeof b.socket, "/tmp/other.sock");
    assert_int_equal(dc_config_restart_needed(&a, &b, note, names), 2);
    assert_non_null(strstr(names, "daemon.workers"));
    assert_non_null(strstr(names, "daemon.socket"));
    /* the GPU workspace is held from start: SIGHUP cannot change it */
    names[0] = '\0';
    b = a;
    b.gpu_workspace = a.gpu_workspace * 2;
    b.gpu_workspace_max = (uint64_t)8 << 30;
    b.gpu_sample_grads_max = 0;
    b.gpu_idle_release_s = 5; /* reloadable */
    assert_int_equal(dc_config_restart_needed(&a, &b, note, names), 3);
    assert_non_null(strstr(names, "gpu.workspace "));
    assert_non_null(strstr(names, "gpu.workspace_max "));
    assert_non_null(strstr(names, "gpu.sample_grads_max "));
    assert_null(strstr(names, "gpu.idle_release_s"));
}
#endif /* DPCLIP_HAVE_INIH */

static void test_bad_flags(void **state) {
    static char *cases[][4] = {
        {"dpclipd", "--workers", "x", NULL},
        {"dpclipd", "--bogus", NULL, NULL},
        {"dpclipd", "--set", "nodot=1", NULL},
        {"dpclipd", "--set", "daemon.nokey=1", NULL},
        {"dpclipd", "stray", NULL, NULL},
        {"dpclipd", "--config", "/nonexistent/dpclipd.conf", NULL},
        {"dpclipd", "--gpu-workspace", "12Q", NULL},
        {"dpclipd", "--gpu-workspace-max", "-1", NULL},
        {"dpclipd", "--set", "gpu.workspace=17179869184T", NULL},
    };
    static const char *expect[] = {"--workers: daemon.workers: 'x'",
                                   "unknown option",
                                   "SECTION.KEY=VALUE",
                                   "unknown key 'nokey'",
                                   "unexpected argument",
                                   "cannot open",
                                   "gpu.workspace: bad value '12Q'",
                                   "gpu.workspace_max: bad value '-1'",
                                   "gpu.workspace: bad value '17179869184T'"};
    (void)state;
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        dc_config c;
        dc_config_action act;
        dc_err e;
        int argc = 0;
        while (cases[i][argc]) argc++;
        int rc = dc_config_from_args(&c, argc, cases[i], &act, &e);
#ifndef DPCLIP_HAVE_INIH
        if (i == 5) continue;
#endif
        if (rc == 0 || !strstr(e.msg, expect[i])) {
            fprintf(stderr, "case %zu: rc %d '%s', expected '%s'\n", i, rc, rc ? e.msg : "",
                    expect[i]);
            fail();
        }
    }
}

/* Runs dpclipd with args; returns its exit status and its stdout+stderr. */
static int run_daemon(const char *args, char *out, size_t n) {
    char cmd[1024];
    snprintf(cmd, sizeof cmd, "env -u DPCLIP_SOCKET %s %s 2>&1", DPCLIPD_PATH, args);
    int rc = dc_sh(cmd, out, n);
    assert_int_not_equal(rc, DC_SH_NOSTART);
    return rc;
}

static void test_check_config_cli(void **state) {
    char out[16384], args[600];
    (void)state;
#ifdef DPCLIP_HAVE_INIH
    char good[400], bad[400];
    snprintf(good, sizeof good, "%s",
             write_conf("good.conf", "[daemon]\nsocket = /tmp/"
                                     "dpclip-check.sock\nworkers = 2\n[ledger]\ndelta = 1e-6\n"));
    snprintf(bad, sizeof bad, "%s",
             write_conf("bad.conf", "[daemon]\nworkers = 2\n"
                                    "workerz = 3\n"));
    snprintf(args, sizeof args,
             "--config %s --check-config --max-batch 33 --gpu-workspace 1000 "
             "--gpu-workspace-max 1536M",
             good);
    assert_int_equal(run_daemon(args, out, sizeof out), 0);
    /* prints the effective configuration, itself a valid config file */
    assert_non_null(strstr(out, "socket = /tmp/dpclip-check.sock"));
    assert_non_null(strstr(out, "max_batch = 33"));
    assert_non_null(strstr(out, "\ndelta = 1e-06\n")); /* the shortest exact form */
    /* sizes in the largest exact unit; the GPU settings need a restart */
    assert_non_null(strstr(out, "\nworkspace = 1000\n"));
    assert_non_null(strstr(out, "\nworkspace_max = 1536M\n"));
    assert_non_null(strstr(out, "a larger step grows it once (restart to change)\nworkspace ="));
    {
        const char *printed = write_conf("printed.conf", strchr(out, '['));
        dc_config a, b;
        dc_err e;
        dc_config_defaults(&a);
        assert_int_equal(dc_config_load_file(&a, printed, &e), 0);
        dc_config_defaults(&b);
        assert_int_equal(dc_config_load_file(&b, good, &e), 0);
        b.max_batch = 33;
        b.gpu_workspace = 1000;
        b.gpu_workspace_max = (uint64_t)1536 << 20;
        assert_int_equal(dc_config_restart_needed(&a, &b, NULL, NULL), 0);
        assert_true(a.gpu_workspace == 1000 && a.gpu_workspace_max == (uint64_t)1536 << 20);
        assert_int_equal(a.max_batch, 33);
        assert_true(a.delta == b.delta);
    }
    snprintf(args, sizeof args, "--config %s --check-config", bad);
    assert_int_not_equal(run_daemon(args, out, sizeof out), 0);
    assert_non_null(strstr(out, "bad.conf:3: unknown key 'workerz' in [daemon]"));
#endif
    snprintf(args, sizeof args, "--check-config --socket /tmp/x.sock --workers nine");
    assert_int_not_equal(run_daemon(args, out, sizeof out), 0);
    assert_non_null(strstr(out, "--workers: daemon.workers: 'nine'"));
    assert_int_equal(run_daemon("--help", out, sizeof out), 0);
    assert_non_null(strstr(out, "--check-config"));
    assert_non_null(strstr(out, "(limits.max_batch)"));
}

/* gpu.sample_grads_max takes auto (its default: each GPU resolves it), a
 * size or 0; auto prints back as auto, in the listing and in /status's
 * limits (a JSON string there); other sizes do not take auto. */
static void test_size_auto(void **state) {
    dc_config c;
    dc_err e;
    char num[32], *text = NULL;
    size_t len = 0, i = 0;
    const char *section, *key;
    (void)state;
    dc_config_defaults(&c);
    assert_true(c.gpu_sample_grads_max == DC_SAMPLE_GRADS_AUTO);
    assert_int_equal(c.gpu_idle_release_s, 300); /* a shared node gets its memory back */
    while (dc_config_key(i, &section, &key) &&
           !(strcmp(section, "gpu") == 0 && strcmp(key, "sample_grads_max") == 0))
        i++;
    assert_true(dc_config_number(&c, i, num, sizeof num));
    assert_string_equal(num, "\"auto\"");
    FILE *f = open_memstream(&text, &len);
    assert_non_null(f);
    dc_config_print(&c, f);
    fclose(f);
    assert_non_null(strstr(text, "\nsample_grads_max = auto\n"));
    free(text);
    assert_int_equal(dc_config_set(&c, "gpu", "sample_grads_max", "12G", "t", &e), 0);
    assert_true(c.gpu_sample_grads_max == (uint64_t)12 << 30);
    assert_true(dc_config_number(&c, i, num, sizeof num));
    assert_string_equal(num, "12884901888");
    assert_int_equal(dc_config_set(&c, "gpu", "sample_grads_max", "0", "t", &e), 0);
    assert_true(c.gpu_sample_grads_max == 0);
    assert_int_equal(dc_config_set(&c, "gpu", "sample_grads_max", "auto", "t", &e), 0);
    assert_true(c.gpu_sample_grads_max == DC_SAMPLE_GRADS_AUTO);
    /* 2^64 - 1 bytes would read as auto: refused, as are words other than auto */
    assert_int_not_equal(
        dc_config_set(&c, "gpu", "sample_grads_max", "18446744073709551615", "t", &e), 0);
    assert_non_null(strstr(e.msg, "gpu.sample_grads_max: bad value"));
    assert_non_null(strstr(e.msg, "expected auto or bytes"));
    assert_int_not_equal(dc_config_set(&c, "gpu", "sample_grads_max", "automatic", "t", &e), 0);
    assert_true(c.gpu_sample_grads_max == DC_SAMPLE_GRADS_AUTO);
    assert_int_not_equal(dc_config_set(&c, "gpu", "workspace", "auto", "t", &e), 0);
    assert_non_null(strstr(e.msg, "gpu.workspace: bad value 'auto'"));
}

/* An empty file ("--config /dev/null": no config file) sets nothing, with
 * or without inih; a missing one is an error naming it. */
static void test_empty_file(void **state) {
    dc_config c, d;
    dc_err e;
    (void)state;
    dc_config_defaults(&c);
    dc_config_defaults(&d);
    assert_int_equal(dc_config_load_file(&c, "/dev/null", &e), 0);
    memcpy(d.config_path, c.config_path, sizeof d.config_path); /* the file read, if kept */
    assert_memory_equal(&c, &d, sizeof c);
    assert_int_not_equal(dc_config_load_file(&c, "/nonexistent/dpclipd.conf", &e), 0);
    assert_non_null(strstr(e.msg, "/nonexistent/dpclipd.conf"));
}

int main(void) {
    const struct CMUnitTest tests[] = {
#ifdef DPCLIP_HAVE_INIH
        cmocka_unit_test(test_full_file),      cmocka_unit_test(test_bad_files),
        cmocka_unit_test(test_cross_checks),   cmocka_unit_test(test_flags_override_file),
        cmocka_unit_test(test_restart_needed),
#endif
        cmocka_unit_test(test_bad_flags),      cmocka_unit_test(test_check_config_cli),
        cmocka_unit_test(test_empty_file),     cmocka_unit_test(test_size_auto),
    };
#ifndef DPCLIP_HAVE_INIH
    printf("test_config: SKIPPED the config-file cases: built without inih (libinih-dev)\n");
#endif
    return cmocka_run_group_tests(tests, setup, teardown);
}
