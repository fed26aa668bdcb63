/* Waiting for a step's GPU work without burning a core.
 *
 * cudaStreamSynchronize spins: the worker thread took a whole core for the
 * whole step (1.3 cores with a trainer stepping back to back, 0.55 at a
 * 30 ms period). A blocking-sync wait sleeps, but adds the driver's wake-up
 * to every step's round trip. So the wait sleeps in short naps until the
 * predicted completion is near (the recent steps' time per unit of
 * estimated cost, from the moment the step was queued: a step that waits
 * for the trainer's backward pass learns that wait too), spins only inside
 * a window around it, and past the window sleeps on a blocking-sync event. */
#include <time.h>

#include "backend_int.h"
#include "dc_clock.h"

namespace dcb {

namespace {

constexpr uint64_t NAP_NS = 200000;        /* a misprediction costs at most this */
constexpr uint64_t MIN_MARGIN_NS = 150000; /* the window's half-width, at least */

void nap(uint64_t ns) {
    struct timespec ts = {(time_t)(ns / 1000000000u), (long)(ns % 1000000000u)};
    nanosleep(&ts, NULL);
}

} // namespace

cudaError_t wait_stream(cuda_backend *cb, double cost) {
    cudaError_t e;
    if (!cb->ev_done &&
        (e = cudaEventCreateWithFlags(&cb->ev_done, cudaEventBlockingSync |
                                                        cudaEventDisableTiming)) != cudaSuccess) {
        cb->ev_done = NULL;
        return cudaStreamSynchronize(cb->stream);
    }
    if ((e = cudaEventRecord(cb->ev_done, cb->stream)) != cudaSuccess) return e;
    const uint64_t t0 = dc_clock_ns();
    const double units = cost + 0.01; /* launches and copies cost something too */
    const uint64_t pred = (uint64_t)(cb->ns_per_cost * units);
    const uint64_t margin = pred / 8 > MIN_MARGIN_NS ? pred / 8 : MIN_MARGIN_NS;
    const uint64_t open = t0 + (pred > margin ? pred - margin : 0), close = t0 + pred + margin;
    uint64_t t;
    while ((t = dc_clock_ns()) < open) {
        if ((e = cudaEventQuery(cb->ev_done)) != cudaErrorNotReady) goto done;
        nap(open - t < NAP_NS ? open - t : NAP_NS);
    }
    while ((e = cudaEventQuery(cb->ev_done)) == cudaErrorNotReady)
        if (dc_clock_ns() > close) {
            e = cudaEventSynchronize(cb->ev_done);
            break;
        }
done:
    if (e == cudaSuccess) {
        double r = (double)(dc_clock_ns() - t0) / units;
        cb->ns_per_cost = cb->ns_per_cost > 0.0 ? 0.75 * cb->ns_per_cost + 0.25 * r : r;
    }
    return e;
}

} // namespace dcb
