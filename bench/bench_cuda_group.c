/* A norm group on one daemon and one GPU: GPT-2-small's 72 Linear layers
 * (B=8, T=1024, bf16) split in pipeline order over 2 and 4 member sessions,
 * each a thread with its own connection and device buffer, every member
 * stepping at once; against the same 72 layers as one ungrouped session, in
 * the same run. Prints one JSON line per split:
 *   step_ms   median wall time from all members starting a step to the last
 *             one's reply
 *   added_ms  step_ms minus the unsplit step's
 *   wait_ms   median of rank 0's wait for the group's totals (its norms in
 *             to the totals back: the reduction, and the others' norms)
 *   after_last_ms  median time from the last member's submission to the
 *             last reply: what the daemon adds once every member's inputs
 *             exist (the skew of the members' arrivals, here the threads'
 *             wake-ups from a barrier, is the trainer's; no daemon can clip
 *             before the last member's norms)
 *   after_last_added_ms  after_last_ms minus the unsplit step's
 * With --socket2, a second daemon on the same GPU: the 2-member split with
 * one member on each daemon, whose daemons exchange their totals through
 * NCCL (give each daemon its own NCCL_HOSTID; see docs/groups.md):
 *   exchange_ms  median of the cross-daemon exchange's time on rank 0's
 *                daemon: its totals sent to the other's received, which
 *                includes waiting for the other daemon's members
 *   exchange_last_arrival_ms  the same on whichever daemon came last: the
 *                transport's latency
 *   bench/bench_cuda_group --socket S [--socket2 S2] [--iters N] */
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
    double *wait, *exch; /* [iters], this member's group wait and exchange */
    double *sub, *rep;   /* [iters], this member's submission and reply (ms) */
    int daemons; /* the group spans 2 daemons: rank 0 on daemon 0, the rest on daemon 1 */
    dpclip_group_link *link; /* shared: rank 0's join fills the NCCL id */
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
        int rc;
        snprintf(name, sizeof name, "bench-g%d-d%d", m->n, m->daemons);
        dpclip_group_opts g = {name, (uint32_t)m->rank, (uint32_t)m->n, 0, 0};
        if (m->daemons > 1) {
            /* rank 0 joins first (its daemon makes the NCCL id), the rest
             * after it with the id: the barrier is this bench's rendezvous */
            dpclip_group_link link = *m->link;
            link.daemon_rank = m->rank ? 1 : 0;
            link.local_size = m->rank ? (uint32_t)m->n - 1 : 1;
            if (m->rank == 0) {
                rc = dpclip_join_group_linked(cl, &g, &link, NULL);
                *m->link = link;
                pthread_barrier_wait(m->bar);
            } else {
                pthread_barrier_wait(m->bar);
                link = *m->link;
                link.daemon_rank = 1;
                link.local_size = (uint32_t)m->n - 1;
                rc = m->link->nccl_version ? dpclip_join_group_linked(cl, &g, &link, NULL) : -1;
            }
        } else {
            rc = dpclip_join_group(cl, &g, NULL);
        }
        if (rc) {
            fprintf(stderr, "member %d: join: %s\n", m->rank, dpclip_errmsg(cl));
            exit(1); /* the others would wait for this member for ever */
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
        double ts = now_ms();
        int rc = dpclip_run(cl, s, &res);
        double tr = now_ms();
        if (it >= 0) {
            m->sub[it] = ts;
            m->rep[it] = tr;
        }
        if (rc) {
            fprintf(stderr, "member %d: step: %s (%s)\n", m->rank, dpclip_errmsg(cl),
                    dpclip_errfield(cl));
            exit(1); /* the others would wait for this member for ever */
        }
        dpclip_result_free(&res);
        pthread_barrier_wait(m->bar);
        if (it >= 0) {
            dpclip_timing tm;
            if (m->rank == 0) m->ms[it] = now_ms() - t0;
            if (dpclip_last_timing(cl, &tm) == 0) {
                m->wait[it] = tm.group_wait_ns / 1e6;
                m->exch[it] = tm.group_exchange_ns / 1e6;
            }
        }
    }
    dpclip_step_free(s);
    m->rc = 0;
out:
    dpclip_disconnect(cl);
    if (dev) cudaFree(dev);
    return NULL;
}

typedef struct split_ms {
    double step, wait, exch; /* medians; wait and exch are rank 0's */
    double after_last;       /* median of last reply - last submission */
    double exch_last;        /* median of the smaller exchange of ranks 0 and 1: the
                              * daemon that came last waits for no one */
} split_ms;

static double median(double *v, int n) {
    qsort(v, (size_t)n, sizeof *v, cmp_d);
    return v[n / 2];
}

/* Median times with the layers split over n members; with sock2, rank 0 on
 * sock and the others on sock2. */
static split_ms run_split(const char *sock, const char *sock2, int n, int iters) {
    pthread_t th[4];
    member m[4];
    pthread_barrier_t bar;
    dpclip_group_link link = {.daemons = 2};
    double *ms = calloc((size_t)iters * (1 + 4 * 4 + 2), sizeof *ms), *last = ms + 17 * iters,
           *after = ms + 18 * iters;
    split_ms r;
    pthread_barrier_init(&bar, NULL, (unsigned)n);
    for (int k = 0; k < n; k++) {
        m[k] = (member){k && sock2 ? sock2 : sock, k, n, k * (L_ALL / n), L_ALL / n, iters,
                        &bar, ms, ms + (1 + 4 * k) * iters, ms + (2 + 4 * k) * iters,
                        ms + (3 + 4 * k) * iters, ms + (4 + 4 * k) * iters,
                        sock2 ? 2 : 1, &link, 1};
        pthread_create(&th[k], NULL, member_main, &m[k]);
    }
    for (int k = 0; k < n; k++) pthread_join(th[k], NULL);
    for (int k = 0; k < n; k++)
        if (m[k].rc) exit(1);
    for (int i = 0; i < iters && n > 1; i++)
        last[i] = m[0].exch[i] < m[1].exch[i] ? m[0].exch[i] : m[1].exch[i];
    for (int i = 0; i < iters; i++) {
        double s_last = m[0].sub[i], r_last = m[0].rep[i];
        for (int k = 1; k < n; k++) {
            if (m[k].sub[i] > s_last) s_last = m[k].sub[i];
            if (m[k].rep[i] > r_last) r_last = m[k].rep[i];
        }
        after[i] = r_last - s_last;
    }
    r.after_last = median(after, iters);
    r.step = median(ms, iters);
    r.exch_last = n > 1 ? median(last, iters) : 0;
    r.wait = median(m[0].wait, iters);
    r.exch = median(m[0].exch, iters);
    free(ms);
    pthread_barrier_destroy(&bar);
    return r;
}

int main(int argc, char **argv) {
    const char *sock = dpclip_default_socket(), *sock2 = NULL;
    int iters = 30, c;
    static const struct option opts[] = {{"socket", required_argument, NULL, 's'},
                                         {"socket2", required_argument, NULL, 'S'},
                                         {"iters", required_argument, NULL, 'i'},
                                         {NULL, 0, NULL, 0}};
    while ((c = getopt_long(argc, argv, "", opts, NULL)) != -1) {
        if (c == 's') sock = optarg;
        else if (c == 'S') sock2 = optarg;
        else if (c == 'i') iters = atoi(optarg);
        else return 2;
    }
    if (iters < 1) return 2;
    split_ms one = run_split(sock, NULL, 1, iters);
    double unsplit = one.step, two = 0;
    printf("{\"bench\":\"cuda_group\",\"members\":1,\"layers\":%d,\"B\":%d,\"T\":%d,"
           "\"dtype\":\"bf16\",\"iters\":%d,\"step_ms\":%.3f,\"after_last_ms\":%.3f}\n",
           L_ALL, B, T, iters, unsplit, one.after_last);
    for (int n = 2; n <= 4; n *= 2) {
        split_ms r = run_split(sock, NULL, n, iters);
        if (n == 2) two = r.step;
        printf("{\"bench\":\"cuda_group\",\"members\":%d,\"daemons\":1,\"layers\":%d,"
               "\"B\":%d,\"T\":%d,\"dtype\":\"bf16\",\"iters\":%d,\"step_ms\":%.3f,"
               "\"unsplit_ms\":%.3f,\"added_ms\":%.3f,\"wait_ms\":%.3f,"
               "\"after_last_ms\":%.3f,\"after_last_added_ms\":%.3f,"
               "\"target_added_le_0_1_ms\":%s,\"target_after_last_added_le_0_1_ms\":%s}\n",
               n, L_ALL, B, T, iters, r.step, unsplit, r.step - unsplit, r.wait, r.after_last,
               r.after_last - one.after_last, r.step - unsplit <= 0.1 ? "true" : "false",
               r.after_last - one.after_last <= 0.1 ? "true" : "false");
        fflush(stdout);
    }
    if (sock2) {
        split_ms r = run_split(sock, sock2, 2, iters);
        printf("{\"bench\":\"cuda_group\",\"members\":2,\"daemons\":2,"
               "\"transport\":\"nccl-socket\",\"layers\":%d,\"B\":%d,\"T\":%d,"
               "\"dtype\":\"bf16\",\"iters\":%d,\"step_ms\":%.3f,\"one_daemon_ms\":%.3f,"
               "\"added_vs_one_daemon_ms\":%.3f,\"wait_ms\":%.3f,\"exchange_ms\":%.3f,"
               "\"exchange_last_arrival_ms\":%.3f,\"mps\":%s}\n",
               L_ALL, B, T, iters, r.step, two, r.step - two, r.wait, r.exch, r.exch_last,
               getenv("CUDA_MPS_PIPE_DIRECTORY") ? "true" : "false");
    }
    return 0;
}
