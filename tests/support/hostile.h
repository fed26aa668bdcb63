/* The hostile-input tests' fixture (support/hostile.c), shared by
 * tests/test_hostile.c (framing, handshake, buffers) and
 * tests/test_hostile_steps.c (shapes, data, vanishing clients): a daemon with
 * small limits under attack while a well-behaved client keeps running steps
 * checked against the reference. */
#ifndef DC_TEST_HOSTILE_H
#define DC_TEST_HOSTILE_H

#include <stddef.h>
#include <stdint.h>

#include "dpclip.h"
#include "dpclip.pb-c.h"
#include "harness.h"

#define DC_HOSTILE_MAX_BATCH 64
#define DC_HOSTILE_MAX_FRAME 65536

extern dc_harness dc_hostile_h;                 /* the daemon under attack */
extern const dpclip_clip_config dc_hostile_sum; /* the attacks' config: sum, no noise */

/* cmocka group setup/teardown: start the daemon and the good client; stop
 * them (after a failure: the tests below normally do it). */
int dc_hostile_setup(void **state);
int dc_hostile_teardown(void **state);
/* The same setup with other daemon flags, and its stderr (the log) in a
 * file that dc_hostile_log reads (printed at teardown after a failure). */
int dc_hostile_start_logged(const char *args);
/* The fixture daemon's log so far (malloc'd; "" when not captured). */
char *dc_hostile_log(void);
/* A daemon of a test's own, its stderr in log_path (a char[64], filled). */
int dc_hostile_harness_logged(dc_harness *h, const char *args, char *log_path);
/* A whole file (malloc'd, NUL-terminated), or NULL. */
char *dc_hostile_read_file(const char *path);
/* Tests to run last: the good client made progress with exact results and a
 * newcomer is served; then SIGTERM stops the daemon cleanly. */
void dc_hostile_survivors(void **state);
void dc_hostile_clean_shutdown(void **state);
/* The good client's buffer id (another session's: for isolation tests). */
uint64_t dc_hostile_good_buffer(void);

/* Raw protocol: a connected socket after Hello; a frame with a declared
 * length and n bytes of body; the next reply must be an Error with `code`
 * whose field contains `field` (NULL: any) and a message; a Ping answered. */
int dc_hostile_raw_hello(void);
void dc_hostile_send_frame(int fd, uint32_t len, const void *body, size_t n);
void dc_hostile_expect_error(int fd, Dpclip__ErrorCode code, const char *field);
void dc_hostile_expect_pong(int fd, uint64_t id);
int dc_hostile_ends_with(const char *s, const char *suffix);
/* libdpclip connected to the daemon (asserts). */
dpclip_client *dc_hostile_connect(void);

/* A linear step on buffer `buf`: activations [B,T,d] at 0, grads [B,T,p]
 * right after; callers then break one thing. */
typedef struct dc_lin_desc {
    uint32_t B;
    dpclip_linear l;
} dc_lin_desc;
dc_lin_desc dc_hostile_lin_on(uint64_t buf, uint32_t B, int64_t T, int64_t d, int64_t p);
/* Runs a one-layer step; the status (the handle keeps errfield). */
int dc_hostile_run_linear(dpclip_client *c, const dc_lin_desc *x);

#endif
