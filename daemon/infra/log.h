/* Daemon logging: one line per event on stderr (journald adds the time when
 * run as a service; we add it ourselves only when stderr is a terminal).
 * The level is process-wide and set once at start-up by main.c. */
#ifndef DC_LOG_H
#define DC_LOG_H

#include <stddef.h>
#include <stdint.h>

#include "dc_err.h"

typedef enum dc_log_level {
    DC_LOG_ERROR = 0,
    DC_LOG_WARN = 1,
    DC_LOG_INFO = 2,
    DC_LOG_DEBUG = 3
} dc_log_level;

void dc_log_set_level(dc_log_level level);
dc_log_level dc_log_get_level(void);
/* Parses "error", "warn", "info", "debug"; returns -1 if unknown. */
int dc_log_parse_level(const char *s);
/* One line on stderr. Control bytes and backslashes in the formatted
 * message come out as C escapes (\n, \x1b, \\): client strings inside
 * it cannot forge lines. */
void dc_log(dc_log_level level, const char *fmt, ...) DC_PRINTF(2, 3);
/* That escaping into out[cap] (NUL-terminated, cut before an escape that
 * does not fit); returns the length written. */
size_t dc_log_escape(char *out, size_t cap, const char *in);

/* For conditions that can recur thousands of times a second (accept out of
 * fds, a flood of refused connections): at most one line per period. */
typedef struct dc_log_limit {
    uint64_t next_ns; /* uv_hrtime-style clock: when the next line may go */
    uint64_t skipped; /* occurrences not logged since the last line */
} dc_log_limit;
/* 1 if a line may be logged at now_ns (then *skipped gets the occurrences
 * held back before it and the count restarts), else 0 (counted). */
int dc_log_limit_pass(dc_log_limit *l, uint64_t now_ns, uint64_t period_ns, uint64_t *skipped);

#define dc_log_error(...) dc_log(DC_LOG_ERROR, __VA_ARGS__)
#define dc_log_warn(...) dc_log(DC_LOG_WARN, __VA_ARGS__)
#define dc_log_info(...) dc_log(DC_LOG_INFO, __VA_ARGS__)
#define dc_log_debug(...) dc_log(DC_LOG_DEBUG, __VA_ARGS__)

#endif
