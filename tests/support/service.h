/* Helpers for the node-service tests (test_status.c, test_service.c): HTTP
 * requests to the daemon's status socket, checking the Prometheus text with
 * a real parser, and steps with privacy accounting fields.
 *
 * Ownership: bodies and parsed texts are malloc'd; the caller frees them. */
#ifndef DC_TEST_SERVICE_H
#define DC_TEST_SERVICE_H

#include <stddef.h>
#include <stdint.h>

#include "dpclip.h"
#include "harness.h"

/* One HTTP/1.0 request over a Unix socket (the client side only: the
 * daemon's server is libmicrohttpd). Returns the status code or -1; *head
 * and *body (either may be NULL) get the header block and the body; *ms
 * (may be NULL) the time to the last byte. */
/* Runs a shell command: its exit status (-1 if it did not exit normally),
 * its stdout (and whatever the command sends there, e.g. 2>&1) in out[n],
 * NUL-terminated. DC_SH_NOSTART if the command could not be started. */
#define DC_SH_NOSTART (-2)
int dc_sh(const char *cmd, char *out, size_t n);

int dc_http(const char *sock, const char *method, const char *path, int timeout_ms, char **head,
            char **body, double *ms);

/* The status socket of a harness daemon (derived from its socket path). */
void dc_harness_status_path(const dc_harness *h, char *out, size_t n);

/* Parses Prometheus text exposition with prometheus_client's own parser
 * (text_string_to_metric_families) in a python3 subprocess. Returns 1 and
 * *samples: one line per sample, "name{k="v",...} value" with labels sorted
 * by name; 0 when no python3 with prometheus_client exists (*samples NULL);
 * -1 when the parser rejected the text (its error printed). */
int dc_prom_parse(const char *text, char **samples);
/* A strict line grammar check of the same format, in C (HELP/TYPE lines,
 * metric and label names, label escapes, values): 0, or -1 naming the line. */
int dc_prom_grammar(const char *text);
/* The value of sample `key` (e.g. `dpclip_steps_total{result="ok"}`) in
 * dc_prom_parse's output, or NAN. */
double dc_prom_value(const char *samples, const char *key);

/* A small CPU step (two linear layers, batch B) in a shared buffer on c,
 * with noise multiplier sigma and sample rate q (the ledger's inputs). */
int dc_service_step_init(dc_shm_step *s, dpclip_client *c, uint32_t B, float sigma, double q,
                         uint64_t seed);

/* Spawns DPCLIPD_PATH with args[] (NULL-terminated, without argv[0]) plus
 * `--ready-fd N`, the fds keep[0..n_keep) moved to 3, 4, ... in the child
 * (READY comes on the next fd), and the extra environment env[] ("K=V",
 * NULL-terminated, may be NULL); with LISTEN_FDS among them the child also
 * gets LISTEN_PID = its own pid, as systemd does. Waits up to 20 s for
 * READY. Returns the pid, or -1 (the reason printed). For what
 * dc_harness_start cannot do: socket activation, sd_notify, config files. */
pid_t dc_spawn_daemon(char *const args[], char *const env[], const int *keep, int n_keep);
/* SIGTERM and wait (30 s, then SIGKILL): the exit status, or -1. */
int dc_spawn_stop(pid_t pid);

#endif
