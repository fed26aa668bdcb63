/* A window (CLOCK_MONOTONIC ns, the clock of uv_hrtime and dc_clock_ns) in
 * which something is expected: a thread that waits for it sleeps until
 * `from`, then polls until `to`, so that what comes then does not pay a
 * sleeping thread's wake-up. The GPU workers wait for their tasks so
 * (daemon/infra/worker.c), an NCCL link's thread for its exchanges
 * (daemon/protocol/nccl_link.c). Under its owner's lock; to = 0: none. */
#ifndef DC_WINDOW_H
#define DC_WINDOW_H

#include <stdbool.h>
#include <stdint.h>

typedef struct dc_window {
    uint64_t from, to;
} dc_window;

static inline void dc_window_clear(dc_window *w) { w->from = w->to = 0; }

/* Sets [from, to), merged with the window set where they overlap
 * (earliest start, latest end). false: ignored (empty, or past at now). */
static inline bool dc_window_set(dc_window *w, uint64_t from, uint64_t to, uint64_t now) {
    if (to <= from || to <= now) return false;
    if (w->to && w->to > from) {
        if (from < w->from) w->from = from;
        if (to > w->to) w->to = to;
    } else {
        w->from = from;
        w->to = to;
    }
    return true;
}

typedef enum dc_window_now {
    DC_WINDOW_NONE = 0, /* no window: sleep until woken */
    DC_WINDOW_OPEN,     /* poll until w->to */
    DC_WINDOW_LATER     /* sleep until w->from */
} dc_window_now;

/* Where `now` stands; a window already past is dropped. */
static inline dc_window_now dc_window_at(dc_window *w, uint64_t now) {
    if (w->to && w->to <= now) dc_window_clear(w);
    if (!w->to) return DC_WINDOW_NONE;
    return w->from <= now ? DC_WINDOW_OPEN : DC_WINDOW_LATER;
}

/* After polling until `end` (the window's end then): spent, unless another
 * was set meanwhile. */
static inline void dc_window_spent(dc_window *w, uint64_t end) {
    if (w->to == end) dc_window_clear(w);
}

#endif
