/* daemon/privacy/ledger_store.c: an account's ledger state made durable off
 * the loop. In memory a waiter is answered at once; on disk it is answered
 * only once a write holding its generation is in the file (the loop runs
 * meanwhile), changes made during a write go out in the next one, writes and
 * failures are counted in the metrics, and a failed write reaches every
 * waiter with the error. Each test gets its own directory. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "ledger.h"
#include "metrics.h"

static char g_dir[256];

static int setup(void **state) {
    (void)state;
    snprintf(g_dir, sizeof g_dir, "%s/dpclip-ledger-store.XXXXXX",
             getenv("TMPDIR") && getenv("TMPDIR")[0] ? getenv("TMPDIR") : "/tmp");
    return mkdtemp(g_dir) ? 0 : -1;
}

static int teardown(void **state) {
    char cmd[600];
    (void)state;
    snprintf(cmd, sizeof cmd, "rm -rf '%s' '%s.moved'", g_dir, g_dir);
    return system(cmd) == 0 ? 0 : -1;
}

typedef struct waited {
    dc_ledger_waiter w;
    int calls, rc;
    char msg[384];
} waited;

static void on_done(dc_ledger_waiter *w, int rc, const dc_err *err) {
    waited *x = (waited *)w;
    x->calls++;
    x->rc = rc;
    snprintf(x->msg, sizeof x->msg, "%s", err ? err->msg : "");
}

static void waiter(waited *x, const dc_ledger_account *acct) {
    memset(x, 0, sizeof *x);
    x->w.gen = acct->gen;
    x->w.done = on_done;
}

/* The file's contents (malloc'd). */
static char *slurp(const char *path) {
    FILE *f = fopen(path, "r");
    char *buf = calloc(1, 4096);
    assert_non_null(f);
    assert_non_null(buf);
    assert_true(fread(buf, 1, 4095, f) > 0);
    fclose(f);
    return buf;
}

static void test_in_memory(void **state) {
    dc_ledger l;
    dc_ledger_account *acct;
    dc_metrics m;
    waited a;
    dc_err e;
    (void)state;

    memset(&m, 0, sizeof m);
    assert_int_equal(dc_ledger_open(&l, "", 1e-5, &e), 0);
    dc_ledger_store_init(&l, uv_default_loop(), &m);
    acct = dc_ledger_account_get(&l, 1000, "mem");
    assert_int_equal(dc_ledger_spend(&l, acct, 0.01, 1.0, &e), 0);
    waiter(&a, acct);
    dc_ledger_persist(acct, &a.w);
    /* nothing to write: answered within the call */
    assert_int_equal(a.calls, 1);
    assert_int_equal(a.rc, 0);
    assert_true(acct->saved_gen == acct->gen);
    assert_int_equal(m.ledger_writes, 0);
    assert_int_equal(l.writes_in_flight, 0);
    dc_ledger_close(&l);
}

static void test_on_disk(void **state) {
    uv_loop_t loop;
    dc_ledger l;
    dc_ledger_account *acct;
    dc_metrics m;
    waited a, b, c;
    dc_err e;
    char path[600], *want, *got;
    (void)state;

    memset(&m, 0, sizeof m);
    assert_int_equal(uv_loop_init(&loop), 0);
    assert_int_equal(dc_ledger_open(&l, g_dir, 1e-5, &e), 0);
    dc_ledger_store_init(&l, &loop, &m);
    acct = dc_ledger_account_get(&l, 1000, "disk");
    assert_int_equal(dc_ledger_spend(&l, acct, 0.01, 1.0, &e), 0);
    waiter(&a, acct);
    dc_ledger_persist(acct, &a.w);
    /* the write runs on libuv's pool: the waiter is answered on the loop */
    assert_int_equal(a.calls, 0);
    assert_int_equal(l.writes_in_flight, 1);
    assert_true(acct->writing);

    /* a change during the write goes out in the next one */
    assert_int_equal(dc_ledger_spend(&l, acct, 0.01, 1.0, &e), 0);
    waiter(&b, acct);
    dc_ledger_persist(acct, &b.w);
    assert_int_equal(l.writes_in_flight, 1);
    assert_int_equal(uv_run(&loop, UV_RUN_DEFAULT), 0);
    assert_int_equal(a.calls, 1);
    assert_int_equal(a.rc, 0);
    assert_int_equal(b.calls, 1);
    assert_int_equal(b.rc, 0);
    assert_true(acct->saved_gen == acct->gen);
    assert_false(acct->writing);
    assert_int_equal(l.writes_in_flight, 0);
    assert_int_equal(m.ledger_writes, 2);
    assert_int_equal(m.ledger_write_errors, 0);
    assert_int_equal(m.ledger_write.count, 2);

    /* the file holds the account as it is now */
    dc_ledger_account_path(&l, acct, path, sizeof path);
    got = slurp(path);
    assert_int_equal(dc_ledger_serialize(acct, &want, &(size_t){0}), 0);
    assert_string_equal(got, want);
    free(got);
    free(want);

    /* nothing changed since: answered at once, no write */
    waiter(&c, acct);
    dc_ledger_persist(acct, &c.w);
    assert_int_equal(c.calls, 1);
    assert_int_equal(c.rc, 0);
    assert_int_equal(l.writes_in_flight, 0);
    dc_ledger_close(&l);
    assert_int_equal(uv_loop_close(&loop), 0);
}

static void test_write_fails(void **state) {
    uv_loop_t loop;
    dc_ledger l;
    dc_ledger_account *acct;
    dc_metrics m;
    waited a;
    dc_err e;
    char moved[300];
    (void)state;

    memset(&m, 0, sizeof m);
    assert_int_equal(uv_loop_init(&loop), 0);
    assert_int_equal(dc_ledger_open(&l, g_dir, 1e-5, &e), 0);
    dc_ledger_store_init(&l, &loop, &m);
    acct = dc_ledger_account_get(&l, 1000, "gone");
    assert_int_equal(dc_ledger_spend(&l, acct, 0.01, 1.0, &e), 0);
    /* the directory is no longer where the ledger writes */
    snprintf(moved, sizeof moved, "%s.moved", g_dir);
    assert_int_equal(rename(g_dir, moved), 0);
    waiter(&a, acct);
    dc_ledger_persist(acct, &a.w);
    assert_int_equal(uv_run(&loop, UV_RUN_DEFAULT), 0);
    assert_int_equal(a.calls, 1);
    assert_int_not_equal(a.rc, 0);
    assert_true(strlen(a.msg) > 0);
    assert_true(acct->saved_gen < acct->gen);
    assert_int_equal(m.ledger_writes, 0);
    assert_int_equal(m.ledger_write_errors, 1);
    assert_int_equal(l.writes_in_flight, 0);
    assert_int_equal(rename(moved, g_dir), 0);
    dc_ledger_close(&l);
    assert_int_equal(uv_loop_close(&loop), 0);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_in_memory, setup, teardown),
        cmocka_unit_test_setup_teardown(test_on_disk, setup, teardown),
        cmocka_unit_test_setup_teardown(test_write_fails, setup, teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
