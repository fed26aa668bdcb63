/* The status endpoint of a real dpclipd: /status JSON (checked against what
 * the test did and against the accountant), /metrics through a real
 * Prometheus parser (prometheus_client's, via python3, when installed; else
 * a strict line grammar check, and the test says which), HTTP errors, an
 * answer within 50 ms while 8 clients run steps, slow connections that
 * neither lock others out nor stay forever, what each caller may see (the
 * renderer on hand-made snapshots, and a real caller of another uid when
 * run as root), Hellos that leave no account behind, the insecure mark, and
 * dpclipctl's tables. */
#include <errno.h>
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
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmocka.h>

#include "accountant.h"
#include "harness.h"
#include "report.h"
#include "service.h"

/* Whatever dpclip config is installed on this machine stays out. */
#ifdef DPCLIP_HAVE_INIH
#define NO_SYSTEM_CONFIG "--config /dev/null "
#else
#define NO_SYSTEM_CONFIG ""
#endif

#ifdef DPCLIP_HAVE_JANSSON
#include <jansson.h>
#endif

static dc_harness g_h;
static char g_status[400], g_ledger[300];

static int group_setup(void **state) {
    char args[600];
    (void)state;
    snprintf(g_ledger, sizeof g_ledger, "%s/dpclip-status-ledger.XXXXXX",
             getenv("TMPDIR") && getenv("TMPDIR")[0] ? getenv("TMPDIR") : "/tmp");
    if (!mkdtemp(g_ledger)) return -1;
    /* status.timeout_s: short, for test_idle_connection_closed; a status
     * socket any user can open, for test_own_view. */
    snprintf(args, sizeof args,
             NO_SYSTEM_CONFIG "--workers 2 --ledger-dir %s "
                              "--set status.timeout_s=1 --set status.socket_mode=0666",
             g_ledger);
    if (dc_harness_start(&g_h, args)) return -1;
    dc_harness_status_path(&g_h, g_status, sizeof g_status);
    return 0;
}

static int group_teardown(void **state) {
    char cmd[400];
    (void)state;
    if (g_h.pid) dc_harness_stop(&g_h);
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", g_ledger);
    return system(cmd) == 0 ? 0 : -1;
}

static dpclip_client *connect_job(const char *job) {
    dpclip_client *c = NULL;
    dpclip_connect_opts o = {.client_name = "status-test", .job_id = job};
    int rc = dpclip_connect(g_h.sock, &o, &c);
    if (rc) fprintf(stderr, "connect: %s\n", dpclip_errmsg(c));
    assert_int_equal(rc, 0);
    return c;
}

static double accountant_eps(double q, double sigma, double steps, double delta) {
    double rdp[DC_RDP_N_ORDERS];
    dc_rdp_steps(q, sigma, dc_rdp_default_orders(), DC_RDP_N_ORDERS, rdp);
    for (int k = 0; k < DC_RDP_N_ORDERS; k++) rdp[k] *= steps;
    return dc_rdp_epsilon(dc_rdp_default_orders(), rdp, DC_RDP_N_ORDERS, delta, NULL);
}

/* Runs n steps of (q, sigma = 1.0) in job `job`; returns the last epsilon. */
static double run_steps(dpclip_client *c, int n, double q, uint64_t seed) {
    dc_shm_step s;
    dpclip_result res;
    double eps = NAN;
    assert_int_equal(dc_service_step_init(&s, c, 8, 1.0f, q, seed), 0);
    for (int i = 0; i < n; i++) {
        int rc = dpclip_run(c, s.step, &res);
        if (rc) fprintf(stderr, "run: %s\n", dpclip_errmsg(c));
        assert_int_equal(rc, 0);
        eps = res.epsilon;
        assert_true(res.delta == 1e-5);
        dpclip_result_free(&res);
    }
    dc_shm_step_free(&s);
    return eps;
}

static const int k_steps = 12;
static const double k_q = 0.02;

static void test_status_json(void **state) {
    dpclip_client *c = connect_job("status-json");
    double eps = run_steps(c, k_steps, k_q, 1);
    char *body = NULL, *head = NULL;
    int code;
    (void)state;

    /* the reply's epsilon is the accountant's for this many steps */
    assert_true(fabs(eps - accountant_eps(k_q, 1.0, k_steps, 1e-5)) <= 1e-9 * eps);
    code = dc_http(g_status, "GET", "/status", 5000, &head, &body, NULL);
    assert_int_equal(code, 200);
    assert_non_null(strstr(head, "Content-Type: application/json"));
#ifdef DPCLIP_HAVE_JANSSON
    {
        json_error_t je;
        json_t *root = json_loads(body, 0, &je), *s, *j, *found_s = NULL, *found_j = NULL;
        size_t i;
        if (!root) fprintf(stderr, "/status: %s at line %d\n", je.text, je.line);
        assert_non_null(root);
        assert_string_equal(json_string_value(
                                json_object_get(json_object_get(root, "daemon"), "version")),
                            DPCLIP_VERSION);
        json_array_foreach(json_object_get(root, "sessions"), i,
                           s) if (strcmp(json_string_value(json_object_get(s, "job")),
                                         "status-json") == 0) found_s = s;
        assert_non_null(found_s);
        assert_int_equal(json_integer_value(json_object_get(found_s, "pid")), getpid());
        assert_int_equal(json_integer_value(json_object_get(found_s, "uid")), getuid());
        assert_int_equal(json_integer_value(json_object_get(found_s, "steps")), k_steps);
        /* run_steps released its buffer again */
        assert_int_equal(json_integer_value(json_object_get(found_s, "buffers")), 0);
        json_array_foreach(json_object_get(json_object_get(root, "ledger"), "jobs"), i,
                           j) if (strcmp(json_string_value(json_object_get(j, "job")),
                                         "status-json") == 0) found_j = j;
        assert_non_null(found_j);
        assert_int_equal(json_integer_value(json_object_get(found_j, "steps")), k_steps);
        assert_int_equal(json_integer_value(json_object_get(found_j, "uid")), getuid());
        assert_true(json_real_value(json_object_get(found_j, "epsilon")) == eps);
        assert_true(json_is_true(json_object_get(found_j, "on_disk")));
        assert_true(json_is_true(json_object_get(json_object_get(root, "ledger"), "persistent")));
        json_decref(root);
    }
    /* groups: the sessions of one job (uid + job id) */
    {
        dpclip_client *c2 = connect_job("status-json"), *c3 = connect_job("status-other");
        json_error_t je;
        json_t *root, *g, *found = NULL, *other = NULL;
        size_t i;
        run_steps(c2, 2, k_q, 3);
        free(body);
        body = NULL;
        assert_int_equal(dc_http(g_status, "GET", "/status", 5000, NULL, &body, NULL), 200);
        root = json_loads(body, 0, &je);
        assert_non_null(root);
        json_array_foreach(json_object_get(root, "groups"), i, g) {
            if (strcmp(json_string_value(json_object_get(g, "job")), "status-json") == 0) {
                assert_null(found); /* one group per job */
                found = g;
            }
            if (strcmp(json_string_value(json_object_get(g, "job")), "status-other") == 0)
                other = g;
        }
        assert_non_null(found);
        assert_non_null(other);
        assert_string_equal(json_string_value(json_object_get(found, "kind")), "job");
        assert_int_equal(json_integer_value(json_object_get(found, "uid")), getuid());
        assert_int_equal(json_array_size(json_object_get(found, "sessions")), 2);
        assert_int_equal(json_integer_value(json_object_get(found, "steps")), k_steps + 2);
        assert_int_equal(json_array_size(json_object_get(other, "sessions")), 1);
        assert_int_equal(json_integer_value(json_object_get(other, "steps")), 0);
        /* the members are exactly the listed sessions of that job */
        {
            json_t *s, *id;
            size_t k, n_job = 0, n_other = 0;
            json_array_foreach(json_object_get(root, "sessions"), i, s) {
                const char *job = json_string_value(json_object_get(s, "job"));
                json_t *grp = strcmp(job, "status-json") == 0    ? found
                              : strcmp(job, "status-other") == 0 ? other
                                                                 : NULL;
                bool member = false;
                if (!grp) continue;
                n_job += grp == found;
                n_other += grp == other;
                json_array_foreach(json_object_get(grp, "sessions"), k,
                                   id) if (json_integer_value(id) ==
                                           json_integer_value(json_object_get(s, "id")))
                    member = true;
                assert_true(member);
            }
            assert_int_equal(n_job, 2);
            assert_int_equal(n_other, 1);
        }
        json_decref(root);
        dpclip_disconnect(c2);
        dpclip_disconnect(c3);
    }
#else
    printf("test_status: jansson not available: /status checked as text only\n");
    assert_non_null(strstr(body, "\"job\":\"status-json\""));
#endif
    free(head);
    free(body);
    dpclip_disconnect(c);
}

static void test_metrics_prometheus(void **state) {
    dpclip_client *c = connect_job("status-metrics \"quoted\"\n");
    double eps = run_steps(c, 3, 0.5, 2);
    char *body = NULL, *head = NULL, *samples = NULL;
    int code, parsed;
    (void)state;

    code = dc_http(g_status, "GET", "/metrics", 5000, &head, &body, NULL);
    assert_int_equal(code, 200);
    assert_non_null(strstr(head, "Content-Type: text/plain; version=0.0.4"));
    /* always: the strict grammar; and the real parser where installed */
    assert_int_equal(dc_prom_grammar(body), 0);
    parsed = dc_prom_parse(body, &samples);
    assert_true(parsed >= 0);
    if (parsed == 0) {
        printf("test_status: python3 prometheus_client not installed: /metrics checked with "
               "the strict line grammar only\n");
    } else {
        printf("test_status: /metrics parsed with prometheus_client's text parser\n");
        assert_true(dc_prom_value(samples, "dpclip_steps_total{result=\"ok\"}") >= k_steps + 3);
        assert_true(dc_prom_value(samples, "dpclip_requests_total{type=\"clip_step\"}") >=
                    k_steps + 3);
        assert_true(dc_prom_value(samples, "dpclip_step_seconds_count{}") >= k_steps + 3);
        assert_true(dc_prom_value(samples, "dpclip_step_phase_seconds_count{phase=\"run\"}") >=
                    k_steps + 3);
        /* run's parts, timed by the backend: every successful step has each,
         * and together they fit in run */
        {
            static const char *const parts[] = {"norms", "reduction", "clipping", "noise"};
            double sum = 0.0;
            char key[128];
            for (int i = 0; i < 4; i++) {
                snprintf(key, sizeof key, "dpclip_step_phase_seconds_count{phase=\"%s\"}",
                         parts[i]);
                assert_true(dc_prom_value(samples, key) >= k_steps + 3);
                snprintf(key, sizeof key, "dpclip_step_phase_seconds_sum{phase=\"%s\"}", parts[i]);
                assert_true(dc_prom_value(samples, key) > 0.0);
                sum += dc_prom_value(samples, key);
            }
            assert_true(sum <=
                        dc_prom_value(samples, "dpclip_step_phase_seconds_sum{phase=\"run\"}"));
        }
        assert_true(dc_prom_value(samples, "dpclip_sessions{}") >= 1);
        assert_true(dc_prom_value(samples, "dpclip_ledger_writes_total{result=\"ok\"}") >=
                    k_steps + 3);
        /* the per-job gauge, with a label value that needed escaping */
        {
            char key[256];
            snprintf(key, sizeof key,
                     "dpclip_job_epsilon{job=\"status-metrics \"quoted\"\n\","
                     "uid=\"%u\"}",
                     (unsigned)getuid());
            double v = dc_prom_value(samples, key);
            if (!(v == eps)) fprintf(stderr, "job epsilon %g, reply said %g\n", v, eps);
            assert_true(v == eps);
        }
        free(samples);
    }
    free(head);
    free(body);
    dpclip_disconnect(c);
}

static void test_http_errors(void **state) {
    char *body = NULL;
    (void)state;
    assert_int_equal(dc_http(g_status, "GET", "/nope", 5000, NULL, &body, NULL), 404);
    free(body);
    assert_int_equal(dc_http(g_status, "POST", "/status", 5000, NULL, &body, NULL), 405);
    free(body);
    assert_int_equal(dc_http(g_status, "GET", "/", 5000, NULL, &body, NULL), 200);
    assert_non_null(strstr(body, "/metrics"));
    free(body);
}

/* --- under load ---------------------------------------------------------------- */

static atomic_int g_stop, g_running;
static atomic_long g_done;

static void *load_thread(void *arg) {
    dpclip_client *c = NULL;
    dpclip_connect_opts o = {.client_name = "load", .job_id = "status-load"};
    dc_shm_step s;
    dpclip_clip_config cfg = {.max_grad_norm = 1.0f,
                              .reduction = DPCLIP_MEAN,
                              .expected_batch_size = 32,
                              .noise_multiplier = 1.0f,
                              .sample_rate = 0.01};
    dc_test_layer_spec big = {DC_LAYER_LINEAR, 32, 16, 64, 64, DC_F32, 1, DC_ALGO_AUTO, 1, 0};
    dc_test_rng r;
    long seed = (long)(intptr_t)arg;

    dc_test_rng_seed(&r, (uint64_t)seed);
    if (dpclip_connect(g_h.sock, &o, &c) || dc_shm_step_init(&s, c, 4u << 20, 32, &cfg) ||
        dc_shm_step_add(&s, &big, &r, 1.0f) < 0 || dc_shm_step_add(&s, &big, &r, 1.0f) < 0) {
        fprintf(stderr, "load thread %ld: setup failed\n", seed);
        dpclip_disconnect(c);
        return (void *)1;
    }
    atomic_fetch_add(&g_running, 1);
    while (!atomic_load(&g_stop)) {
        dpclip_result res;
        if (dpclip_run(c, s.step, &res)) break;
        dpclip_result_free(&res);
        atomic_fetch_add(&g_done, 1);
    }
    dc_shm_step_free(&s);
    dpclip_disconnect(c);
    return NULL;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static void test_status_under_load(void **state) {
    enum { N_CLIENTS = 8, N_REQ = 30 };
    pthread_t th[N_CLIENTS];
    double ms[N_REQ];
    long before;
    int seen_busy = 0;
    (void)state;

    atomic_store(&g_stop, 0);
    atomic_store(&g_running, 0);
    for (int i = 0; i < N_CLIENTS; i++)
        assert_int_equal(pthread_create(&th[i], NULL, load_thread, (void *)(intptr_t)(i + 10)), 0);
    while (atomic_load(&g_running) < N_CLIENTS) usleep(1000);
    before = atomic_load(&g_done);
    for (int i = 0; i < N_REQ; i++) {
        char *body = NULL;
        int code = dc_http(g_status, "GET", i % 2 ? "/metrics" : "/status", 5000, NULL, &body,
                           &ms[i]);
        assert_int_equal(code, 200);
        seen_busy += i % 2 == 0 && strstr(body, "\"busy\":true") != NULL;
        free(body);
        usleep(20000);
    }
    atomic_store(&g_stop, 1);
    for (int i = 0; i < N_CLIENTS; i++) {
        void *ret;
        pthread_join(th[i], &ret);
        assert_null(ret);
    }
    /* the clients really were stepping all along */
    assert_true(atomic_load(&g_done) - before >= N_REQ);
    assert_true(seen_busy > 0);
    qsort(ms, N_REQ, sizeof ms[0], cmp_double);
    printf("test_status: status/metrics under load of %d clients: median %.2f ms, p90 %.2f ms, "
           "max %.2f ms (%ld steps meanwhile)\n",
           N_CLIENTS, ms[N_REQ / 2], ms[N_REQ * 9 / 10], ms[N_REQ - 1],
           atomic_load(&g_done) - before);
    /* The brief's requirement. The endpoint never waits more than 40 ms for
     * the loop (it then serves the last rendering), so this holds unless the
     * machine starves the HTTP thread itself. */
    assert_true(ms[N_REQ / 2] < 50.0);
    assert_true(ms[N_REQ * 9 / 10] < 50.0);
}

/* --- slow connections ------------------------------------------------------------ */

/* A connection to the status socket that sent half a request line. */
static int stalled_connection(void) {
    struct sockaddr_un a;
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    memset(&a, 0, sizeof a);
    a.sun_family = AF_UNIX;
    assert_true(strlen(g_status) < sizeof a.sun_path);
    memcpy(a.sun_path, g_status, strlen(g_status) + 1);
    assert_true(fd >= 0);
    assert_int_equal(connect(fd, (struct sockaddr *)&a, sizeof a), 0);
    assert_int_equal(send(fd, "GET /sta", 8, MSG_NOSIGNAL), 8);
    return fd;
}

/* 70 slow connections locked /status out (64 at most were served). */
static void test_slow_connections(void **state) {
    enum { N = 70 };
    int fds[N];
    char *body = NULL;
    (void)state;
    for (int i = 0; i < N; i++) fds[i] = stalled_connection();
    assert_int_equal(dc_http(g_status, "GET", "/status", 5000, NULL, &body, NULL), 200);
    assert_non_null(strstr(body, "\"daemon\""));
    free(body);
    for (int i = 0; i < N; i++) close(fds[i]);
}

/* A connection silent for status.timeout_s (1 s here) is closed. */
static void test_idle_connection_closed(void **state) {
    int fd = stalled_connection();
    char buf[256];
    ssize_t n;
    struct timeval tv = {60, 0}; /* generous: closing is what is checked */
    (void)state;
    assert_int_equal(setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv), 0);
    while ((n = read(fd, buf, sizeof buf)) > 0) continue;
    assert_int_equal(n, 0); /* EOF from the daemon, not our timeout */
    close(fd);
}

/* --- who sees what ------------------------------------------------------------------ */

/* A snapshot by hand: two users' sessions and jobs. */
static void fake_report(dc_report *r, dc_report_session *ss, dc_report_account *jj) {
    memset(r, 0, sizeof *r);
    memset(ss, 0, 2 * sizeof *ss);
    memset(jj, 0, 2 * sizeof *jj);
    r->pid = 1;
    r->daemon_uid = 999;
    r->ops_gid = 4242;
    r->log_level = "info";
    r->sessions = ss;
    r->accounts = jj;
    r->n_sessions = r->n_accounts = 2;
    for (int i = 0; i < 2; i++) {
        ss[i].id = (uint64_t)i + 1;
        ss[i].pid = 100 + i;
        ss[i].uid = jj[i].uid = 1000 + (uint32_t)i;
        ss[i].hello = true;
        snprintf(ss[i].client, sizeof ss[i].client, "client-of-%d", 1000 + i);
        snprintf(ss[i].job_id, sizeof ss[i].job_id, "job-of-%d", 1000 + i);
        snprintf(jj[i].job_id, sizeof jj[i].job_id, "job-of-%d", 1000 + i);
        jj[i].steps = 10;
        jj[i].eps = 1.5 + i;
        jj[i].delta = 1e-5;
    }
    r->metrics.samples = 12345;
    r->metrics.bytes_referenced = 777;
    r->metrics.steps_ok = 20;
}

static void test_views(void **state) {
    dc_report r;
    dc_report_session ss[2];
    dc_report_account jj[2];
    dc_status_viewer v = {.known = true, .uid = 1000, .gid = 1000};
    dc_sbuf b = {0};
    (void)state;
    fake_report(&r, ss, jj);

    /* who gets which view */
    assert_int_equal(dc_report_view(&r, &v), DC_VIEW_OWN);
    v.groups[v.n_groups++] = 4242; /* status.ops_group, as a supplementary group */
    assert_int_equal(dc_report_view(&r, &v), DC_VIEW_ALL);
    v.n_groups = 0;
    v.gid = 4242;
    assert_int_equal(dc_report_view(&r, &v), DC_VIEW_ALL);
    v.gid = 1000;
    v.uid = 0;
    assert_int_equal(dc_report_view(&r, &v), DC_VIEW_ALL);
    v.uid = 999; /* the daemon's own user */
    assert_int_equal(dc_report_view(&r, &v), DC_VIEW_ALL);
    v.known = false; /* TCP */
    assert_int_equal(dc_report_view(&r, &v), DC_VIEW_AGGREGATE);

    /* everything */
    dc_report_status(&r, DC_VIEW_ALL, 0, &b);
    assert_non_null(strstr(b.p, "client-of-1000"));
    assert_non_null(strstr(b.p, "client-of-1001"));
    assert_non_null(strstr(b.p, "\"samples\":12345"));
    dc_sbuf_free(&b);
    /* one's own */
    dc_report_status(&r, DC_VIEW_OWN, 1000, &b);
    assert_non_null(strstr(b.p, "client-of-1000"));
    assert_non_null(strstr(b.p, "\"job\":\"job-of-1000\""));
    assert_null(strstr(b.p, "1001")); /* no session, pid, job or group of the other */
    assert_null(strstr(b.p, "\"samples\""));
    assert_non_null(strstr(b.p, "\"view\":\"own\""));
    dc_sbuf_free(&b);
    /* TCP: counts only */
    dc_report_status(&r, DC_VIEW_AGGREGATE, 0, &b);
    assert_null(strstr(b.p, "client-of"));
    assert_null(strstr(b.p, "job-of"));
    assert_null(strstr(b.p, "\"samples\""));
    assert_non_null(strstr(b.p, "\"steps_ok\":20"));
    dc_sbuf_free(&b);

    /* /metrics: per-job series of one's own; batch-size counters for ops */
    dc_report_metrics(&r, DC_VIEW_ALL, 0, &b);
    assert_int_equal(dc_prom_grammar(b.p), 0);
    assert_non_null(strstr(b.p, "dpclip_samples_total 12345"));
    assert_non_null(strstr(b.p, "dpclip_bytes_referenced_total 777"));
    assert_non_null(strstr(b.p, "job=\"job-of-1001\""));
    dc_sbuf_free(&b);
    dc_report_metrics(&r, DC_VIEW_OWN, 1000, &b);
    assert_int_equal(dc_prom_grammar(b.p), 0);
    assert_null(strstr(b.p, "dpclip_samples_total"));
    assert_null(strstr(b.p, "dpclip_bytes_referenced_total"));
    assert_non_null(strstr(b.p, "dpclip_job_epsilon{uid=\"1000\",job=\"job-of-1000\"}"));
    assert_null(strstr(b.p, "job-of-1001"));
    dc_sbuf_free(&b);
    dc_report_metrics(&r, DC_VIEW_AGGREGATE, 0, &b);
    assert_int_equal(dc_prom_grammar(b.p), 0);
    assert_null(strstr(b.p, "job-of"));
    assert_null(strstr(b.p, "dpclip_samples_total"));
    assert_non_null(strstr(b.p, "dpclip_steps_total{result=\"ok\"} 20"));
    dc_sbuf_free(&b);
}

/* The limits object lists every setting the config table counts as a
 * limit, [limits] ones by key, others by section.key, with the configured
 * value: a limits.* setting added to config.c and left out fails here. */
static void test_status_limits(void **state) {
    dc_report r;
    dc_report_session ss[2];
    dc_report_account jj[2];
    dc_sbuf b = {0};
    dc_err e;
    const char *section, *key, *lim, *end;
    char obj[4096], want[160], num[32];
    size_t n = 0;
    (void)state;
    fake_report(&r, ss, jj);
    dc_config_defaults(&r.cfg);
    assert_int_equal(dc_config_set(&r.cfg, "limits", "max_group_links", "7", "test", &e), 0);
    assert_int_equal(dc_config_set(&r.cfg, "ledger", "max_jobs_per_uid", "77", "test", &e), 0);
    dc_report_status(&r, DC_VIEW_OWN, 1000, &b);
    assert_non_null(lim = strstr(b.p, "\"limits\":{"));
    assert_non_null(end = strchr(lim, '}'));
    lim += strlen("\"limits\":{");
    snprintf(obj, sizeof obj, "%.*s,", (int)(end - lim), lim);
    for (size_t i = 0; dc_config_key(i, &section, &key); i++) {
        bool in_limits = strcmp(section, "limits") == 0;
        if (in_limits) assert_true(dc_config_is_limit(i));
        if (!dc_config_is_limit(i)) continue;
        assert_true(dc_config_number(&r.cfg, i, num, sizeof num));
        snprintf(want, sizeof want, "\"%s%s%s\":%s,", in_limits ? "" : section,
                 in_limits ? "" : ".", key, num);
        if (!strstr(obj, want)) fprintf(stderr, "/status limits lack %s in %s\n", want, obj);
        assert_non_null(strstr(obj, want));
        n++;
    }
    /* every entry is a listed setting, and the values are the snapshot's */
    for (const char *p = obj; (p = strchr(p, ':')); p++) n--;
    assert_int_equal(n, 0);
    assert_non_null(strstr(obj, "\"max_group_links\":7,"));
    assert_non_null(strstr(obj, "\"ledger.max_jobs_per_uid\":77,"));
    assert_non_null(strstr(obj, "\"max_step_memory\":2147483648,"));
    dc_sbuf_free(&b);
}

/* A real caller of another uid (needs root to become one): it sees its own
 * sessions and jobs, i.e. none, and not this test's. */
static void test_own_view(void **state) {
    pid_t pid;
    int st;
    dpclip_client *c;
    (void)state;
    if (geteuid() != 0) {
        printf("test_own_view: SKIPPED: needs root to query as another uid (the renderer's "
               "views are covered by test_views)\n");
        skip();
    }
    c = connect_job("own-view-secret");
    run_steps(c, 1, k_q, 9);
    assert_int_equal(chmod(g_h.dir, 0755), 0); /* the socket's directory */
    pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        char *body = NULL;
        int bad = 0;
        if (setgid(65534) != 0 || setuid(65534) != 0) _exit(10);
        if (dc_http(g_status, "GET", "/status", 5000, NULL, &body, NULL) != 200) _exit(11);
        bad |= strstr(body, "own-view-secret") != NULL || strstr(body, "status-test") != NULL;
        bad |= strstr(body, "\"view\":\"own\"") == NULL;
        bad |= strstr(body, "\"samples\"") != NULL;
        free(body);
        if (dc_http(g_status, "GET", "/metrics", 5000, NULL, &body, NULL) != 200) _exit(12);
        bad |= strstr(body, "own-view-secret") != NULL;
        bad |= strstr(body, "dpclip_samples_total") != NULL;
        free(body);
        _exit(bad ? 13 : 0);
    }
    assert_int_equal(waitpid(pid, &st, 0), pid);
    if (!WIFEXITED(st) || WEXITSTATUS(st) != 0)
        fprintf(stderr, "the other uid's view: exit %d\n", WIFEXITED(st) ? WEXITSTATUS(st) : -1);
    assert_true(WIFEXITED(st) && WEXITSTATUS(st) == 0);
    dpclip_disconnect(c);
}

/* --- accounts ------------------------------------------------------------------------ */

/* 20k Hellos with fresh job ids kept 20k accounts (and /status grew to
 * 3.7 MB): an account that never spent anything goes with its sessions. */
static void test_hellos_leave_no_accounts(void **state) {
    enum { N = 300 };
    char job[32], *body = NULL;
    (void)state;
    for (int i = 0; i < N; i++) {
        snprintf(job, sizeof job, "fresh-%d", i);
        dpclip_disconnect(connect_job(job));
    }
    /* the sessions are gone once a ping on a new one has been answered */
    {
        dpclip_client *c = connect_job("fresh-check");
        assert_int_equal(dpclip_ping(c), 0);
        dpclip_disconnect(c);
    }
    for (int tries = 0; tries < 100; tries++) { /* disconnects are asynchronous */
        free(body);
        assert_int_equal(dc_http(g_status, "GET", "/status", 5000, NULL, &body, NULL), 200);
        if (!strstr(body, "\"job\":\"fresh-")) break;
        usleep(50000);
    }
    assert_null(strstr(body, "\"job\":\"fresh-"));
    assert_true(strlen(body) < 64 * 1024);
    free(body);
}

/* --insecure-fixed-seed (the harness's daemons all run with it) marks the
 * replies, /status, /metrics and the ledger's accounts. */
static void test_insecure_marked(void **state) {
    dpclip_client *c = connect_job("insecure-mark");
    char *body = NULL, *samples = NULL;
    (void)state;
    assert_int_equal(dpclip_insecure(c), 1); /* from the Hello's reply on */
    run_steps(c, 1, k_q, 11);
    assert_int_equal(dc_http(g_status, "GET", "/status", 5000, NULL, &body, NULL), 200);
    assert_non_null(strstr(body, "\"insecure\":true}")); /* the daemon's */
#ifdef DPCLIP_HAVE_JANSSON
    {
        json_error_t je;
        json_t *root = json_loads(body, 0, &je), *j, *found = NULL;
        size_t i;
        assert_non_null(root);
        assert_true(json_is_true(json_object_get(json_object_get(root, "daemon"), "insecure")));
        json_array_foreach(json_object_get(json_object_get(root, "ledger"), "jobs"), i,
                           j) if (strcmp(json_string_value(json_object_get(j, "job")),
                                         "insecure-mark") == 0) found = j;
        assert_non_null(found);
        assert_true(json_is_true(json_object_get(found, "insecure")));
        json_decref(root);
    }
#endif
    free(body);
    assert_int_equal(dc_http(g_status, "GET", "/metrics", 5000, NULL, &body, NULL), 200);
    assert_non_null(strstr(body, "\ndpclip_insecure 1\n"));
    (void)samples;
    free(body);
    /* and on disk */
    {
        char path[600], line[256];
        FILE *f;
        bool marked = false;
        snprintf(path, sizeof path, "%s/%u-%s.ledger", g_ledger, (unsigned)getuid(),
                 "696e7365637572652d6d61726b"); /* hex of "insecure-mark" */
        f = fopen(path, "r");
        assert_non_null(f);
        while (fgets(line, sizeof line, f)) marked |= strcmp(line, "insecure 1\n") == 0;
        fclose(f);
        assert_true(marked);
    }
    dpclip_disconnect(c);
}

/* --- dpclipctl ------------------------------------------------------------------ */

static int run_ctl(const char *args, char *out, size_t n) {
#ifdef DPCLIPCTL_PATH
    char cmd[800];
    snprintf(cmd, sizeof cmd, "%s --socket %s %s 2>&1", DPCLIPCTL_PATH, g_status, args);
    int rc = dc_sh(cmd, out, n);
    assert_int_not_equal(rc, DC_SH_NOSTART);
    return rc;
#else
    (void)args;
    (void)out;
    (void)n;
    return -2;
#endif
}

/* dpclipctl's groups table has a row for `job`: one session, `steps` steps. */
static void check_ctl_group(const char *out, const char *job, unsigned steps) {
    const char *t = strstr(out, "\nGROUP"), *row;
    char kind[16], name[64], ids[256];
    unsigned uid, got_steps, busy;
    assert_non_null(t);
    for (row = strchr(t + 1, '\n'); row; row = strchr(row + 1, '\n'))
        if (sscanf(row + 1, "%15s %u %63s %u %u %255s", kind, &uid, name, &got_steps, &busy, ids) ==
                6 &&
            strcmp(name, job) == 0)
            break;
    assert_non_null(row);
    assert_string_equal(kind, "job");
    assert_int_equal(uid, getuid());
    assert_int_equal(got_steps, steps);
    assert_null(strchr(ids, ',')); /* one session */
}

static void test_dpclipctl(void **state) {
    char out[65536], want[64];
    dpclip_client *c = connect_job("ctl-job");
    double eps = run_steps(c, 5, 0.1, 3);
    (void)state;
    if (run_ctl("status", out, sizeof out) == -2) {
        printf("test_dpclipctl: SKIPPED: dpclipctl not built (needs libcurl and jansson)\n");
        dpclip_disconnect(c);
        skip();
    }
    assert_int_equal(run_ctl("status", out, sizeof out), 0);
    assert_non_null(strstr(out, "dpclipd " DPCLIP_VERSION));
    assert_non_null(strstr(out, g_h.sock));
    check_ctl_group(out, "ctl-job", 5);
    assert_int_equal(run_ctl("sessions", out, sizeof out), 0);
    assert_non_null(strstr(out, "ctl-job"));
    check_ctl_group(out, "ctl-job", 5);
    assert_int_equal(run_ctl("ledger", out, sizeof out), 0);
    snprintf(want, sizeof want, "%.4g", eps);
    {
        /* the job's row shows its steps and epsilon */
        char *row = strstr(out, "ctl-job");
        assert_non_null(row);
        assert_non_null(strstr(row, want));
        assert_non_null(strstr(row, "5 x (q=0.1, s=1)"));
    }
    assert_int_equal(run_ctl("metrics", out, sizeof out), 0);
    assert_non_null(strstr(out, "dpclip_step_phase_seconds{phase=\"run\"}"));
    assert_int_not_equal(run_ctl("bogus", out, sizeof out), 0);
    dpclip_disconnect(c);
}

static void test_clean_shutdown(void **state) {
    struct stat st;
    (void)state;
    assert_int_equal(dc_harness_stop(&g_h), 0);
    /* the daemon made the status socket, so it removes it */
    assert_int_equal(stat(g_status, &st), -1);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_status_json),
        cmocka_unit_test(test_metrics_prometheus),
        cmocka_unit_test(test_http_errors),
        cmocka_unit_test(test_status_under_load),
        cmocka_unit_test(test_slow_connections),
        cmocka_unit_test(test_idle_connection_closed),
        cmocka_unit_test(test_views),
        cmocka_unit_test(test_status_limits),
        cmocka_unit_test(test_own_view),
        cmocka_unit_test(test_hellos_leave_no_accounts),
        cmocka_unit_test(test_insecure_marked),
        cmocka_unit_test(test_dpclipctl),
        cmocka_unit_test(test_clean_shutdown),
    };
#ifndef DPCLIP_HAVE_MHD
    printf("test_status: SKIPPED: dpclipd was built without libmicrohttpd (no status socket)\n");
    return DC_TEST_SKIP;
#endif
    return cmocka_run_group_tests(tests, group_setup, group_teardown);
}
