/* A moving average of recent durations (ns), weighting the newest sample
 * 1/4: what the daemon and libdpclip use to predict when something comes
 * back (a step's end, an early notice, a reply, the next request). */
#ifndef DC_EWMA_H
#define DC_EWMA_H

#include <stdint.h>

/* The first sample sets the average. */
static inline void dc_ewma_add(uint64_t *avg, uint64_t v) { *avg = *avg ? (3 * *avg + v) / 4 : v; }

#endif
