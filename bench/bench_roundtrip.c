/* bench_roundtrip: the cost of one dpclip_run round trip for a small step,
 * i.e. the library + socket + daemon overhead a trainer pays per optimizer
 * step on top of the arithmetic. A 16-layer ClipStep of tiny Linear layers
 * (B=4, d=p=8, f32, with weight outputs) against a running dpclipd.
 *
 *   bench_roundtrip [--socket PATH] [--iters N] [--warmup N] [--layers L]
 *                   [--sigma S]
 *
 * Prints one JSON line:
 * {"bench":"roundtrip","layers":16,"B":4,"iters":5000,"p50_us":..,"p99_us":..,"mean_us":..,
 *  "sigma":1,"compute_mean_us":..,"ping_p50_us":..}
 * compute_mean_us is the daemon's worker time per step (from the replies)
 * and ping_p50_us a bare request/reply measured in the same run, so the
 * step's overhead over the transport can be read off as a ratio.
 * bench/run_roundtrip.sh starts a daemon and runs this. */
#include <getopt.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "dpclip.h"

#define BATCH 4
#define DIM 8

static double now_us(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e6 + (double)ts.tv_nsec / 1e3;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

int main(int argc, char **argv) {
    static const struct option opts[] = {
        {"socket", required_argument, NULL, 's'}, {"iters", required_argument, NULL, 'i'},
        {"warmup", required_argument, NULL, 'w'}, {"layers", required_argument, NULL, 'l'},
        {"sigma", required_argument, NULL, 'n'},  {NULL, 0, NULL, 0}};
    const char *sock = dpclip_default_socket();
    int iters = 5000, warmup = 200, layers = 16, o, rc = 1;
    double sigma = 1.0, compute_ns = 0.0, ping_p50, part[4] = {0, 0, 0, 0};
    dpclip_client *c = NULL;
    dpclip_step *s = NULL;
    double *t = NULL, sum = 0.0;
    uint64_t buf;
    void *mem;
    size_t per_layer, size;

    while ((o = getopt_long(argc, argv, "", opts, NULL)) != -1) {
        switch (o) {
        case 's': sock = optarg; break;
        case 'i': iters = atoi(optarg); break;
        case 'w': warmup = atoi(optarg); break;
        case 'l': layers = atoi(optarg); break;
        case 'n': sigma = atof(optarg); break;
        default:
            fprintf(stderr, "usage: bench_roundtrip [--socket PATH] [--iters N] [--warmup N] "
                            "[--layers L] [--sigma S]\n");
            return 2;
        }
    }
    if (iters < 1 || warmup < 0 || layers < 1 || !(sigma >= 0.0)) return 2;

    if (dpclip_connect(sock, NULL, &c)) {
        fprintf(stderr, "bench_roundtrip: connect %s: %s\n", sock, dpclip_errmsg(c));
        goto out;
    }
    /* per layer: activations [B,d], output grad [B,p], weight out [p,d] */
    per_layer = (size_t)(BATCH * DIM + BATCH * DIM + DIM * DIM) * sizeof(float);
    size = per_layer * (size_t)layers;
    if (dpclip_buffer_alloc(c, size, &buf, &mem)) {
        fprintf(stderr, "bench_roundtrip: buffer: %s\n", dpclip_errmsg(c));
        goto out;
    }
    {
        float *f = mem;
        uint64_t x = 88172645463325252ull;
        for (size_t i = 0; i < size / sizeof(float); i++) { /* xorshift64: values in [-1, 1) */
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            f[i] = (float)((double)(x >> 11) / 4503599627370496.0 - 1.0);
        }
    }
    {
        dpclip_clip_config cfg = {.max_grad_norm = 1.0f,
                                  .reduction = DPCLIP_MEAN,
                                  .noise_multiplier = (float)sigma,
                                  .mode = DPCLIP_FLAT};
        s = dpclip_step_new(BATCH, &cfg);
        if (!s) goto out;
        for (int l = 0; l < layers; l++) {
            size_t base = per_layer * (size_t)l, f = sizeof(float);
            char name[16];
            dpclip_linear lin = {
                .name = name,
                .activations = {buf, base, DPCLIP_F32, 2, {BATCH, DIM, 0}},
                .output_grad = {buf, base + BATCH * DIM * f, DPCLIP_F32, 2, {BATCH, DIM, 0}},
                .weight_grad_out = {buf, base + 2 * BATCH * DIM * f, DPCLIP_F32, 2, {DIM, DIM, 0}},
            };
            snprintf(name, sizeof name, "fc%d", l);
            if (dpclip_step_add_linear(s, &lin)) goto out;
        }
    }

    if (!(t = malloc((size_t)iters * sizeof *t))) goto out;
    for (int i = 0; i < warmup + iters; i++) {
        dpclip_result res;
        double t0 = now_us();
        if (dpclip_run(c, s, &res)) {
            fprintf(stderr, "bench_roundtrip: step: %s\n", dpclip_errmsg(c));
            goto out;
        }
        double dt = now_us() - t0;
        dpclip_timing tm;
        if (i >= warmup) {
            t[i - warmup] = dt;
            compute_ns += (double)res.compute_ns;
            if (dpclip_last_timing(c, &tm) == 0) {
                part[0] += (double)(tm.sent_ns - tm.start_ns);
                part[1] += (double)tm.daemon_received_ns - (double)tm.sent_ns;
                part[2] += (double)tm.daemon_replied_ns - (double)tm.daemon_received_ns -
                           (double)tm.compute_ns;
                part[3] += (double)tm.received_ns - (double)tm.daemon_replied_ns;
            }
        }
        dpclip_result_free(&res);
    }
    for (int i = 0; i < iters; i++) sum += t[i];
    qsort(t, (size_t)iters, sizeof *t, cmp_double);
    {
        /* the bare transport, for comparison: ping round trips */
        double *pt = malloc((size_t)iters * sizeof *pt);
        if (!pt) goto out;
        for (int i = 0; i < iters; i++) {
            double t0 = now_us();
            if (dpclip_ping(c)) {
                fprintf(stderr, "bench_roundtrip: ping: %s\n", dpclip_errmsg(c));
                free(pt);
                goto out;
            }
            pt[i] = now_us() - t0;
        }
        qsort(pt, (size_t)iters, sizeof *pt, cmp_double);
        ping_p50 = pt[iters / 2];
        free(pt);
    }
    printf("{\"bench\":\"roundtrip\",\"layers\":%d,\"B\":%d,\"iters\":%d,\"p50_us\":%.1f,"
           "\"p99_us\":%.1f,\"mean_us\":%.1f,\"sigma\":%g,\"compute_mean_us\":%.1f,"
           "\"ping_p50_us\":%.1f,\"mean_parts_us\":{\"send\":%.1f,\"to_daemon\":%.1f,"
           "\"in_daemon\":%.1f,\"to_client\":%.1f}}\n",
           layers, BATCH, iters, t[(size_t)iters / 2], t[(size_t)((double)iters * 0.99)],
           sum / iters, sigma, compute_ns / iters / 1e3, ping_p50, part[0] / iters / 1e3,
           part[1] / iters / 1e3, part[2] / iters / 1e3, part[3] / iters / 1e3);
    rc = 0;
out:
    free(t);
    dpclip_step_free(s);
    dpclip_disconnect(c);
    return rc;
}
