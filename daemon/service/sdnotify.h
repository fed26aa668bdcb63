/* systemd integration through libsystemd: readiness and status
 * notifications (sd_notify), the watchdog, and listening sockets handed over
 * by socket activation (sd_listen_fds). Without libsystemd at build time
 * every call is a no-op and no socket is ever handed over.
 *
 * Socket activation: the daemon matches each passed socket to a configured
 * endpoint by what it is (a Unix stream socket bound to that path, or a TCP
 * socket on that port), so unit files need no FileDescriptorName
 * agreement; sockets nobody claims are closed with a warning. A socket that
 * systemd owns is never unlinked by the daemon: clients connecting while it
 * restarts wait in the backlog instead of failing.
 *
 * Loop thread (or start-up) only. */
#ifndef DC_SDNOTIFY_H
#define DC_SDNOTIFY_H

#include <stdbool.h>
#include <stdint.h>

#include "dc_err.h"

void dc_sd_ready(void);
void dc_sd_reloading(void);
void dc_sd_stopping(void);
void dc_sd_status(const char *fmt, ...) DC_PRINTF(1, 2);
/* The watchdog period systemd expects keep-alives within (0 = none). */
uint64_t dc_sd_watchdog_usec(void);
void dc_sd_watchdog(void);

/* Collects the sockets systemd passed (once; later calls are no-ops).
 * Returns how many there are. */
int dc_sd_listen_init(void);
/* The passed listening Unix stream socket bound to `path`, or -1. The
 * caller owns the returned fd. */
int dc_sd_take_unix(const char *path);
/* The passed listening TCP socket on `port`, or -1. */
int dc_sd_take_tcp(unsigned port);
/* Closes (and reports) passed sockets nobody took. */
void dc_sd_listen_done(void);

#endif
