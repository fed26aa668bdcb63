/* dc_step_result lifetime and the step's cost estimate. The step itself
 * (step.h) is plain data. */
#include <stdlib.h>
#include <string.h>

#include "step.h"

int dc_step_result_init(dc_step_result *r, uint32_t batch, size_t n_layers, bool per_layer) {
    r->batch = batch;
    r->n_layers = n_layers;
    r->compute_ns = 0;
    memset(r->phase_ns, 0, sizeof r->phase_ns);
    r->released = false;
    r->layer_coefs = NULL;
    r->norms = calloc(batch, sizeof(float));
    r->coefs = calloc(batch, sizeof(float));
    /* n_layers may be 0 for an empty step; keep a valid pointer anyway. */
    r->layer_norms = calloc(n_layers ? n_layers * (size_t)batch : 1, sizeof(float));
    if (per_layer) r->layer_coefs = calloc(n_layers ? n_layers * (size_t)batch : 1, sizeof(float));
    if (!r->norms || !r->coefs || !r->layer_norms || (per_layer && !r->layer_coefs)) {
        dc_step_result_free(r);
        return DC_ENOSPACE;
    }
    return DC_OK;
}

void dc_step_result_free(dc_step_result *r) {
    free(r->norms);
    free(r->coefs);
    free(r->layer_norms);
    free(r->layer_coefs);
    r->norms = r->coefs = r->layer_norms = r->layer_coefs = NULL;
}

static double tensor_elems(const dc_tensor *t) {
    double n = t->data ? 1.0 : 0.0;
    for (int i = 0; i < t->ndim; i++) n *= (double)t->shape[i];
    return n;
}

/* Doubles: products of client-chosen dimensions may pass 2^64, and an
 * estimate only has to be compared with a limit. */
void dc_step_cost_estimate(const dc_step *s, dc_step_cost *c) {
    double B = s->batch, L = (double)s->n_layers, LB = L * B;
    double flops = 0.0, scratch = 0.0, staged = 0.0, idx = 0.0;
    bool host = s->device < 0;
    for (size_t l = 0; l < s->n_layers; l++) {
        const dc_layer *ly = &s->layers[l];
        double T = (double)ly->T, d = (double)ly->d, p = (double)ly->p, rows = B * T;
        double f = 0.0, mem = 0.0;
        switch (ly->kind) {
        case DC_LAYER_LINEAR:
            /* norms: direct 2Tdp or ghost 2T^2(d+p) per sample; clipped sum:
             * one GEMM of 2 B T d p */
            f = (dc_linear_pick(ly) == DC_ALGO_DIRECT || ly->T == 1 ? 2.0 * T * d * p
                                                                      : 2.0 * T * T * (d + p)) *
                    B +
                2.0 * rows * d * p;
            mem = 4.0 * rows * (d + p) + (dc_linear_pick(ly) == DC_ALGO_GHOST ? 8.0 * T * T : 0.0) +
                  4.0 * rows * p; /* f32 copies, Grams, the scaled g of the sum */
            break;
        case DC_LAYER_EMBEDDING:
            f = 4.0 * rows * d;
            mem = 4.0 * rows * d + 16.0 * T + 8.0 * d;
            idx += 8.0 * rows;
            break;
        case DC_LAYER_LAYERNORM:
        case DC_LAYER_RMSNORM:
            f = 16.0 * rows * d;
            mem = 8.0 * rows * d + 32.0 * d;
            break;
        }
        if (dc_layer_tied_later(ly)) {
            /* the cross term of a tied pair: a Gram of the two uses'
             * positions per sample, and the embedding's grads as f32 */
            const dc_layer *o = &s->layers[ly->tie - 1];
            double Te = (double)(ly->kind == DC_LAYER_EMBEDDING ? ly->T : o->T);
            double Tl = (double)(ly->kind == DC_LAYER_LINEAR ? ly->T : o->T);
            f += 2.0 * B * Te * Tl * d;
            mem += 4.0 * Te * Tl + 4.0 * B * Te * d;
        }
        flops += f;
        if (mem > scratch) scratch = mem;
        staged += 4.0 * (tensor_elems(&ly->weight_grad_out) + tensor_elems(&ly->bias_grad_out));
    }
    /* tables: n2 (double), per-layer norms and coefficients, the result's
     * arrays; the reply carries norms and coefficients, and per layer when
     * asked */
    double tables = LB * (8.0 + 4.0 + 4.0 + 4.0) + B * 16.0;
    double reply = B * 8.0 + (s->want_layer_norms ? LB * 4.0 : 0.0) +
                   (s->mode == DC_CLIP_PER_LAYER ? LB * 4.0 : 0.0);
    double bytes = tables + reply + (host ? scratch + staged + idx : 0.0);
    c->samples = LB > 1.8e19 ? UINT64_MAX : (uint64_t)LB;
    c->host_bytes = bytes > 1.8e19 ? UINT64_MAX : (uint64_t)bytes;
    c->gflop = flops / 1e9;
}
