/* Test harness: start and stop a real dpclipd, talk raw wire to it, and
 * build shared-memory steps whose results can be checked against the
 * double-precision reference (shm_step.h, included).
 *
 * Ownership: a dc_harness owns its temp dir and the daemon process. Replies
 * from dc_raw_read_reply are freed with dpclip__reply__free_unpacked. */
#ifndef DC_TEST_HARNESS_H
#define DC_TEST_HARNESS_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "dpclip.h"
#include "dpclip.pb-c.h"
#include "ref.h"

/* --- the daemon ------------------------------------------------------------ */

typedef struct dc_harness {
    pid_t pid;      /* dpclipd, or 0 */
    char dir[256];  /* temp dir holding the socket */
    char sock[300]; /* <dir>/d.sock */
} dc_harness;

/* Starts DPCLIPD_PATH on <tmpdir>/d.sock with a fixed noise seed (tests
 * only), plus extra_args (space-separated, may be NULL), and waits up to
 * 20 s for READY on fd 3. 0 on success; on failure prints why. */
int dc_harness_start(dc_harness *h, const char *extra_args);
/* SIGTERM, waits for the exit (up to 30 s, then SIGKILL) and removes the
 * dir. Returns the daemon's exit status (0 = clean), or -1 if it did not
 * exit by itself or died from a signal. */
int dc_harness_stop(dc_harness *h);
/* As dc_harness_stop for a daemon already told to stop (no signal sent: a
 * second SIGTERM may land as the daemon closes its signal watchers, when
 * the default action applies). */
int dc_harness_join(dc_harness *h);
/* 1 while the daemon process is running. */
int dc_harness_alive(const dc_harness *h);

/* --- raw wire, for hostile tests ----------------------------------------- */

/* A connected blocking socket, or -1. */
int dc_raw_connect(const char *sock);
/* All of [buf, buf+n), without SIGPIPE. 0 or -1. */
int dc_raw_send(int fd, const void *buf, size_t n);
/* Packs req into one frame and sends it. 0 or -1. */
int dc_raw_send_request(int fd, const Dpclip__Request *req);
/* Same, with pass_fd attached as SCM_RIGHTS to the frame's first byte. */
int dc_raw_send_request_fd(int fd, const Dpclip__Request *req, int pass_fd);
/* A sealed memfd of `size` bytes registered on a raw connection (after
 * hello): the daemon's buffer id, or 0. *map (may be NULL) gets a shared
 * mapping of it (munmap(size) when done). */
uint64_t dc_raw_register_memfd(int fd, uint64_t req_id, size_t size, void **map);
/* One reply frame, or NULL on EOF, timeout (timeout_ms) or a bad frame. */
Dpclip__Reply *dc_raw_read_reply(int fd, int timeout_ms);
/* Waits up to timeout_ms for the peer to close: 1 closed, 0 not. Data that
 * arrives first is discarded. */
int dc_raw_wait_eof(int fd, int timeout_ms);
/* Hello with protocol 1 and reads the HelloReply: 0 on success. */
int dc_raw_hello(int fd, uint64_t req_id);
/* The Error of a reply, or NULL if it is not one. */
const Dpclip__Error *dc_raw_error(const Dpclip__Reply *r);

/* A client connected with `client_name` and `job_id` (a 10 s timeout);
 * fails the calling cmocka test, printing why, if the connect fails. */
dpclip_client *dc_harness_connect(const dc_harness *h, const char *client_name, const char *job_id);

#include "shm_step.h"

#endif
