/* The first stage of every request: a connection's byte stream cut into
 * frames (common/dc_frame.h: a u32 length, then a dpclip.Request), with the
 * file descriptors passed alongside (SCM_RIGHTS), and a frame decoded.
 *
 * The session reads into its dc_frame_in when the socket is readable, then
 * takes whole frames out one at a time (dc_frame_next) and hands each back
 * (dc_frame_release) once it has been answered; nothing here calls the
 * session. A descriptor belongs to the frame holding the last byte of the
 * read that brought it (the kernel ends a read at a message that carried
 * descriptors): a frame gets the ones that came with its own bytes, and
 * those that came with bytes no frame took are closed.
 *
 * Loop thread only. Ownership: a dc_frame_in owns its buffer and the
 * descriptors not yet taken; a dc_frame owns its descriptors until
 * dc_frame_release, and its payload points into the reader's buffer, valid
 * until the next dc_frame_read, dc_frame_compact or dc_frame_drop. */
#ifndef DC_FRAME_IN_H
#define DC_FRAME_IN_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "dc_err.h"
#include "dc_frame.h"
#include "dpclip.pb-c.h"
#include "metrics.h"

/* Descriptors held at once: a request needs one (a SHM_FD registration);
 * more than this with one read are closed as they arrive. */
#define DC_FRAME_MAX_FDS 16

typedef struct dc_frame_in {
    /* Bytes received: buf[off, len) not taken yet. base is the stream
     * offset of buf[0], so that descriptors can be matched to frames. */
    uint8_t *buf;
    size_t len, cap, off;
    uint64_t base;
    struct {
        int fd;
        uint64_t pos;
    } fds[DC_FRAME_MAX_FDS];
    int nfds;
    bool eof; /* the peer finished sending */
} dc_frame_in;

typedef struct dc_frame {
    const uint8_t *payload;    /* in the reader's buffer */
    uint32_t len;              /* DC_FRAME_TOO_LONG: the length the header claims */
    int fds[DC_FRAME_MAX_FDS]; /* passed with this frame's bytes; owned */
    int nfds;
} dc_frame;

typedef enum dc_frame_status {
    DC_FRAME_NONE = 0, /* no whole frame buffered */
    DC_FRAME_OK,       /* *f is the next frame */
    DC_FRAME_TOO_LONG  /* the next frame's length is over the maximum */
} dc_frame_status;

void dc_frame_in_init(dc_frame_in *in);
/* Frees the buffer and closes every descriptor not taken. */
void dc_frame_in_free(dc_frame_in *in);

/* Reads what the non-blocking socket has, stopping once `limit` bytes are
 * buffered (a whole frame at the maximum: process it first). Sets in->eof
 * when the peer has finished. 0, or -1 when the socket failed (errno) or
 * out of memory. */
int dc_frame_read(dc_frame_in *in, int fd, size_t limit);
/* Bytes buffered and not taken. */
size_t dc_frame_buffered(const dc_frame_in *in);
/* A frame has begun: at least its length is buffered. */
bool dc_frame_started(const dc_frame_in *in);
/* The whole frames buffered, without taking them: from *pos = 0, each
 * call gives the next one's payload and length and moves *pos past it;
 * false when no whole frame follows. */
bool dc_frame_peek(const dc_frame_in *in, size_t *pos, const uint8_t **payload, uint32_t *len);
/* Takes the next frame if it is whole and at most `max` bytes. */
dc_frame_status dc_frame_next(dc_frame_in *in, uint32_t max, dc_frame *f);
/* Closes the frame's descriptors (what a request keeps, it has mapped or
 * duplicated). */
void dc_frame_release(dc_frame *f);
/* Gives back the space of the frames taken (payloads taken are invalid). */
void dc_frame_compact(dc_frame_in *in);
/* Forgets every byte buffered: the stream is beyond recovery, or the
 * connection is closing. */
void dc_frame_drop(dc_frame_in *in);

/* The frame's payload as a Request (free with
 * dpclip__request__free_unpacked), or NULL with *e (PROTOCOL, field
 * "request"). A request whose body this daemon does not know decodes; its
 * body_case says so. */
Dpclip__Request *dc_frame_decode(const dc_frame *f, dc_err *e);
/* What the metrics count a request as (NULL: not a request). */
dc_req_kind dc_frame_kind(const Dpclip__Request *req);

#endif
