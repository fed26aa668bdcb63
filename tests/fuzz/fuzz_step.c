/* libFuzzer target: ClipStep decoding and validation against a registry
 * (daemon/protocol/validate.c, registry.c).
 *
 * Input: 8 bytes of buffer sizes (4 x u16 little-endian, + 1: buffers 1..4
 * of 1 to 65536 bytes), then a serialized dpclip.ClipStep. Each buffer is a
 * heap block of exactly its size, so under AddressSanitizer any byte a
 * validated step would have a backend touch outside its buffer is caught.
 *
 * A step that validates is then used as a backend would use it: every
 * input tensor read in full and every output written, over the element
 * counts the backend derives from the layer's dimensions (B, T, d, p,
 * vocab; backend.h), which must also be what the tensor's own shape holds.
 * A mismatch, or a range outside its buffer, aborts (a crash for libFuzzer). */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "dpclip.pb-c.h"
#include "registry.h"
#include "validate.h"

#define FZ_BUFFERS 4

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static void fz_fail(const char *what, size_t layer) {
    fprintf(stderr, "fuzz_step: %s (layer %zu)\n", what, layer);
    abort();
}

/* The buffer holding [p, p + bytes), or abort. */
static void fz_check_range(const dc_registry *reg, const void *p, uint64_t bytes, size_t layer) {
    uintptr_t c = (uintptr_t)p; /* addresses: the blocks are unrelated objects */
    for (size_t i = 0; i < reg->n; i++) {
        uintptr_t b = (uintptr_t)reg->items[i].base;
        if (c >= b && c - b <= reg->items[i].size && bytes <= reg->items[i].size - (c - b)) return;
    }
    fz_fail("a validated tensor is not inside one buffer", layer);
}

static uint64_t fz_numel(const dc_tensor *t) {
    uint64_t n = 1;
    for (int i = 0; i < t->ndim; i++) n *= (uint64_t)t->shape[i];
    return n;
}

static volatile uint8_t fz_sink;

/* Reads (or, for outputs, writes) n elements of t, which must be exactly
 * what its shape holds. */
static void fz_touch(const dc_registry *reg, const dc_tensor *t, uint64_t n, int write,
                     size_t layer) {
    uint64_t bytes;
    if (!t->data) return;
    if (fz_numel(t) != n) fz_fail("a tensor's shape disagrees with its layer's dimensions", layer);
    bytes = n * dc_dtype_size(t->dtype);
    fz_check_range(reg, t->data, bytes, layer);
    if (write) {
        memset(t->data, 0x5a, (size_t)bytes);
    } else {
        uint8_t acc = 0;
        for (uint64_t i = 0; i < bytes; i++) acc ^= ((const uint8_t *)t->data)[i];
        fz_sink = acc;
    }
}

static void fz_use_step(const dc_registry *reg, const dc_step *s) {
    const uint64_t B = s->batch;
    for (size_t i = 0; i < s->n_layers; i++) {
        const dc_layer *l = &s->layers[i];
        uint64_t bt = B * (uint64_t)l->T;
        switch (l->kind) {
        case DC_LAYER_LINEAR:
            fz_touch(reg, &l->input, bt * (uint64_t)l->d, 0, i);
            fz_touch(reg, &l->grad, bt * (uint64_t)l->p, 0, i);
            fz_touch(reg, &l->weight_grad_out, (uint64_t)l->p * (uint64_t)l->d, 1, i);
            fz_touch(reg, &l->bias_grad_out, (uint64_t)l->p, 1, i);
            break;
        case DC_LAYER_EMBEDDING:
            fz_touch(reg, &l->input, bt, 0, i);
            fz_touch(reg, &l->grad, bt * (uint64_t)l->d, 0, i);
            fz_touch(reg, &l->weight_grad_out, (uint64_t)l->vocab * (uint64_t)l->d, 1, i);
            if (l->bias_grad_out.data) fz_fail("an embedding with a bias output", i);
            break;
        case DC_LAYER_LAYERNORM:
        case DC_LAYER_RMSNORM:
            fz_touch(reg, &l->input, bt * (uint64_t)l->d, 0, i);
            fz_touch(reg, &l->grad, bt * (uint64_t)l->d, 0, i);
            fz_touch(reg, &l->weight_grad_out, (uint64_t)l->d, 1, i);
            fz_touch(reg, &l->bias_grad_out, (uint64_t)l->d, 1, i);
            break;
        default: fz_fail("a validated layer of no known kind", i);
        }
        if (!l->input.data || !l->grad.data) fz_fail("a layer without its inputs", i);
    }
    fz_touch(reg, &s->norms_out, B, 1, s->n_layers);
    fz_touch(reg, &s->coefs_out, B, 1, s->n_layers);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    const dc_limits lim = {.max_batch = 64, .max_layers = 16, .max_frame = 1u << 16};
    Dpclip__ClipStep *msg;
    dc_registry reg;
    dc_step step;
    dc_err err;

    if (size < 2 * FZ_BUFFERS) return 0;
    dc_registry_init(&reg);
    for (int i = 0; i < FZ_BUFFERS; i++) {
        dc_buffer b = {.id = (uint64_t)i + 1, .kind = DC_BUFFER_SHM, .device = -1};
        b.size = 1 + ((uint64_t)data[2 * i] | (uint64_t)data[2 * i + 1] << 8);
        b.base = malloc((size_t)b.size);
        if (!b.base || dc_registry_add(&reg, &b, &err)) abort();
        memset(b.base, 0, (size_t)b.size);
    }
    msg = dpclip__clip_step__unpack(NULL, size - 2 * FZ_BUFFERS, data + 2 * FZ_BUFFERS);
    if (msg) {
        if (dc_validate_step(msg, &reg, &lim, &step, &err) == 0) {
            fz_use_step(&reg, &step);
            dc_validate_step_free(&step);
        } else if (!err.msg[0]) {
            fz_fail("a refusal without a message", 0);
        }
        dpclip__clip_step__free_unpacked(msg, NULL);
    }
    /* The blocks are ours (malloc), not mappings for the registry to unmap. */
    for (size_t i = 0; i < reg.n; i++) {
        free(reg.items[i].base);
        reg.items[i].base = NULL;
    }
    dc_registry_destroy(&reg);
    return 0;
}
