/* "Now" for the daemon, libdpclip, the CUDA backend and the tests: one
 * clock, CLOCK_MONOTONIC (the clock uv_hrtime reads on Linux), so stamps and
 * deadlines taken in one place compare with those taken in another. */
#ifndef DC_CLOCK_H
#define DC_CLOCK_H

#include <stdint.h>
#include <time.h>

/* Nanoseconds since an arbitrary point (boot), never going back. */
static inline uint64_t dc_clock_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* The same clock in milliseconds (signed: deadlines are subtracted). */
static inline int64_t dc_clock_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

#endif
