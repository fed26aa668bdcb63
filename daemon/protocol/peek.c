/* See peek.h. The fuzz target tests/fuzz/fuzz_frame.c checks every frame
 * this accepts against protobuf-c's own decoding. */
#include "peek.h"

/* A varint of at most max bytes at p[0, n): its length, with its value in
 * *v (bits past 64 dropped, as protobuf-c's parse_uint64 does), or 0 when it
 * does not end within them. */
static size_t peek_varint(const uint8_t *p, size_t n, size_t max, uint64_t *v) {
    uint64_t x = 0;
    for (size_t i = 0; i < n && i < max; i++) {
        x |= (uint64_t)(p[i] & 0x7f) << (7 * i);
        if (!(p[i] & 0x80)) {
            *v = x;
            return i + 1;
        }
    }
    return 0;
}

int dc_peek_step_key(const uint8_t *payload, size_t n, uint64_t *id, size_t *key_off) {
    size_t k = 0, m;
    uint64_t len;

    *id = 0;
    if (n && payload[0] == DC_WIRE_TAG_ID) {
        if (!(m = peek_varint(payload + 1, n - 1, DC_WIRE_VARINT_MAX, id))) return 0;
        k = 1 + m;
    }
    if (k >= n || payload[k] != DC_WIRE_TAG_CLIP_STEP) return 0;
    m = peek_varint(payload + k + 1, n - k - 1, DC_WIRE_LENGTH_MAX, &len);
    /* the body is the frame's last byte range: no field may follow it */
    if (!m || len != n - k - 1 - m) return 0;
    *key_off = k;
    return 1;
}

uint32_t dc_peek_body(const uint8_t *payload, size_t n) {
    size_t k = 0, m;
    uint64_t v;

    if (n && payload[0] == DC_WIRE_TAG_ID) {
        if (!(m = peek_varint(payload + 1, n - 1, DC_WIRE_VARINT_MAX, &v))) return 0;
        k = 1 + m;
    }
    if (k >= n || !peek_varint(payload + k, n - k, DC_WIRE_VARINT_MAX, &v)) return 0;
    return v >> 3 <= UINT32_MAX ? (uint32_t)(v >> 3) : DC_WIRE_BODY_NONE;
}

const char *dc_wire_body_name(uint32_t body) {
    switch (body) {
    case DC_WIRE_BODY_HELLO: return "hello";
    case DC_WIRE_BODY_REGISTER_BUFFER: return "register_buffer";
    case DC_WIRE_BODY_RELEASE_BUFFER: return "release_buffer";
    case DC_WIRE_BODY_CLIP_STEP: return "clip_step";
    case DC_WIRE_BODY_PING: return "ping";
    case DC_WIRE_BODY_REGISTER_EVENT: return "register_event";
    case DC_WIRE_BODY_JOIN_GROUP: return "join_group";
    default: return "request";
    }
}
