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

void dc_log(dc_log_level level, const char *fmt, ...) {
    static const char *tags[] = {"error", "warn", "info", "debug"};
    char line[1024];
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
    if (n < sizeof line) vsnprintf(line + n, sizeof line - n, fmt, ap);
    va_end(ap);
    /* One fputs per line so that lines from worker threads never interleave. */
    n = strlen(line);
    if (n + 1 < sizeof line) {
        line[n] = '\n';
        line[n + 1] = '\0';
    }
    fputs(line, stderr);
}
