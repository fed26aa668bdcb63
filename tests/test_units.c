/* What `cmake --install` ships for running dpclipd under systemd: the units
 * pass `systemd-analyze verify` (where systemd-analyze exists; the test
 * says so when it does not), the service's hardening scores as systemd's
 * own `security` audit rates it, the install puts every file where systemd
 * and the docs say, and the shipped default config passes --check-config. */
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

#if !defined(DPCLIP_UNIT_DIR) || !defined(DPCLIP_CMAKE_COMMAND)
#error "the unit paths are defined by the top-level CMakeLists.txt"
#endif

static const char *k_units[] = {"dpclipd.service", "dpclipd.socket", "dpclipd-status.socket",
                                "dpclip-mps.service"};
static char g_tmp[300];

static int setup(void **state) {
    (void)state;
    snprintf(g_tmp, sizeof g_tmp, "%s/dpclip-units.XXXXXX",
             getenv("TMPDIR") && getenv("TMPDIR")[0] ? getenv("TMPDIR") : "/tmp");
    return mkdtemp(g_tmp) ? 0 : -1;
}

static int teardown(void **state) {
    char cmd[400];
    (void)state;
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", g_tmp);
    return system(cmd) == 0 ? 0 : -1;
}

/* Runs a shell command; its exit status, output (both streams) in out. */
static int sh(const char *cmd, char *out, size_t n) {
    int rc = dc_sh(cmd, out, n);
    assert_int_not_equal(rc, DC_SH_NOSTART);
    return rc;
}

static int have_analyze(void) { return system("command -v systemd-analyze >/dev/null 2>&1") == 0; }

/* The configured units, with the binaries they name pointed at this build
 * (the installed paths do not exist on a build machine; verify checks that
 * every ExecStart= is executable). */
static void stage_units(const char *dir) {
    char cmd[2048];
    snprintf(cmd, sizeof cmd, "mkdir -p '%s'", dir);
    assert_int_equal(system(cmd), 0);
    for (size_t i = 0; i < sizeof k_units / sizeof k_units[0]; i++) {
        snprintf(cmd, sizeof cmd, "sed -e 's|%s/dpclipd|%s|g' -e 's|%s|%s|g' '%s/%s' > '%s/%s'",
                 DPCLIP_INSTALL_SBINDIR, DPCLIPD_PATH, DPCLIP_MPS_CONTROL,
                 access(DPCLIP_MPS_CONTROL, X_OK) == 0 ? DPCLIP_MPS_CONTROL : "/bin/true",
                 DPCLIP_UNIT_DIR, k_units[i], dir, k_units[i]);
        assert_int_equal(system(cmd), 0);
    }
}

static void test_units_verify(void **state) {
    char dir[400], cmd[1200], out[16384];
    int rc;
    (void)state;
    if (!have_analyze()) {
        printf("test_units: SKIPPED: systemd-analyze is not installed\n");
        skip();
    }
    snprintf(dir, sizeof dir, "%s/units", g_tmp);
    stage_units(dir);
    snprintf(cmd, sizeof cmd,
             "cd '%s' && systemd-analyze verify dpclipd.service dpclipd.socket "
             "dpclipd-status.socket dpclip-mps.service 2>&1",
             dir);
    rc = sh(cmd, out, sizeof out);
    if (rc != 0 || out[0]) fprintf(stderr, "systemd-analyze verify (rc %d):\n%s", rc, out);
    assert_int_equal(rc, 0);
    /* not even a warning */
    assert_string_equal(out, "");
    printf("test_units: systemd-analyze verify: 4 units clean\n");
}

static void test_service_hardening(void **state) {
    char dir[400], cmd[1200], out[65536], *line;
    double level = 99;
    (void)state;
    if (!have_analyze()) {
        printf("test_units: SKIPPED: systemd-analyze is not installed\n");
        skip();
    }
    snprintf(dir, sizeof dir, "%s/units-sec", g_tmp);
    stage_units(dir);
    snprintf(cmd, sizeof cmd,
             "cd '%s' && systemd-analyze security --offline=yes ./dpclipd.service 2>&1", dir);
    if (sh(cmd, out, sizeof out) != 0 && !strstr(out, "Overall exposure level")) {
        printf("test_units: systemd-analyze security --offline is not supported here: %.200s\n",
               out);
        skip();
    }
    line = strstr(out, "Overall exposure level for dpclipd.service:");
    assert_non_null(line);
    assert_int_equal(sscanf(line, "Overall exposure level for dpclipd.service: %lf", &level), 1);
    printf("test_units: systemd's exposure level for dpclipd.service: %.1f (0 best, 10 worst)\n",
           level);
    /* systemd calls < 5 "OK"; what is left is what the GPUs need (devices,
     * W+X memory for the CUDA JIT) and the network families of the status
     * port. */
    assert_true(level < 5.0);
    /* the settings the issue asks for are there */
    {
        static const char *want[] = {"NoNewPrivileges=yes",   "ProtectSystem=strict",
                                     "ProtectHome=yes",       "CapabilityBoundingSet=\n",
                                     "Type=notify",           "WatchdogSec=",
                                     "Restart=on-failure",    "RuntimeDirectory=dpclip",
                                     "StateDirectory=dpclip", "User=dpclip"};
        char path[500];
        FILE *f;
        size_t n;
        snprintf(path, sizeof path, "%s/dpclipd.service", DPCLIP_UNIT_DIR);
        f = fopen(path, "r");
        assert_non_null(f);
        n = fread(out, 1, sizeof out - 1, f);
        out[n] = '\0';
        fclose(f);
        for (size_t i = 0; i < sizeof want / sizeof want[0]; i++) {
            if (!strstr(out, want[i])) fprintf(stderr, "dpclipd.service lacks %s\n", want[i]);
            assert_non_null(strstr(out, want[i]));
        }
    }
}

static void test_install_layout(void **state) {
    char root[400], cmd[2400], out[16384], path[800], conf[600], units[600];
    struct stat st;
    (void)state;
    /* DESTDIR: every path as configured, under a scratch root. */
    snprintf(root, sizeof root, "%s/destdir", g_tmp);
    snprintf(cmd, sizeof cmd, "DESTDIR='%s' '%s' --install '%s' 2>&1", root, DPCLIP_CMAKE_COMMAND,
             DPCLIP_BINARY_DIR);
    if (sh(cmd, out, sizeof out) != 0) {
        fprintf(stderr, "cmake --install failed:\n%s", out);
        fail();
    }
    snprintf(conf, sizeof conf, "%s%s/dpclip/dpclipd.conf", root, DPCLIP_INSTALL_SYSCONFDIR);
    snprintf(units, sizeof units, "%s%s", root, DPCLIP_INSTALL_UNITDIR);
    {
        const char *files[] = {"dpclipd.service", "dpclipd.socket", "dpclipd-status.socket",
                               "dpclip-mps.service"};
        for (size_t i = 0; i < 4; i++) {
            snprintf(path, sizeof path, "%s/%s", units, files[i]);
            if (stat(path, &st) != 0) fprintf(stderr, "not installed: %s\n", path);
            assert_int_equal(stat(path, &st), 0);
        }
    }
    {
        const char *files[] = {"/sbin/dpclipd", "/lib/sysusers.d/dpclip.conf",
                               "/lib/tmpfiles.d/dpclip.conf", "/include/dpclip.h"};
        for (size_t i = 0; i < 4; i++) {
            snprintf(path, sizeof path, "%s%s%s", root, DPCLIP_INSTALL_PREFIX, files[i]);
            if (stat(path, &st) != 0) fprintf(stderr, "not installed: %s\n", path);
            assert_int_equal(stat(path, &st), 0);
        }
    }
    assert_int_equal(stat(conf, &st), 0);
    /* every page the installed README names (docs/NAME.md), beside it */
    static const char *pages[] = {"README.md", "docs/operations.md", "docs/design.md",
                                  "docs/groups.md", "docs/fuzzing.md"};
    for (size_t i = 0; i < sizeof pages / sizeof pages[0]; i++) {
        snprintf(path, sizeof path, "%s%s/%s", root, DPCLIP_INSTALL_DOCDIR, pages[i]);
        if (stat(path, &st) != 0) fprintf(stderr, "not installed: %s\n", path);
        assert_int_equal(stat(path, &st), 0);
    }
#ifdef DPCLIPCTL_PATH
    snprintf(path, sizeof path, "%s%s/bin/dpclipctl", root, DPCLIP_INSTALL_PREFIX);
    assert_int_equal(stat(path, &st), 0);
#endif
    /* The unit starts the binary where it was installed, with that config. */
    snprintf(cmd, sizeof cmd, "grep -h '^ExecStart=' '%s/dpclipd.service'", units);
    assert_int_equal(sh(cmd, out, sizeof out), 0);
    snprintf(path, sizeof path, "ExecStart=%s/dpclipd --config %s/dpclip/dpclipd.conf\n",
             DPCLIP_INSTALL_SBINDIR, DPCLIP_INSTALL_SYSCONFDIR);
    assert_string_equal(out, path);
    /* The shipped config is valid as it is. */
#ifdef DPCLIP_HAVE_INIH
    snprintf(cmd, sizeof cmd, "'%s' --config '%s' --check-config 2>&1", DPCLIPD_PATH, conf);
    if (sh(cmd, out, sizeof out) != 0) fprintf(stderr, "%s", out);
    assert_int_equal(sh(cmd, out, sizeof out), 0);
    assert_non_null(strstr(out, "dir = /var/lib/dpclip/ledger"));
    /* ... and names the same sockets as the socket units */
    assert_non_null(strstr(out, "socket = /run/dpclip/dpclipd.sock"));
    assert_non_null(strstr(out, "socket = /run/dpclip/dpclipd-status.sock"));
    snprintf(cmd, sizeof cmd,
             "grep -h '^ListenStream=' '%s/dpclipd.socket' "
             "'%s/dpclipd-status.socket'",
             units, units);
    assert_int_equal(sh(cmd, out, sizeof out), 0);
    assert_string_equal(out, "ListenStream=/run/dpclip/dpclipd.sock\n"
                             "ListenStream=/run/dpclip/dpclipd-status.sock\n");
#endif
    /* sysusers.d snippet, as systemd-sysusers reads it (where it exists) */
    if (system("command -v systemd-sysusers >/dev/null 2>&1") == 0) {
        snprintf(cmd, sizeof cmd,
                 "systemd-sysusers --dry-run --root='%s/root' "
                 "'%s%s/lib/sysusers.d/dpclip.conf' 2>&1",
                 g_tmp, root, DPCLIP_INSTALL_PREFIX);
        snprintf(path, sizeof path, "mkdir -p '%s/root/etc'", g_tmp);
        assert_int_equal(system(path), 0);
        if (sh(cmd, out, sizeof out) != 0) fprintf(stderr, "systemd-sysusers: %s", out);
        assert_int_equal(sh(cmd, out, sizeof out), 0);
        assert_non_null(strstr(out, "dpclip"));
    } else {
        printf("test_units: systemd-sysusers not installed: sysusers.d snippet not checked\n");
    }
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_units_verify),
        cmocka_unit_test(test_service_hardening),
        cmocka_unit_test(test_install_layout),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
