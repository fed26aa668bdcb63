/* A moving average of recent durations (ns), weighting the newest sample
 * 1/4: what the daemon and libdpclip use to predict when something comes
 * back (a step's end, an early notice, a reply, the next request). */
#ifndef DC_EWMA_H
#define DC_EWMA_H

#include <stdint.h>

/* The first sample sets the average. */
static inline void dc_ewma_add(uint64_t *avg, uint64_t v) { *avg = *avg ? (3 * *avg + v) / 4 : v; }

/* Margin of a polling window around something expected in `ahead_ns`: 2.5%
 * of the wait (the jitter of a trainer's period), and at least 0.3 ms, with
 * the window opened by a timerfd or a timed wait (1.5 ms on the millisecond
 * uv timer). */
static inline uint64_t dc_ewma_margin(uint64_t ahead_ns) {
    return ahead_ns / 40 > 300000u ? ahead_ns / 40 : 300000u;
}

/* The window around something due `run_ns` after `now` (its recent time):
 * from the margin (plus `widen`) before it, never before now, to twice the
 * margin (plus widen) after it: what is late is likelier than what is
 * early. */
static inline void dc_ewma_window(uint64_t now, uint64_t run_ns, uint64_t widen, uint64_t *from,
                                  uint64_t *to) {
    const uint64_t due = now + run_ns, m = dc_ewma_margin(run_ns);
    *from = due > now + m + widen ? due - m - widen : now;
    *to = due + 2 * m + widen;
}

#endif
