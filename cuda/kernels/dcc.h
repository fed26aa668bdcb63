/* Internal interface of the CUDA kernels (prefix dcc_): one launcher per
 * stage, used by backend_cuda.cu and by bench/bench_cuda_norms.cu. Every
 * launcher only enqueues work on `st` and returns the launch status; none
 * synchronises. Pointers are device pointers unless stated.
 *
 * Accumulation: squared norms are *added* (atomically) into n2[b], so the
 * caller zeroes n2 first; flags[b] gets bits OR-ed in (DCC_FLAG_*).
 * Non-finite inputs: LINEAR kernels rely on propagation (a NaN or Inf in a
 * sample's input or grad makes its squared norm NaN or Inf); the others set
 * DCC_FLAG_NONFINITE explicitly because they skip some rows (padding). */
#ifndef DC_DCC_H
#define DC_DCC_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <cuda_runtime_api.h>

#ifdef __cplusplus
extern "C" {
#endif

/* the kernels see common/ only: the daemon's step is the backend's business */
#include "dc_algo.h"
#include "dc_dtype.h"
#include "dcc_path.h"
#include "dcc_types.h"

#define DCC_FLAG_NONFINITE 1u
#define DCC_FLAG_INDEX 2u

/* status word bits (one per step): dcc_types.h */

/* The DPCLIP_CUDA_* switches (dcc_types.h, dcc_options): the defaults, and
 * those of the environment (options.cu, the backend's: the one reader). */
void dcc_options_default(dcc_options *o);
void dcc_options_from_env(dcc_options *o);

size_t dcc_linear_bias_ws_bytes(const dcc_linear *L);

/* Padded copies of a 16-bit LINEAR layer whose d or p is not a multiple of
 * 8 (pad.cu): whether the layer wants them, the workspace bytes of one
 * sample's copies, how many samples fit in cap bytes (at least 1), and the
 * copies of samples [b0, b0 + n) into ws (that many samples' bytes): *out
 * is the chunk as a layer of n samples with d and p rounded up to 8 (the
 * extra columns zero, so its norms are the chunk's). */
bool dcc_pad_wanted(const dcc_linear *L);
size_t dcc_pad_sample_bytes(const dcc_linear *L);
int dcc_pad_samples(const dcc_linear *L, size_t cap);
cudaError_t dcc_pad_chunk(const dcc_linear *L, int b0, int n, void *ws, dcc_linear *out,
                          cudaStream_t st);

/* GPU cost model (see dc_cuda_linear_pick). */
dc_algo dcc_linear_pick(int T, int d, int p, dc_algo requested);
/* The same for this layer on the kernels it would run on (f32 on TF32 with
 * the ghost form on wgmma: the direct form counts double). */
dc_algo dcc_linear_pick_for(const dcc_linear *L, dc_algo requested);
/* The same for a layer that may join the grouped norms launch, whose direct
 * form runs faster than a launch of its own. */
dc_algo dcc_linear_pick_grouped(int T, int d, int p, dc_algo requested);

/* n2[b] += s2 * ||per-sample gradient of weight (and bias)||^2. algo DIRECT or
 * GHOST (AUTO is resolved by dcc_linear_pick); with T == 1 GHOST is the
 * rank-one formula ||a||^2 ||g||^2. Needs no workspace. */
cudaError_t dcc_linear_sqnorms(const dcc_linear *L, dc_algo algo, float s2, float *n2,
                               cudaStream_t st);

/* Which kernel family dcc_linear_sqnorms uses (dcc_path.h: TF32 mma.sync,
 * wgmma, mma.sync with 16-byte or element loads, CUDA cores). For tests
 * and the benchmark. */
dcc_path dcc_linear_path(const dcc_linear *L);

/* The wgmma kernels, fed by TMA (norms_tma.cu): available when built for
 * sm_90a, the current device is compute capability 9.0, the driver encodes
 * tensor maps and DPCLIP_CUDA_WGMMA is not "0". dcc_linear_wgmma needs
 * bf16/f16 inputs that qualify for 16-byte loads (cudaErrorNotSupported
 * where a tensor map cannot be made: use the mma.sync kernels then). */
int dcc_wgmma_available(const dcc_options *o);
cudaError_t dcc_linear_wgmma(const dcc_linear *L, dc_algo algo, float s2, float *n2,
                             cudaStream_t st);
/* The ghost form on wgmma for bf16, f16 and (TF32) f32 inputs, by
 * dcc_ghost_plan_get's plan (ghost_tma.cu; cudaErrorNotSupported where
 * wgmma does not run or no tensor map can be made). */
cudaError_t dcc_ghost_wgmma(const dcc_linear *L, float s2, float *n2, cudaStream_t st);
/* The ghost form of f32 inputs on TF32 wgmma (both Grams' operands are
 * K-major, which TF32 wgmma requires; the direct form's are not):
 * cudaErrorNotSupported where the wgmma kernels are not available or no
 * tensor map can be made (rows not on 16 bytes). */
cudaError_t dcc_linear_ghost_wgmma_tf32(const dcc_linear *L, float s2, float *n2, cudaStream_t st);
/* The wgmma direct form's tile for this layer (direct_plan.cu): 128 or 256
 * rows of p, and how many CTAs of a cluster split each tile's K range. */
int dcc_direct_tile_rows(const dcc_linear *L);
int dcc_direct_split(const dcc_linear *L);
/* The whole plan of the TMA direct form. Tiles are numbered over (sample,
 * tile); with tail_ks > 1 the first `full` of them (whole waves of SMs) run
 * unsplit and the rest, a partial wave, on clusters of tail_ks CTAs that
 * split their K ranges; otherwise every tile on a cluster of `split`.
 * persist: the `full` tiles on persistent CTAs (dcc_linear_sqnorms_waves)
 * instead of one CTA a tile. */
typedef struct dcc_direct_plan {
    int rows;
    int split;
    int tail_ks;
    long long full;
    bool persist;
} dcc_direct_plan;
void dcc_direct_plan_get(const dcc_linear *L, dcc_direct_plan *p);
/* The plan of the TMA ghost form. Its first `wide` wide items (16-bit
 * inputs: a row block against two column blocks, dcc_wide_pair) run one a
 * CTA; the pairs (numbered over samples, dcc_tri_pair) from the first that
 * no wide item took, `first`, up to `full` on persistent CTAs; and with
 * tail_ks > 1 the rest on clusters of tail_ks CTAs that split both K
 * ranges (tail_ks 0: full is every pair). */
typedef struct dcc_ghost_plan {
    long long wide;
    long long first;
    int tail_ks;
    long long full;
} dcc_ghost_plan;
void dcc_ghost_plan_get(const dcc_linear *L, dcc_ghost_plan *p);
/* The largest tail cluster size the kernels take that is <= k (at least 2). */
int dcc_direct_ks_floor(int k);
/* How many clusters of ks direct-form CTAs (rows-row tiles) fit the current
 * device at once; 0 where the kernels are not built or it cannot be asked. */
int dcc_direct_max_clusters(int rows, int ks);
/* LINEAR clipped weight sum on the TMA/wgmma path: w[p][d] = sum_b cs[b] *
 * g_b^T a_b (f32, overwritten), exact per-sample scaling in one launch.
 * cudaErrorNotSupported when the layer does not qualify (T < 64, not bf16/f16
 * with 16-byte rows, no sm_90a): use cuBLAS then. */
cudaError_t dcc_linear_clipped_tc(const dcc_linear *L, const float *cs, float *w, cudaStream_t st);

/* Persistent kernels over many LINEAR layers (grouped_tma.cu): a few
 * launches for the whole step, 256x128 tiles dealt to one CTA per SM.
 *
 * Book-keeping: every (layer, weight tile) is one item that runs K = B*T,
 * the samples in ascending coefficient order with the accumulator rescaled
 * between them (perm and fac from dcc_bk_order), and stores the tile once
 * (no atomics, no zeroing); the first column of tiles writes the bias.
 * w[p][d] = sum_b cs[b] g_b^T a_b, bias[p] = sum_b cs[b] sum_t g_b,t. */
typedef struct dcc_bk_layer {
    dcc_linear L;
    const int *perm;  /* device [B] (dcc_bk_order) */
    const float *fac; /* device [B] (dcc_bk_order) */
    float *w;         /* device f32 [p][d] */
    float *bias;      /* device f32 [p] or NULL */
    /* Non-NULL: w (bias) is a whole output of the step, whose max |.| the
     * epilogue raises *amax_w (*amax_b) to, as bits: dcc_out_check's amax
     * of that output, found without a pass over it (dcc_out.amax_found) */
    unsigned *amax_w, *amax_b;
    /* dcc_linear_clipped_direct: the weight's and the bias's index in the
     * step's output table (-1: none; w and bias are then not read) */
    int oi_w, oi_b;
} dcc_bk_layer;
/* Whether a layer qualifies (bf16/f16 with 16-byte rows, T >= 64, sm_90a,
 * TMA available); the others use dcc_linear_clipped_tc or cuBLAS. */
int dcc_bk_grouped_ok(const dcc_linear *L);
/* All layers must share B and qualify; one launch per max_layers layers of
 * one dtype (clamped to 1-80, the most the kernel parameters hold).
 * cudaErrorNotSupported (a tensor map the driver refuses) comes before
 * anything runs, as every chunk's maps are made first: the caller may then
 * run every layer another way (the same for dcc_linear_sqnorms_grouped). */
cudaError_t dcc_linear_clipped_grouped(const dcc_bk_layer *layers, int n, int max_layers,
                                       cudaStream_t st);
/* The same sums written straight into the step's outputs (outs: its table
 * in device memory; layer i's at oi_w, oi_b), each value noised, divided
 * and stored as the output pass would (dcc_out_write, bit for bit), no
 * staging. Queued after dcc_out_check, whose *mode it reads: mode 1 writes;
 * mode 0 with *status 0 only checks each value in its dtype (a bad one sets
 * DCC_STATUS_OUTPUT and lowers *bad), and the launch with commit = 1, queued
 * once every other output is checked, makes the sums again and writes them
 * unless *status is set; mode 1 checks as it writes (a client that rewrote
 * its tensors during the step may exceed the bound the check took: the
 * step then fails, having written). noise: DCC_NOISE_*. cudaErrorNotSupported
 * as for dcc_linear_clipped_grouped: nothing ran. */
cudaError_t dcc_linear_clipped_direct(const dcc_bk_layer *layers, int n, int max_layers,
                                      const dcc_out *outs, float std, float divisor,
                                      const uint32_t *mode, uint32_t *status,
                                      unsigned long long *bad, int commit, int noise,
                                      cudaStream_t st);
/* For each of L layers of coefficients cs[l*B + b]: perm[l*B + k] = the
 * samples in ascending order of cs (NaN last, ties by index), fac[l*B + k] =
 * cs[perm[k-1]] / cs[perm[k]] for k >= 1 (0 where the divisor is 0) and
 * fac[l*B] = cs[perm[B-1]]. */
cudaError_t dcc_bk_order(const float *cs, int L, int B, int *perm, float *fac, cudaStream_t st);

/* Norms: every (layer, sample, tile) is one item with K = T; n2[b] +=
 * s2 * ||G_b||^2 (+ bias), as dcc_linear_sqnorms does with DIRECT. */
typedef struct dcc_norm_layer {
    dcc_linear L;
    float *n2; /* device [B] of this layer */
    /* Non-NULL: the per-sample gradients are kept (sgrad.cu): sg, the weight
     * gradients as bf16 in tile order (dcc_sgrad_bytes), and sgb, the bias
     * sums [B][p] as f32 when the layer's norm counts its bias. The norm is
     * then that of the kept bf16 values, so that the clipped sum of exactly
     * those values stays within C. */
    void *sg;
    float *sgb;
} dcc_norm_layer;
/* Whether a layer with this (resolved) algorithm qualifies: DIRECT, bf16/f16
 * with 16-byte rows, sm_90a, TMA available. */
int dcc_norms_grouped_ok(const dcc_linear *L, dc_algo algo);
/* Work items of a layer, and the fewest items worth a grouped launch (a few
 * waves; below it the per-layer kernels' split and tile choices do better;
 * DPCLIP_CUDA_GROUPED_MIN overrides it, for tests). */
int64_t dcc_norms_grouped_items(const dcc_linear *L);
int dcc_grouped_min_items(const dcc_options *o);
/* The first `items` tiles (whole waves) of one layer's direct form with
 * 256-row tiles, on the grouped kernel's persistent CTAs (norms_tma.cu's
 * plans; its tail launch may overlap this one). */
cudaError_t dcc_linear_sqnorms_waves(const dcc_linear *L, int64_t items, float s2, float *n2,
                                     cudaStream_t st);
/* max_layers as for dcc_linear_clipped_grouped. */
cudaError_t dcc_linear_sqnorms_grouped(const dcc_norm_layer *layers, int n, float s2,
                                       int max_layers, cudaStream_t st);

/* Per-sample gradients kept by the grouped norm pass, then summed with
 * their coefficients (sgrad.cu): the clipped sum of a layer whose norms
 * computed every g_b^T a_b anyway, as one pass over memory instead of a
 * second GEMM over the samples. A layer's store: for each sample, its
 * 256 x 128 tiles in the norm kernel's item order, DCC_SG_TILE bf16 values
 * a tile (each consumer thread's 128 accumulators as 16 chunks of 8, chunk
 * j of thread t at (j * 256 + t) * 8: every store and load a warp makes is
 * 512 contiguous bytes); then, with a bias, [B][p] f32. */
#define DCC_SG_TILE 32768
#define DCC_SG_THREADS 256                               /* the norm kernel's consumer threads */
#define DCC_SG_CHUNKS (DCC_SG_TILE / 8 / DCC_SG_THREADS) /* 16-byte chunks a thread */
size_t dcc_sgrad_bytes(const dcc_linear *L);
/* Whether keeping a layer's per-sample gradients should pay: the GEMM its
 * clipped sum would be (2 T d p flops a sample), plus, where the norms
 * would otherwise take the ghost form (`norm_algo`), what that saves over
 * the direct form a kept layer needs, against the store and the read of
 * 2 d p bytes a sample each way. */
bool dcc_sgrad_worth(int T, int d, int p, dc_algo norm_algo);
size_t dcc_sgrad_bias_off(const dcc_linear *L); /* where sgb starts in the store */
/* Where one output's values go and the noise they get: dcc_out's fields of
 * the same names (dst NULL: no such output). */
typedef struct dcc_out_sink {
    void *dst;
    uint64_t key, step;
    uint32_t stream;
    int32_t dtype;
    uint64_t nz_mod, nz_lo, nz_hi; /* the elements that get noise (dcc_out.nz_*) */
} dcc_out_sink;
typedef struct dcc_sg_layer {
    const void *sg;            /* the store (dcc_norm_layer.sg) */
    const float *sgb;          /* its bias sums, or NULL: no bias output */
    const float *cs;           /* device [B]: this layer's coefficients */
    float *w;                  /* device f32 [p][d] (overwritten) */
    float *bias;               /* device f32 [p] or NULL */
    unsigned *amax_w, *amax_b; /* as in dcc_bk_layer; NULL: none */
    dcc_out_sink out_w, out_b; /* the outputs, written with mode 1, and their noise */
    int oi_w, oi_b;            /* their places in the step's output table (*bad), -1 none */
    int unstaged;              /* no staging (dcc_out.unstaged): w and bias are not written */
    float *acc_w, *acc_b;      /* unstaged, of a logical step: its accumulators (dcc_out.acc) */
    int d, p;
} dcc_sg_layer;
/* What an unstaged layer's sums do with its accumulators (dcc_sg_layer.acc_*)
 * in a logical step: a micro-batch's set them (STORE, the first) or add to
 * them (ADD), as dcc_acc_store does with staged sums; the commit's are
 * added to them, after their noise (FOLD, as dcc_acc_fold), then checked
 * and written as a step's. */
enum { DCC_SG_ACC_NONE = 0, DCC_SG_ACC_STORE, DCC_SG_ACC_ADD, DCC_SG_ACC_FOLD };
/* v = sum_b cs[b] * G_b + std * z for w, and likewise for bias, over each
 * layer's store (f32 sums in sample order; z the outputs' own draws, by
 * `noise` (DCC_NOISE_*), none when std is 0). With *mode == 1 (the output
 * check found that no output can leave its dtype: dcc_out_check, run first)
 * v / divisor goes straight into out_w / out_b, as dcc_out_write would
 * write it, and w and bias are not touched; otherwise (or mode NULL) v goes
 * into w and bias and its max |.| into amax_*, but for an unstaged layer,
 * whose v / divisor is only checked as dcc_out_write checks a staged value
 * (not finite in its output's dtype: DCC_STATUS_OUTPUT into *status, and
 * *bad lowered to output << 40 | element), unless *status is set already.
 * The outputs are marked dcc_out.noised. acc (DCC_SG_ACC_*): a logical
 * step's micro-batch (STORE, ADD) puts an unstaged layer's v into its
 * accumulators instead; its commit (FOLD) adds them to v before the check.
 * dcc_sgrad_commit, after every output's check: with *mode == 0 (or mode
 * NULL) and *status == 0, the unstaged layers' v / divisor into their
 * outputs (the same values, computed again); otherwise nothing (the commit
 * passes zero them with zero_on_fail). */
cudaError_t dcc_sgrad_sum(const dcc_sg_layer *layers, int n, int B, float std, float divisor,
                          const uint32_t *mode, uint32_t *status, unsigned long long *bad, int acc,
                          int noise, cudaStream_t st);
cudaError_t dcc_sgrad_commit(const dcc_sg_layer *layers, int n, int B, float std, float divisor,
                             const uint32_t *mode, uint32_t *status, int acc, int noise,
                             cudaStream_t st);

/* TF32 tensor-core kernels for f32 inputs (norms_tf32.cu): the forms of
 * dcc_linear_sqnorms, and the clipped weight sum w[p][d] = sum_b cs[b]
 * g_b^T a_b (f32, overwritten; exact per-sample scaling, the bias is not
 * included). Every kernel multiplies the operands' TF32 truncations (the top
 * 19 bits, as the tensor cores read f32), so that the norms and the sum they
 * clip are of the same values. The ghost form runs on wgmma
 * (dcc_linear_ghost_wgmma_tf32) where it can, the rest on mma.sync m16n8k8. */
cudaError_t dcc_linear_tf32(const dcc_linear *L, dc_algo algo, float s2, float *n2,
                            cudaStream_t st);
/* perm, fac: B ints and floats of scratch for the sample order. The sum
 * runs on wgmma (dcc_tf32_clipped_wgmma) where it can. */
cudaError_t dcc_linear_clipped_tf32(const dcc_linear *L, const float *cs, int *perm, float *fac,
                                    float *w, cudaStream_t st);

/* The TF32 clipped sum on wgmma (clipped_tf32.cu), 128x256 tiles, each
 * tile's stages split in chunks against wave quantization (several: w
 * zeroed, summed with atomics), perm and fac from dcc_bk_order: for
 * dcc_linear_clipped_tf32. cudaErrorNotSupported without sm_90a code or
 * where rows are not on 16 bytes. */
cudaError_t dcc_tf32_clipped_wgmma(const dcc_linear *L, const float *cs, const int *perm,
                                   const float *fac, float *w, cudaStream_t st);

/* The CUDA-core paths behind dcc_linear_sqnorms (norms_simt.cu): f32 or
 * mixed dtypes, and the rank-one T == 1 formula. */
cudaError_t dcc_linear_simt(const dcc_linear *L, dc_algo algo, float s2, float *n2,
                            cudaStream_t st);
cudaError_t dcc_linear_rank1(const dcc_linear *L, float s2, float *n2, cudaStream_t st);

/* --- embedding, LayerNorm, RMSNorm (norms_other.cu) ---------------------- */

typedef struct dcc_embedding {
    const void *idx; /* [B,T] i32 or i64 */
    dc_dtype tidx;
    const void *g; /* [B,T,d] */
    dc_dtype tg;
    int B;
    int T, d;
    int64_t vocab;
    int64_t padding_idx; /* -1: none */
} dcc_embedding;

/* Workspace bytes dcc_embedding_sqnorms needs (16-byte aligned pieces). */
size_t dcc_embedding_ws_bytes(int B, int T);
cudaError_t dcc_embedding_sqnorms(const dcc_embedding *E, float s2, float *n2, uint32_t *flags,
                                  void *ws, size_t ws_bytes, cudaStream_t st);
/* w[idx,:] += cs[b] * g[b,t,:] over non-padding rows (w f32 [vocab,d], zeroed
 * by the caller). */
cudaError_t dcc_embedding_clipped_sum(const dcc_embedding *E, const float *cs, float *w,
                                      cudaStream_t st);

/* Tied parameters (tied.cu): E and N are a pair's embedding and linear
 * layer (one weight, [vocab, d] = [p, d]) whose norms are in n2o (the
 * owner's) and n2l (the later layer's, its weight part only): n2o[b] +=
 * n2l[b] + s2 * 2 <G_emb,b, G_lin,b>, then n2l[b] = s2 * ||sum_t g_b,t||^2
 * when later_bias (the later layer is N, with a bias), else 0. cross:
 * device workspace of B doubles. */
cudaError_t dcc_tied_sqnorms(const dcc_embedding *E, const dcc_linear *N, bool later_bias, float s2,
                             float *n2o, float *n2l, double *cross, cudaStream_t st);

typedef struct dcc_norm {
    const void *x; /* [B,T,d] */
    const void *g; /* [B,T,d] */
    dc_dtype tx, tg;
    int B;
    int T, d;
    bool rms;      /* RMSNorm (no bias) */
    bool has_bias; /* LayerNorm bias is trainable */
    float eps;
} dcc_norm;

/* Row statistics scratch: B*T*2 floats. per_sample: 2*B*d floats that
 * receive the per-sample weight grads [B,d] then bias grads [B,d] (unscaled);
 * they stay valid for dcc_norm_clipped_sum. */
cudaError_t dcc_norm_sqnorms(const dcc_norm *N, float s2, float *n2, uint32_t *flags,
                             float *row_stats, float *per_sample, cudaStream_t st);
/* w[j] = sum_b cs[b] * wg[b,j], bias likewise (bias may be NULL). */
cudaError_t dcc_norm_clipped_sum(const dcc_norm *N, const float *per_sample, const float *cs,
                                 float *w, float *bias, cudaStream_t st);

/* --- coefficients, clipped sums, noise, commit (clip.cu) ----------------- */

/* From n2[L*B] (layer-major) and flags: norms[b] = sqrt(sum_l n2), coefs[b]
 * (FLAT: dc_clip_coef(C, norm, e); PER_LAYER: 1), lcoef[l*B+b] (PER_LAYER:
 * dc_clip_coef(C_l, sqrt n2, layer_e[l])), cs[l*B+b] = the coefficient used
 * for layer l times grad_scale, rounded down (dc_clip_scaled). e, layer_e:
 * the bounds on the norms' rounding (step.h dc_clip_e). Sets
 * DCC_STATUS_INPUT in *status when any n2 is not finite or any flag is set.
 * layer_C, layer_e: device [L] per-layer thresholds and bounds (PER_LAYER).
 * count: device [L], NULL = every layer in the norm; count[l] = 0 leaves
 * layer l out of the sum (step.h: norm_excluded). */
cudaError_t dcc_coefs(const float *n2, const uint32_t *flags, const float *count, int L, int B,
                      bool per_layer, float C, double e, const float *layer_C,
                      const double *layer_e, float grad_scale, float *norms, float *coefs,
                      float *lcoef, float *cs, uint32_t *status, cudaStream_t st);
/* The same with the per-sample total squared norms given (device [B]
 * doubles, a norm group's or a norm pass's): the flat coefficients come
 * from tot, not from n2's sum. */
cudaError_t dcc_coefs_tot(const float *n2, const uint32_t *flags, const double *tot, int L, int B,
                          float C, double e, float grad_scale, float *norms, float *coefs,
                          float *cs, uint32_t *status, cudaStream_t st);

/* out[j] += sum_b cs[b] * sum_t g[b,t,j] for a [B,T,p] grad (out zeroed);
 * tf32: f32 values truncated to TF32 first, as the layer's norms saw them
 * (norms_tf32.cu). */
cudaError_t dcc_bias_clipped_sum(const void *g, dc_dtype tg, int B, int T, int p, bool tf32,
                                 const float *cs, float *out, cudaStream_t st);

/* Rows [r0, r0+R) of a [*, d] and g [*, p] (T rows per sample) as f32, g rows
 * scaled by cs[row / T]: the operands of the small-T clipped-sum GEMM. */
cudaError_t dcc_rows_to_f32(const void *a, dc_dtype ta, const void *g, dc_dtype tg, int T, int d,
                            int p, int64_t r0, int R, const float *cs, float *af, float *gf,
                            cudaStream_t st);

/* For every output o and element i: v = staging[off+i] + std * z(o.key, o.step,
 * o.stream, i) (no draw when std == 0), v /= divisor, stored back; a value not
 * finite in the output dtype sets DCC_STATUS_OUTPUT and lowers *bad to
 * (o << 40 | i). outs: device array [n_out]. */
cudaError_t dcc_finalize(const dcc_out *outs, int n_out, uint64_t max_n, float *staging, float std,
                         float divisor, uint32_t *status, unsigned long long *bad, int noise,
                         cudaStream_t st);

/* If *status == 0: every output converted from staging into dst; norms and
 * coefs (device [B]) copied into norms_out / coefs_out when non-NULL.
 * Otherwise nothing is written, or zeros everywhere with zero_on_fail (the
 * same for dcc_out_commit). */
/* Gradient accumulation (accum.cu), over the staged sums of every output
 * with an accumulator: dcc_acc_store sets it to (add 0) or adds to it
 * (add 1) the staged sum; dcc_acc_fold adds it into the staged sum (a
 * logical step's commit, before dcc_finalize noises it). */
cudaError_t dcc_acc_store(const dcc_out *outs, int n_out, uint64_t max_n, const float *staging,
                          int add, cudaStream_t st);
cudaError_t dcc_acc_fold(const dcc_out *outs, int n_out, uint64_t max_n, float *staging,
                         cudaStream_t st);

/* The keyed checksum of n bytes at p (common/dc_hash.h) added into *out
 * (device, zeroed by the caller). hash.cu. */
cudaError_t dcc_tensor_hash(const void *p, uint64_t n, uint64_t key, unsigned long long *out,
                            cudaStream_t st);

cudaError_t dcc_commit(const dcc_out *outs, int n_out, uint64_t max_n, const float *staging,
                       const uint32_t *status, const float *norms, float *norms_out,
                       const float *coefs, float *coefs_out, int B, int zero_on_fail,
                       cudaStream_t st);

/* The one-pass output path (chunk grid over all outputs). Each pass runs
 * grid-stride on `grid` blocks, from dcc_out_grid: as many as the SMs hold
 * at once, or max_blocks when positive, and never more than n_chunks.
 * Then:
 * dcc_out_check finds max |staging| per output (amax[n_out], zeroed by the
 * caller; an output marked amax_found keeps what the grouped kernel found,
 * a noised one takes its bound) and sets *mode = 1 when the step's status
 * is 0 and no output can leave its dtype's finite range, whatever the
 * noise: |z| <= 8.58 bounds every draw, so |v| <= (amax + 8.6 std) /
 * divisor. Mode 1 is final: nothing after the check can fail the step (but
 * a direct sum reading a client's buffers that were rewritten since), so the
 * outputs may be written from here on. Then dcc_out_write writes v =
 * (staging + std z) / divisor straight into the outputs (mode 1; the noised
 * ones are the kept sum's to write), or as dcc_finalize does into staging
 * (mode 0, status 0) for dcc_out_commit, which converts only in mode 0 with
 * status 0, and with zero_on_fail writes zeros into every output of a step
 * that failed, in either mode. A non-finite staging value makes amax NaN, so such steps always
 * take mode 0. scan false: every output is marked amax_found (the kept
 * sum's too), so the pass over the chunks, which would skip each of them,
 * is not launched (a Llama-1B-like step's 139K chunks: 0.2 ms). Each pass
 * skips the outputs it leaves alone whole. */
cudaError_t dcc_out_grid(uint64_t n_chunks, int max_blocks, unsigned *grid);
cudaError_t dcc_out_check(const dcc_out *outs, int n_out, unsigned grid, const float *staging,
                          float std, float divisor, float *amax, bool scan, const uint32_t *status,
                          uint32_t *mode, cudaStream_t st);
cudaError_t dcc_out_write(const dcc_out *outs, int n_out, unsigned grid, float *staging, float std,
                          float divisor, const uint32_t *mode, uint32_t *status,
                          unsigned long long *bad, int noise, cudaStream_t st);
cudaError_t dcc_out_commit(const dcc_out *outs, int n_out, unsigned grid, const float *staging,
                           const uint32_t *mode, const uint32_t *status, int zero_on_fail,
                           cudaStream_t st);

/* Index of the first non-finite element of a float array (or of the first
 * integer outside [0, vocab) for i32/i64), lowered into *first (set it to
 * ~0 first). */
cudaError_t dcc_find_bad(const void *p, dc_dtype t, uint64_t n, int64_t vocab,
                         unsigned long long *first, cudaStream_t st);

/* N(0,1) draws i in [0, n) of (key, step, stream) as dc_noise_normal
 * (daemon/compute/noise.h) defines them, computed as `noise` says (DCC_NOISE_*).
 * For tests. */
cudaError_t dcc_noise_normal(uint64_t key, uint64_t step, uint32_t stream, float *out, uint64_t n,
                             int noise, cudaStream_t st);

/* out[2i] = x[i] / d as the output pass divides (a reciprocal made once),
 * out[2i+1] = __fdiv_rn(x[i], d), for n elements of device memory. For
 * tests: the two must agree bit for bit. */
cudaError_t dcc_test_fdiv(const float *x, float *out, uint64_t n, float d, cudaStream_t st);

/* The Box-Muller step alone: out[2j], out[2j+1] from the Philox words
 * words[4j..4j+3] (device memory), as `noise` says. For tests. */
cudaError_t dcc_noise_box_muller(const uint32_t *words, float *out, uint64_t npairs, int noise,
                                 cudaStream_t st);

#ifdef __cplusplus
}
#endif

#endif
