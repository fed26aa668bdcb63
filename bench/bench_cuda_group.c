/* A norm group on one daemon and one GPU: GPT-2-small's 72 Linear layers
 * (B=8, T=1024, bf16) split in pipeline order over 2 and 4 member sessions,
 * each a thread with its own connection and device buffer, every member
 * stepping at once; against the same 72 layers as one ungrouped session, in
 * the same run. Prints one JSON line per split:
 *   step_ms   median wall time from all members starting a step to the last
 *             one's reply
 *   added_ms  step_ms minus the unsplit step's
 *   wait_ms   the daemon's last reduction wait (first member's norms to the
 *             group's totals), from /status when given --status
 *   bench/bench_cuda_group --socket S [--iters N] */
#include <getopt.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cuda_runtime_api.h>

#include "dpclip.h"

#define L_ALL 72
#define B 8
#define T 1024

static const int shapes[4][2] = {{768, 2304}, {768, 768}, {768, 3072}, {3072, 768}};

typedef struct member {
    const char *sock;
    int rank, n, first, count, iters;
    pthread_barrier_t *bar;
    double *ms;  /* [iters], rank 0 writes */
    int rc;
} member;

static double now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

static int cmp_d(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static void *member_main(void *arg) {
    member *m = arg;
    size_t off = 0, offs[L_ALL][4];
    uint8_t *dev = NULL;
    dpclip_client *cl = NULL;
    dpclip_connect_opts o = {"bench_cuda_group", "bench-group", 0};
    uint64_t buf, boff;
    m->rc = 1;
    for (int i = 0; i < m->count; i++) {
        int l = m->first + i, d = shapes[l % 4][0], p = shapes[l % 4][1];
        size_t n[4] = {(size_t)B * T * d * 2, (size_t)B * T * p * 2, (size_t)p * d * 4,
                       (size_t)p * 4};
        for (int k = 0; k < 4; k++) {
            offs[i][k] = off;
            off += (n[k] + 255) & ~(size_t)255;
        }
    }
    if (cudaSetDevice(0) != cudaSuccess || cudaMalloc((void **)&dev, off) != cudaSuccess ||
        cudaMemset(dev, 0x3c, off) != cudaSuccess || cudaDeviceSynchronize() != cudaSuccess) {
        fprintf(stderr, "member %d: CUDA allocation failed\n", m->rank);
        goto out;
    }
    if (dpclip_connect(m->sock, &o, &cl) || dpclip_buffer_register_cuda(cl, dev, &buf, &boff)) {
        fprintf(stderr, "member %d: %s\n", m->rank, dpclip_errmsg(cl));
        goto out;
    }
    if (m->n > 1) {
        char name[32];
        snprintf(name, sizeof name, "bench-g%d", m->n);
        dpclip_group_opts g = {name, (uint32_t)m->rank, (uint32_t)m->n, 0, 0};
        if (dpclip_join_group(cl, &g, NULL)) {
            fprintf(stderr, "member %d: join: %s\n", m->rank, dpclip_errmsg(cl));
            goto out;
        }
    }
    dpclip_clip_config cfg = {.max_grad_norm = 1.0f, .reduction = DPCLIP_MEAN,
                              .expected_batch_size = B, .noise_multiplier = 1.0f};
    dpclip_step *s = dpclip_step_new(B, &cfg);
    for (int i = 0; i < m->count; i++) {
        int l = m->first + i, d = shapes[l % 4][0], p = shapes[l % 4][1];
        dpclip_linear x;
        memset(&x, 0, sizeof x);
        x.has_bias = 1;
        x.activations = (dpclip_tensor){buf, offs[i][0], DPCLIP_BF16, 3, {B, T, d}};
        x.output_grad = (dpclip_tensor){buf, offs[i][1], DPCLIP_BF16, 3, {B, T, p}};
        x.weight_grad_out = (dpclip_tensor){buf, offs[i][2], DPCLIP_F32, 2, {p, d, 0}};
        x.bias_grad_out = (dpclip_tensor){buf, offs[i][3], DPCLIP_F32, 1, {p, 0, 0}};
        dpclip_step_add_linear(s, &x);
    }
    for (int it = -5; it < m->iters; it++) {
        dpclip_result res;
        double t0 = 0;
        pthread_barrier_wait(m->bar);
        if (m->rank == 0) t0 = now_ms();
        if (dpclip_run(cl, s, &res)) {
            fprintf(stderr, "member %d: step: %s (%s)\n", m->rank, dpclip_errmsg(cl),
                    dpclip_errfield(cl));
            exit(1); /* the others would wait for this member for ever */
        }
        dpclip_result_free(&res);
        pthread_barrier_wait(m->bar);
        if (m->rank == 0 && it >= 0) m->ms[it] = now_ms() - t0;
    }
    dpclip_step_free(s);
    m->rc = 0;
out:
    dpclip_disconnect(cl);
    if (dev) cudaFree(dev);
    return NULL;
}

/* Median step wall time with the layers split over n members. */
static double run_split(const char *sock, int n, int iters) {
    pthread_t th[4];
    member m[4];
    pthread_barrier_t bar;
    double *ms = calloc((size_t)iters, sizeof *ms), med;
    pthread_barrier_init(&bar, NULL, (unsigned)n);
    for (int k = 0; k < n; k++) {
        m[k] = (member){sock, k, n, k * (L_ALL / n), L_ALL / n, iters, &bar, ms, 1};
        pthread_create(&th[k], NULL, member_main, &m[k]);
    }
    for (int k = 0; k < n; k++) pthread_join(th[k], NULL);
    for (int k = 0; k < n; k++)
        if (m[k].rc) exit(1);
    qsort(ms, (size_t)iters, sizeof *ms, cmp_d);
    med = ms[iters / 2];
    free(ms);
    pthread_barrier_destroy(&bar);
    return med;
}

int main(int argc, char **argv) {
    const char *sock = dpclip_default_socket();
    int iters = 30, c;
    static const struct option opts[] = {{"socket", required_argument, NULL, 's'},
                                         {"iters", required_argument, NULL, 'i'},
                                         {NULL, 0, NULL, 0}};
    while ((c = getopt_long(argc, argv, "", opts, NULL)) != -1) {
        if (c == 's') sock = optarg;
        else if (c == 'i') iters = atoi(optarg);
        else return 2;
    }
    if (iters < 1) return 2;
    double unsplit = run_split(sock, 1, iters);
    printf("{\"bench\":\"cuda_group\",\"members\":1,\"layers\":%d,\"B\":%d,\"T\":%d,"
           "\"dtype\":\"bf16\",\"iters\":%d,\"step_ms\":%.3f}\n",
           L_ALL, B, T, iters, unsplit);
    for (int n = 2; n <= 4; n *= 2) {
        double ms = run_split(sock, n, iters);
        printf("{\"bench\":\"cuda_group\",\"members\":%d,\"layers\":%d,\"B\":%d,\"T\":%d,"
               "\"dtype\":\"bf16\",\"iters\":%d,\"step_ms\":%.3f,\"unsplit_ms\":%.3f,"
               "\"added_ms\":%.3f,\"target_added_le_0_1_ms\":%s}\n",
               n, L_ALL, B, T, iters, ms, unsplit, ms - unsplit,
               ms - unsplit <= 0.1 ? "true" : "false");
        fflush(stdout);
    }
    return 0;
}
