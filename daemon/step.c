/* dc_step_result lifetime. The step plan itself (step.h) is plain data. */
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
