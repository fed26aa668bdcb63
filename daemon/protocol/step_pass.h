/* Steps in phases (ClipStep.phase): a norm pass kept between steps.
 *
 * A sharded model (FSDP) wants its clipped sums one layer group at a time,
 * so that no full unsharded gradient exists at once. Flat clipping needs
 * each sample's whole norm first: a NORMS step computes every layer's
 * per-sample norms, and the session keeps them here; SUMS steps then name
 * some of those layers again and get their clipped sums with the pass's
 * coefficients (the backends' run_clip, as a norm group's clip phase).
 *
 * What this guards: a SUMS layer is one the pass measured (the same kind,
 * shapes and tensors), each summed at most once, with the pass's batch and
 * clip terms, and its pass's noise: the pass is accounted at its sigma (a
 * data-parallel member where it declares one), and each sums step adds
 * that sigma's noise itself, before anything is written, to the part of
 * each output its rank owns (dc_layer.noise_w / noise_b: validate.c checks
 * them against the outputs, dc_pass_take against the pass; outside data
 * parallelism a range is the whole output). The rest of a data-parallel
 * rank's output is a share, noised by the rank that owns it.
 *
 * Ownership: the session owns its pass (dc_session.pass, one at a time); a
 * SUMS step call owns the n2 and tot copies dc_pass_take gives it. */
#ifndef DC_STEP_PASS_H
#define DC_STEP_PASS_H

#include <stdbool.h>

#include "dc_err.h"
#include "step_call.h"

typedef struct dc_pass dc_pass;

/* The rules of a NORMS or SUMS request that need no pass: flat clipping,
 * no norm group; a NORMS step names no outputs and no signal. */
int dc_pass_check(const dc_step_call *sc, bool grouped, dc_err *e);

/* A NORMS step that ran (sc->n2 filled by the backend's run_norms): fills its
 * result (norms, coefficients, layer norms) and keeps the pass, taking
 * sc->n2. */
int dc_pass_new(dc_step_call *sc, dc_pass **out, dc_err *e);

/* A SUMS step: its noise is the pass's (noise_multiplier, and outside data
 * parallelism whole ranges); matches each of its layers to a layer of the
 * pass not summed yet and marks it summed; gives the call its n2 rows, the
 * pass's totals and each layer's index in the pass (sc->n2, sc->tot,
 * sc->pass_at, owned by the call). p may be NULL (no pass: refused). A sums
 * step carries its pass's ClipStep.logical. */
int dc_pass_take(dc_pass *p, dc_step_call *sc, dc_err *e);

/* A clip phase that runs in a later task than its norms (a sums step's
 * pass; a grouped member's norm phase before the group's reduction) reads
 * client memory the client may have rewritten since. So it checks each
 * layer's seal (step_run.h: a keyed checksum of the data, taken right
 * after the norms) and refuses a layer whose data changed, but for the
 * layers it sums from the daemon's own copy (a kept store): a member's
 * kept layers, and a pass's kept layers without a bias or a tie, which
 * its sums steps must take whole from the store (step_run.c). It clips by
 * totals raised by the bound below, which the pass's reply coefficients
 * include: the margin of the re-measurement this check replaced, kept so
 * that replies and references did not change. dc_phase_margin raises
 * tot[B]. */
#define DC_PHASE_RECHECK_TOL (1.0 / 1024.0)
void dc_phase_margin(double *tot, uint32_t batch);

/* The host bytes a pass of n_layers layers and batch samples holds between
 * its steps (what the pass-memory limits count). */
uint64_t dc_pass_bytes(uint32_t batch, size_t n_layers);

/* A micro-batch's pass (ClipStep.logical) that is not summed whole yet:
 * its logical step's accumulators would miss some of its samples. */
bool dc_pass_pending(const dc_pass *p);
/* The logical step a micro-batch's pass belongs to (0: none). */
uint64_t dc_pass_logical_id(const dc_pass *p);

/* Whether every layer of the pass was summed (the session may drop it). */
bool dc_pass_done(const dc_pass *p);

void dc_pass_free(dc_pass *p);

#endif
