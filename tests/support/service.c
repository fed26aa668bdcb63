/* Node-service test helpers (service.h). */
#include "service.h"

#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <poll.h>
#include <regex.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "dc_clock.h"

/* --- HTTP ------------------------------------------------------------------- */

int dc_http(const char *sock, const char *method, const char *path, int timeout_ms, char **head,
            char **body, double *ms) {
    struct sockaddr_un a;
    char req[512], *buf = NULL, *sep;
    size_t len = 0, cap = 0;
    double t0 = dc_clock_ns() / 1e6, deadline = t0 + timeout_ms;
    int fd, code = -1;

    if (head) *head = NULL;
    if (body) *body = NULL;
    memset(&a, 0, sizeof a);
    a.sun_family = AF_UNIX;
    snprintf(a.sun_path, sizeof a.sun_path, "%s", sock);
    fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0 || connect(fd, (struct sockaddr *)&a, sizeof a) != 0) {
        if (fd >= 0) close(fd);
        return -1;
    }
    snprintf(req, sizeof req, "%s %s HTTP/1.0\r\nHost: localhost\r\nConnection: close\r\n\r\n",
             method, path);
    if (send(fd, req, strlen(req), MSG_NOSIGNAL) != (ssize_t)strlen(req)) goto out;
    for (;;) {
        struct pollfd p = {fd, POLLIN, 0};
        double left = deadline - dc_clock_ns() / 1e6;
        ssize_t n;
        if (left <= 0 || poll(&p, 1, (int)left + 1) <= 0) goto out; /* timed out */
        if (cap - len < 4096) {
            char *nb = realloc(buf, cap = cap ? 2 * cap : 8192);
            if (!nb) goto out;
            buf = nb;
        }
        n = read(fd, buf + len, cap - len - 1);
        if (n < 0 && errno == EINTR) continue;
        if (n < 0) goto out;
        if (n == 0) break;
        len += (size_t)n;
    }
    if (ms) *ms = dc_clock_ns() / 1e6 - t0;
    if (!buf) goto out;
    buf[len] = '\0';
    if (sscanf(buf, "HTTP/1.%*d %d", &code) != 1 || !(sep = strstr(buf, "\r\n\r\n"))) {
        code = -1;
        goto out;
    }
    *sep = '\0';
    if (body) *body = strdup(sep + 4);
    if (head) *head = strdup(buf);
out:
    free(buf);
    close(fd);
    return code;
}

void dc_harness_status_path(const dc_harness *h, char *out, size_t n) {
    size_t len = strlen(h->sock);
    if (len > 5 && strcmp(h->sock + len - 5, ".sock") == 0) len -= 5;
    snprintf(out, n, "%.*s-status.sock", (int)len, h->sock);
}

/* --- Prometheus text ----------------------------------------------------------- */

static const char *k_parse_py =
    "import sys\n"
    "from prometheus_client.parser import text_string_to_metric_families as parse\n"
    "out = []\n"
    "for fam in parse(open(sys.argv[1]).read()):\n"
    "    for s in fam.samples:\n"
    "        lab = ','.join('%s=\"%s\"' % (k, v) for k, v in sorted(s.labels.items()))\n"
    "        out.append('%s{%s} %r' % (s.name, lab, float(s.value)))\n"
    "print('\\n'.join(out))\n";

int dc_prom_parse(const char *text, char **samples) {
    static const char *pythons[] = {"/usr/bin/python3", "python3"};
    char tpy[] = "/tmp/dpclip-prom-XXXXXX.py", ttxt[] = "/tmp/dpclip-prom-XXXXXX.txt";
    const char *py = NULL;
    char cmd[600], *buf = NULL;
    size_t len = 0, cap = 0;
    int fd, st, rc = -1;
    FILE *p;

    *samples = NULL;
    for (size_t i = 0; i < 2 && !py; i++) {
        snprintf(cmd, sizeof cmd, "%s -c 'import prometheus_client.parser' >/dev/null 2>&1",
                 pythons[i]);
        if (system(cmd) == 0) py = pythons[i];
    }
    if (!py) return 0;
    if ((fd = mkstemps(tpy, 3)) < 0) return -1;
    if (write(fd, k_parse_py, strlen(k_parse_py)) < 0) rc = -1;
    close(fd);
    if ((fd = mkstemps(ttxt, 4)) < 0) {
        unlink(tpy);
        return -1;
    }
    if (write(fd, text, strlen(text)) != (ssize_t)strlen(text)) goto done;
    close(fd);
    fd = -1;
    snprintf(cmd, sizeof cmd, "%s %s %s", py, tpy, ttxt);
    if (!(p = popen(cmd, "r"))) goto done;
    for (;;) {
        size_t n;
        if (cap - len < 4096) {
            char *nb = realloc(buf, cap = cap ? 2 * cap : 65536);
            if (!nb) break;
            buf = nb;
        }
        n = fread(buf + len, 1, cap - len - 1, p);
        if (n == 0) break;
        len += n;
    }
    st = pclose(p);
    if (buf && WIFEXITED(st) && WEXITSTATUS(st) == 0) {
        buf[len] = '\0';
        *samples = buf;
        buf = NULL;
        rc = 1;
    } else {
        fprintf(stderr, "prometheus_client's parser rejected the metrics (status %d)\n", st);
    }
done:
    if (fd >= 0) close(fd);
    free(buf);
    unlink(tpy);
    unlink(ttxt);
    return rc;
}

int dc_prom_grammar(const char *text) {
    static const char *name = "[a-zA-Z_:][a-zA-Z0-9_:]*";
    static const char *label = "[a-zA-Z_][a-zA-Z0-9_]*=\"([^\"\\\\\n]|\\\\[\\\\\"n])*\"";
    char sample_re[512], help_re[128], type_re[160];
    regex_t rs, rh, rt;
    const char *line = text;
    int lineno = 0, rc = 0;

    snprintf(sample_re, sizeof sample_re,
             "^%s(\\{(%s(,%s)*)?\\})? (NaN|[+-]Inf|[-+]?[0-9]+(\\.[0-9]*)?([eE][-+]?[0-9]+)?)$",
             name, label, label);
    snprintf(help_re, sizeof help_re, "^# HELP %s .*$", name);
    snprintf(type_re, sizeof type_re, "^# TYPE %s (counter|gauge|histogram|summary|untyped)$",
             name);
    if (regcomp(&rs, sample_re, REG_EXTENDED | REG_NOSUB) ||
        regcomp(&rh, help_re, REG_EXTENDED | REG_NOSUB) ||
        regcomp(&rt, type_re, REG_EXTENDED | REG_NOSUB))
        return -1;
    while (*line) {
        const char *nl = strchr(line, '\n');
        char one[1024];
        size_t n = nl ? (size_t)(nl - line) : strlen(line);
        lineno++;
        snprintf(one, sizeof one, "%.*s", (int)(n < sizeof one ? n : sizeof one - 1), line);
        if (!nl) {
            fprintf(stderr, "metrics: the text does not end with a newline\n");
            rc = -1;
            break;
        }
        if (regexec(one[0] == '#' ? (strncmp(one, "# TYPE", 6) == 0 ? &rt : &rh) : &rs, one, 0,
                    NULL, 0) != 0) {
            fprintf(stderr, "metrics line %d does not follow the format: '%s'\n", lineno, one);
            rc = -1;
            break;
        }
        line = nl + 1;
    }
    regfree(&rs);
    regfree(&rh);
    regfree(&rt);
    return rc;
}

double dc_prom_value(const char *samples, const char *key) {
    size_t k = strlen(key);
    for (const char *line = samples; line && *line;) {
        if (strncmp(line, key, k) == 0 && line[k] == ' ') return strtod(line + k + 1, NULL);
        line = strchr(line, '\n');
        if (line) line++;
    }
    return NAN;
}

/* --- steps ------------------------------------------------------------------------ */

int dc_service_step_init(dc_shm_step *s, dpclip_client *c, uint32_t B, float sigma, double q,
                         uint64_t seed) {
    dpclip_clip_config cfg = {.max_grad_norm = 1.0f,
                              .reduction = DPCLIP_SUM,
                              .noise_multiplier = sigma,
                              .mode = DPCLIP_FLAT,
                              .sample_rate = q};
    dc_test_layer_spec a = {DC_LAYER_LINEAR, B, 4, 16, 8, DC_F32, 1, DC_ALGO_AUTO, 1, 0};
    dc_test_layer_spec b = {DC_LAYER_LINEAR, B, 0, 8, 4, DC_F32, 0, DC_ALGO_AUTO, 1, 0};
    dc_test_rng r;
    dc_test_rng_seed(&r, seed);
    if (dc_shm_step_init(s, c, 1u << 20, B, &cfg)) return -1;
    if (dc_shm_step_add(s, &a, &r, 1.0f) < 0 || dc_shm_step_add(s, &b, &r, 1.0f) < 0) {
        dc_shm_step_free(s);
        return -1;
    }
    return 0;
}

/* --- daemons with systemd's environment ----------------------------------------- */

pid_t dc_spawn_daemon(char *const args[], char *const env[], const int *keep, int n_keep) {
    char *argv[64], fdbuf[16], line[64];
    int p[2], argc = 0, ready_fd = 3 + n_keep;
    size_t got = 0;
    double deadline;
    pid_t pid;

    argv[argc++] = (char *)DPCLIPD_PATH;
    for (int i = 0; args && args[i] && argc < 60; i++) argv[argc++] = args[i];
    snprintf(fdbuf, sizeof fdbuf, "%d", ready_fd);
    argv[argc++] = "--ready-fd";
    argv[argc++] = fdbuf;
    argv[argc] = NULL;
    if (pipe2(p, O_CLOEXEC) != 0) return -1;
    pid = fork();
    if (pid < 0) return -1;
    if (pid == 0) {
        /* Move the fds high first so that placing them cannot clobber one
         * another, then onto 3, 4, ... (dup2 clears close-on-exec). */
        int hi[16];
        for (int i = 0; i < n_keep && i < 15; i++) hi[i] = fcntl(keep[i], F_DUPFD_CLOEXEC, 100);
        hi[n_keep] = fcntl(p[1], F_DUPFD_CLOEXEC, 100);
        for (int i = 0; i <= n_keep; i++)
            if (dup2(hi[i], 3 + i) < 0) _exit(126);
        for (int i = 0; env && env[i]; i++) {
            putenv(env[i]);
            if (strncmp(env[i], "LISTEN_FDS=", 11) == 0) {
                char pidv[32];
                snprintf(pidv, sizeof pidv, "%d", (int)getpid());
                setenv("LISTEN_PID", pidv, 1);
            }
        }
        execv(argv[0], argv);
        _exit(127);
    }
    close(p[1]);
    deadline = dc_clock_ns() / 1e6 + 20000;
    while (got < sizeof line - 1) {
        struct pollfd pf = {p[0], POLLIN, 0};
        double left = deadline - dc_clock_ns() / 1e6;
        ssize_t n;
        if (left <= 0 || poll(&pf, 1, (int)left) <= 0) break;
        n = read(p[0], line + got, sizeof line - 1 - got);
        if (n <= 0) break;
        got += (size_t)n;
        line[got] = '\0';
        if (strchr(line, '\n')) break;
    }
    line[got] = '\0';
    close(p[0]);
    if (strcmp(line, "READY\n") != 0) {
        fprintf(stderr, "spawn: dpclipd did not report READY (got '%s')\n", line);
        kill(pid, SIGKILL);
        waitpid(pid, NULL, 0);
        return -1;
    }
    return pid;
}

int dc_spawn_stop(pid_t pid) {
    int st = 0;
    double deadline = dc_clock_ns() / 1e6 + 30000;
    pid_t w;
    kill(pid, SIGTERM);
    while ((w = waitpid(pid, &st, WNOHANG)) == 0 && dc_clock_ns() / 1e6 < deadline) {
        struct timespec ts = {0, 10 * 1000 * 1000};
        nanosleep(&ts, NULL);
    }
    if (w == 0) {
        kill(pid, SIGKILL);
        waitpid(pid, &st, 0);
        return -1;
    }
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

int dc_sh(const char *cmd, char *out, size_t n) {
    FILE *p = popen(cmd, "r");
    size_t got;
    int st;
    out[0] = '\0';
    if (!p) return DC_SH_NOSTART;
    got = fread(out, 1, n - 1, p);
    out[got] = '\0';
    st = pclose(p);
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}
