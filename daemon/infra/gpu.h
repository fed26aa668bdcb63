/* The daemon's GPU side: one worker pool (of one thread) per GPU owning that
 * GPU's CUDA backend, CUDA IPC buffers and interprocess events, and MPS
 * detection. Everything that calls into the CUDA driver runs on the GPU's
 * worker thread, never on the loop thread: opening an IPC handle costs
 * ~0.1-0.2 ms and takes driver locks a running step may hold.
 *
 * In a build without CUDA (or on a node without GPUs) dc_gpu_init finds no
 * devices and every GPU request is refused with a clear error. */
#ifndef DC_GPU_H
#define DC_GPU_H

#include <stdbool.h>
#include <stdint.h>
#include <uv.h>

#include "registry.h"
#include "worker.h"

/* GPUs one daemon serves: devices past these are left unused (and logged). */
#define DC_MAX_GPUS 8
#define DC_GPU_UUID_LEN 16
#define DC_GPU_UUID_STR 41 /* "GPU-" and 36 characters, NUL */

typedef struct dc_gpu {
    int n;                   /* usable devices, at most DC_MAX_GPUS */
    dc_worker_pool *pools;   /* [n] */
    dc_worker_pool *closing; /* pools closed, freed once their handles are */
    int n_closing;
    bool mps_active;
    char names[DC_MAX_GPUS][64];
    /* Each device's UUID: trainers name their GPU by it, since ordinals
     * depend on each process's CUDA_VISIBLE_DEVICES. has_uuid false: the
     * runtime did not say (the device is then found by ordinal only). */
    uint8_t uuids[DC_MAX_GPUS][DC_GPU_UUID_LEN];
    bool has_uuid[DC_MAX_GPUS];
} dc_gpu;

/* The device serving `uuid` (DC_GPU_UUID_LEN bytes), or -1. */
int dc_gpu_find_uuid(const dc_gpu *g, const uint8_t *uuid);
/* `uuid` as nvidia-smi prints it (GPU-8-4-4-4-12 hex digits). */
void dc_gpu_uuid_str(const uint8_t *uuid, char out[DC_GPU_UUID_STR]);

/* Finds the GPUs and starts one worker per GPU. `enable` false: none.
 * Each GPU's backend preallocates `workspace` bytes of device workspace and
 * refuses steps that need more than `workspace_max` (0 = no cap), of which
 * at most `sample_grads_max` keeps per-sample gradients (dc_cuda.h). */
int dc_gpu_init(dc_gpu *g, uv_loop_t *loop, bool enable, uint64_t workspace, uint64_t workspace_max,
                uint64_t sample_grads_max, dc_err *err);
void dc_gpu_close(dc_gpu *g);
/* Tasks (including steps) in flight on any GPU. */
int dc_gpu_busy(const dc_gpu *g);

/* Opening a CUDA IPC memory handle, as a task on the device's worker.
 * On completion `done` runs on the loop thread with rc/err filled and, on
 * success, buf (kind DC_BUFFER_CUDA, base = device pointer, size checked
 * against the allocation's real extent). */
typedef struct dc_gpu_open_task {
    dc_task task;
    int device;
    uint8_t handle[64];
    uint64_t size;
    dc_buffer buf;
    uint64_t req_id;
    int rc;
    dc_err err;
    void *user;
    void (*done)(struct dc_gpu_open_task *t);
} dc_gpu_open_task;
int dc_gpu_open_buffer(dc_gpu *g, dc_gpu_open_task *t);

/* Closes an opened buffer that no registry holds (fire and forget). */
void dc_gpu_close_buffer(dc_gpu *g, dc_buffer *b);

/* Interprocess events. */
typedef struct dc_gpu_event_task {
    dc_task task;
    int device;
    uint8_t handle[64];
    void *event; /* cudaEvent_t once opened */
    uint64_t req_id;
    int rc;
    dc_err err;
    void *user;
    void (*done)(struct dc_gpu_event_task *t);
} dc_gpu_event_task;
int dc_gpu_open_event(dc_gpu *g, dc_gpu_event_task *t);
/* Destroys an opened event on its device's worker (fire and forget). */
void dc_gpu_close_event(dc_gpu *g, int device, void *event);

/* Step hooks for the session: run on the device's worker, before and after
 * the backend's run_step. */
int dc_gpu_wait_event(dc_backend *be, void *event, dc_err *err);
int dc_gpu_record_event(dc_backend *be, void *event, dc_err *err);

#endif
