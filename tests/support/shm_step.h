/* Shared-memory steps for tests: a step whose layers are random tensors
 * in one memfd buffer registered on a client, sent through libdpclip and
 * checked against the double-precision reference (ref.h).
 *
 * Ownership: a dc_shm_step owns its dpclip_step, its layers' reference
 * descriptions and one shared-memory buffer registered on the client it
 * was created with (the client itself is the caller's). */
#ifndef DC_TEST_SHM_STEP_H
#define DC_TEST_SHM_STEP_H

#include <stddef.h>
#include <stdint.h>

#include "dpclip.h"
#include "ref.h"

typedef struct dc_shm_step {
    dpclip_client *c; /* not owned */
    uint64_t buf_id;
    uint64_t wire_id; /* the buffer the wire step names (0 = buf_id) */
    uint8_t *base;    /* our mapping of the buffer */
    size_t size, used;
    dpclip_step *step; /* what goes on the wire */
    dc_step ref;       /* the same step for dc_ref_step; tensors point into base */
    size_t cap;        /* of ref.layers */
    dpclip_clip_config cfg;
    /* Reference results, filled by dc_shm_step_check. */
    double *norms, *coefs, *layer_sq, *layer_coefs;
} dc_shm_step;

/* Allocates a `capacity`-byte shared buffer on c (0 = 16 MiB) and an empty
 * step of batch B with cfg. */
int dc_shm_step_init(dc_shm_step *s, dpclip_client *c, size_t capacity, uint32_t B,
                     const dpclip_clip_config *cfg);
/* Makes a random layer with dc_test_layer_make(spec), copies its tensors
 * into the shared buffer and adds it to both the wire step and the
 * reference step. spec->B must equal the step's batch. max_grad_norm: the
 * layer's threshold (PER_LAYER). Returns the layer's index, or -1. */
int dc_shm_step_add(dc_shm_step *s, const dc_test_layer_spec *spec, dc_test_rng *r,
                    float max_grad_norm);
/* Copies a given layer (host tensors, e.g. a slice of another layer) into
 * the shared buffer and adds it to both steps, as dc_shm_step_add does with
 * a random one. src is not changed or freed. Returns the index, or -1. */
int dc_shm_step_add_layer(dc_shm_step *s, const dc_layer *src);
/* Adds ref layers layers[0..n) to another wire step dst (a step in
 * phases naming some of them), with their outputs or without. */
int dc_shm_step_wire_layers(dc_shm_step *s, dpclip_step *dst, const size_t *layers, size_t n,
                            int outputs);
/* Adds every ref layer to another wire step dst, with its outputs, its
 * inputs cut to samples [b0, b0 + nb): a micro-batch of the step's batch
 * (tied pairs are not marked). */
int dc_shm_step_wire_slice(dc_shm_step *s, dpclip_step *dst, uint32_t b0, uint32_t nb);
/* The same for ref layers layers[0..n), with their outputs or without (a
 * micro-batch's norm pass or sums step). */
int dc_shm_step_wire_layers_cut(dc_shm_step *s, dpclip_step *dst, const size_t *layers, size_t n,
                                int outputs, uint32_t b0, uint32_t nb);
/* Adds [B] f32 norms_out / coefs_out tensors in the buffer. */
int dc_shm_step_add_outputs(dc_shm_step *s, int norms, int coefs);
/* Replaces the clipping config (rebuilding the wire step), e.g. to pick C
 * from the reference norms of the data. */
int dc_shm_step_set_config(dc_shm_step *s, const dpclip_clip_config *cfg);
void dc_shm_step_want_layer_norms(dc_shm_step *s, int yes);
/* Makes the wire step name buffer `id` at the same offsets (e.g. a GPU copy
 * of the shared buffer registered over CUDA IPC); 0 = back to the shared
 * buffer. The reference keeps computing on the shared buffer. */
int dc_shm_step_wire_buffer(dc_shm_step *s, uint64_t id);
/* The reference per-sample norms of the current data: out[B]. */
void dc_shm_step_ref_norms(dc_shm_step *s, double *out);
/* The median of the reference norms: a threshold that clips about half. */
double dc_shm_step_median_norm(dc_shm_step *s);
/* Refills every input (activations, grads, indices) of every layer with new
 * random data, as a trainer would for its next batch. */
void dc_shm_step_refill(dc_shm_step *s, dc_test_rng *r);
/* Fills every output tensor (weight/bias grads, norms/coefs out) with v. */
void dc_shm_step_fill_outputs(dc_shm_step *s, float v);
/* Computes the reference for the current data and compares the daemon's
 * result and output tensors with it (noise treated as 0). Returns the worst
 * max_relerr (<= 1 means everything is within rtol/atol) and prints what
 * was off when > 1. */
double dc_shm_step_check(dc_shm_step *s, const dpclip_result *res, double rtol, double atol);
/* Total element count of all weight/bias output tensors, and a copy of them
 * (f32, layer order, weight then bias) into out[] (may be NULL). */
int64_t dc_shm_step_outputs(const dc_shm_step *s, float *out);
/* The reference values of the outputs, same order as dc_shm_step_outputs. */
void dc_shm_step_ref_outputs(dc_shm_step *s, double *out);
void dc_shm_step_free(dc_shm_step *s);

/* The dpclip_dtype of a reference tensor. */
dpclip_dtype dc_shm_dtype(dc_dtype t);

#endif
