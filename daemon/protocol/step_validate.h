/* The first stage of a ClipStep: what it asks, checked before anything is
 * held for it. Every field (validate.c: dtypes, shapes, byte ranges,
 * limits.*) becomes a dc_step; then what it names of the session: its
 * device among the daemon's GPUs, its events among those the session
 * registered, an early notice only with a signal event. Refusals name the
 * field.
 *
 * The plan cache lets the same step skip decoding and validation: a
 * trainer sends the same ClipStep every iteration (the same tensors of the
 * same registered buffers; PyTorch's caching allocator hands back the same
 * blocks). Decoding and validating 70-odd layers costs tens of microseconds
 * on the loop thread per step, so the session keeps the last step that
 * validated with the bytes of its clip_step field: the same bytes under the
 * same registry generation (no buffer added or released since) and the same
 * limits validate to the same step, and are taken from the plan. Only frames
 * whose id and step those bytes alone decide are keyed (peek.h): any other
 * frame is decoded, so the cache never answers what the decoder would
 * refuse, nor with another id. Everything that depends on other state
 * (events, device, budget) is checked again on every step. */
#ifndef DC_STEP_VALIDATE_H
#define DC_STEP_VALIDATE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "dpclip.pb-c.h"
#include "registry.h"
#include "step_call.h"
#include "validate.h"

/* The last ClipStep that validated: the request's bytes after its id, the
 * registry generation and limits it was validated under, and the result.
 * Owned by the session (dc_session.plan). */
typedef struct dc_step_plan {
    uint8_t *bytes;
    size_t len;
    uint64_t reg_gen;
    dc_limits limits;
    dc_step step; /* owns step.layers */
    struct dc_step_params params;
} dc_step_plan;

/* The request's fields: sc->step (owned) and sc->params. Nothing is held on
 * refusal. */
int dc_step_validate(dc_step_call *sc, const Dpclip__ClipStep *m, const dc_registry *reg,
                     const dc_limits *lim, dc_err *e);
/* What the step names of the session: its device (n_gpus: the daemon's),
 * its events as the session found them under sc->params' ids (NULL: not
 * registered, or not asked for), and an early notice. Sets sc->wait_event,
 * sc->signal_event and sc->notify. */
int dc_step_validate_names(dc_step_call *sc, int n_gpus, const struct dc_session_event *wait,
                           const struct dc_session_event *signal, dc_err *e);

/* A copy of the step that just validated from key[0, key_len) (NULL when
 * out of memory: that only costs the next step its cache hit). */
dc_step_plan *dc_step_plan_new(const dc_step_call *sc, const uint8_t *key, size_t key_len,
                               uint64_t reg_gen, const dc_limits *lim);
void dc_step_plan_free(dc_step_plan *p);
/* Whether p validated these bytes under this registry generation and these
 * limits, so that they validate to p's step again. */
bool dc_step_plan_matches(const dc_step_plan *p, const uint8_t *key, size_t key_len,
                          uint64_t reg_gen, const dc_limits *lim);
/* sc's step and params from p: the layers are borrowed (sc->cached), so p
 * must outlive the call. */
void dc_step_plan_use(const dc_step_plan *p, dc_step_call *sc);

#endif
