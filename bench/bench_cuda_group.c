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
 * With --gpus N (N > 1; 1, the default, is all of the above unchanged), the
 * members' buffers go on several GPUs of this host (device ordinals as this
 * process sees them), and every line also says its layout: "gpus" (GPUs the
 * members' buffers are on), "daemons", "transport" ("in-daemon": one
 * daemon reduces the group in memory; "nccl-p2p": NCCL between daemons on
 * different GPUs of one host, no NCCL_HOSTID, so its P2P/NVLink or
 * shared-memory transports; "nccl-socket": the one-GPU test setting).
 *   with --socket2: daemon k serves GPU k alone (run_cuda_group.sh starts it
 *     with CUDA_VISIBLE_DEVICES=k and no NCCL_HOSTID); the 2-member split
 *     across the daemons has the member on daemon k on device k
 *     ("transport":"nccl-p2p"); the one-daemon lines keep every buffer on
 *     device 0, as references
 *   without: the --socket daemon serves GPUs 0..N-1; after each one-GPU
 *     split, the same split with member k on device k*g/n, g = min(N, n)
 *     (consecutive stages share a GPU), the group reduced inside the daemon:
 *     one_gpu_ms is that one-GPU split's step_ms, added_vs_one_gpu_ms the
 *     difference
 *   bench/bench_cuda_group --socket S [--socket2 S2] [--gpus N] [--iters N] */
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
    const char *sock, *group;
    int rank, n, first, count, iters;
    int device; /* the CUDA device of this member's buffer, as this process numbers them */
    pthread_barrier_t *bar;
    double *ms;          /* [iters], rank 0 writes */
    double *wait, *exch; /* [iters], this member's group wait and exchange */
    double *sub, *rep;   /* [iters], this member's submission and reply (ms) */
    int daemons;         /* the group spans 2 daemons: rank 0 on daemon 0, the rest on daemon 1 */
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
    cudaError_t ce;
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
    /* the buffer's device is current in this thread while it registers, so
     * the library sends this process's ordinal of it (the daemon maps it to
     * its own device) */
    if ((ce = cudaSetDevice(m->device)) != cudaSuccess ||
        (ce = cudaMalloc((void **)&dev, off)) != cudaSuccess ||
        (ce = cudaMemset(dev, 0x3c, off)) != cudaSuccess ||
        (ce = cudaDeviceSynchronize()) != cudaSuccess) {
        fprintf(stderr, "member %d: CUDA allocation on device %d failed: %s\n", m->rank, m->device,
                cudaGetErrorString(ce));
        if (m->n > 1) exit(1); /* the others would wait at the barrier for ever */
        goto out;
    }
    if (dpclip_connect(m->sock, &o, &cl) || dpclip_buffer_register_cuda(cl, dev, &buf, &boff)) {
        fprintf(stderr, "member %d (device %d): %s (%s)\n", m->rank, m->device, dpclip_errmsg(cl),
                dpclip_errfield(cl));
        if (m->n > 1) exit(1); /* the others would wait at the barrier for ever */
        goto out;
    }
    if (m->n > 1) {
        int rc;
        dpclip_group_opts g = {m->group, (uint32_t)m->rank, (uint32_t)m->n, 0, 0};
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
    dpclip_clip_config cfg = {.max_grad_norm = 1.0f,
                              .reduction = DPCLIP_MEAN,
                              .expected_batch_size = B,
                              .noise_multiplier = 1.0f};
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

/* How many GPUs n members' buffers are on: two daemons, one GPU each when
 * --gpus allows; one daemon, min(gpus, n). */
static int gpus_used(int n, int two_daemons, int gpus) {
    if (two_daemons) return gpus > 1 ? 2 : 1;
    return gpus < n ? gpus : n;
}

/* The device of member k's buffer: two daemons, its daemon's GPU (rank 0 on
 * daemon 0); one daemon, consecutive stages share a GPU. */
static int member_device(int k, int n, int two_daemons, int gpus) {
    if (two_daemons) return gpus > 1 && k ? 1 : 0;
    return k * gpus_used(n, 0, gpus) / n;
}

/* Median times with the layers split over n members; with sock2, rank 0 on
 * sock and the others on sock2; buffers placed by member_device. 0, or -1
 * (said why). */
static int run_split(const char *sock, const char *sock2, int n, int iters, int gpus, split_ms *r) {
    pthread_t th[4];
    member m[4];
    pthread_barrier_t bar;
    dpclip_group_link link = {.daemons = 2};
    double *ms = calloc((size_t)iters * (1 + 4 * 4 + 2), sizeof *ms), *last, *after;
    char group[48];
    int rc = -1;
    if (!ms) {
        fprintf(stderr, "out of memory\n");
        return -1;
    }
    last = ms + 17 * iters;
    after = ms + 18 * iters;
    /* a name per layout: the previous layout's members may still be leaving
     * a group of the same name when this one's members join */
    snprintf(group, sizeof group, "bench-g%d-d%d-gpus%d", n, sock2 ? 2 : 1,
             gpus_used(n, sock2 != NULL, gpus));
    if (pthread_barrier_init(&bar, NULL, (unsigned)n)) {
        fprintf(stderr, "pthread_barrier_init failed\n");
        goto out_free;
    }
    for (int k = 0; k < n; k++) {
        m[k] = (member){.sock = k && sock2 ? sock2 : sock,
                        .group = group,
                        .rank = k,
                        .n = n,
                        .first = k * (L_ALL / n),
                        .count = L_ALL / n,
                        .iters = iters,
                        .device = member_device(k, n, sock2 != NULL, gpus),
                        .bar = &bar,
                        .ms = ms,
                        .wait = ms + (1 + 4 * k) * iters,
                        .exch = ms + (2 + 4 * k) * iters,
                        .sub = ms + (3 + 4 * k) * iters,
                        .rep = ms + (4 + 4 * k) * iters,
                        .daemons = sock2 ? 2 : 1,
                        .link = &link,
                        .rc = 1};
        if (pthread_create(&th[k], NULL, member_main, &m[k])) {
            fprintf(stderr, "pthread_create failed\n");
            exit(1); /* the members started would wait at the barrier for ever */
        }
    }
    for (int k = 0; k < n; k++) pthread_join(th[k], NULL);
    for (int k = 0; k < n; k++)
        if (m[k].rc) goto out;
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
    r->after_last = median(after, iters);
    r->step = median(ms, iters);
    r->exch_last = n > 1 ? median(last, iters) : 0;
    r->wait = median(m[0].wait, iters);
    r->exch = median(m[0].exch, iters);
    rc = 0;
out:
    pthread_barrier_destroy(&bar);
out_free:
    free(ms);
    return rc;
}

/* The layout fields of a line when --gpus is over 1 ("" otherwise, so that
 * the one-GPU lines stay as they were). */
static const char *layout(char *buf, size_t n, int gpus, int used, int daemons,
                          const char *transport) {
    if (gpus <= 1) return "";
    snprintf(buf, n, "\"gpus\":%d,\"daemons\":%d,\"transport\":\"%s\",", used, daemons, transport);
    return buf;
}

int main(int argc, char **argv) {
    const char *sock = dpclip_default_socket(), *sock2 = NULL;
    const char *mps = getenv("CUDA_MPS_PIPE_DIRECTORY") ? "true" : "false";
    int iters = 30, gpus = 1, c;
    char lay[96];
    split_ms one, r;
    static const struct option opts[] = {{"socket", required_argument, NULL, 's'},
                                         {"socket2", required_argument, NULL, 'S'},
                                         {"iters", required_argument, NULL, 'i'},
                                         {"gpus", required_argument, NULL, 'g'},
                                         {NULL, 0, NULL, 0}};
    while ((c = getopt_long(argc, argv, "", opts, NULL)) != -1) {
        if (c == 's') sock = optarg;
        else if (c == 'S') sock2 = optarg;
        else if (c == 'i') iters = atoi(optarg);
        else if (c == 'g') gpus = atoi(optarg);
        else return 2;
    }
    if (iters < 1 || gpus < 1 || gpus > 8) return 2;
    if (gpus > 1) {
        int have = 0, need = sock2 ? 2 : gpus_used(4, 0, gpus); /* 4 members at most */
        if (cudaGetDeviceCount(&have) != cudaSuccess || have < need) {
            fprintf(stderr, "--gpus %d needs %d CUDA devices here; %d visible\n", gpus, need, have);
            return 2;
        }
    }
    if (run_split(sock, NULL, 1, iters, 1, &one)) return 1;
    double unsplit = one.step, two = 0;
    printf("{\"bench\":\"cuda_group\",\"members\":1,%s\"layers\":%d,\"B\":%d,\"T\":%d,"
           "\"dtype\":\"bf16\",\"iters\":%d,\"step_ms\":%.3f,\"after_last_ms\":%.3f}\n",
           layout(lay, sizeof lay, gpus, 1, 1, "in-daemon"), L_ALL, B, T, iters, unsplit,
           one.after_last);
    fflush(stdout);
    for (int n = 2; n <= 4; n *= 2) {
        if (run_split(sock, NULL, n, iters, 1, &r)) return 1;
        double one_gpu = r.step;
        if (n == 2) two = r.step;
        /* with --gpus, "daemons" is in the layout's fields */
        printf("{\"bench\":\"cuda_group\",\"members\":%d,%s\"layers\":%d,"
               "\"B\":%d,\"T\":%d,\"dtype\":\"bf16\",\"iters\":%d,\"step_ms\":%.3f,"
               "\"unsplit_ms\":%.3f,\"added_ms\":%.3f,\"wait_ms\":%.3f,"
               "\"after_last_ms\":%.3f,\"after_last_added_ms\":%.3f,"
               "\"target_added_le_0_1_ms\":%s,\"target_after_last_added_le_0_1_ms\":%s}\n",
               n, gpus > 1 ? layout(lay, sizeof lay, gpus, 1, 1, "in-daemon") : "\"daemons\":1,",
               L_ALL, B, T, iters, r.step, unsplit, r.step - unsplit, r.wait, r.after_last,
               r.after_last - one.after_last, r.step - unsplit <= 0.1 ? "true" : "false",
               r.after_last - one.after_last <= 0.1 ? "true" : "false");
        fflush(stdout);
        if (gpus == 1 || sock2) continue;
        /* the same split over several GPUs of this daemon: the members'
         * steps are on different devices, so the daemon reduces their norms
         * between its GPUs' norm and clip phases instead of fusing them */
        if (run_split(sock, NULL, n, iters, gpus, &r)) return 1;
        printf("{\"bench\":\"cuda_group\",\"members\":%d,%s\"layers\":%d,\"B\":%d,\"T\":%d,"
               "\"dtype\":\"bf16\",\"iters\":%d,\"step_ms\":%.3f,\"unsplit_ms\":%.3f,"
               "\"added_ms\":%.3f,\"one_gpu_ms\":%.3f,\"added_vs_one_gpu_ms\":%.3f,"
               "\"wait_ms\":%.3f,\"after_last_ms\":%.3f,\"after_last_added_ms\":%.3f,"
               "\"mps\":%s}\n",
               n, layout(lay, sizeof lay, gpus, gpus_used(n, 0, gpus), 1, "in-daemon"), L_ALL, B, T,
               iters, r.step, unsplit, r.step - unsplit, one_gpu, r.step - one_gpu, r.wait,
               r.after_last, r.after_last - one.after_last, mps);
        fflush(stdout);
    }
    if (sock2) {
        if (run_split(sock, sock2, 2, iters, gpus, &r)) return 1;
        printf("{\"bench\":\"cuda_group\",\"members\":2,%s"
               "\"layers\":%d,\"B\":%d,\"T\":%d,"
               "\"dtype\":\"bf16\",\"iters\":%d,\"step_ms\":%.3f,\"one_daemon_ms\":%.3f,"
               "\"added_vs_one_daemon_ms\":%.3f,\"wait_ms\":%.3f,\"exchange_ms\":%.3f,"
               "\"exchange_last_arrival_ms\":%.3f,\"mps\":%s}\n",
               gpus > 1 ? layout(lay, sizeof lay, gpus, 2, 2, "nccl-p2p")
                        : "\"daemons\":2,\"transport\":\"nccl-socket\",",
               L_ALL, B, T, iters, r.step, two, r.step - two, r.wait, r.exch, r.exch_last, mps);
    }
    return 0;
}
