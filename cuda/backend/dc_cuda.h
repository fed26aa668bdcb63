/* The CUDA backend, as the daemon sees it: a dc_backend (daemon/compute/backend.h)
 * whose run_step reads tensors in the memory of one GPU.
 *
 * Semantics are exactly the CPU backend's (backend.h): the same norms,
 * coefficients, checks, error fields and messages, atomic outputs, and the
 * same noise values (daemon/compute/noise.h: Philox4x32-10 keyed by noise_key, drawn
 * on the GPU). A step whose tensors are in host memory (step->device == -1)
 * is handed to a CPU backend the instance owns.
 *
 * Threading: one instance per GPU, used by one worker thread at a time. It
 * owns a stream, a cuBLAS handle and a device workspace that only grows, so a
 * steady stream of same-shaped steps allocates nothing. Each step is
 * asynchronous on the instance's stream up to one synchronisation at its end,
 * where the host-side dc_step_result is filled.
 *
 * Precision: bf16/f16 inputs run on tensor cores with f32 accumulation;
 * f32 inputs on TF32 tensor cores unless DPCLIP_CUDA_TF32=0 (then exact
 * f32 kernels); see backend_cuda.cu for the other switches.
 *
 * Errors: a CUDA failure fails the step with DC_EINTERNAL and the CUDA error
 * string; if the CUDA context is left unusable (a sticky error) every later
 * step fails fast with DC_EUNAVAIL. */
#ifndef DC_CUDA_H
#define DC_CUDA_H

#include <stddef.h>

/* backend.h is C: its functions keep C linkage when C++ (.cu) includes it */
#ifdef __cplusplus
extern "C" {
#endif

#include "backend.h"

/* Number of usable CUDA devices; 0 when there is no driver or no GPU (never
 * aborts, never prints). */
int dc_cuda_device_count(void);

/* A backend bound to `device`. Creates the stream and cuBLAS handle now, so
 * that a missing or broken GPU is reported here (DC_EUNAVAIL). */
int dc_cuda_backend_create(int device, dc_backend **out, dc_err *err);

/* Ordering with other processes' streams through interprocess events
 * (cudaEvent_t passed as void *): the backend's stream waits on / records
 * `cuda_event`. Return 0, or DC_EUNAVAIL. Call from the worker thread. */
int dc_cuda_backend_wait_event(dc_backend *be, void *cuda_event);
int dc_cuda_backend_record_event(dc_backend *be, void *cuda_event);

/* GPU time of each phase of the following steps, measured with CUDA events
 * recorded between the phases on the backend's stream; it also fills
 * dc_step_result.phase_ns (the daemon's per-phase histograms). On from
 * creation unless DPCLIP_CUDA_PROFILE=0 in the environment (the events cost
 * a few microseconds of host time a step). Phases, in order: setup
 * (counters, table upload), norms, coefs (norm reduction, coefficients),
 * clipped (book-keeping sums into staging), check (the one-pass path's
 * output bound), kept (the clipped sums of kept per-sample gradients, with
 * their noise: into their outputs when the check allows, else into
 * staging), noise (noise, division, conversion: into the outputs, or into
 * staging with the dtype check), commit (staging to outputs, gated),
 * download (results to the host). dc_cuda_backend_phase_ms fills ms with
 * the last successful step's times (-1 where unknown); DC_EPRECOND when
 * timing is off. */
#define DC_CUDA_PHASES 9
int dc_cuda_backend_profile(dc_backend *be, int on);
int dc_cuda_backend_phase_ms(const dc_backend *be, float ms[DC_CUDA_PHASES]);
const char *dc_cuda_phase_name(int phase);

/* Preallocates `initial` bytes of device workspace now (so that steps up to
 * that size never allocate) and caps it at `max` bytes (0 = no cap): a step
 * that needs more fails with DC_ENOSPACE naming gpu.workspace_max. A step
 * needing more than the workspace held (and within the cap) grows it once.
 * DC_ENOSPACE if the preallocation fails. */
int dc_cuda_backend_set_workspace(dc_backend *be, size_t initial, size_t max, dc_err *err);

/* Caps the device workspace that keeps per-sample gradients between a
 * step's norms and its clipped sum (gpu.sample_grads_max; 0 = none kept;
 * DC_SAMPLE_GRADS_AUTO, the default: 1/DC_SAMPLE_GRADS_PARTS of the
 * device's memory, none if that cannot be read).
 * Layers the grouped norm kernel takes are kept, in step order, while they
 * fit within it and within gpu.workspace_max; their clipped sums are then a
 * pass over memory instead of a GEMM (cuda/kernels/sgrad.cu). A step whose
 * workspace would leave the GPU less than a tenth of its memory free with
 * them, or cannot be allocated, runs without. dc_cuda_backend_sample_grads:
 * the cap in bytes, auto resolved. */
void dc_cuda_backend_set_sample_grads(dc_backend *be, uint64_t max);
uint64_t dc_cuda_backend_sample_grads(const dc_backend *be);
/* How many layers of the last step had their per-sample gradients kept
 * (tests and benchmarks). */
int dc_cuda_backend_kept_layers(const dc_backend *be);
/* Whether the last step's kept layers' sums went straight into their
 * outputs (the output check's mode 1) rather than through staging. */
int dc_cuda_backend_kept_direct(const dc_backend *be);
/* How many LINEAR layers of the last step had their book-keeping sums
 * written straight into their outputs, without staging (the grouped
 * kernel's direct epilogue: a one-pass whole step; DPCLIP_CUDA_BK_DIRECT). */
int dc_cuda_backend_direct_layers(const dc_backend *be);

/* The DPCLIP_CUDA_* switches the instance follows (cuda/prims/dcc_types.h,
 * dcc_options): read from the environment when it was made; tests and
 * benchmarks replace them between steps. */
struct dcc_options;
void dc_cuda_backend_get_options(const dc_backend *be, struct dcc_options *out);
void dc_cuda_backend_set_options(dc_backend *be, const struct dcc_options *o);

/* How many outputs of the last step had their max |.| found by the grouped
 * clipped sum's epilogue rather than by a pass of the output check (those
 * it writes directly: a bound known before stands for it). For tests and
 * benchmarks. */
int dc_cuda_backend_amax_found(const dc_backend *be);

/* Device workspace currently held by the instance, in bytes (not the kept
 * stores of norm phases, backend_kept.cu: gpu.sample_grads_max bounds
 * those). */
size_t dc_cuda_backend_workspace_bytes(const dc_backend *be);
/* Every output the step names zeroed on the backend's stream, which is
 * then waited for (dc_backend_ops.zero_outputs). */
int dc_cuda_backend_zero_outputs(dc_backend *be, const dc_step *step);

/* Device memory in the kept stores of norm phases (backend_kept.cu), held
 * or given back for reuse, in bytes: at most gpu.sample_grads_max. Read on
 * the instance's worker thread (tests). */
size_t dc_cuda_backend_kept_bytes(const dc_backend *be);

/* The GPU cost model's choice for a LINEAR layer (AUTO resolved; a forced
 * algorithm is returned as is). Differs from dc_linear_pick because the
 * kernels' tiles and the ghost form's symmetry change the arithmetic. */
dc_algo dc_cuda_linear_pick(const dc_layer *l);

#ifdef __cplusplus
}
#endif

#endif
