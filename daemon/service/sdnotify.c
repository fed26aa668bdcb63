#include "sdnotify.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <unistd.h>

#include "log.h"

#ifdef DPCLIP_HAVE_SYSTEMD
#include <netinet/in.h>
#include <systemd/sd-daemon.h>

#define MAX_PASSED 16
static int g_fds[MAX_PASSED];
static int g_n = -1; /* -1: not collected yet */

void dc_sd_ready(void) { sd_notify(0, "READY=1"); }
void dc_sd_reloading(void) { sd_notify(0, "RELOADING=1"); }
void dc_sd_stopping(void) { sd_notify(0, "STOPPING=1"); }
void dc_sd_watchdog(void) { sd_notify(0, "WATCHDOG=1"); }

void dc_sd_status(const char *fmt, ...) {
    char line[256];
    va_list ap;
    if (!getenv("NOTIFY_SOCKET")) return; /* not under systemd: skip formatting */
    va_start(ap, fmt);
    vsnprintf(line, sizeof line, fmt, ap);
    va_end(ap);
    sd_notifyf(0, "STATUS=%s", line);
}

uint64_t dc_sd_watchdog_usec(void) {
    uint64_t usec = 0;
    return sd_watchdog_enabled(0, &usec) > 0 ? usec : 0;
}

int dc_sd_listen_init(void) {
    int n;
    if (g_n >= 0) return g_n;
    g_n = 0;
    /* unset_environment: the variables name this process only; children
     * (none today) must not think they were activated. */
    n = sd_listen_fds(1);
    if (n < 0) {
        dc_log_warn("socket activation: %s", "sd_listen_fds failed");
        return 0;
    }
    if (n > MAX_PASSED) {
        dc_log_warn("socket activation: %d sockets passed, using the first %d", n, MAX_PASSED);
        for (int i = MAX_PASSED; i < n; i++) close(SD_LISTEN_FDS_START + i);
        n = MAX_PASSED;
    }
    for (int i = 0; i < n; i++) g_fds[g_n++] = SD_LISTEN_FDS_START + i;
    if (n) dc_log_info("socket activation: %d listening sockets from systemd", n);
    return g_n;
}

int dc_sd_take_unix(const char *path) {
    dc_sd_listen_init();
    for (int i = 0; i < g_n; i++) {
        int fd = g_fds[i];
        if (fd >= 0 && sd_is_socket_unix(fd, SOCK_STREAM, 1, path, 0) > 0) {
            g_fds[i] = -1;
            return fd;
        }
    }
    return -1;
}

int dc_sd_take_tcp(unsigned port) {
    dc_sd_listen_init();
    for (int i = 0; i < g_n; i++) {
        int fd = g_fds[i];
        if (fd >= 0 && sd_is_socket_inet(fd, AF_UNSPEC, SOCK_STREAM, 1, (uint16_t)port) > 0) {
            g_fds[i] = -1;
            return fd;
        }
    }
    return -1;
}

void dc_sd_listen_done(void) {
    for (int i = 0; i < g_n; i++)
        if (g_fds[i] >= 0) {
            dc_log_warn("socket activation: fd %d matches no configured socket; closing it",
                        g_fds[i]);
            close(g_fds[i]);
            g_fds[i] = -1;
        }
}

#else /* !DPCLIP_HAVE_SYSTEMD */

void dc_sd_ready(void) {}
void dc_sd_reloading(void) {}
void dc_sd_stopping(void) {}
void dc_sd_watchdog(void) {}
void dc_sd_status(const char *fmt, ...) { (void)fmt; }
uint64_t dc_sd_watchdog_usec(void) { return 0; }

int dc_sd_listen_init(void) {
    static bool warned;
    if (getenv("LISTEN_FDS") && !warned) {
        warned = true;
        dc_log_warn("socket activation requested but this dpclipd was built without "
                    "libsystemd; creating its own sockets");
    }
    return 0;
}

int dc_sd_take_unix(const char *path) {
    (void)path;
    return -1;
}

int dc_sd_take_tcp(unsigned port) {
    (void)port;
    return -1;
}

void dc_sd_listen_done(void) {}
#endif
