/* dpclipctl: reads dpclipd's status endpoint and prints readable tables.
 *
 *   dpclipctl [--socket PATH | --url URL] status|sessions|ledger|metrics|get PATH
 *
 * HTTP through libcurl (over the Unix status socket, or TCP), JSON through
 * jansson. Exit status: 0 ok, 1 the daemon could not be reached or answered
 * an error, 2 usage. */
#include <curl/curl.h>
#include <getopt.h>
#include <jansson.h>
#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define DEFAULT_SOCKET "/run/dpclip/dpclipd-status.sock"

typedef struct buf {
    char *p;
    size_t len;
} buf;

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

/* GET path from the daemon; 0 and *out (malloc'd, NUL-terminated) or -1. */
static int fetch(const char *sock, const char *url, const char *path, char **out) {
    char full[512], err[CURL_ERROR_SIZE] = "";
    buf b = {NULL, 0};
    long code = 0;
    CURL *c = curl_easy_init();
    CURLcode rc;
    if (!c) return -1;
    snprintf(full, sizeof full, "%s%s", url ? url : "http://localhost", path);
    curl_easy_setopt(c, CURLOPT_URL, full);
    if (!url) curl_easy_setopt(c, CURLOPT_UNIX_SOCKET_PATH, sock);
    curl_easy_setopt(c, CURLOPT_WRITEFUNCTION, on_data);
    curl_easy_setopt(c, CURLOPT_WRITEDATA, &b);
    curl_easy_setopt(c, CURLOPT_ERRORBUFFER, err);
    curl_easy_setopt(c, CURLOPT_TIMEOUT, 10L);
    rc = curl_easy_perform(c);
    if (rc == CURLE_OK) curl_easy_getinfo(c, CURLINFO_RESPONSE_CODE, &code);
    curl_easy_cleanup(c);
    if (rc != CURLE_OK) {
        fprintf(stderr, "dpclipctl: %s: %s\n", url ? full : sock, err[0] ? err : curl_easy_strerror(rc));
        free(b.p);
        return -1;
    }
    if (code != 200) {
        fprintf(stderr, "dpclipctl: %s: HTTP %ld: %s", path, code, b.p ? b.p : "\n");
        free(b.p);
        return -1;
    }
    *out = b.p ? b.p : strdup("");
    return *out ? 0 : -1;
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

static const char *eps_str(json_t *job, char *out, size_t n) {
    if (json_is_true(json_object_get(job, "epsilon_infinite"))) snprintf(out, n, "inf");
    else snprintf(out, n, "%.4g", num(job, "epsilon"));
    return out;
}

/* --- commands ------------------------------------------------------------------ */

/* The node-local groups /status reports (today: the sessions of one job). */
static void print_groups(json_t *root) {
    size_t i;
    json_t *s;
    if (!json_array_size(json_object_get(root, "groups"))) return;
    printf("\n%-6s %6s %-20s %8s %4s  %s\n", "GROUP", "UID", "JOB", "STEPS", "BUSY", "SESSIONS");
    json_array_foreach(json_object_get(root, "groups"), i, s) {
        char ids[256] = "";
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
        printf("%-6s %6.0f %-20.20s %8.0f %4.0f  %s\n", str(s, "kind"), num(s, "uid"),
               cell(str(s, "job")), num(s, "steps"), num(s, "busy"), ids);
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
    printf("MPS         %s\n", json_is_true(json_object_get(root, "mps_active")) ? "active" : "not active");
    printf("limits      batch %.0f, layers %.0f, frame %s, buffers/session %.0f\n",
           num(lim, "max_batch"), num(lim, "max_layers"), human_bytes(num(lim, "max_frame"), a, sizeof a),
           num(lim, "max_buffers"));
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
    printf("%-8s %-5s %-28s %6s %16s\n", "BACKEND", "INDEX", "NAME", "BUSY", "WORKSPACE");
    json_array_foreach(json_object_get(root, "backends"), i, be) {
        bool cpu = strcmp(str(be, "backend"), "cpu") == 0;
        char name[64];
        if (cpu) snprintf(name, sizeof name, "%.0f workers", num(be, "workers"));
        printf("%-8s %-5s %-28s %6.0f %16s\n", str(be, "backend"),
               cpu ? "-" : (snprintf(a, sizeof a, "%.0f", num(be, "index")), a),
               cpu ? name : str(be, "name"), num(be, "busy"),
               cpu ? "-" : human_bytes(num(be, "workspace_bytes"), name, sizeof name));
    }
    print_groups(root);
}

static void print_sessions(json_t *root) {
    size_t i;
    json_t *s;
    printf("%6s %8s %6s %-16s %-20s %8s %6s %7s %10s %4s %9s %9s\n", "ID", "PID", "UID",
           "CLIENT", "JOB", "STEPS", "FAILED", "BUFFERS", "BYTES", "BUSY", "CONNECTED",
           "LAST STEP");
    json_array_foreach(json_object_get(root, "sessions"), i, s) {
        char b1[32], b2[32], b3[32];
        printf("%6.0f %8.0f %6.0f %-16.16s %-20.20s %8.0f %6.0f %7.0f %10s %4s %9s %9s\n",
               num(s, "id"), num(s, "pid"), num(s, "uid"), cell(str(s, "client")),
               cell(str(s, "job")), num(s, "steps"), num(s, "steps_failed"), num(s, "buffers"),
               human_bytes(num(s, "buffer_bytes"), b1, sizeof b1),
               json_is_true(json_object_get(s, "busy")) ? "yes" : "no",
               human_secs(num(s, "connected_s"), b2, sizeof b2),
               human_secs(num(s, "idle_s"), b3, sizeof b3));
    }
    if (!json_array_size(json_object_get(root, "sessions"))) printf("(no sessions)\n");
    print_groups(root);
}

static void print_ledger(json_t *root) {
    json_t *led = json_object_get(root, "ledger"), *j;
    size_t i;
    printf("ledger: %s\n", json_is_true(json_object_get(led, "persistent")) ? str(led, "dir")
                                                                            : "in memory only");
    printf("%6s %-24s %8s %9s %10s %8s %8s %6s %5s  %s\n", "UID", "JOB", "SESSIONS", "STEPS",
           "EPSILON", "DELTA", "BUDGET", "ORDER", "DISK", "STEPS BY (SAMPLE RATE, NOISE)");
    json_array_foreach(json_object_get(led, "jobs"), i, j) {
        char e[32], b[32], o[16], hist[256] = "";
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
        printf("%6.0f %-24.24s %8.0f %9.0f %10s %8.2g %8s %6s %5s  %s\n", num(j, "uid"),
               cell(str(j, "job")), num(j, "sessions"), num(j, "steps"), eps_str(j, e, sizeof e),
               num(j, "delta"), b, o,
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
            double bound = le ? (strncmp(le + 4, "+Inf", 4) == 0 ? INFINITY : strtod(le + 4, NULL)) : 0;
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
    fprintf(f, "usage: dpclipctl [--socket PATH | --url URL] COMMAND\n"
               "  status     the daemon, its backends and totals\n"
               "  sessions   open sessions: pid, uid, client, job, steps, buffers\n"
               "  ledger     privacy ledger: epsilon spent per job (uid + job id)\n"
               "  metrics    the Prometheus metrics as a table\n"
               "  get PATH   the raw body of PATH (/status, /metrics)\n"
               "  --socket PATH  the status socket (default $DPCLIP_STATUS_SOCKET, else "
               DEFAULT_SOCKET ")\n"
               "  --url URL      http://127.0.0.1:PORT instead of the socket\n");
}

int main(int argc, char **argv) {
    static const struct option opts[] = {{"socket", required_argument, NULL, 's'},
                                         {"url", required_argument, NULL, 'u'},
                                         {"help", no_argument, NULL, 'h'},
                                         {"version", no_argument, NULL, 'V'},
                                         {NULL, 0, NULL, 0}};
    const char *sock = getenv("DPCLIP_STATUS_SOCKET"), *url = NULL, *cmd;
    char *body = NULL;
    int c, rc = 1;

    if (!sock || !sock[0]) sock = DEFAULT_SOCKET;
    while ((c = getopt_long(argc, argv, "", opts, NULL)) != -1) {
        switch (c) {
        case 's': sock = optarg; break;
        case 'u': url = optarg; break;
        case 'h': usage(stdout); return 0;
        case 'V': printf("dpclipctl %s\n", DPCLIP_VERSION); return 0;
        default: usage(stderr); return 2;
        }
    }
    if (optind >= argc) {
        usage(stderr);
        return 2;
    }
    cmd = argv[optind];
    curl_global_init(CURL_GLOBAL_DEFAULT);
    if (strcmp(cmd, "get") == 0) {
        if (optind + 1 >= argc) {
            usage(stderr);
            rc = 2;
        } else if (fetch(sock, url, argv[optind + 1], &body) == 0) {
            fputs(body, stdout);
            rc = 0;
        }
    } else if (strcmp(cmd, "metrics") == 0) {
        if (fetch(sock, url, "/metrics", &body) == 0) {
            print_metrics(body);
            rc = 0;
        }
    } else if (strcmp(cmd, "status") == 0 || strcmp(cmd, "sessions") == 0 ||
               strcmp(cmd, "ledger") == 0) {
        if (fetch(sock, url, "/status", &body) == 0) {
            json_error_t je;
            json_t *root = json_loads(body, 0, &je);
            if (!root) {
                fprintf(stderr, "dpclipctl: /status is not JSON: %s (line %d)\n", je.text, je.line);
            } else {
                if (cmd[1] == 't') print_status(root);
                else if (cmd[0] == 's') print_sessions(root);
                else print_ledger(root);
                json_decref(root);
                rc = 0;
            }
        }
    } else {
        fprintf(stderr, "dpclipctl: unknown command '%s'\n", cmd);
        usage(stderr);
        rc = 2;
    }
    free(body);
    curl_global_cleanup();
    return rc;
}
