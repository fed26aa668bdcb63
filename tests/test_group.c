/* The norm group's reduction stage (daemon/protocol/group.c) alone, with
 * fake members standing in for sessions: steps delivered unrun on one
 * device run fused; members on different devices compute their norms
 * (unfuse) as soon as fusing is impossible, and from the next group step on
 * at once on arrival, without waiting for the last member; either way each
 * member gets the sum of every member's norms, and the largest of their
 * rounding bounds. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <cmocka.h>
#include <uv.h>

#include "group.h"

#define N 3
#define BATCH 4

typedef struct member {
    dc_group_waiter w;
    dc_group *g;
    double mine[BATCH]; /* this member's squared norms, once computed */
    int unfused, fused, done, rc;
    double tot[BATCH];
    double e;       /* the bound its norms come with */
    double e_group; /* the one it was answered with */
} member;

static const dc_group_terms k_terms = {.batch = BATCH,
                                       .max_grad_norm = 1.0f,
                                       .expected_batch = BATCH};

static void on_done(dc_group_waiter *w, int rc, const double *tot, const dc_err *err) {
    member *m = w->arg;
    (void)err;
    m->done++;
    m->rc = rc;
    if (rc == 0) memcpy(m->tot, tot, sizeof m->tot);
    m->e_group = w->e_group;
}

static void on_fuse(dc_group_waiter *all, uint32_t n) {
    uint32_t seen = 0;
    for (dc_group_waiter *w = all; w; w = w->next_call, seen++) ((member *)w->arg)->fused++;
    assert_int_equal(seen, n);
    dc_group_fused(((member *)all->arg)->g);
}

/* The session would queue the norm pass; the test delivers its result
 * itself (compute()), in the order it chooses. */
static void on_unfuse(dc_group_waiter *w) { ((member *)w->arg)->unfused++; }

/* Member m's step of group step `step` on `device`, unrun. */
static void arrive(member *m, uint32_t rank, uint64_t step, int device) {
    dc_err e;
    memset(&m->w, 0, sizeof m->w);
    m->w.rank = rank;
    m->w.step = step;
    m->w.terms = k_terms;
    m->w.done = on_done;
    m->w.arg = m;
    m->w.device = device;
    m->w.fuse = on_fuse;
    m->w.unfuse = on_unfuse;
    assert_int_equal(dc_group_deliver(m->g, &m->w, &e), 0);
}

/* An unfused step's norms, delivered again. */
static void compute(member *m) {
    dc_err e;
    m->w.partial = m->mine;
    m->w.e = m->e;
    int rc = dc_group_deliver(m->g, &m->w, &e);
    if (rc) fprintf(stderr, "%s: %s\n", e.field, e.msg);
    assert_int_equal(rc, 0);
}

typedef struct rig {
    uv_loop_t loop;
    dc_groups gs;
    member m[N];
} rig;

static void rig_open(rig *r) {
    assert_int_equal(uv_loop_init(&r->loop), 0);
    dc_groups_init(&r->gs, &r->loop, 12345, 16, 60000, 600000);
    for (uint32_t k = 0; k < N; k++) {
        dc_group_spec sp = {.name = "g", .rank = k, .size = N, .daemons = 1, .device = -1};
        dc_err e;
        memset(&r->m[k], 0, sizeof r->m[k]);
        assert_int_equal(dc_group_join(&r->gs, 1000, &sp, &r->m[k].g, &e), 0);
        for (int b = 0; b < BATCH; b++) r->m[k].mine[b] = (k + 1) * 10.0 + b;
    }
}

static void rig_close(rig *r) {
    for (uint32_t k = 0; k < N; k++) dc_group_leave(r->m[k].g, k, "test over");
    dc_groups_close(&r->gs);
    uv_run(&r->loop, UV_RUN_DEFAULT); /* the timers' close callbacks free the group */
    assert_int_equal(uv_loop_close(&r->loop), 0);
}

static void assert_totals(const rig *r) {
    for (uint32_t k = 0; k < N; k++) {
        assert_int_equal(r->m[k].rc, 0);
        for (int b = 0; b < BATCH; b++)
            assert_true(r->m[k].tot[b] == r->m[0].mine[b] + r->m[1].mine[b] + r->m[2].mine[b]);
    }
}

static void test_one_device_fuses(void **state) {
    rig r;
    (void)state;
    rig_open(&r);
    for (uint32_t k = 0; k < N; k++) arrive(&r.m[k], k, 1, 0);
    for (uint32_t k = 0; k < N; k++) {
        assert_int_equal(r.m[k].fused, 1);
        assert_int_equal(r.m[k].unfused, 0);
        assert_int_equal(r.m[k].done, 0); /* a fused step is answered by its runner */
    }
    rig_close(&r);
}

static void test_devices_split_early(void **state) {
    rig r;
    (void)state;
    rig_open(&r);
    /* group step 1: fusing is ruled out once members on two devices wait */
    arrive(&r.m[0], 0, 1, 0);
    assert_int_equal(r.m[0].unfused, 0);
    arrive(&r.m[1], 1, 1, 1);
    assert_int_equal(r.m[0].unfused, 1);
    assert_int_equal(r.m[1].unfused, 1);
    compute(&r.m[1]);
    arrive(&r.m[2], 2, 1, 0); /* a step has its norms already: no fusing */
    assert_int_equal(r.m[2].unfused, 1);
    compute(&r.m[2]);
    assert_int_equal(r.m[0].done, 0);
    compute(&r.m[0]); /* the last norms in: everyone answered */
    for (uint32_t k = 0; k < N; k++) {
        assert_int_equal(r.m[k].done, 1);
        assert_int_equal(r.m[k].fused, 0);
    }
    assert_totals(&r);

    /* group step 2: each member computes its norms on arrival, the first
     * one without waiting for the others */
    arrive(&r.m[2], 2, 2, 0);
    assert_int_equal(r.m[2].unfused, 2);
    arrive(&r.m[0], 0, 2, 0);
    assert_int_equal(r.m[0].unfused, 2);
    compute(&r.m[0]);
    compute(&r.m[2]);
    arrive(&r.m[1], 1, 2, 1);
    assert_int_equal(r.m[1].unfused, 2);
    compute(&r.m[1]);
    for (uint32_t k = 0; k < N; k++) assert_int_equal(r.m[k].done, 2);
    assert_totals(&r);

    /* group step 3 all on one device: it waits once more (step 2 was
     * split), then fuses again from step 4 on */
    for (uint32_t k = 0; k < N; k++) arrive(&r.m[k], k, 3, 0);
    for (uint32_t k = 0; k < N; k++) compute(&r.m[k]);
    for (uint32_t k = 0; k < N; k++) assert_int_equal(r.m[k].done, 3);
    for (uint32_t k = 0; k < N; k++) arrive(&r.m[k], k, 4, 0);
    for (uint32_t k = 0; k < N; k++) assert_int_equal(r.m[k].fused, 1);
    rig_close(&r);
}

/* Members whose norms come with different rounding bounds: each is
 * answered with the largest, in any order of arrival, and a bound that is
 * not a number wins (its coefficients are then 0, never 1); the next group
 * step starts from none. */
static void test_largest_bound(void **state) {
    static const double k_e[3][N] = {{1e-3, 4e-3, 2e-3}, {5e-3, 1e-4, 1e-4}, {1e-4, NAN, 1e-2}};
    rig r;
    (void)state;
    rig_open(&r);
    for (uint64_t st = 1; st <= 4; st++) {
        const double *e = k_e[(st - 1) % 3];
        int before[N];
        bool computed[N] = {false}, any = true;
        for (uint32_t k = 0; k < N; k++) {
            r.m[k].e = st == 4 ? 1e-5 * (k + 1) : e[k];
            before[k] = r.m[k].unfused;
            arrive(&r.m[k], k, st, (int)k); /* on three devices: each computes */
        }
        /* the steps sent back to compute, last rank first */
        while (any) {
            any = false;
            for (uint32_t k = N; k-- > 0;)
                if (!computed[k] && r.m[k].unfused > before[k]) {
                    compute(&r.m[k]);
                    computed[k] = any = true;
                }
        }
        for (uint32_t k = 0; k < N; k++) {
            assert_int_equal(r.m[k].done, (int)st);
            if (st == 3) assert_true(isnan(r.m[k].e_group));
            else assert_true(r.m[k].e_group == (st == 4 ? r.m[N - 1].e : st == 1 ? 4e-3 : 5e-3));
        }
        assert_totals(&r);
    }
    rig_close(&r);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_one_device_fuses),
        cmocka_unit_test(test_devices_split_early),
        cmocka_unit_test(test_largest_bound),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
