/* A whole training step of GPT-2-small's 72 Linear layers (12 blocks of
 * qkv 768->2304, proj 768->768, up 768->3072, down 3072->768; B=8, T=1024,
 * bf16, with bias, clipped sums written as f32) sent to dpclipd from this
 * process over CUDA IPC, ordered by interprocess events.
 *
 * Prints one JSON line:
 *   daemon_gpu_ms   the daemon's time for the step (its worker, GPU-bound)
 *   rt_ms           dpclip_run round trip seen by the trainer (host)
 *   overhead_ms     rt - daemon time: what crossing processes costs
 *   timeline_ms     trainer-stream time from `ready` to after `done` (GPU
 *                   ordering only, no host sync inside)
 *   us              the blocking round trip's parts (see main)
 * all medians (p90 too), and whether MPS was active (HelloReply); then a
 * second line for the same steps with the early notice (notify_enqueued).
 *
 * --gap-us N leaves N microseconds between steps, as a trainer's forward and
 * backward pass does, so that the daemon's threads go idle in between and
 * wake-ups cost what they cost in training (0, the default: back to back).
 * By default this process sleeps through the gap and the GPU idles (the
 * coldest case); with --gap-gpu the gap is GPU work on the trainer's stream
 * (memsets of its own buffer) that the host waits for, as a trainer that
 * reads its loss every step does: GPU busy until the step, host awake.
 *
 *   bench_cuda_step --socket PATH [--iters N] [--gap-us N [--gap-gpu]] */
#include <cuda_runtime_api.h>
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "dpclip.h"

#define CK(x)                                                                                      \
    do {                                                                                           \
        cudaError_t e_ = (x);                                                                      \
        if (e_ != cudaSuccess) {                                                                   \
            fprintf(stderr, "%s: %s\n", #x, cudaGetErrorString(e_));                               \
            exit(1);                                                                               \
        }                                                                                          \
    } while (0)

static double now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

static int cmp_d(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static double pct(double *v, int n, double p) {
    qsort(v, (size_t)n, sizeof *v, cmp_d);
    int i = (int)(p * (n - 1) + 0.5);
    return v[i];
}

int main(int argc, char **argv) {
    const char *sock = dpclip_default_socket();
    int iters = 50, B = 8, T = 1024, c;
    long gap_us = 0;
    int gap_gpu = 0;
    static const struct option opts[] = {{"socket", required_argument, NULL, 's'},
                                         {"iters", required_argument, NULL, 'i'},
                                         {"gap-us", required_argument, NULL, 'g'},
                                         {"gap-gpu", no_argument, NULL, 'G'},
                                         {NULL, 0, NULL, 0}};
    while ((c = getopt_long(argc, argv, "", opts, NULL)) != -1) {
        if (c == 's') sock = optarg;
        else if (c == 'i') iters = atoi(optarg);
        else if (c == 'g') gap_us = atol(optarg);
        else if (c == 'G') gap_gpu = 1;
        else return 2;
    }
    if (iters < 1 || gap_us < 0) return 2;
    const int shapes[4][2] = {{768, 2304}, {768, 768}, {768, 3072}, {3072, 768}};
    const int L = 72;
    size_t off = 0, offs[72][4];
    for (int l = 0; l < L; l++) {
        int d = shapes[l % 4][0], p = shapes[l % 4][1];
        size_t n[4] = {(size_t)B * T * d * 2, (size_t)B * T * p * 2, (size_t)p * d * 4,
                       (size_t)p * 4};
        for (int k = 0; k < 4; k++) {
            offs[l][k] = off;
            off += (n[k] + 255) & ~(size_t)255;
        }
    }
    size_t total = off;

    CK(cudaSetDevice(0));
    uint8_t *dev;
    CK(cudaMalloc((void **)&dev, total));
    /* 0x3c3c as bf16 is 0.0115: finite, nonzero data everywhere. */
    CK(cudaMemset(dev, 0x3c, total));
    CK(cudaDeviceSynchronize());

    dpclip_client *cl = NULL;
    dpclip_connect_opts o = {"bench_cuda_step", "bench", 0};
    if (dpclip_connect(sock, &o, &cl)) {
        fprintf(stderr, "connect: %s\n", dpclip_errmsg(cl));
        return 1;
    }
    dpclip_daemon_info info;
    dpclip_daemon_info_get(cl, &info);
    uint64_t buf, boff;
    if (dpclip_buffer_register_cuda(cl, dev, &buf, &boff)) {
        fprintf(stderr, "register: %s\n", dpclip_errmsg(cl));
        return 1;
    }
    cudaStream_t st;
    cudaEvent_t ready, done, t0, t1;
    cudaIpcEventHandle_t hr, hd;
    uint64_t er, ed;
    CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    CK(cudaEventCreateWithFlags(&ready, cudaEventInterprocess | cudaEventDisableTiming));
    CK(cudaEventCreateWithFlags(&done, cudaEventInterprocess | cudaEventDisableTiming));
    CK(cudaEventCreate(&t0));
    CK(cudaEventCreate(&t1));
    CK(cudaIpcGetEventHandle(&hr, ready));
    CK(cudaIpcGetEventHandle(&hd, done));
    if (dpclip_event_register_cuda(cl, &hr, 0, &er) ||
        dpclip_event_register_cuda(cl, &hd, 0, &ed)) {
        fprintf(stderr, "events: %s\n", dpclip_errmsg(cl));
        return 1;
    }

    /* --gap-gpu: how many memsets of the buffer fill the gap (the data is
     * 0x3c bytes throughout, so rewriting it changes nothing). */
    int gap_sets = 0;
    if (gap_us && gap_gpu) {
        float ms = 0;
        CK(cudaEventRecord(t0, st));
        for (int k = 0; k < 4; k++) CK(cudaMemsetAsync(dev, 0x3c, total, st));
        CK(cudaEventRecord(t1, st));
        CK(cudaEventSynchronize(t1));
        CK(cudaEventElapsedTime(&ms, t0, t1));
        gap_sets = (int)(gap_us / 1e3 / (ms / 4) + 0.5);
        if (gap_sets < 1) gap_sets = 1;
    }

    dpclip_clip_config cfg = {.max_grad_norm = 1.0f,
                              .reduction = DPCLIP_MEAN,
                              .expected_batch_size = (uint32_t)B,
                              .noise_multiplier = 1.0f};
    dpclip_step *s = dpclip_step_new((uint32_t)B, &cfg);
    for (int l = 0; l < L; l++) {
        int d = shapes[l % 4][0], p = shapes[l % 4][1];
        dpclip_linear x;
        memset(&x, 0, sizeof x);
        x.has_bias = 1;
        x.activations = (dpclip_tensor){buf, offs[l][0], DPCLIP_BF16, 3, {B, T, d}};
        x.output_grad = (dpclip_tensor){buf, offs[l][1], DPCLIP_BF16, 3, {B, T, p}};
        x.weight_grad_out = (dpclip_tensor){buf, offs[l][2], DPCLIP_F32, 2, {p, d, 0}};
        x.bias_grad_out = (dpclip_tensor){buf, offs[l][3], DPCLIP_F32, 1, {p, 0, 0}};
        dpclip_step_add_linear(s, &x);
    }
    dpclip_step_set_events(s, er, ed);

    /* Pass 1, blocking (dpclip_run), with where the round trip went:
     *   send      building and sending the request (this process)
     *   to_daemon sent until the daemon took the frame up (socket, loop wake)
     *   in_daemon the daemon's time beyond the backend's compute (decode,
     *             validation, ledger, worker hand-off, result, reply)
     *   to_client reply sent until read here (socket, wake-up)
     *   ret       reply read until dpclip_run returned
     * Pass 2, early notice (dpclip_submit + dpclip_wait_enqueued): notice_ms
     * is the call-to-notice wall time (what blocks the trainer's thread),
     * and timeline_ms the trainer stream's time as before. */
    enum { P_RT, P_GPU, P_TL, P_SEND, P_TOD, P_IND, P_TOC, P_RET, P_NOTICE, P_TL2, P_GPU2, P_N };
    double *v[P_N];
    for (int k = 0; k < P_N; k++) v[k] = calloc((size_t)iters, sizeof(double));
    for (int pass = 0; pass < 2; pass++) {
        dpclip_step_notify_enqueued(s, pass == 1);
        for (int i = -5; i < iters; i++) {
            dpclip_result res;
            dpclip_timing tm;
            uint64_t ticket;
            CK(cudaEventRecord(t0, st));
            CK(cudaEventRecord(ready, st));
            double a = now_ms(), b;
            if (pass == 0) {
                if (dpclip_run(cl, s, &res) || dpclip_last_timing(cl, &tm)) {
                    fprintf(stderr, "step: %s (%s)\n", dpclip_errmsg(cl), dpclip_errfield(cl));
                    return 1;
                }
                b = now_ms();
                CK(cudaStreamWaitEvent(st, done, 0));
                CK(cudaEventRecord(t1, st));
            } else {
                dpclip_enqueued en;
                if (dpclip_submit(cl, s, &ticket) || dpclip_wait_enqueued(cl, ticket, -1, &en)) {
                    fprintf(stderr, "step: %s (%s)\n", dpclip_errmsg(cl), dpclip_errfield(cl));
                    return 1;
                }
                b = now_ms();
                CK(cudaStreamWaitEvent(st, done, 0));
                CK(cudaEventRecord(t1, st));
                if (dpclip_wait(cl, ticket, -1, &res)) {
                    fprintf(stderr, "step: %s (%s)\n", dpclip_errmsg(cl), dpclip_errfield(cl));
                    return 1;
                }
            }
            CK(cudaEventSynchronize(t1));
            float ms = 0;
            CK(cudaEventElapsedTime(&ms, t0, t1));
            if (i >= 0 && pass == 0) {
                v[P_RT][i] = b - a;
                v[P_GPU][i] = res.compute_ns / 1e6;
                v[P_TL][i] = ms;
                v[P_SEND][i] = (tm.sent_ns - tm.start_ns) / 1e3;
                v[P_TOD][i] = ((double)tm.daemon_received_ns - (double)tm.sent_ns) / 1e3;
                v[P_IND][i] = ((double)tm.daemon_replied_ns - (double)tm.daemon_received_ns -
                               (double)tm.compute_ns) /
                              1e3;
                v[P_TOC][i] = ((double)tm.received_ns - (double)tm.daemon_replied_ns) / 1e3;
                v[P_RET][i] = (b - tm.received_ns / 1e6) * 1e3;
            } else if (i >= 0) {
                v[P_NOTICE][i] = b - a;
                v[P_TL2][i] = ms;
                v[P_GPU2][i] = res.compute_ns / 1e6;
            }
            dpclip_result_free(&res);
            if (gap_sets) {
                for (int k = 0; k < gap_sets; k++) CK(cudaMemsetAsync(dev, 0x3c, total, st));
                CK(cudaStreamSynchronize(st));
            } else if (gap_us) {
                struct timespec gap = {gap_us / 1000000, (gap_us % 1000000) * 1000};
                nanosleep(&gap, NULL);
            }
        }
    }
    double ov[4096], ov2[4096];
    int n = iters < 4096 ? iters : 4096;
    for (int i = 0; i < n; i++) {
        ov[i] = v[P_RT][i] - v[P_GPU][i];
        ov2[i] = v[P_TL2][i] - v[P_GPU2][i];
    }
    printf(
        "{\"bench\":\"cuda_step\",\"model\":\"gpt2-small-linears\",\"layers\":%d,\"B\":%d,"
        "\"T\":%d,\"dtype\":\"bf16\",\"iters\":%d,\"gap_us\":%ld,\"gap\":\"%s\",\"mps\":%s,\"daemon_gpu_ms\":%.3f,"
        "\"daemon_gpu_p90_ms\":%.3f,\"rt_ms\":%.3f,\"rt_p90_ms\":%.3f,\"overhead_ms\":%.3f,"
        "\"overhead_p90_ms\":%.3f,\"timeline_ms\":%.3f,\"buffer_mib\":%.0f,"
        "\"us\":{\"send\":%.1f,\"to_daemon\":%.1f,\"in_daemon\":%.1f,\"to_client\":%.1f,"
        "\"ret\":%.1f}}\n",
        L, B, T, iters, gap_us,
        !gap_us   ? "none"
        : gap_gpu ? "gpu"
                  : "sleep",
        info.mps_active ? "true" : "false", pct(v[P_GPU], iters, 0.5), pct(v[P_GPU], iters, 0.9),
        pct(v[P_RT], iters, 0.5), pct(v[P_RT], iters, 0.9), pct(ov, n, 0.5), pct(ov, n, 0.9),
        pct(v[P_TL], iters, 0.5), total / 1048576.0, pct(v[P_SEND], iters, 0.5),
        pct(v[P_TOD], iters, 0.5), pct(v[P_IND], iters, 0.5), pct(v[P_TOC], iters, 0.5),
        pct(v[P_RET], iters, 0.5));
    printf(
        "{\"bench\":\"cuda_step_notify\",\"layers\":%d,\"gap_us\":%ld,\"gap\":\"%s\",\"mps\":%s,\"notice_ms\":%.3f,"
        "\"notice_p90_ms\":%.3f,\"daemon_gpu_ms\":%.3f,\"timeline_ms\":%.3f,"
        "\"timeline_over_gpu_ms\":%.3f,\"timeline_over_gpu_p90_ms\":%.3f}\n",
        L, gap_us,
        !gap_us   ? "none"
        : gap_gpu ? "gpu"
                  : "sleep",
        info.mps_active ? "true" : "false", pct(v[P_NOTICE], iters, 0.5),
        pct(v[P_NOTICE], iters, 0.9), pct(v[P_GPU2], iters, 0.5), pct(v[P_TL2], iters, 0.5),
        pct(ov2, n, 0.5), pct(ov2, n, 0.9));
    dpclip_step_free(s);
    dpclip_disconnect(cl);
    cudaFree(dev);
    for (int k = 0; k < P_N; k++) free(v[k]);
    return 0;
}
