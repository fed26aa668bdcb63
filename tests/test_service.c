/* dpclipd as a node service, end to end: the privacy ledger on real steps
 * (epsilon in replies against the accountant, the job's and the node's
 * budgets refusing steps before any work, refunds of failed steps; more in
 * test_service_ledger.c), the
 * ledger surviving kill -9 with every completed step's spend, [access]
 * lists, SIGHUP reloads (good and bad files), and systemd's side: sd_notify
 * messages and socket activation with a client that connects while no
 * daemon runs. */
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <poll.h>
#include <pthread.h>
#include <setjmp.h>
#include <signal.h>
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
#include <time.h>
#include <unistd.h>

#include <cmocka.h>

#include "accountant.h"
#include "harness.h"
#include "service.h"

/* Whatever dpclip config is installed on this machine stays out. */
#ifdef DPCLIP_HAVE_INIH
#define NO_SYSTEM_CONFIG "--config /dev/null "
#else
#define NO_SYSTEM_CONFIG ""
#endif

#ifdef DPCLIP_HAVE_JANSSON
#include <jansson.h>

#include "ledger_test.h"

static char g_tmp[300];

static int group_setup(void **state) {
    (void)state;
    snprintf(g_tmp, sizeof g_tmp, "%s/dpclip-service.XXXXXX",
             getenv("TMPDIR") && getenv("TMPDIR")[0] ? getenv("TMPDIR") : "/tmp");
    return mkdtemp(g_tmp) ? 0 : -1;
}

static dc_harness g_h;

static int group_teardown(void **state) {
    char cmd[400];
    (void)state;
    if (g_h.pid) dc_harness_stop(&g_h); /* after a failure */
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", g_tmp);
    return system(cmd) == 0 ? 0 : -1;
}

static void sleep_ms(int ms) {
    struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

/* --- the ledger through the daemon (one daemon for these) ------------------------- */

static char g_status[400], g_ledger[400];

static void start_main_daemon(void) {
    char args[600];
    snprintf(g_ledger, sizeof g_ledger, "%s/ledger", g_tmp);
    snprintf(args, sizeof args, NO_SYSTEM_CONFIG "--workers 2 --ledger-dir %s", g_ledger);
    assert_int_equal(dc_harness_start(&g_h, args), 0);
    dc_harness_status_path(&g_h, g_status, sizeof g_status);
}

static void test_epsilon_in_replies(void **state) {
    dpclip_client *c;
    dc_shm_step s;
    double eps = 0, delta = 0;
    (void)state;
    start_main_daemon();
    c = connect_job(g_h.sock, "eps");
    assert_int_equal(dc_service_step_init(&s, c, 8, 1.2f, 0.05, 1), 0);
    set_privacy(&s, 1.2f, 0.05, 1e-6, 0);
    for (int i = 1; i <= 6; i++) {
        assert_int_equal(run(c, &s, &eps, &delta), 0);
        assert_true(delta == 1e-6);
        /* the daemon gets sigma as a float, as the wire carries it */
        assert_rel(eps, accountant_eps(0.05, (double)1.2f, i, 1e-6), 1e-9);
    }
    /* Another kind of step composes with the first: RDP curves add up. */
    set_privacy(&s, 2.0f, 0.2, 0, 0); /* delta 0: keep the job's */
    assert_int_equal(run(c, &s, &eps, &delta), 0);
    assert_true(delta == 1e-6);
    {
        double a[DC_RDP_N_ORDERS], b[DC_RDP_N_ORDERS];
        const double *o = dc_rdp_default_orders();
        dc_rdp_steps(0.05, (double)1.2f, o, DC_RDP_N_ORDERS, a);
        dc_rdp_steps(0.2, 2.0, o, DC_RDP_N_ORDERS, b);
        for (int k = 0; k < DC_RDP_N_ORDERS; k++) a[k] = 6 * a[k] + b[k];
        assert_rel(eps, dc_rdp_epsilon(o, a, DC_RDP_N_ORDERS, 1e-6, NULL), 1e-9);
    }
    /* No sample rate: counted as rate 1 (no amplification). */
    dc_shm_step_free(&s);
    dpclip_disconnect(c);
    c = connect_job(g_h.sock, "eps-no-rate");
    assert_int_equal(dc_service_step_init(&s, c, 8, 1.0f, 0.0, 2), 0);
    assert_int_equal(run(c, &s, &eps, NULL), 0);
    assert_rel(eps, accountant_eps(1.0, 1.0, 1, 1e-5), 1e-12);
    /* No noise: no privacy. */
    set_privacy(&s, 0.0f, 0.01, 0, 0);
    assert_int_equal(run(c, &s, &eps, NULL), 0);
    assert_true(isinf(eps));
    dc_shm_step_free(&s);
    dpclip_disconnect(c);
}

static void test_bad_privacy_fields(void **state) {
    dpclip_client *c = connect_job(g_h.sock, "bad-fields");
    dc_shm_step s;
    static const struct {
        double q, delta, budget;
        const char *field;
    } bad[] = {
        {1.5, 0, 0, "clip_step.sample_rate"},           {-0.1, 0, 0, "clip_step.sample_rate"},
        {NAN, 0, 0, "clip_step.sample_rate"},           {0.1, 1.0, 0, "clip_step.target_delta"},
        {0.1, -1e-5, 0, "clip_step.target_delta"},      {0.1, 0, -1, "clip_step.target_epsilon"},
        {0.1, 0, INFINITY, "clip_step.target_epsilon"},
    };
    (void)state;
    assert_int_equal(dc_service_step_init(&s, c, 8, 1.0f, 0.1, 3), 0);
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        set_privacy(&s, 1.0f, bad[i].q, bad[i].delta, bad[i].budget);
        assert_int_equal(run(c, &s, NULL, NULL), DPCLIP_EINVAL);
        assert_string_equal(dpclip_errfield(c), bad[i].field);
    }
    /* none of them was counted */
    assert_true(job_steps(g_status, "bad-fields") <= 0);
    dc_shm_step_free(&s);
    dpclip_disconnect(c);
}

static void test_job_budget(void **state) {
    dpclip_client *c = connect_job(g_h.sock, "budget");
    dc_shm_step s;
    double budget = accountant_eps(0.1, 1.0, 3, 1e-5) * (1 + 1e-9), eps;
    float *out;
    int64_t n;
    (void)state;

    assert_int_equal(dc_service_step_init(&s, c, 8, 1.0f, 0.1, 4), 0);
    set_privacy(&s, 1.0f, 0.1, 0, budget);
    for (int i = 0; i < 3; i++) assert_int_equal(run(c, &s, &eps, NULL), 0);
    assert_true(eps <= budget);

    /* The 4th would go past the budget: refused, and before any work (the
     * outputs keep what we put there). */
    dc_shm_step_fill_outputs(&s, 7.0f);
    assert_int_equal(run(c, &s, NULL, NULL), DPCLIP_ENOSPACE);
    assert_string_equal(dpclip_errfield(c), "clip_step.target_epsilon");
    assert_non_null(strstr(dpclip_errmsg(c), "budget"));
    n = dc_shm_step_outputs(&s, NULL);
    out = malloc((size_t)n * sizeof *out);
    assert_non_null(out);
    dc_shm_step_outputs(&s, out);
    for (int64_t i = 0; i < n; i++) assert_true(out[i] == 7.0f);
    free(out);
    assert_int_equal(job_steps(g_status, "budget"), 3);

    /* A budget cannot be raised by asking again... */
    set_privacy(&s, 1.0f, 0.1, 0, budget * 100);
    assert_int_equal(run(c, &s, NULL, NULL), DPCLIP_ENOSPACE);
    /* ... also not by a new session of the same job ... */
    dc_shm_step_free(&s);
    dpclip_disconnect(c);
    c = connect_job(g_h.sock, "budget");
    assert_int_equal(dc_service_step_init(&s, c, 8, 1.0f, 0.1, 4), 0);
    assert_int_equal(run(c, &s, NULL, NULL), DPCLIP_ENOSPACE);
    /* ... but a cheaper step (less sampling, more noise) may still fit. */
    set_privacy(&s, 50.0f, 1e-4, 0, 0);
    assert_int_equal(run(c, &s, &eps, NULL), 0);
    assert_true(eps <= budget);
    assert_int_equal(job_steps(g_status, "budget"), 4);
    dc_shm_step_free(&s);
    dpclip_disconnect(c);
}

static void test_failed_step_refunded(void **state) {
    dpclip_client *c = connect_job(g_h.sock, "refund");
    dc_shm_step s;
    double eps1 = 0, eps2 = 0;
    float keep;
    (void)state;
    assert_int_equal(dc_service_step_init(&s, c, 8, 1.0f, 0.1, 5), 0);
    assert_int_equal(run(c, &s, &eps1, NULL), 0);
    /* a NaN in the first layer's input: the step fails, writes nothing */
    keep = ((float *)s.ref.layers[0].input.data)[3];
    ((float *)s.ref.layers[0].input.data)[3] = NAN;
    assert_int_equal(run(c, &s, NULL, NULL), DPCLIP_ENONFINITE);
    assert_int_equal(job_steps(g_status, "refund"), 1);
    ((float *)s.ref.layers[0].input.data)[3] = keep;
    assert_int_equal(run(c, &s, &eps2, NULL), 0);
    assert_rel(eps2, accountant_eps(0.1, 1.0, 2, 1e-5), 1e-12);
    assert_true(eps2 > eps1);
    dc_shm_step_free(&s);
    dpclip_disconnect(c);
}

/* --- kill -9 ----------------------------------------------------------------------- */

#define K9_CLIENTS 4
static atomic_long g_k9_ok[K9_CLIENTS];
static atomic_int g_k9_started;

static void *k9_client(void *arg) {
    int idx = (int)(intptr_t)arg;
    char job[32];
    dpclip_client *c = NULL;
    dpclip_connect_opts o = {.client_name = "k9", .job_id = job};
    dc_shm_step s;
    snprintf(job, sizeof job, "k9-%d", idx);
    if (dpclip_connect(g_h.sock, &o, &c) ||
        dc_service_step_init(&s, c, 8, 1.1f, 0.01 * (idx + 1), (uint64_t)idx + 100)) {
        dpclip_disconnect(c);
        return (void *)1;
    }
    atomic_fetch_add(&g_k9_started, 1);
    /* Until the daemon dies under us. */
    while (run(c, &s, NULL, NULL) == 0) atomic_fetch_add(&g_k9_ok[idx], 1);
    dc_shm_step_free(&s);
    dpclip_disconnect(c);
    return NULL;
}

static void test_ledger_survives_kill9(void **state) {
    pthread_t th[K9_CLIENTS];
    (void)state;

    for (int i = 0; i < K9_CLIENTS; i++)
        assert_int_equal(pthread_create(&th[i], NULL, k9_client, (void *)(intptr_t)i), 0);
    for (int waited = 0; atomic_load(&g_k9_started) < K9_CLIENTS && waited < 20000; waited++)
        sleep_ms(1);
    assert_int_equal(atomic_load(&g_k9_started), K9_CLIENTS);
    for (int waited = 0; atomic_load(&g_k9_ok[K9_CLIENTS - 1]) < 20 && waited < 60000; waited += 5)
        sleep_ms(5);
    /* Mid-run: every client has a step in flight or about to be. */
    kill(g_h.pid, SIGKILL);
    waitpid(g_h.pid, NULL, 0);
    g_h.pid = 0;
    for (int i = 0; i < K9_CLIENTS; i++) {
        void *ret;
        pthread_join(th[i], &ret);
        assert_null(ret);
    }
    /* what kill -9 left behind */
    unlink(g_status);
    unlink(g_h.sock);
    dc_harness_stop(&g_h);

    /* A new daemon on the same ledger: every step a client saw complete is
     * there. A step in flight at the kill may be counted too (its spend is
     * written before it runs, as its outputs may already have reached the
     * trainer): at most one per client, which runs one step at a time. */
    start_main_daemon();
    {
        json_t *root = get_status(g_status);
        for (int i = 0; i < K9_CLIENTS; i++) {
            char job[32];
            json_t *j;
            long ok = atomic_load(&g_k9_ok[i]), steps;
            snprintf(job, sizeof job, "k9-%d", i);
            j = ledger_job(root, job);
            assert_non_null(j);
            steps = (long)json_integer_value(json_object_get(j, "steps"));
            printf("test_service: kill -9: %s: %ld steps answered, %ld in the ledger\n", job, ok,
                   steps);
            assert_true(steps >= ok && steps <= ok + 1);
            assert_rel(json_real_value(json_object_get(j, "epsilon")),
                       accountant_eps(0.01 * (i + 1), (double)1.1f, (double)steps, 1e-5), 1e-12);
        }
        /* and the earlier tests' jobs are still there */
        assert_non_null(ledger_job(root, "budget"));
        assert_int_equal(json_integer_value(json_object_get(ledger_job(root, "budget"), "steps")),
                         4);
        json_decref(root);
    }
    assert_int_equal(dc_harness_stop(&g_h), 0);
}

/* --- config file: node budget, required rate, access, reload --------------------- */

static void write_file(const char *path, const char *text) {
    char tmp[600];
    FILE *f;
    /* replace atomically, so the daemon never reads half a file */
    snprintf(tmp, sizeof tmp, "%s.new", path);
    f = fopen(tmp, "w");
    assert_non_null(f);
    fputs(text, f);
    fclose(f);
    assert_int_equal(rename(tmp, path), 0);
}

static long status_int(const char *status_sock, const char *obj, const char *key) {
    json_t *root = get_status(status_sock);
    long v = (long)json_integer_value(json_object_get(json_object_get(root, obj), key));
    json_decref(root);
    return v;
}

static void test_config_budget_access_reload(void **state) {
    char conf[400], sock[400], st[400], text[1200], *args[8];
    dpclip_client *c, *other = NULL;
    dc_shm_step s;
    double node_budget = accountant_eps(0.2, 1.0, 2, 1e-6) * (1 + 1e-9), eps;
    pid_t pid;
    (void)state;

    snprintf(conf, sizeof conf, "%s/d.conf", g_tmp);
    snprintf(sock, sizeof sock, "%s/cfg.sock", g_tmp);
    snprintf(st, sizeof st, "%s/cfg-status.sock", g_tmp);
    snprintf(text, sizeof text,
             "[daemon]\nsocket = %s\nworkers = 1\nlog_level = warn\n"
             "[limits]\nmax_batch = 64\n"
             "[access]\nallowed_uids = %u\n"
             "[ledger]\ndir = %s/ledger-cfg\nbudget_epsilon = %.17g\nbudget_delta = 1e-6\n"
             "require_sample_rate = true\n",
             sock, (unsigned)getuid(), g_tmp, node_budget);
    write_file(conf, text);
    args[0] = "--config";
    args[1] = conf;
    args[2] = "--insecure-fixed-seed";
    args[3] = "7";
    args[4] = NULL;
    pid = dc_spawn_daemon(args, NULL, NULL, 0);
    assert_true(pid > 0);

    c = connect_job(sock, "cfg");
    assert_int_equal(dc_service_step_init(&s, c, 8, 1.0f, 0.0, 6), 0);
    /* require_sample_rate */
    assert_int_equal(run(c, &s, NULL, NULL), DPCLIP_EPRECOND);
    assert_string_equal(dpclip_errfield(c), "clip_step.sample_rate");
    /* the node-wide budget, at its own delta, whatever the job reports at */
    set_privacy(&s, 1.0f, 0.2, 1e-3, 0);
    assert_int_equal(run(c, &s, &eps, NULL), 0);
    assert_int_equal(run(c, &s, &eps, NULL), 0);
    assert_int_equal(run(c, &s, NULL, NULL), DPCLIP_ENOSPACE);
    assert_string_equal(dpclip_errfield(c), "ledger.budget_epsilon");
    assert_int_equal(job_steps(st, "cfg"), 2);

    /* Reload: a smaller max_batch, nobody allowed but uid 4242, no node budget. */
    snprintf(text, sizeof text,
             "[daemon]\nsocket = %s\nworkers = 1\nlog_level = warn\n"
             "[limits]\nmax_batch = 4\n"
             "[access]\nallowed_uids = 4242\n"
             "[ledger]\ndir = %s/ledger-cfg\nbudget_epsilon = 0\nrequire_sample_rate = true\n",
             sock, g_tmp);
    write_file(conf, text);
    kill(pid, SIGHUP);
    for (int i = 0; i < 500 && status_int(st, "limits", "max_batch") != 4; i++) sleep_ms(10);
    assert_int_equal(status_int(st, "limits", "max_batch"), 4);
    /* the open session now gets the new limit... */
    assert_int_equal(run(c, &s, NULL, NULL), DPCLIP_EINVAL);
    /* ... and a new connection is refused at hello */
    {
        dpclip_connect_opts o = {.job_id = "cfg"};
        assert_int_equal(dpclip_connect(sock, &o, &other), DPCLIP_EPERM);
        assert_non_null(strstr(dpclip_errmsg(other), "[access]"));
        dpclip_disconnect(other);
    }

    /* A bad file on reload: the running configuration stays. */
    write_file(conf, "[daemon]\nworkers = 1\nbogus_key = 3\n");
    kill(pid, SIGHUP);
    {
        json_t *root = NULL;
        char *body = NULL, *samples = NULL;
        int i;
        for (i = 0; i < 500; i++) {
            free(body);
            body = NULL;
            assert_int_equal(dc_http(st, "GET", "/metrics", 5000, NULL, &body, NULL), 200);
            if (strstr(body, "dpclip_reloads_total{result=\"error\"} 1")) break;
            sleep_ms(10);
        }
        assert_true(i < 500);
        if (dc_prom_parse(body, &samples) == 1) {
            assert_true(dc_prom_value(samples, "dpclip_reloads_total{result=\"ok\"}") == 1);
            free(samples);
        }
        free(body);
        root = get_status(st);
        assert_int_equal(
            json_integer_value(json_object_get(json_object_get(root, "limits"), "max_batch")), 4);
        json_decref(root);
    }
    dc_shm_step_free(&s);
    dpclip_disconnect(c);
    assert_int_equal(dc_spawn_stop(pid), 0);
}

/* --- systemd: sd_notify and socket activation ------------------------------------- */

#ifdef DPCLIP_HAVE_SYSTEMD
static int unix_socket(const char *path, int type) {
    struct sockaddr_un a;
    int fd = socket(AF_UNIX, type | SOCK_CLOEXEC, 0);
    memset(&a, 0, sizeof a);
    a.sun_family = AF_UNIX;
    snprintf(a.sun_path, sizeof a.sun_path, "%s", path);
    unlink(path);
    if (fd < 0 || bind(fd, (struct sockaddr *)&a, sizeof a) != 0) return -1;
    if (type == SOCK_STREAM && listen(fd, 16) != 0) return -1;
    return fd;
}

/* Datagrams from the daemon until `want` is seen or timeout_ms; all of them
 * appended to log. */
static int notify_wait(int fd, const char *want, int timeout_ms, char *log, size_t n) {
    for (int waited = 0; waited < timeout_ms; waited += 10) {
        char msg[512];
        ssize_t got;
        while ((got = recv(fd, msg, sizeof msg - 1, MSG_DONTWAIT)) > 0) {
            msg[got] = '\0';
            strncat(log, msg, n - strlen(log) - 2);
            strcat(log, "|");
        }
        if (strstr(log, want)) return 1;
        sleep_ms(10);
    }
    return 0;
}

static void test_sd_notify(void **state) {
    char path[400], sock[400], env1[480], log[16384] = "", *args[10];
    char *env[] = {env1, "WATCHDOG_USEC=300000", NULL};
    int fd;
    pid_t pid;
    (void)state;
    snprintf(path, sizeof path, "%s/notify", g_tmp);
    snprintf(sock, sizeof sock, "%s/n.sock", g_tmp);
    fd = unix_socket(path, SOCK_DGRAM);
    assert_true(fd >= 0);
    snprintf(env1, sizeof env1, "NOTIFY_SOCKET=%s", path);
    args[0] = "--socket";
    args[1] = sock;
    args[2] = "--insecure-fixed-seed";
    args[3] = "7";
    args[4] = "--log-level";
    args[5] = "warn";
    args[6] = "--config"; /* nothing installed on this machine */
    args[7] = "/dev/null";
    args[8] = NULL;
    pid = dc_spawn_daemon(args, env, NULL, 0);
    assert_true(pid > 0);
    assert_true(notify_wait(fd, "READY=1", 5000, log, sizeof log));
    assert_true(notify_wait(fd, "STATUS=0 sessions", 5000, log, sizeof log));
    /* keep-alives at a third of WATCHDOG_USEC, from the loop: 3 within a
     * few periods (allowing for a slow machine) */
    {
        int n = 0;
        for (int waited = 0; waited < 5000 && n < 3; waited += 100) {
            char *p = log;
            notify_wait(fd, "\x01", 100, log, sizeof log); /* collect for 100 ms */
            for (n = 0; (p = strstr(p, "WATCHDOG=1")); p++) n++;
        }
        assert_true(n >= 3);
    }
    kill(pid, SIGHUP); /* no config file: a reload that changes nothing */
    assert_true(notify_wait(fd, "RELOADING=1", 5000, log, sizeof log));
    kill(pid, SIGTERM);
    assert_true(notify_wait(fd, "STOPPING=1", 5000, log, sizeof log));
    assert_int_equal(dc_spawn_stop(pid), 0);
    close(fd);
    unlink(path);
}

static void test_socket_activation(void **state) {
    char sock[400], st[400], *args[12], *env[] = {"LISTEN_FDS=2", NULL};
    int fds[2], early;
    pid_t pid;
    struct stat sb;
    dpclip_client *c;
    dc_shm_step s;
    (void)state;
    snprintf(sock, sizeof sock, "%s/act.sock", g_tmp);
    snprintf(st, sizeof st, "%s/act-status.sock", g_tmp);
    /* what systemd's .socket units would hold */
    fds[0] = unix_socket(st, SOCK_STREAM);
    fds[1] = unix_socket(sock, SOCK_STREAM);
    assert_true(fds[0] >= 0 && fds[1] >= 0);
    args[0] = "--socket";
    args[1] = sock;
    args[2] = "--status-socket";
    args[3] = st;
    args[4] = "--insecure-fixed-seed";
    args[5] = "7";
    args[6] = "--log-level";
    args[7] = "warn";
    args[8] = "--config";
    args[9] = "/dev/null";
    args[10] = NULL;

    /* A client that connects before any daemon runs waits in the backlog. */
    early = dc_raw_connect(sock);
    assert_true(early >= 0);
    {
        Dpclip__Request req = DPCLIP__REQUEST__INIT;
        Dpclip__Hello h = DPCLIP__HELLO__INIT;
        h.protocol_version = 1;
        req.id = 1;
        req.body_case = DPCLIP__REQUEST__BODY_HELLO;
        req.hello = &h;
        assert_int_equal(dc_raw_send_request(early, &req), 0);
    }
    pid = dc_spawn_daemon(args, env, fds, 2);
    assert_true(pid > 0);
    {
        Dpclip__Reply *r = dc_raw_read_reply(early, 10000);
        assert_non_null(r);
        assert_int_equal(r->body_case, DPCLIP__REPLY__BODY_HELLO);
        dpclip__reply__free_unpacked(r, NULL);
        close(early);
    }
    c = connect_job(sock, "activated");
    assert_int_equal(dc_service_step_init(&s, c, 8, 1.0f, 0.1, 9), 0);
    assert_int_equal(run(c, &s, NULL, NULL), 0);
    {
        json_t *root = get_status(st);
        assert_true(
            json_is_true(json_object_get(json_object_get(root, "daemon"), "socket_activated")));
        json_decref(root);
    }
    dc_shm_step_free(&s);
    dpclip_disconnect(c);
    assert_int_equal(dc_spawn_stop(pid), 0);
    /* systemd's sockets stay: the daemon must not unlink them */
    assert_int_equal(stat(sock, &sb), 0);
    assert_int_equal(stat(st, &sb), 0);

    /* ... and a restart serves clients that came meanwhile. */
    early = dc_raw_connect(sock);
    assert_true(early >= 0);
    pid = dc_spawn_daemon(args, env, fds, 2);
    assert_true(pid > 0);
    assert_int_equal(dc_raw_hello(early, 1), 0);
    close(early);
    assert_int_equal(dc_spawn_stop(pid), 0);
    close(fds[0]);
    close(fds[1]);
    unlink(sock);
    unlink(st);
}
#endif /* DPCLIP_HAVE_SYSTEMD */

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_epsilon_in_replies),
        cmocka_unit_test(test_bad_privacy_fields),
        cmocka_unit_test(test_job_budget),
        cmocka_unit_test(test_failed_step_refunded),
        cmocka_unit_test(test_ledger_survives_kill9),
        cmocka_unit_test(test_config_budget_access_reload),
#ifdef DPCLIP_HAVE_SYSTEMD
        cmocka_unit_test(test_sd_notify),
        cmocka_unit_test(test_socket_activation),
#endif
    };
#if !defined(DPCLIP_HAVE_MHD) || !defined(DPCLIP_HAVE_INIH)
    printf("test_service: SKIPPED: needs dpclipd built with libmicrohttpd and inih\n");
    return DC_TEST_SKIP;
#endif
#ifndef DPCLIP_HAVE_SYSTEMD
    printf("test_service: sd_notify and socket activation cases SKIPPED: no libsystemd\n");
#endif
    return cmocka_run_group_tests(tests, group_setup, group_teardown);
}

#else /* !DPCLIP_HAVE_JANSSON */
int main(void) {
    printf("test_service: SKIPPED: needs jansson (libjansson-dev) to read /status\n");
    return DC_TEST_SKIP;
}
#endif
