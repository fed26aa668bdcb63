/* dpclipctl: reads dpclipd's status endpoint and prints readable tables.
 *
 *   dpclipctl [--socket PATH | --url URL | --config FILE] status|sessions|ledger|metrics|get PATH
 *
 * HTTP through libcurl (over the Unix status socket, or TCP), JSON through
 * jansson. The status socket is --socket, else $DPCLIP_STATUS_SOCKET, else
 * the one of the daemon $DPCLIP_SOCKET names (what the trainers use), else
 * what the daemon's config file says (inih), else the default. Failures
 * are said in dpclip's terms: which socket, where that path came from, and
 * what to do. Exit status: 0 ok, 1 the daemon could not be reached or
 * answered an error, 2 usage. */
#include <curl/curl.h>
#include <errno.h>
#include <getopt.h>
#include <jansson.h>
#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#ifdef DPCLIP_HAVE_INIH
#include <ini.h>
#endif

#include "dc_install.h"

#define DEFAULT_SOCKET "/run/dpclip/dpclipd-status.sock"
#define TIMEOUT_S 10L

typedef struct buf {
    char *p;
    size_t len;
} buf;

/* The status endpoint and where it came from (for messages). */
typedef struct target {
    char sock[108]; /* the status socket; "" with url */
    char url[256];  /* http://127.0.0.1:PORT; "" with sock */
    char from[512];
} target;

static size_t on_data(char *ptr, size_t size, size_t n, void *user) {
    buf *b = user;
    size_t add = size * n;
    char *p = realloc(b->p, b->len + add + 1);
    if (!p) return 0;
    memcpy(p + b->len, ptr, add);
    b->p = p;
    b->len += add;
    b->p[b->len] = '\0';
    return add;
}

/* --- finding the status socket ---------------------------------------------- */

/* The daemon's rule (config.c): beside its socket, X.sock -> X-status.sock. */
static void status_beside(const char *sock, char *out, size_t n) {
    size_t len = strlen(sock);
    if (len > 5 && strcmp(sock + len - 5, ".sock") == 0) len -= 5;
    snprintf(out, n, "%.*s-status.sock", (int)len, sock);
}

/* What the config file says about the sockets. */
typedef struct conf {
    char daemon_socket[108], status_socket[108];
    unsigned long tcp_port;
    char problem[160]; /* why the default file was not used ("" = it was, or is absent) */
} conf;

#ifdef DPCLIP_HAVE_INIH
static int on_conf(void *user, const char *section, const char *key, const char *value) {
    conf *c = user;
    if (strcmp(section, "daemon") == 0 && strcmp(key, "socket") == 0)
        snprintf(c->daemon_socket, sizeof c->daemon_socket, "%s", value);
    else if (strcmp(section, "status") == 0 && strcmp(key, "socket") == 0)
        snprintf(c->status_socket, sizeof c->status_socket, "%s", value);
    else if (strcmp(section, "status") == 0 && strcmp(key, "tcp_port") == 0)
        c->tcp_port = strtoul(value, NULL, 10);
    return 1; /* the rest is the daemon's to check */
}
#endif

/* Reads `path` into *c. The file named by --config must be readable (else
 * 2, said why); the default one is used if it is (else c->problem says why
 * not, for the messages). 0 or 2. */
static int read_conf(const char *path, bool named, conf *c) {
    int rc = -1;
    memset(c, 0, sizeof *c);
    if (!named && access(path, F_OK) != 0) return 0;
#ifdef DPCLIP_HAVE_INIH
    errno = 0;
    rc = ini_parse(path, on_conf, c);
    if (rc < 0) snprintf(c->problem, sizeof c->problem, "cannot be read: %s", strerror(errno));
    else if (rc > 0)
        snprintf(c->problem, sizeof c->problem,
                 "has a bad line %d (dpclipd --check-config "
                 "--config FILE says more)",
                 rc);
#else
    snprintf(c->problem, sizeof c->problem, "cannot be read: dpclipctl was built without inih");
#endif
    if (rc == 0) return 0;
    if (!named) {
        char keep[sizeof c->problem];
        memcpy(keep, c->problem, sizeof keep);
        memset(c, 0, sizeof *c); /* nothing half-read */
        memcpy(c->problem, keep, sizeof keep);
        return 0;
    }
    fprintf(stderr, "dpclipctl: the config file %s %s; use --socket PATH\n", path, c->problem);
    return 2;
}

/* Where the status socket is (see the top). 0, 1 (none), or 2 (usage). */
static int find_target(const char *config, target *t) {
    const char *st = getenv("DPCLIP_STATUS_SOCKET"), *ds = getenv("DPCLIP_SOCKET");
    char path[256];
    bool same;
    conf c;
    int rc;

    memset(t, 0, sizeof *t);
    if (st && st[0]) {
        snprintf(t->sock, sizeof t->sock, "%s", st);
        snprintf(t->from, sizeof t->from, "$DPCLIP_STATUS_SOCKET");
        return 0;
    }
    if (!config) dc_install_config_path(DPCLIP_BINDIR, path, sizeof path);
    else snprintf(path, sizeof path, "%s", config);
    if ((rc = read_conf(path, config != NULL, &c))) return rc;
    /* The file's status socket is that of the daemon the file describes:
     * it applies unless $DPCLIP_SOCKET names another one. */
    same = !ds || !ds[0] || !c.daemon_socket[0] || strcmp(ds, c.daemon_socket) == 0;
    if (c.status_socket[0] && same && strcmp(c.status_socket, "none") == 0) {
        if (!c.tcp_port) {
            fprintf(stderr,
                    "dpclipctl: the daemon has no status socket (status.socket = none "
                    "in %s) and no status.tcp_port\n",
                    path);
            return 1;
        }
        snprintf(t->url, sizeof t->url, "http://127.0.0.1:%lu", c.tcp_port);
        snprintf(t->from, sizeof t->from, "status.tcp_port in %s", path);
    } else if (c.status_socket[0] && same) {
        snprintf(t->sock, sizeof t->sock, "%s", c.status_socket);
        snprintf(t->from, sizeof t->from, "status.socket in %s", path);
    } else if (ds && ds[0]) {
        status_beside(ds, t->sock, sizeof t->sock);
        snprintf(t->from, sizeof t->from, "the status socket beside $DPCLIP_SOCKET=%s", ds);
    } else if (c.daemon_socket[0]) {
        status_beside(c.daemon_socket, t->sock, sizeof t->sock);
        snprintf(t->from, sizeof t->from, "the status socket beside daemon.socket in %s", path);
    } else {
        snprintf(t->sock, sizeof t->sock, "%s", DEFAULT_SOCKET);
        snprintf(t->from, sizeof t->from, "the default; no $DPCLIP_SOCKET, and %s %s", path,
                 c.problem[0]              ? c.problem
                 : access(path, F_OK) == 0 ? "names no socket"
                                           : "does not exist");
    }
    return 0;
}

/* --- asking it ------------------------------------------------------------------ */

/* Why the Unix socket t->sock took no connection, in our words. */
static void say_unreachable(const target *t) {
    struct sockaddr_un a;
    struct stat st;
    int fd, e = 0;

    if (stat(t->sock, &st) != 0) {
        fprintf(stderr,
                "dpclipctl: no such socket: %s (%s). Is dpclipd running? Name its "
                "status socket with --socket PATH, or the daemon with $DPCLIP_SOCKET or "
                "--config FILE\n",
                t->sock, t->from);
        return;
    }
    if (!S_ISSOCK(st.st_mode)) {
        fprintf(stderr, "dpclipctl: %s (%s) is not a socket\n", t->sock, t->from);
        return;
    }
    memset(&a, 0, sizeof a);
    a.sun_family = AF_UNIX;
    memcpy(a.sun_path, t->sock, strlen(t->sock) + 1); /* < sizeof sun_path: target.sock */
    fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd >= 0 && connect(fd, (struct sockaddr *)&a, sizeof a) != 0) e = errno;
    if (fd >= 0) close(fd);
    if (e == ECONNREFUSED)
        fprintf(stderr,
                "dpclipctl: nothing is listening on %s (%s): dpclipd is not running (a "
                "daemon that did not stop cleanly left the socket behind)\n",
                t->sock, t->from);
    else if (e == EACCES || e == EPERM)
        fprintf(stderr,
                "dpclipctl: %s (%s): permission denied: the status socket's group "
                "and mode (status.socket_group, status.socket_mode) say who may connect\n",
                t->sock, t->from);
    else
        fprintf(stderr, "dpclipctl: cannot connect to %s (%s): %s\n", t->sock, t->from,
                strerror(e ? e : EIO));
}

/* A reply that is not HTTP: our daemon's trainers' socket answers a dpclip
 * frame (a u32 length, then that many bytes: its refusal of the request). */
static void say_not_http(const target *t, const buf *b) {
    const unsigned char *p = (const unsigned char *)b->p;
    if (!t->url[0] && b->len >= 4 &&
        ((uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24) ==
            b->len - 4) {
        char st[128];
        status_beside(t->sock, st, sizeof st);
        fprintf(stderr,
                "dpclipctl: %s (%s) is dpclipd's trainers' socket, not its status "
                "socket; that daemon's status socket is %s unless its status.socket says "
                "otherwise (dpclipctl --socket %s, or DPCLIP_SOCKET=%s dpclipctl)\n",
                t->sock, t->from, st, st, t->sock);
        return;
    }
    fprintf(stderr, "dpclipctl: %s (%s) does not answer HTTP: it is not dpclipd's status %s\n",
            t->url[0] ? t->url : t->sock, t->from, t->url[0] ? "port" : "socket");
}

/* GET path from the daemon; 0 and *out (malloc'd, NUL-terminated) or -1
 * (said why). */
static int fetch(const target *t, const char *path, char **out) {
    char full[512], err[CURL_ERROR_SIZE] = "";
    const char *where = t->url[0] ? t->url : t->sock;
    buf b = {NULL, 0};
    long code = 0;
    CURL *c = curl_easy_init();
    CURLcode rc;
    if (!c) return -1;
    { /* one slash between the base and the path, whichever of them has it */
        const char *base = t->url[0] ? t->url : "http://localhost";
        int blen = (int)strlen(base);
        while (blen > 0 && base[blen - 1] == '/') blen--;
        while (path[0] == '/') path++;
        snprintf(full, sizeof full, "%.*s/%s", blen, base, path);
    }
    curl_easy_setopt(c, CURLOPT_URL, full);
    if (!t->url[0]) curl_easy_setopt(c, CURLOPT_UNIX_SOCKET_PATH, t->sock);
    curl_easy_setopt(c, CURLOPT_WRITEFUNCTION, on_data);
    curl_easy_setopt(c, CURLOPT_WRITEDATA, &b);
    curl_easy_setopt(c, CURLOPT_ERRORBUFFER, err);
    curl_easy_setopt(c, CURLOPT_TIMEOUT, TIMEOUT_S);
    /* whatever answers: we tell what it is, not curl */
    curl_easy_setopt(c, CURLOPT_HTTP09_ALLOWED, 1L);
    rc = curl_easy_perform(c);
    if (rc == CURLE_OK) curl_easy_getinfo(c, CURLINFO_RESPONSE_CODE, &code);
    curl_easy_cleanup(c);
    if (rc == CURLE_COULDNT_CONNECT && !t->url[0]) {
        say_unreachable(t);
    } else if (rc == CURLE_COULDNT_CONNECT) {
        fprintf(stderr,
                "dpclipctl: nothing answers at %s (%s): is dpclipd running with "
                "status.tcp_port set?\n",
                t->url, t->from);
    } else if (rc == CURLE_OPERATION_TIMEDOUT) {
        fprintf(stderr, "dpclipctl: %s (%s) did not answer within %ld s\n", where, t->from,
                TIMEOUT_S);
    } else if ((rc == CURLE_OK && code == 0) || rc == CURLE_WEIRD_SERVER_REPLY ||
               rc == CURLE_UNSUPPORTED_PROTOCOL || rc == CURLE_GOT_NOTHING ||
               rc == CURLE_RECV_ERROR || rc == CURLE_SEND_ERROR) {
        say_not_http(t, &b);
    } else if (rc != CURLE_OK) {
        fprintf(stderr, "dpclipctl: %s (%s): %s\n", where, t->from,
                err[0] ? err : curl_easy_strerror(rc));
    } else if (code != 200) {
        fprintf(stderr, "dpclipctl: GET /%s from %s (%s): HTTP %ld: %s", path, where, t->from, code,
                b.p && b.p[0] ? b.p : "(no body)\n");
    } else {
        *out = b.p ? b.p : strdup("");
        return *out ? 0 : -1;
    }
    free(b.p);
    return -1;
}

/* --- formatting --------------------------------------------------------------- */

static const char *human_bytes(double v, char *out, size_t n) {
    static const char *u[] = {"B", "KiB", "MiB", "GiB", "TiB"};
    int i = 0;
    while (v >= 1024 && i < 4) {
        v /= 1024;
        i++;
    }
    snprintf(out, n, i ? "%.1f %s" : "%.0f %s", v, u[i]);
    return out;
}

static const char *human_secs(double s, char *out, size_t n) {
    if (isnan(s)) snprintf(out, n, "-");
    else if (s < 1e-3) snprintf(out, n, "%.0f us", s * 1e6);
    else if (s < 1) snprintf(out, n, "%.1f ms", s * 1e3);
    else if (s < 120) snprintf(out, n, "%.1f s", s);
    else if (s < 7200) snprintf(out, n, "%.0f min", s / 60);
    else if (s < 172800) snprintf(out, n, "%.1f h", s / 3600);
    else snprintf(out, n, "%.1f d", s / 86400);
    return out;
}

static double num(json_t *o, const char *key) {
    json_t *v = json_object_get(o, key);
    return json_is_number(v) ? json_number_value(v) : NAN;
}

static const char *str(json_t *o, const char *key) {
    const char *s = json_string_value(json_object_get(o, key));
    return s ? s : "";
}

/* A job or client name for a table cell: empty shows as "-". */
static const char *cell(const char *s) { return s && s[0] ? s : "-"; }

/* A name chosen by a client (or a driver) for a column w wide (w < n):
 * control bytes become '?' (a name must not drive the operator's
 * terminal), and a longer name is cut at a character boundary and ends in
 * '~', so that a cut name never passes for a whole one. */
static const char *fit(const char *s, int w, char *out, size_t n) {
    size_t len, keep;
    s = cell(s);
    for (len = 0; s[len] && len + 1 < n; len++)
        out[len] = (unsigned char)s[len] < 0x20 || s[len] == 0x7f ? '?' : s[len];
    out[len] = '\0';
    if (len <= (size_t)w) return out;
    keep = (size_t)w - 1;
    while (keep > 0 && ((unsigned char)out[keep] & 0xc0) == 0x80) keep--;
    out[keep] = '~';
    out[keep + 1] = '\0';
    return out;
}

static const char *eps_str(json_t *job, char *out, size_t n) {
    if (json_is_true(json_object_get(job, "epsilon_infinite"))) snprintf(out, n, "inf");
    else snprintf(out, n, "%.4g", num(job, "epsilon"));
    return out;
}

/* --- commands ------------------------------------------------------------------ */

/* The node-local groups /status reports (today: the sessions of one job):
 * their steps in total, how many of them are running one now, and their
 * ids (as `dpclipctl sessions` lists them). */
static void print_groups(json_t *root) {
    size_t i;
    json_t *s;
    if (!json_array_size(json_object_get(root, "groups"))) return;
    printf("\n%-6s %6s %-20s %8s %7s  %s\n", "GROUP", "UID", "JOB", "STEPS", "RUNNING",
           "SESSION IDS");
    json_array_foreach(json_object_get(root, "groups"), i, s) {
        char ids[256] = "", job[64];
        const size_t room = sizeof ids - 4; /* keeps room for "..." */
        size_t k, used = 0;
        json_t *id;
        json_array_foreach(json_object_get(s, "sessions"), k, id) {
            int n = snprintf(ids + used, room - used, "%s%.0f", k ? "," : "",
                             json_number_value(id));
            if (n < 0 || (size_t)n >= room - used) {
                memcpy(ids + used, "...", 4); /* a long list: no half-printed id */
                break;
            }
            used += (size_t)n;
        }
        printf("%-6s %6.0f %-20s %8.0f %7.0f  %s\n", str(s, "kind"), num(s, "uid"),
               fit(str(s, "job"), 20, job, sizeof job), num(s, "steps"), num(s, "busy"), ids);
    }
}

/* Norm groups (model-parallel ranks whose norms are summed) and their
 * cross-daemon links. */
static void print_norm_groups(json_t *root) {
    size_t i;
    json_t *g;
    if (!json_array_size(json_object_get(root, "norm_groups"))) return;
    printf("\n%-6s %-16s %6s %-11s %-9s %-10s %9s %10s %9s %11s\n", "NGROUP", "NAME", "UID",
           "MEMBERS", "STATE", "DAEMON", "LINK", "REDUCTIONS", "LAST MS", "EXCH. MS");
    json_array_foreach(json_object_get(root, "norm_groups"), i, g) {
        char name[40], members[32], daemon[32];
        snprintf(members, sizeof members, "%.0f/%.0f of %.0f", num(g, "joined"),
                 num(g, "local_members"), num(g, "size"));
        snprintf(daemon, sizeof daemon, "%.0f of %.0f", num(g, "daemon_rank"), num(g, "daemons"));
        printf("%-6.0f %-16s %6.0f %-11s %-9s %-10s %9s %10.0f %9.3f %11.3f\n", num(g, "id"),
               fit(str(g, "name"), 16, name, sizeof name), num(g, "uid"), members, str(g, "state"),
               daemon, str(g, "link"), num(g, "reductions"), num(g, "last_wait_ms"),
               num(g, "last_exchange_ms"));
        if (str(g, "why")[0]) printf("       dissolved: %s\n", str(g, "why"));
    }
}

static void print_status(json_t *root) {
    json_t *d = json_object_get(root, "daemon"), *t = json_object_get(root, "totals");
    json_t *lim = json_object_get(root, "limits"), *led = json_object_get(root, "ledger");
    char a[32];
    size_t i;
    json_t *be;

    printf("dpclipd %s  pid %.0f  up %s%s\n", str(d, "version"), num(d, "pid"),
           human_secs(num(d, "uptime_s"), a, sizeof a),
           json_is_true(json_object_get(d, "stopping")) ? "  (stopping)" : "");
    if (json_is_true(json_object_get(d, "insecure")))
        printf("INSECURE    --insecure-fixed-seed: the noise is predictable, nothing this "
               "daemon computes is private\n");
    if (strcmp(str(root, "view"), "own") == 0)
        printf("view        uid %.0f's sessions and jobs only (status.ops_group sees all)\n",
               num(root, "view_uid"));
    else if (strcmp(str(root, "view"), "aggregate") == 0)
        printf("view        node-wide counts only (TCP callers cannot be told apart)\n");
    printf("socket      %s%s\n", str(d, "socket"),
           json_is_true(json_object_get(d, "socket_activated")) ? "  (from systemd)" : "");
    printf("config      %s\n", cell(str(d, "config_file")));
    printf("log level   %s\n", str(d, "log_level"));
    printf("MPS         %s\n",
           json_is_true(json_object_get(root, "mps_active")) ? "active" : "not active");
    printf("limits      batch %.0f, layers %.0f, frame %s, buffers/session %.0f\n",
           num(lim, "max_batch"), num(lim, "max_layers"),
           human_bytes(num(lim, "max_frame"), a, sizeof a), num(lim, "max_buffers"));
    printf("ledger      %s, %.0f jobs in memory, delta %g, node budget %s\n",
           json_is_true(json_object_get(led, "persistent")) ? cell(str(led, "dir"))
                                                            : "in memory only",
           num(led, "n_jobs"), num(led, "delta"), num(led, "budget_epsilon") > 0 ? "set" : "none");
    if (num(led, "budget_epsilon") > 0)
        printf("            budget epsilon %g at delta %g per job\n", num(led, "budget_epsilon"),
               num(led, "budget_delta"));
    printf("sessions    %zu open, %.0f since start\n",
           json_array_size(json_object_get(root, "sessions")), num(t, "sessions"));
    if (isnan(num(t, "samples"))) /* not shown to this caller: batch sizes */
        printf("steps       %.0f ok, %.0f failed\n\n", num(t, "steps_ok"), num(t, "steps_failed"));
    else
        printf("steps       %.0f ok, %.0f failed, %.0f samples, %.0f layers\n\n",
               num(t, "steps_ok"), num(t, "steps_failed"), num(t, "samples"), num(t, "layers"));
    printf("%-8s %-5s %-28s %6s %16s %16s\n", "BACKEND", "INDEX", "NAME", "BUSY", "WORKSPACE",
           "KEPT");
    json_array_foreach(json_object_get(root, "backends"), i, be) {
        bool cpu = strcmp(str(be, "backend"), "cpu") == 0;
        char name[64], ws[32], kept[32];
        if (cpu) snprintf(name, sizeof name, "%.0f workers", num(be, "workers"));
        else fit(str(be, "name"), 28, name, sizeof name);
        printf("%-8s %-5s %-28s %6.0f %16s %16s\n", str(be, "backend"),
               cpu ? "-" : (snprintf(a, sizeof a, "%.0f", num(be, "index")), a), name,
               num(be, "busy"), cpu ? "-" : human_bytes(num(be, "workspace_bytes"), ws, sizeof ws),
               cpu ? "-" : human_bytes(num(be, "kept_bytes"), kept, sizeof kept));
    }
    print_groups(root);
    print_norm_groups(root);
}

static void print_sessions(json_t *root) {
    size_t i;
    json_t *s;
    printf("%6s %8s %6s %-16s %-20s %8s %6s %7s %10s %7s %9s %13s\n", "ID", "PID", "UID", "CLIENT",
           "JOB", "STEPS", "FAILED", "BUFFERS", "BYTES", "RUNNING", "CONNECTED", "LAST STEP");
    json_array_foreach(json_object_get(root, "sessions"), i, s) {
        char b1[32], b2[32], b3[32], last[40], client[64], job[64];
        double idle = num(s, "idle_s");
        if (isnan(idle)) snprintf(last, sizeof last, "-");
        else snprintf(last, sizeof last, "%s ago", human_secs(idle, b3, sizeof b3));
        printf("%6.0f %8.0f %6.0f %-16s %-20s %8.0f %6.0f %7.0f %10s %7s %9s %13s\n", num(s, "id"),
               num(s, "pid"), num(s, "uid"), fit(str(s, "client"), 16, client, sizeof client),
               fit(str(s, "job"), 20, job, sizeof job), num(s, "steps"), num(s, "steps_failed"),
               num(s, "buffers"), human_bytes(num(s, "buffer_bytes"), b1, sizeof b1),
               json_is_true(json_object_get(s, "busy")) ? "yes" : "no",
               human_secs(num(s, "connected_s"), b2, sizeof b2), last);
    }
    if (!json_array_size(json_object_get(root, "sessions"))) printf("(no sessions)\n");
    print_groups(root);
    print_norm_groups(root);
}

static void print_ledger(json_t *root) {
    json_t *led = json_object_get(root, "ledger"), *j;
    size_t i;
    printf("ledger: %s\n",
           json_is_true(json_object_get(led, "persistent")) ? str(led, "dir") : "in memory only");
    printf("%6s %-24s %13s %9s %10s %8s %10s %9s %7s  %s\n", "UID", "JOB", "OPEN SESSIONS", "STEPS",
           "EPSILON", "DELTA", "EPS BUDGET", "RDP ORDER", "ON DISK",
           "STEPS BY (SAMPLE RATE q, NOISE MULTIPLIER s)");
    json_array_foreach(json_object_get(led, "jobs"), i, j) {
        char e[32], b[32], o[16], hist[256] = "", job[64];
        size_t k, used = 0;
        json_t *h;
        json_array_foreach(json_object_get(j, "history"), k, h) {
            if (used < sizeof hist)
                used += (size_t)snprintf(hist + used, sizeof hist - used, "%s%.0f x (q=%g, s=%g)",
                                         k ? ", " : "", num(h, "steps"), num(h, "sample_rate"),
                                         num(h, "noise_multiplier"));
        }
        /* pairs folded out of the bounded history; data-parallel shares;
         * spent under --insecure-fixed-seed */
        if (num(j, "folded_steps") > 0 && used < sizeof hist)
            used += (size_t)snprintf(hist + used, sizeof hist - used, ", %.0f x (older pairs)",
                                     num(j, "folded_steps"));
        if (num(j, "shares") > 0 && used < sizeof hist)
            used += (size_t)snprintf(hist + used, sizeof hist - used, "; %.0f rank shares",
                                     num(j, "shares"));
        if (json_is_true(json_object_get(j, "insecure")) && used < sizeof hist)
            used += (size_t)snprintf(hist + used, sizeof hist - used, "; INSECURE");
        if (num(j, "budget_epsilon") > 0) snprintf(b, sizeof b, "%.4g", num(j, "budget_epsilon"));
        else snprintf(b, sizeof b, "-");
        if (isnan(num(j, "best_order"))) snprintf(o, sizeof o, "-");
        else snprintf(o, sizeof o, "%g", num(j, "best_order"));
        printf("%6.0f %-24s %13.0f %9.0f %10s %8.2g %10s %9s %7s  %s\n", num(j, "uid"),
               fit(str(j, "job"), 24, job, sizeof job), num(j, "sessions"), num(j, "steps"),
               eps_str(j, e, sizeof e), num(j, "delta"), b, o,
               !json_is_true(json_object_get(led, "persistent")) ? "-"
               : json_is_true(json_object_get(j, "on_disk"))     ? "yes"
                                                                 : "pend",
               hist);
    }
    if (!json_array_size(json_object_get(led, "jobs"))) printf("(no jobs)\n");
}

/* /metrics: one row per sample, histograms summarised (count, mean, and the
 * bucket bound holding the median and the 99th percentile). */
static void print_metrics(char *text) {
    char hname[128] = "", hlabels[256] = "";
    double bounds[64], counts[64], sum = 0;
    int nb = 0;
    printf("%-64s %s\n", "METRIC", "VALUE");
    for (char *line = strtok(text, "\n"); line; line = strtok(NULL, "\n")) {
        char name[128], labels[256] = "", *sp, *br;
        double v;
        if (line[0] == '#' || !line[0]) continue;
        sp = strrchr(line, ' ');
        if (!sp) continue;
        v = strtod(sp + 1, NULL);
        *sp = '\0';
        br = strchr(line, '{');
        snprintf(name, sizeof name, "%.*s", br ? (int)(br - line) : (int)strlen(line), line);
        if (br) snprintf(labels, sizeof labels, "%s", br);
        size_t nl = strlen(name);
        if (nl > 7 && strcmp(name + nl - 7, "_bucket") == 0) {
            /* strip le="..." from the labels to find the series */
            char *le = strstr(labels, "le=\"");
            double bound = le ? (strncmp(le + 4, "+Inf", 4) == 0 ? INFINITY : strtod(le + 4, NULL))
                              : 0;
            if (le) {
                char *end = strchr(le + 4, '"');
                if (le > labels + 1 && le[-1] == ',') le--;
                memmove(le, end + 1, strlen(end + 1) + 1);
                if (strcmp(labels, "{}") == 0) labels[0] = '\0';
            }
            name[nl - 7] = '\0';
            if (strcmp(name, hname) != 0 || strcmp(labels, hlabels) != 0) {
                snprintf(hname, sizeof hname, "%s", name);
                snprintf(hlabels, sizeof hlabels, "%s", labels);
                nb = 0;
            }
            if (nb < 64) {
                bounds[nb] = bound;
                counts[nb++] = v;
            }
            continue;
        }
        if (nl > 4 && strcmp(name + nl - 4, "_sum") == 0) {
            sum = v;
            continue;
        }
        if (nl > 6 && strcmp(name + nl - 6, "_count") == 0 && nb) {
            char row[400], p50[32] = "-", p99[32] = "-", mean[32] = "-";
            for (int q = 0; q < 2; q++) {
                double want = (q ? 0.99 : 0.5) * v;
                for (int i = 0; i < nb && v > 0; i++)
                    if (counts[i] >= want) {
                        snprintf(q ? p99 : p50, 32, isinf(bounds[i]) ? "> max" : "<= %g s",
                                 bounds[i]);
                        break;
                    }
            }
            if (v > 0) snprintf(mean, sizeof mean, "%.3g s", sum / v);
            snprintf(row, sizeof row, "%s%s", hname, hlabels);
            printf("%-64s count %.0f, mean %s, p50 %s, p99 %s\n", row, v, mean, p50, p99);
            nb = 0;
            continue;
        }
        {
            char row[400];
            snprintf(row, sizeof row, "%s%s", name, labels);
            printf("%-64s %.10g\n", row, v);
        }
    }
}

static void usage(FILE *f) {
    char usage_conf[256];
    fprintf(f,
            "usage: dpclipctl [--socket PATH | --url URL | --config FILE] COMMAND\n"
            "  status     the daemon, its backends and totals\n"
            "  sessions   open sessions: pid, uid, client, job, steps, buffers\n"
            "  ledger     privacy ledger: epsilon spent per job (uid + job id)\n"
            "  metrics    the Prometheus metrics as a table\n"
            "  get PATH   the raw body of PATH (/status, /metrics)\n"
            "  --socket PATH  the status socket; default: $DPCLIP_STATUS_SOCKET, else the\n"
            "                 one beside $DPCLIP_SOCKET, else the config file's, else\n"
            "                 " DEFAULT_SOCKET "\n"
            "  --url URL      http://127.0.0.1:PORT instead of the socket\n"
            "  --config FILE  the daemon's config file, to find its status socket\n"
            "                 (default %s)\n"
            "Names cut to fit a column end in '~'.\n",
            (dc_install_config_path(DPCLIP_BINDIR, usage_conf, sizeof usage_conf), usage_conf));
}

static bool known_command(const char *cmd) {
    static const char *k[] = {"status", "sessions", "ledger", "metrics", "get"};
    for (size_t i = 0; i < sizeof k / sizeof k[0]; i++)
        if (strcmp(cmd, k[i]) == 0) return true;
    return false;
}

int main(int argc, char **argv) {
    static const struct option opts[] = {
        {"socket", required_argument, NULL, 's'}, {"url", required_argument, NULL, 'u'},
        {"config", required_argument, NULL, 'c'}, {"help", no_argument, NULL, 'h'},
        {"version", no_argument, NULL, 'V'},      {NULL, 0, NULL, 0}};
    const char *sock = NULL, *url = NULL, *config = NULL, *cmd;
    char *body = NULL;
    target t;
    int c, rc = 1;

    while ((c = getopt_long(argc, argv, "", opts, NULL)) != -1) {
        switch (c) {
        case 's': sock = optarg; break;
        case 'u': url = optarg; break;
        case 'c': config = optarg; break;
        case 'h': usage(stdout); return 0;
        case 'V': printf("dpclipctl %s\n", DPCLIP_VERSION); return 0;
        default: usage(stderr); return 2;
        }
    }
    if (optind >= argc || (strcmp(argv[optind], "get") == 0 && optind + 1 >= argc)) {
        usage(stderr);
        return 2;
    }
    cmd = argv[optind];
    if (!known_command(cmd)) {
        fprintf(stderr, "dpclipctl: unknown command '%s'\n", cmd);
        usage(stderr);
        return 2;
    }
    memset(&t, 0, sizeof t);
    if (url) {
        snprintf(t.url, sizeof t.url, "%s", url);
        snprintf(t.from, sizeof t.from, "--url");
    } else if (sock) {
        if (strlen(sock) >= sizeof t.sock) {
            fprintf(stderr, "dpclipctl: --socket %s: longer than a socket path may be (%zu)\n",
                    sock, sizeof t.sock - 1);
            return 2;
        }
        snprintf(t.sock, sizeof t.sock, "%s", sock);
        snprintf(t.from, sizeof t.from, "--socket");
    } else if ((rc = find_target(config, &t))) {
        return rc;
    }
    rc = 1;
    curl_global_init(CURL_GLOBAL_DEFAULT);
    if (strcmp(cmd, "get") == 0) {
        if (fetch(&t, argv[optind + 1], &body) == 0) {
            fputs(body, stdout);
            rc = 0;
        }
    } else if (strcmp(cmd, "metrics") == 0) {
        if (fetch(&t, "/metrics", &body) == 0) {
            print_metrics(body);
            rc = 0;
        }
    } else if (fetch(&t, "/status", &body) == 0) {
        json_error_t je;
        json_t *root = json_loads(body, 0, &je);
        if (!root) {
            fprintf(stderr,
                    "dpclipctl: %s (%s) answered /status, but not with dpclipd's JSON "
                    "(%s, line %d): is it dpclipd's status endpoint?\n",
                    t.url[0] ? t.url : t.sock, t.from, je.text, je.line);
        } else {
            if (cmd[1] == 't') print_status(root);
            else if (cmd[0] == 's') print_sessions(root);
            else print_ledger(root);
            json_decref(root);
            rc = 0;
        }
    }
    free(body);
    curl_global_cleanup();
    return rc;
}
