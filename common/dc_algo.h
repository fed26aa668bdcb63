/* How a LINEAR layer's per-sample norms are computed: chosen by cost (AUTO),
 * or forced. Shared by the daemon's step (step.h) and the GPU kernels
 * (cuda/kernels/dcc.h), which must not depend on the daemon's headers. */
#ifndef DC_ALGO_H
#define DC_ALGO_H

typedef enum dc_algo {
    DC_ALGO_AUTO = 0,
    DC_ALGO_DIRECT = 1, /* the per-sample gradient itself */
    DC_ALGO_GHOST = 2   /* its norm from the inputs' and grads' Gram matrices */
} dc_algo;

#endif
