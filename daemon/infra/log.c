#include "log.h"

#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

/* Set at start-up and again by a config reload (SIGHUP, on the loop thread)
 * while workers log: atomic, relaxed (a line logged at the old level during
 * a reload is fine). */
static atomic_int g_level = DC_LOG_INFO;

void dc_log_set_level(dc_log_level level) {
    atomic_store_explicit(&g_level, (int)level, memory_order_relaxed);
}
dc_log_level dc_log_get_level(void) {
    return (dc_log_level)atomic_load_explicit(&g_level, memory_order_relaxed);
}

int dc_log_parse_level(const char *s) {
    static const char *names[] = {"error", "warn", "info", "debug"};
    for (int i = 0; i < 4; i++)
        if (strcmp(s, names[i]) == 0) return i;
    return -1;
}

/* Client-chosen strings (Hello names, job ids, layer names in errors) reach
 * the log inside messages: a newline in one would forge a line of its own
 * (`dpclipd[error]: ...`), a terminal escape would rewrite the operator's
 * screen. Every control byte and the backslash (so that an escape cannot be
 * forged either) are written as C escapes, here, once for every message.
 * Stops before an escape that would not fit; returns the length. */
size_t dc_log_escape(char *out, size_t cap, const char *in) {
    static const char hex[] = "0123456789abcdef";
    size_t n = 0;
    if (!cap) return 0;
    for (const unsigned char *p = (const unsigned char *)in; *p; p++) {
        char esc[4];
        size_t k = 0;
        if (*p == '\\') {
            esc[k++] = '\\';
            esc[k++] = '\\';
        } else if (*p == '\n' || *p == '\r' || *p == '\t') {
            esc[k++] = '\\';
            esc[k++] = *p == '\n' ? 'n' : *p == '\r' ? 'r' : 't';
        } else if (*p < 0x20 || *p == 0x7f) {
            esc[k++] = '\\';
            esc[k++] = 'x';
            esc[k++] = hex[*p >> 4];
            esc[k++] = hex[*p & 15];
        } else {
            esc[k++] = (char)*p;
        }
        if (n + k >= cap) break;
        memcpy(out + n, esc, k);
        n += k;
    }
    out[n] = '\0';
    return n;
}

void dc_log(dc_log_level level, const char *fmt, ...) {
    static const char *tags[] = {"error", "warn", "info", "debug"};
    char msg[1024], line[1280];
    size_t n = 0;
    va_list ap;

    if ((int)level > atomic_load_explicit(&g_level, memory_order_relaxed)) return;
    if (isatty(STDERR_FILENO)) {
        struct timespec ts;
        struct tm tm;
        clock_gettime(CLOCK_REALTIME, &ts);
        gmtime_r(&ts.tv_sec, &tm);
        n = strftime(line, sizeof line, "%H:%M:%S", &tm);
        n += (size_t)snprintf(line + n, sizeof line - n, ".%03ld ", ts.tv_nsec / 1000000);
    }
    n += (size_t)snprintf(line + n, sizeof line - n, "dpclipd[%s]: ", tags[level]);
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    /* Room is left for the newline. */
    if (n + 2 < sizeof line) n += dc_log_escape(line + n, sizeof line - n - 1, msg);
    /* One fputs per line so that lines from worker threads never interleave. */
    line[n] = '\n';
    line[n + 1] = '\0';
    fputs(line, stderr);
}

int dc_log_limit_pass(dc_log_limit *l, uint64_t now_ns, uint64_t period_ns, uint64_t *skipped) {
    if (l->next_ns && now_ns < l->next_ns) {
        l->skipped++;
        return 0;
    }
    *skipped = l->skipped;
    l->skipped = 0;
    l->next_ns = now_ns + period_ns;
    return 1;
}
