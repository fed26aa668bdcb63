/* Frame layout shared by daemon and client: u32 little-endian length, then a
 * protobuf payload (dpclip.Request or dpclip.Reply). */
#ifndef DC_FRAME_H
#define DC_FRAME_H

#include <stdint.h>

#define DC_PROTOCOL_VERSION 1u
#define DC_FRAME_HEADER 4u
#define DC_DEFAULT_MAX_FRAME (1u << 20) /* 1 MiB: requests are references, not data */
#define DC_DEFAULT_MAX_BATCH 16384u
#define DC_DEFAULT_MAX_LAYERS 4096u

static inline void dc_frame_put_len(uint8_t out[4], uint32_t n) {
    out[0] = (uint8_t)n;
    out[1] = (uint8_t)(n >> 8);
    out[2] = (uint8_t)(n >> 16);
    out[3] = (uint8_t)(n >> 24);
}

static inline uint32_t dc_frame_get_len(const uint8_t in[4]) {
    return (uint32_t)in[0] | (uint32_t)in[1] << 8 | (uint32_t)in[2] << 16 | (uint32_t)in[3] << 24;
}

#endif
