/* Daemon logging: one line per event on stderr (journald adds the time when
 * run as a service; we add it ourselves only when stderr is a terminal).
 * The level is process-wide and set once at start-up by main.c. */
#ifndef DC_LOG_H
#define DC_LOG_H

#include <stddef.h>

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

#define dc_log_error(...) dc_log(DC_LOG_ERROR, __VA_ARGS__)
#define dc_log_warn(...) dc_log(DC_LOG_WARN, __VA_ARGS__)
#define dc_log_info(...) dc_log(DC_LOG_INFO, __VA_ARGS__)
#define dc_log_debug(...) dc_log(DC_LOG_DEBUG, __VA_ARGS__)

#endif
