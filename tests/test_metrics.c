/* metrics.c and the /metrics text report.c renders from it: the growable
 * string, JSON and Prometheus escaping, histograms (buckets at their
 * bounds, cumulative exposition), error-code names, and a whole rendering
 * from a hand-made snapshot: every counter's sample carries the snapshot's
 * value, and every sample belongs to a family introduced by exactly one
 * # HELP and one # TYPE line. test_status.c covers who sees which series. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "metrics.h"
#include "report.h"
#include "service.h"

static void test_sbuf(void **state) {
    dc_sbuf b = {0};
    char big[600];
    (void)state;
    dc_sbuf_puts(&b, "a");
    dc_sbuf_printf(&b, "%d-%s", 42, "x");
    assert_string_equal(b.p, "a42-x");
    assert_int_equal(b.len, 5);
    /* longer than printf's on-stack buffer, and past the first 1 KiB */
    memset(big, 'z', sizeof big - 1);
    big[sizeof big - 1] = '\0';
    dc_sbuf_printf(&b, "[%s]", big);
    dc_sbuf_printf(&b, "%s", big);
    assert_int_equal(b.len, 5 + 2 + 2 * (sizeof big - 1));
    assert_int_equal(strlen(b.p), b.len);
    assert_true(b.cap > b.len);
    assert_memory_equal(b.p + 5, "[zz", 3);
    assert_int_equal(b.p[5 + 1 + sizeof big - 1], ']');
    assert_false(b.oom);
    dc_sbuf_free(&b);
    assert_null(b.p);
    assert_int_equal(b.len, 0);
}

static void test_json_escaping(void **state) {
    dc_sbuf b = {0};
    (void)state;
    /* quote, backslash, a newline, a control byte and UTF-8 bytes */
    dc_sbuf_json_str(&b, "a\"b\\c\nd\x01\xc3\xa9");
    assert_string_equal(b.p, "\"a\\\"b\\\\c\\u000ad\\u0001\\u00c3\\u00a9\"");
    dc_sbuf_free(&b);
    dc_sbuf_json_num(&b, NAN);
    dc_sbuf_puts(&b, ",");
    dc_sbuf_json_num(&b, -INFINITY);
    dc_sbuf_puts(&b, ",");
    dc_sbuf_json_num(&b, 0.1);
    assert_string_equal(b.p, "null,null,0.10000000000000001");
    assert_true(strtod(b.p + 10, NULL) == 0.1); /* reads back exactly */
    dc_sbuf_free(&b);
}

static void test_prom_escaping(void **state) {
    dc_sbuf b = {0};
    (void)state;
    dc_sbuf_prom_str(&b, "a\"b\\c\nd\x01\xc3");
    /* the format's three escapes; other bytes as \xNN text (an escaped
     * backslash, then xNN) */
    assert_string_equal(b.p, "\"a\\\"b\\\\c\\nd\\\\x01\\\\xc3\"");
    dc_sbuf_free(&b);
    dc_sbuf_prom_num(&b, NAN);
    dc_sbuf_puts(&b, " ");
    dc_sbuf_prom_num(&b, INFINITY);
    dc_sbuf_puts(&b, " ");
    dc_sbuf_prom_num(&b, -INFINITY);
    dc_sbuf_puts(&b, " ");
    dc_sbuf_prom_num(&b, 1.5);
    assert_string_equal(b.p, "NaN +Inf -Inf 1.5");
    dc_sbuf_free(&b);
}

static void test_prom_head(void **state) {
    dc_sbuf b = {0};
    (void)state;
    dc_prom_head(&b, "dpclip_x_total", "counter", "Things done");
    assert_string_equal(b.p, "# HELP dpclip_x_total Things done\n# TYPE dpclip_x_total counter\n");
    dc_sbuf_free(&b);
}

/* "name{labels} value" of text, or NAN. */
static double sample(const char *text, const char *key) { return dc_prom_value(text, key); }

static void test_histogram(void **state) {
    dc_hist h;
    dc_sbuf b = {0};
    char key[128];
    (void)state;
    memset(&h, 0, sizeof h);
    /* a value equal to a bound is in that bucket (le: less or equal) */
    dc_hist_add(&h, dc_hist_bounds[0]);
    dc_hist_add(&h, dc_hist_bounds[0] * 1.01);
    dc_hist_add(&h, 0.003);
    dc_hist_add(&h, 0.003);
    dc_hist_add(&h, 60.0); /* past the last bound: +Inf only */
    assert_int_equal(h.count, 5);
    assert_int_equal(h.bucket[0], 1);
    assert_int_equal(h.bucket[1], 1);
    assert_int_equal(h.bucket[DC_HIST_NB], 1);
    assert_true(fabs(h.sum - (dc_hist_bounds[0] * 2.01 + 0.006 + 60.0)) < 1e-12);

    dc_prom_head(&b, "t_seconds", "histogram", "test");
    dc_prom_hist(&b, "t_seconds", "phase=\"queue\"", &h);
    assert_int_equal(dc_prom_grammar(b.p), 0);
    /* cumulative: every bucket holds all values up to its bound */
    assert_true(sample(b.p, "t_seconds_bucket{phase=\"queue\",le=\"5e-06\"}") == 1);
    assert_true(sample(b.p, "t_seconds_bucket{phase=\"queue\",le=\"1e-05\"}") == 2);
    assert_true(sample(b.p, "t_seconds_bucket{phase=\"queue\",le=\"0.0025\"}") == 2);
    assert_true(sample(b.p, "t_seconds_bucket{phase=\"queue\",le=\"0.005\"}") == 4);
    assert_true(sample(b.p, "t_seconds_bucket{phase=\"queue\",le=\"10\"}") == 4);
    assert_true(sample(b.p, "t_seconds_bucket{phase=\"queue\",le=\"+Inf\"}") == 5);
    assert_true(sample(b.p, "t_seconds_count{phase=\"queue\"}") == 5);
    assert_true(fabs(sample(b.p, "t_seconds_sum{phase=\"queue\"}") - h.sum) < 1e-12);
    /* one line per bound, +Inf, sum and count */
    size_t lines = 0;
    for (const char *p = b.p; *p; p++) lines += *p == '\n';
    assert_int_equal(lines, 2 + DC_HIST_NB + 3);
    dc_sbuf_free(&b);
    /* no labels: no braces on _sum and _count */
    dc_prom_hist(&b, "u_seconds", "", &h);
    assert_true(sample(b.p, "u_seconds_bucket{le=\"+Inf\"}") == 5);
    assert_true(sample(b.p, "u_seconds_count") == 5);
    snprintf(key, sizeof key, "u_seconds_sum");
    assert_false(isnan(sample(b.p, key)));
    dc_sbuf_free(&b);
}

static void test_code_names(void **state) {
    (void)state;
    assert_string_equal(dc_code_name(DC_OK), "ok");
    assert_string_equal(dc_code_name(DC_EINVAL), "invalid_argument");
    assert_string_equal(dc_code_name(DC_ENOSPACE), "resource_exhausted");
    assert_string_equal(dc_code_name(DC_ENONFINITE), "non_finite");
    assert_string_equal(dc_code_name(DC_EUNAVAIL), "unavailable");
    assert_string_equal(dc_code_name(DC_EUNIMPL), "unimplemented");
    assert_string_equal(dc_code_name(DC_CODE_N), "unknown");
    assert_string_equal(dc_code_name(-1), "unknown");
    /* every code below the count has its own name */
    for (int c = 0; c < DC_CODE_N; c++) {
        assert_string_not_equal(dc_code_name(c), "unknown");
        for (int k = 0; k < c; k++) assert_string_not_equal(dc_code_name(c), dc_code_name(k));
    }
}

static void test_error_counts(void **state) {
    dc_metrics m;
    (void)state;
    memset(&m, 0, sizeof m);
    dc_metrics_error(&m, DC_EUNIMPL);
    dc_metrics_error(&m, DC_EINVAL);
    dc_metrics_error(&m, DC_EINVAL);
    /* a code the table has no row for counts as internal, never out of bounds */
    dc_metrics_error(&m, DC_CODE_N);
    dc_metrics_error(&m, -3);
    assert_int_equal(m.errors[DC_EUNIMPL], 1);
    assert_int_equal(m.errors[DC_EINVAL], 2);
    assert_int_equal(m.errors[DC_EINTERNAL], 2);
    assert_int_equal(sizeof m.errors / sizeof m.errors[0], DC_CODE_N);
}

/* --- the whole /metrics text ------------------------------------------------------- */

/* Checks the exposition's structure: each family has exactly one # HELP
 * and one # TYPE line, HELP first, before its samples; every sample
 * belongs to the family declared last (a histogram's by its _bucket, _sum
 * and _count suffixes). Returns the number of families. */
static int check_families(const char *text) {
    char family[128] = "", type[32] = "";
    char seen[128][128];
    int n = 0;
    for (const char *line = text; *line;) {
        const char *nl = strchr(line, '\n');
        char one[1024], name[128];
        assert_non_null(nl);
        snprintf(one, sizeof one, "%.*s", (int)(nl - line), line);
        if (strncmp(one, "# HELP ", 7) == 0) {
            assert_int_equal(sscanf(one + 7, "%127s", name), 1);
            for (int i = 0; i < n; i++) assert_string_not_equal(seen[i], name);
            assert_true(n < 128);
            snprintf(seen[n++], sizeof seen[0], "%s", name);
            snprintf(family, sizeof family, "%s", name);
            type[0] = '\0';
            assert_true(strlen(one) > 7 + strlen(name) + 1); /* a help text */
        } else if (strncmp(one, "# TYPE ", 7) == 0) {
            assert_int_equal(sscanf(one + 7, "%127s %31s", name, type), 2);
            assert_string_equal(name, family); /* right after its HELP */
        } else {
            size_t k = strcspn(one, "{ ");
            snprintf(name, sizeof name, "%.*s", (int)k, one);
            assert_true(type[0] != '\0');
            if (strcmp(type, "histogram") == 0) {
                size_t f = strlen(family);
                assert_memory_equal(name, family, f);
                assert_true(strcmp(name + f, "_bucket") == 0 || strcmp(name + f, "_sum") == 0 ||
                            strcmp(name + f, "_count") == 0);
            } else {
                assert_string_equal(name, family);
            }
        }
        line = nl + 1;
    }
    return n;
}

/* A snapshot with a distinct value in every counter. */
static void fake_report(dc_report *r, dc_report_account *accounts) {
    dc_metrics *m = &r->metrics;
    memset(r, 0, sizeof *r);
    memset(accounts, 0, 2 * sizeof *accounts);
    r->pid = 1;
    r->daemon_uid = 999;
    r->ops_gid = -1;
    r->log_level = "info";
    r->uptime_s = 12.5;
    r->n_gpus = DC_MAX_GPUS;
    r->gpu_busy[1] = 3;
    r->gpu_busy[DC_MAX_GPUS - 1] = 5;
    r->gpu_workspace[0] = 1u << 20;
    r->cpu_busy = 2;
    r->n_sessions = 4;
    r->busy_sessions = 1;
    r->buffers = 9;
    r->buffer_bytes = 4096;
    for (int i = 0; i < DC_REQ_N; i++) m->requests[i] = 100 + (uint64_t)i;
    for (int i = 0; i < DC_CODE_N; i++) m->errors[i] = 200 + (uint64_t)i;
    m->steps_ok = 11;
    m->steps_failed = 12;
    m->layers = 13;
    m->samples = 14;
    m->bytes_referenced = 15;
    m->sessions_total = 16;
    m->sessions_refused = 17;
    m->budget_refusals = 18;
    m->ledger_writes = 19;
    m->ledger_write_errors = 20;
    m->reloads = 21;
    m->reload_errors = 22;
    m->compute_ns = 2500000000u;
    for (int i = 0; i < DC_PH_N; i++)
        for (int k = 0; k <= i; k++) dc_hist_add(&m->phase[i], 1e-3);
    dc_hist_add(&m->step, 0.02);
    r->groups_formed = 31;
    r->groups_dissolved = 32;
    r->group_reductions = 33;
    r->group_timeouts = 34;
    r->group_exchanges = 35;
    r->group_link_failures = 36;
    r->group_exchanges_polled = 38;
    r->group_fused = 37;
    r->accounts = accounts;
    r->n_accounts = 2;
    for (int i = 0; i < 2; i++) {
        accounts[i].uid = 1000 + (uint32_t)i;
        snprintf(accounts[i].job_id, sizeof accounts[i].job_id, "job-%d", i);
        accounts[i].steps = 40 + (uint64_t)i;
        accounts[i].eps = 1.25 + i;
        accounts[i].delta = 1e-5;
    }
    accounts[1].budget_eps = 8;
}

static void test_metrics_text(void **state) {
    dc_report r;
    dc_report_account accounts[2];
    dc_sbuf b = {0};
    char key[160];
    (void)state;
    fake_report(&r, accounts);
    dc_report_metrics(&r, DC_VIEW_ALL, 0, &b);
    assert_non_null(b.p);
    assert_int_equal(dc_prom_grammar(b.p), 0);
    assert_true(check_families(b.p) >= 30);

    /* every counter carries its own value */
    static const struct {
        const char *key;
        double v;
    } want[] = {
        {"dpclip_steps_total{result=\"ok\"}", 11},
        {"dpclip_steps_total{result=\"failed\"}", 12},
        {"dpclip_layers_total", 13},
        {"dpclip_samples_total", 14},
        {"dpclip_bytes_referenced_total", 15},
        {"dpclip_sessions_total", 16},
        {"dpclip_sessions_refused_total", 17},
        {"dpclip_budget_refusals_total", 18},
        {"dpclip_ledger_writes_total{result=\"ok\"}", 19},
        {"dpclip_ledger_writes_total{result=\"error\"}", 20},
        {"dpclip_reloads_total{result=\"ok\"}", 21},
        {"dpclip_reloads_total{result=\"error\"}", 22},
        {"dpclip_compute_seconds_total", 2.5},
        {"dpclip_norm_groups_formed_total", 31},
        {"dpclip_norm_groups_dissolved_total", 32},
        {"dpclip_norm_group_reductions_total", 33},
        {"dpclip_norm_group_timeouts_total", 34},
        {"dpclip_norm_group_exchanges_total", 35},
        {"dpclip_norm_group_link_failures_total", 36},
        {"dpclip_norm_group_exchanges_polled_total", 38},
        {"dpclip_norm_group_fused_total", 37},
        {"dpclip_uptime_seconds", 12.5},
        {"dpclip_sessions", 4},
        {"dpclip_steps_in_flight", 1},
        {"dpclip_buffers", 9},
        {"dpclip_buffer_bytes", 4096},
        {"dpclip_queue_depth{pool=\"cpu\"}", 2},
        {"dpclip_queue_depth{pool=\"cuda:1\"}", 3},
        {"dpclip_gpu_workspace_bytes{device=\"0\"}", 1u << 20},
        {"dpclip_ledger_jobs", 2},
        {"dpclip_insecure", 0},
        {"dpclip_job_steps{uid=\"1001\",job=\"job-1\"}", 41},
        {"dpclip_job_epsilon{uid=\"1000\",job=\"job-0\"}", 1.25},
        {"dpclip_job_budget_epsilon{uid=\"1001\",job=\"job-1\"}", 8},
    };
    for (size_t i = 0; i < sizeof want / sizeof want[0]; i++) {
        double got = sample(b.p, want[i].key);
        if (got != want[i].v) fprintf(stderr, "%s: %g, want %g\n", want[i].key, got, want[i].v);
        assert_true(got == want[i].v);
    }
    /* the last GPU the daemon can serve is shown */
    snprintf(key, sizeof key, "dpclip_queue_depth{pool=\"cuda:%d\"}", DC_MAX_GPUS - 1);
    assert_true(sample(b.p, key) == 5);
    /* a job without a budget has no budget sample */
    assert_true(isnan(sample(b.p, "dpclip_job_budget_epsilon{uid=\"1000\",job=\"job-0\"}")));
    /* requests by type and errors by code (not "ok"), each its own count */
    for (int i = 0; i < DC_REQ_N; i++) {
        snprintf(key, sizeof key, "dpclip_requests_total{type=\"%s\"}", dc_req_names[i]);
        assert_true(sample(b.p, key) == 100 + i);
    }
    assert_null(strstr(b.p, "code=\"ok\""));
    for (int c = DC_EINVAL; c < DC_CODE_N; c++) {
        snprintf(key, sizeof key, "dpclip_errors_total{code=\"%s\"}", dc_code_name(c));
        assert_true(sample(b.p, key) == 200 + c);
    }
    /* each phase's histogram under its own label */
    for (int i = 0; i < DC_PH_N; i++) {
        snprintf(key, sizeof key, "dpclip_step_phase_seconds_count{phase=\"%s\"}",
                 dc_phase_names[i]);
        assert_true(sample(b.p, key) == i + 1);
    }
    assert_true(sample(b.p, "dpclip_step_seconds_bucket{le=\"0.025\"}") == 1);
    assert_true(sample(b.p, "dpclip_step_seconds_bucket{le=\"0.01\"}") == 0);
    /* help and type of a few families, as Prometheus shows them */
    assert_non_null(strstr(b.p, "# TYPE dpclip_steps_total counter\n"));
    assert_non_null(strstr(b.p, "# TYPE dpclip_sessions gauge\n"));
    assert_non_null(strstr(b.p, "# TYPE dpclip_step_phase_seconds histogram\n"));
    assert_non_null(strstr(b.p, "# HELP dpclip_budget_refusals_total Steps refused by a "
                                "privacy budget\n"));
    /* refusals are counted at accept (the connection limit, or no file
     * descriptor left) and at Hello ([access]): the help says all three */
    {
        const char *h = strstr(b.p, "# HELP dpclip_sessions_refused_total ");
        const char *nl = h ? strchr(h, '\n') : NULL;
        char help[512];
        assert_non_null(nl);
        snprintf(help, sizeof help, "%.*s", (int)(nl - h), h);
        assert_non_null(strstr(help, "limits.max_connections"));
        assert_non_null(strstr(help, "file descriptors"));
        assert_non_null(strstr(help, "[access]"));
    }
    dc_sbuf_free(&b);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_sbuf),          cmocka_unit_test(test_json_escaping),
        cmocka_unit_test(test_prom_escaping), cmocka_unit_test(test_prom_head),
        cmocka_unit_test(test_histogram),     cmocka_unit_test(test_code_names),
        cmocka_unit_test(test_error_counts),  cmocka_unit_test(test_metrics_text),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
