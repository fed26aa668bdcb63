/* Reading a Request's wire bytes without decoding them: which frames the
 * step cache's fast path (session_requests.c, session_step.c) may take without
 * protobuf-c, and their id; and which request a waiting frame is.
 *
 * The cache keys a step by the bytes of its clip_step field. That is sound
 * only where those bytes alone decide what the decoder makes of the frame:
 * the frame is an optional id field followed by exactly one clip_step field
 * that runs to its end, each as protobuf-c accepts it. Then the frame
 * decodes, with that id, exactly when the same field decoded before (under
 * any id), to the same ClipStep. Every other frame (fields in another order,
 * a second id, trailing fields, a varint protobuf-c refuses) is decoded. */
#ifndef DC_PEEK_H
#define DC_PEEK_H

#include <stddef.h>
#include <stdint.h>

/* The tags, one byte each: Request.id (field 1, varint) and
 * Request.clip_step (field 13, length-delimited). */
typedef enum dc_wire_tag { DC_WIRE_TAG_ID = 0x08, DC_WIRE_TAG_CLIP_STEP = 0x6a } dc_wire_tag;

/* protobuf-c's bounds (protobuf-c.c: scan_varint, scan_length_prefix): a
 * varint ends within 10 bytes, a length prefix within 5. */
#define DC_WIRE_VARINT_MAX 10u
#define DC_WIRE_LENGTH_MAX 5u

/* 1 if payload[0, n) is [id field] clip_step field, as above: *id is the id
 * it decodes to (0 when absent, as proto3 has it) and *key_off where the
 * clip_step field starts (the cache's key runs from there to the end).
 * 0 otherwise. */
int dc_peek_step_key(const uint8_t *payload, size_t n, uint64_t *id, size_t *key_off);

/* Request.body's fields (their numbers in proto/dpclip.proto). */
typedef enum dc_wire_body {
    DC_WIRE_BODY_NONE = 0,
    DC_WIRE_BODY_HELLO = 10,
    DC_WIRE_BODY_REGISTER_BUFFER = 11,
    DC_WIRE_BODY_RELEASE_BUFFER = 12,
    DC_WIRE_BODY_CLIP_STEP = 13,
    DC_WIRE_BODY_PING = 14,
    DC_WIRE_BODY_REGISTER_EVENT = 15,
    DC_WIRE_BODY_JOIN_GROUP = 16
} dc_wire_body;

/* Which request a frame is, for a log line about a frame not yet decoded:
 * the number of its first field after an optional id (DC_WIRE_BODY_NONE:
 * none, or a varint that does not end). The frame may still not decode. */
uint32_t dc_peek_body(const uint8_t *payload, size_t n);
/* Its name in the protocol ("register_buffer"), or "request" for others. */
const char *dc_wire_body_name(uint32_t body);

#endif
