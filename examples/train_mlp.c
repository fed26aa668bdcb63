/* train_mlp: a two-layer MLP trained with DP-SGD through dpclipd.
 *
 * The data are 4 Gaussian blobs in 16 dimensions, generated from a fixed
 * seed. Each step's batch is Poisson-sampled: every training record joins it
 * with probability q = B / N (B the expected batch size), drawn from a seed
 * no one can predict (getrandom), so that the daemon's ledger, told q, may
 * count the privacy amplification by sampling; the batch's size varies, and
 * an empty one still steps (one sample of zeros: noise alone). The trainer
 * does its own forward and backward pass (to the output gradients of each
 * Linear layer, for the batch's mean loss) in a shared-memory buffer
 * registered with the daemon, then sends one ClipStep per batch. The daemon
 * computes per-sample gradient norms, clips, sums, adds Gaussian noise,
 * divides by B and writes the private gradients into the same buffer; the
 * trainer applies plain SGD with them. It never sees a per-sample gradient.
 * Each epoch prints the job's epsilon from the daemon's ledger.
 *
 *   train_mlp [--socket PATH] [--epochs N] [--batch B] [--sigma S] [--clip C]
 *             [--lr LR]
 */
#include <getopt.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>

#include "dpclip.h"

#define D 16 /* input features */
#define H 32 /* hidden units */
#define K 4  /* classes */
#define N_TRAIN 2048
#define N_TEST 1024

typedef struct rng {
    uint64_t s;
} rng;

static uint64_t rng_next(rng *r) { /* splitmix64 */
    uint64_t z = (r->s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

static double rng_uniform(rng *r) {
    return (double)(rng_next(r) >> 11) * (1.0 / 9007199254740992.0);
}

static double rng_normal(rng *r) {
    double u1 = 1.0 - rng_uniform(r), u2 = rng_uniform(r);
    return sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2);
}

typedef struct model {
    float w1[H][D], b1[H], w2[K][H], b2[K];
} model;

/* Gaussian blobs: class centers N(0, 0.6^2) per dim, points at unit spread. */
static void make_data(rng *r, const float centers[K][D], float (*x)[D], int *y, int n) {
    for (int i = 0; i < n; i++) {
        int k = (int)(rng_next(r) % K);
        y[i] = k;
        for (int j = 0; j < D; j++) x[i][j] = centers[k][j] + (float)rng_normal(r);
    }
}

/* Forward one sample: z1 (pre-activation), h, softmax probabilities. */
static void forward(const model *m, const float *x, float *z1, float *h, float *p) {
    float logits[K], mx = -INFINITY, sum = 0.0f;
    for (int u = 0; u < H; u++) {
        float z = m->b1[u];
        for (int j = 0; j < D; j++) z += m->w1[u][j] * x[j];
        z1[u] = z;
        h[u] = z > 0.0f ? z : 0.0f;
    }
    for (int k = 0; k < K; k++) {
        float z = m->b2[k];
        for (int u = 0; u < H; u++) z += m->w2[k][u] * h[u];
        logits[k] = z;
        if (z > mx) mx = z;
    }
    for (int k = 0; k < K; k++) sum += (p[k] = expf(logits[k] - mx));
    for (int k = 0; k < K; k++) p[k] /= sum;
}

static double accuracy(const model *m, float (*x)[D], const int *y, int n) {
    float z1[H], h[H], p[K];
    int right = 0;
    for (int i = 0; i < n; i++) {
        int best = 0;
        forward(m, x[i], z1, h, p);
        for (int k = 1; k < K; k++)
            if (p[k] > p[best]) best = k;
        right += best == y[i];
    }
    return (double)right / n;
}

/* Byte offsets of the tensors in the shared buffer (64-byte aligned). */
typedef struct layout {
    size_t x, h, g1, g2, gw1, gb1, gw2, gb2, size;
} layout;

static size_t take(size_t *at, size_t bytes) {
    size_t off = (*at + 63) & ~(size_t)63;
    *at = off + bytes;
    return off;
}

static void make_layout(layout *L, int B) {
    size_t at = 0, f = sizeof(float);
    L->x = take(&at, (size_t)B * D * f);
    L->h = take(&at, (size_t)B * H * f);
    L->g1 = take(&at, (size_t)B * H * f);
    L->g2 = take(&at, (size_t)B * K * f);
    L->gw1 = take(&at, (size_t)H * D * f);
    L->gb1 = take(&at, (size_t)H * f);
    L->gw2 = take(&at, (size_t)K * H * f);
    L->gb2 = take(&at, (size_t)K * f);
    L->size = at;
}

static dpclip_tensor ten(uint64_t buf, size_t off, int ndim, int64_t s0, int64_t s1) {
    dpclip_tensor t = {buf, off, DPCLIP_F32, ndim, {s0, s1, 0}};
    return t;
}

/* A Linear layer of `rows` samples, in features to out, as the daemon reads
 * it from the buffer: its input and output gradient, and where its private
 * weight and bias gradients go. */
static int add_linear(dpclip_step *step, const char *name, uint64_t buf, int rows, int in, int out,
                      size_t act, size_t grad, size_t gw, size_t gb) {
    dpclip_linear ly = {.name = name,
                        .has_bias = 1,
                        .activations = ten(buf, act, 2, rows, in),
                        .output_grad = ten(buf, grad, 2, rows, out),
                        .weight_grad_out = ten(buf, gw, 2, out, in),
                        .bias_grad_out = ten(buf, gb, 1, out, 0)};
    return dpclip_step_add_linear(step, &ly);
}

static void usage(void) {
    fprintf(stderr, "usage: train_mlp [--socket PATH] [--epochs N] [--batch B] [--sigma S] "
                    "[--clip C] [--lr LR]\n");
}

int main(int argc, char **argv) {
    static const struct option opts[] = {
        {"socket", required_argument, NULL, 's'}, {"epochs", required_argument, NULL, 'e'},
        {"batch", required_argument, NULL, 'b'},  {"sigma", required_argument, NULL, 'n'},
        {"clip", required_argument, NULL, 'c'},   {"lr", required_argument, NULL, 'l'},
        {"help", no_argument, NULL, 'h'},         {NULL, 0, NULL, 0}};
    const char *sock = dpclip_default_socket();
    int epochs = 10, B = 64, o, rc = 1;
    double sigma = 1.0, clip = 1.0, lr = 0.5;
    static float xtr[N_TRAIN][D], xte[N_TEST][D], centers[K][D];
    static int ytr[N_TRAIN], yte[N_TEST], batch[N_TRAIN];
    static model m;
    dpclip_client *c = NULL;
    dpclip_step *step = NULL;
    uint64_t buf;
    void *mem;
    uint8_t *base;
    layout L;
    rng r = {20240601}, sampler;
    double q;

    while ((o = getopt_long(argc, argv, "", opts, NULL)) != -1) {
        switch (o) {
        case 's': sock = optarg; break;
        case 'e': epochs = atoi(optarg); break;
        case 'b': B = atoi(optarg); break;
        case 'n': sigma = atof(optarg); break;
        case 'c': clip = atof(optarg); break;
        case 'l': lr = atof(optarg); break;
        case 'h': usage(); return 0;
        default: usage(); return 2;
        }
    }
    if (epochs < 1 || B < 1 || B > N_TRAIN || sigma < 0.0 || clip <= 0.0 || lr <= 0.0) {
        usage();
        return 2;
    }

    /* data and model, from the fixed seed */
    for (int k = 0; k < K; k++)
        for (int j = 0; j < D; j++) centers[k][j] = (float)(0.6 * rng_normal(&r));
    make_data(&r, (const float(*)[D])centers, xtr, ytr, N_TRAIN);
    make_data(&r, (const float(*)[D])centers, xte, yte, N_TEST);
    for (int u = 0; u < H; u++)
        for (int j = 0; j < D; j++) m.w1[u][j] = (float)(rng_normal(&r) / sqrt((double)D));
    for (int k = 0; k < K; k++)
        for (int u = 0; u < H; u++) m.w2[k][u] = (float)(rng_normal(&r) / sqrt((double)H));

    if (dpclip_connect(sock, &(dpclip_connect_opts){.client_name = "train_mlp"}, &c)) {
        fprintf(stderr, "train_mlp: cannot connect to %s: %s\n", sock, dpclip_errmsg(c));
        goto out;
    }
    make_layout(&L, N_TRAIN); /* room for the largest batch Poisson sampling can draw */
    if (dpclip_buffer_alloc(c, L.size, &buf, &mem)) {
        fprintf(stderr, "train_mlp: buffer: %s\n", dpclip_errmsg(c));
        goto out;
    }
    base = mem;
    q = (double)B / N_TRAIN;
    if (getrandom(&sampler.s, sizeof sampler.s, 0) != (ssize_t)sizeof sampler.s) {
        perror("train_mlp: getrandom");
        goto out;
    }

    /* One step object, its layers named again for each batch's size. MEAN:
     * our loss is the batch's mean (the daemon scales the output gradients
     * back by the batch's size, and divides the noised sum by B); q: the
     * rate the batches are drawn at, which the ledger charges. */
    {
        dpclip_clip_config cfg = {.max_grad_norm = (float)clip,
                                  .reduction = DPCLIP_MEAN,
                                  .expected_batch_size = (uint32_t)B,
                                  .noise_multiplier = (float)sigma,
                                  .mode = DPCLIP_FLAT,
                                  .sample_rate = q,
                                  .target_delta = 1e-5};
        step = dpclip_step_new((uint32_t)B, &cfg);
        if (!step) {
            fprintf(stderr, "train_mlp: cannot build the step\n");
            goto out;
        }
    }

    double eps = 0.0, delta = 0.0; /* the daemon's ledger after the last step */
    for (int ep = 1; ep <= epochs; ep++) {
        double loss = 0.0, coef_sum = 0.0;
        int steps = N_TRAIN / B, drawn = 0; /* an epoch: N / B steps, N samples expected */
        for (int si = 0; si < steps; si++) {
            float(*x)[D] = (float(*)[D])(base + L.x);
            float(*h)[H] = (float(*)[H])(base + L.h);
            float(*g1)[H] = (float(*)[H])(base + L.g1);
            float(*g2)[K] = (float(*)[K])(base + L.g2);
            dpclip_result res;
            int n = 0;

            for (int i = 0; i < N_TRAIN; i++) /* Poisson sampling */
                if (rng_uniform(&sampler) < q) batch[n++] = i;
            /* an empty batch steps too, as one sample of zeros: its update is
             * the noise alone (skipping it would change what is accounted) */
            const int rows = n ? n : 1;
            if (n == 0) { /* (a drawn batch's rows are all written below) */
                memset(x[0], 0, sizeof x[0]);
                memset(h[0], 0, sizeof h[0]);
                memset(g1[0], 0, sizeof g1[0]);
                memset(g2[0], 0, sizeof g2[0]);
            }
            /* forward and backward to the layers' output gradients */
            for (int b = 0; b < n; b++) {
                int idx = batch[b];
                float z1[H], p[K];
                memcpy(x[b], xtr[idx], sizeof x[b]);
                forward(&m, x[b], z1, h[b], p);
                loss -= log(p[ytr[idx]] + 1e-12);
                for (int k = 0; k < K; k++) g2[b][k] = (p[k] - (k == ytr[idx])) / (float)n;
                for (int u = 0; u < H; u++) {
                    float g = 0.0f;
                    for (int k = 0; k < K; k++) g += g2[b][k] * m.w2[k][u];
                    g1[b][u] = z1[u] > 0.0f ? g : 0.0f;
                }
            }
            drawn += n;
            dpclip_step_reset(step, (uint32_t)rows);
            if (add_linear(step, "fc1", buf, rows, D, H, L.x, L.g1, L.gw1, L.gb1) ||
                add_linear(step, "fc2", buf, rows, H, K, L.h, L.g2, L.gw2, L.gb2)) {
                fprintf(stderr, "train_mlp: cannot build the step\n");
                goto out;
            }
            if (dpclip_run(c, step, &res)) {
                fprintf(stderr, "train_mlp: step failed: %s%s%s\n", dpclip_errmsg(c),
                        dpclip_errfield(c)[0] ? " at " : "", dpclip_errfield(c));
                goto out;
            }
            for (int b = 0; b < n; b++) coef_sum += res.coefs[b];
            eps = res.epsilon;
            delta = res.delta;
            dpclip_result_free(&res);

            /* SGD with the private gradients the daemon wrote */
            {
                const float *gw1 = (const float *)(base + L.gw1);
                const float *gb1 = (const float *)(base + L.gb1);
                const float *gw2 = (const float *)(base + L.gw2);
                const float *gb2 = (const float *)(base + L.gb2);
                for (int u = 0; u < H; u++) {
                    for (int j = 0; j < D; j++) m.w1[u][j] -= (float)lr * gw1[u * D + j];
                    m.b1[u] -= (float)lr * gb1[u];
                }
                for (int k = 0; k < K; k++) {
                    for (int u = 0; u < H; u++) m.w2[k][u] -= (float)lr * gw2[k * H + u];
                    m.b2[k] -= (float)lr * gb2[k];
                }
            }
        }
        printf("epoch %d loss %.3f acc %.3f mean_clip_coef %.2f epsilon %.3g (delta %.0e)\n", ep,
               drawn ? loss / drawn : 0.0, accuracy(&m, xte, yte, N_TEST),
               drawn ? coef_sum / drawn : 1.0, eps, delta);
        fflush(stdout);
    }
    printf("final accuracy %.3f\n", accuracy(&m, xte, yte, N_TEST));
    rc = 0;
out:
    dpclip_step_free(step);
    dpclip_disconnect(c); /* also unmaps the buffer */
    return rc;
}
