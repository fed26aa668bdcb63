/* The plain descriptors the kernels take and their device primitives
 * read (dcc.h declares the launchers): the DPCLIP_CUDA_* switches, a
 * LINEAR layer, a step's output and its noise. Plain C; sees only common/. */
#ifndef DC_DCC_TYPES_H
#define DC_DCC_TYPES_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "dc_dtype.h"

/* The DPCLIP_CUDA_* switches (docs/gpu.md), for A/B comparisons and tests:
 * read from the environment once, where a backend is made
 * (dcc_options_from_env, options.cu, the one reader), and passed down to
 * the kernels' choosers (dcc_linear.opt; NULL means the defaults). */
/* dcc_options.sgrad */
enum { DCC_SGRAD_OFF = 0, DCC_SGRAD_AUTO = 1, DCC_SGRAD_ALL = 2 };
/* dcc_options.bk_direct */
enum { DCC_DIRECT_OFF = 0, DCC_DIRECT_AUTO = 1, DCC_DIRECT_ALWAYS = 2 };

typedef struct dcc_options {
    bool tf32;                  /* TF32=0: f32 inputs on the exact f32 kernels */
    bool grouped;               /* GROUPED=0: per-layer launches only */
    int grouped_min;            /* GROUPED_MIN: work items a step needs to group; -1: 4 per SM */
    int grouped_layers;         /* GROUPED_LAYERS: most layers a grouped launch takes (1-80;
                           more means 80) */
    bool one_pass;              /* ONE_PASS=0: outputs always staged and committed */
    int bk_direct;              /* BK_DIRECT=0: the grouped clipped sums always staged;
                           DCC_DIRECT_ALWAYS (tests): even where an output may not
                           fit its dtype (the check, then the commit, make them) */
    int noise;                  /* NOISE=exact: DCC_NOISE_EXACT, else DCC_NOISE_FAST */
    bool profile;               /* PROFILE=0: the phases are not timed */
    bool wgmma;                 /* WGMMA=0: the mma.sync kernels instead of wgmma */
    bool pdl;                   /* PDL=0: a split tail's launch waits for all unsplit CTAs */
    bool persist;               /* DIRECT_PERSIST=0: a split tail's whole waves one CTA a tile */
    int sgrad;                  /* SGRAD=0: no per-sample gradients kept (a GEMM clipped sum);
                          =all: every layer that can (tests); else dcc_sgrad_worth's */
    int direct_tile;            /* DIRECT_TILE: 128 or 256 rows; 0: the cost model's */
    int direct_split;           /* DIRECT_SPLIT: every tile split 1-3 ways; 0: the model's */
    int tail_k;                 /* DIRECT_TAIL=K[:N]: a K-way tail (2, 3, 4 or 6); 0: none */
    long long tail_after;       /* ... after N unsplit tiles; -1: the whole waves */
    int ghost_tail_k;           /* GHOST_TAIL=K[:N]: the ghost form's tail on K-CTA clusters
                          (2, 3, 4 or 6); 1: never split; 0: the model's */
    long long ghost_tail_after; /* ... after N unsplit items; -1: the whole waves */
    long long ghost_wide;       /* GHOST_WIDE=N: the first N wide ghost items wide (0: none,
                             stored as -1); 0: the model's */
    int out_blocks;             /* OUT_BLOCKS: most blocks an output pass launches (tests:
                          many chunks a block); 0: as many as the SMs hold at once */
} dcc_options;

/* Whether a split tail's launch may overlap the unsplit one (NULL: the
 * defaults, which let it). */
static inline bool dcc_pdl_on(const dcc_options *o) { return !o || o->pdl; }

/* A LINEAR layer's data: a [B,T,d] of dtype ta, g [B,T,p] of dtype tg.
 * tf32: f32 inputs may run on TF32 tensor cores (10-bit mantissas, f32
 * accumulation); false keeps them on the exact f32 CUDA-core kernels.
 * opt: the switches the kernels' choosers follow (NULL: the defaults). */
typedef struct dcc_linear {
    const void *a;
    const void *g;
    dc_dtype ta, tg;
    int B;
    int T, d, p;
    bool has_bias;
    bool tf32;
    const dcc_options *opt;
    /* dcc_linear_bias_ws_bytes of device scratch for the wgmma direct form's
     * bias sums, which it then spreads over all tiles; NULL: the tiles of
     * column 0 sum them (a sixth longer than the others) */
    void *bias_ws;
} dcc_linear;

/* status word bits (one per step) */
#define DCC_STATUS_INPUT 1u  /* a non-finite squared norm or a flagged sample */
#define DCC_STATUS_OUTPUT 4u /* an output value not finite in its dtype */

/* One output of a step: `n` f32 values at staging + off, to be written to
 * dst (dtype) with noise stream `stream`. chunk0: index of its first
 * DCC_OUT_CHUNK-element chunk in the step's chunk grid (the sum of
 * dcc_out_chunks over the outputs before it). */
typedef struct dcc_out {
    void *dst;
    uint64_t off;
    uint64_t n;
    uint32_t stream;
    int32_t dtype;
    uint64_t chunk0;
    /* its noise's Philox key and step: the step's own, or for a layer
     * replicated over a norm group the group's, so that every member draws
     * the same noise for it */
    uint64_t key, step;
    /* 1: the grouped clipped sum writes it whole and finds its max |.| in
     * its epilogue (dcc_bk_layer.amax_*): dcc_out_check does not scan it */
    uint32_t amax_found;
    /* nonzero: the sum of kept per-sample gradients (sgrad.cu) draws this
     * output's noise, after the output check: with mode 1 it writes the
     * output itself, and the output passes leave it alone; otherwise it
     * writes the noised sums into staging, for the passes to divide and
     * commit without adding noise */
    uint32_t noised;
    /* for a noised output: a bound on its sums' |.| known before they are
     * made, which dcc_out_check takes instead of their max (each sample
     * adds at most C, its clipped norm, to any element; 0: none known, and
     * the step is staged) */
    float bound;
    /* nonzero: a noised output without staging of its own (its layer's
     * kept bytes hold off's place, for a step that keeps it after all not:
     * the flag is then cleared). Unless mode 1, the kept sum checks its
     * values where it would stage them, and writes them itself once every
     * output is checked (dcc_sgrad_commit); the output passes neither read
     * nor write its staging */
    uint32_t unstaged;
    /* a micro-batch of a logical step: the output's f32 accumulator
     * (dc_layer.acc_w / acc_b, in device memory), else NULL (accum.cu) */
    float *acc;
    /* the elements that get noise (dc_noise_span: a sums step's range, the
     * rows its rank owns): i with nz_lo <= (nz_mod ? i % nz_mod : i) <
     * nz_hi; 0, 0, UINT64_MAX: every element. Each gets the draw of
     * element i, as without a range. */
    uint64_t nz_mod, nz_lo, nz_hi;
} dcc_out;

#define DCC_OUT_CHUNK 8192
static inline uint64_t dcc_out_chunks(uint64_t n) {
    return (n + DCC_OUT_CHUNK - 1) / DCC_OUT_CHUNK;
}

/* Noise draws: DCC_NOISE_EXACT is daemon/compute/noise.c's Box-Muller in double
 * (libm ulps apart); DCC_NOISE_FAST the same Philox words and formula in
 * f32 (logf/log1pf, sincospif on a quadrant-reduced angle): within
 * 6e-7 * r + 1e-7 of the double draw, r = sqrt(-2 ln u1) <= 8.58. */
enum { DCC_NOISE_FAST = 0, DCC_NOISE_EXACT = 1 };

#endif
