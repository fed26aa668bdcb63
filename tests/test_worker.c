/* daemon/infra/worker.c: tasks run on worker threads, each with its own
 * backend, and complete on the loop thread; closing runs what was queued;
 * an idle worker's backend gives back what it grew. */
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cmocka.h>

#include "dc_clock.h"
#include "worker.h"

typedef struct fake_backend {
    dc_backend base;
    int index;
    int ran;
} fake_backend;

static void fake_destroy(dc_backend *be) { free(be); }
static int fake_run(dc_backend *be, const dc_step *s, dc_step_result *r, dc_err *e) {
    (void)be;
    (void)s;
    (void)r;
    (void)e;
    return 0;
}
static const dc_backend_ops fake_ops = {.name = "fake",
                                        .run_step = fake_run,
                                        .destroy = fake_destroy};

static int factory(void *arg, int index, dc_backend **out, dc_err *err) {
    int *made = arg;
    fake_backend *b = calloc(1, sizeof *b);
    (void)err;
    b->base.ops = &fake_ops;
    b->index = index;
    (*made)++;
    *out = &b->base;
    return 0;
}

typedef struct probe_task {
    dc_task task;
    pthread_t loop_thread;
    pthread_t ran_on;
    fake_backend *be;
    int done_on_loop;
    int *ndone;
} probe_task;

static void probe_task_work(dc_task *task, dc_backend *be) {
    probe_task *t = (probe_task *)task;
    struct timespec ts = {0, 200000};
    t->ran_on = pthread_self();
    t->be = (fake_backend *)be;
    t->be->ran++; /* per-backend: only its own worker touches it */
    nanosleep(&ts, NULL);
}

static void probe_task_done(dc_task *task) {
    probe_task *t = (probe_task *)task;
    t->done_on_loop = pthread_equal(pthread_self(), t->loop_thread);
    (*t->ndone)++;
}

static void test_tasks_run_and_complete(void **state) {
    (void)state;
    uv_loop_t loop;
    dc_worker_pool pool;
    dc_err err;
    int made = 0, ndone = 0;
    enum { N = 200 };
    probe_task *tasks = calloc(N, sizeof *tasks);

    assert_int_equal(uv_loop_init(&loop), 0);
    assert_int_equal(dc_worker_pool_init(&pool, &loop, "t", 3, factory, &made, &err), 0);
    assert_int_equal(made, 3);
    for (int i = 0; i < N; i++) {
        tasks[i].task.work = probe_task_work;
        tasks[i].task.done = probe_task_done;
        tasks[i].loop_thread = pthread_self();
        tasks[i].ndone = &ndone;
        dc_worker_pool_submit(&pool, &tasks[i].task);
    }
    assert_int_equal(dc_worker_pool_busy(&pool), N);
    while (ndone < N) uv_run(&loop, UV_RUN_ONCE);
    assert_int_equal(dc_worker_pool_busy(&pool), 0);
    int total = 0;
    for (int i = 0; i < N; i++) {
        assert_true(tasks[i].done_on_loop);
        assert_false(pthread_equal(tasks[i].ran_on, pthread_self()));
        assert_non_null(tasks[i].be);
    }
    for (int k = 0; k < 3; k++) total += ((fake_backend *)pool.backends[k])->ran;
    assert_int_equal(total, N);

    /* Tasks still queued at close run and complete before it returns. */
    ndone = 0;
    for (int i = 0; i < 10; i++) dc_worker_pool_submit(&pool, &tasks[i].task);
    dc_worker_pool_close(&pool);
    assert_int_equal(ndone, 10);
    uv_run(&loop, UV_RUN_DEFAULT); /* processes the async close */
    assert_int_equal(uv_loop_close(&loop), 0);
    free(tasks);
}

/* Expectation windows (a GPU worker awake when a trainer's step is due):
 * they merge, a past one is ignored, a task inside one spends it, tasks run
 * whatever the window, and a worker sleeping until a far window still
 * stops at close. */
static void test_expect_windows(void **state) {
    (void)state;
    uv_loop_t loop;
    dc_worker_pool pool;
    dc_err err;
    int made = 0, ndone = 0;
    probe_task tasks[4];
    memset(tasks, 0, sizeof tasks);

    assert_int_equal(uv_loop_init(&loop), 0);
    assert_int_equal(dc_worker_pool_init(&pool, &loop, "t", 1, factory, &made, &err), 0);
    dc_worker_pool_set_spin(&pool, 20000);
    uint64_t now = dc_clock_ns();

    dc_worker_pool_expect(&pool, now - 2000000, now - 1000000); /* past: ignored */
    assert_int_equal(pool.win.to, 0);
    dc_worker_pool_expect(&pool, now + 5000000, now + 4000000); /* empty: ignored */
    assert_int_equal(pool.win.to, 0);
    dc_worker_pool_expect(&pool, now + 50000000000ull, now + 60000000000ull);
    assert_true(pool.win.from == now + 50000000000ull && pool.win.to == now + 60000000000ull);
    /* overlapping: merged to the earliest start and the latest end */
    dc_worker_pool_expect(&pool, now + 40000000000ull, now + 55000000000ull);
    assert_true(pool.win.from == now + 40000000000ull && pool.win.to == now + 60000000000ull);
    dc_worker_pool_expect(&pool, now + 45000000000ull, now + 70000000000ull);
    assert_true(pool.win.from == now + 40000000000ull && pool.win.to == now + 70000000000ull);

    /* A task before the window runs (the sleeping worker is woken). */
    tasks[0].task.work = probe_task_work;
    tasks[0].task.done = probe_task_done;
    tasks[0].loop_thread = pthread_self();
    tasks[0].ndone = &ndone;
    dc_worker_pool_submit(&pool, &tasks[0].task);
    while (ndone < 1) uv_run(&loop, UV_RUN_ONCE);
    assert_true(tasks[0].done_on_loop);
    assert_int_equal(pool.win.to, now + 70000000000ull); /* not yet open: kept */

    /* An open window is spent by the task it waited for. */
    now = dc_clock_ns();
    dc_worker_pool_expect(&pool, now, now + 30000000000ull);
    tasks[1] = tasks[0];
    dc_worker_pool_submit(&pool, &tasks[1].task);
    while (ndone < 2) uv_run(&loop, UV_RUN_ONCE);
    pthread_mutex_lock(&pool.mu);
    assert_int_equal(pool.win.to, 0);
    pthread_mutex_unlock(&pool.mu);

    /* Asleep until a window 60 s away: close wakes and stops it now. */
    dc_worker_pool_expect(&pool, dc_clock_ns() + 60000000000ull, dc_clock_ns() + 61000000000ull);
    uint64_t t0 = dc_clock_ns();
    dc_worker_pool_close(&pool);
    assert_true(dc_clock_ns() - t0 < 30000000000ull);
    uv_run(&loop, UV_RUN_DEFAULT);
    assert_int_equal(uv_loop_close(&loop), 0);
}

/* Idle release: a backend that grew gives its memory back once its worker
 * has had no task for the pool's release time, once per idle period, and
 * what it holds is published after each task and release
 * (dc_worker_pool_held). Without a release time it never does. */
typedef struct grow_backend {
    dc_backend base;
    uint64_t ws, kept;   /* what it holds; worker thread */
    atomic_int released; /* releases so far */
} grow_backend;

static void grow_release(dc_backend *be) {
    grow_backend *g = (grow_backend *)be;
    g->ws = 100; /* its preallocation */
    g->kept = 0;
    atomic_fetch_add(&g->released, 1);
}
static size_t grow_ws(const dc_backend *be) { return ((const grow_backend *)be)->ws; }
static size_t grow_kept(const dc_backend *be) { return ((const grow_backend *)be)->kept; }
static const dc_backend_ops grow_ops = {.name = "grow",
                                        .run_step = fake_run,
                                        .destroy = fake_destroy,
                                        .release = grow_release,
                                        .workspace_bytes = grow_ws,
                                        .kept_bytes = grow_kept};

static int grow_factory(void *arg, int index, dc_backend **out, dc_err *err) {
    grow_backend **made = arg;
    grow_backend *g = calloc(1, sizeof *g);
    (void)index;
    (void)err;
    g->base.ops = &grow_ops;
    g->ws = 100;
    atomic_init(&g->released, 0);
    *made = g;
    *out = &g->base;
    return 0;
}

typedef struct grow_task {
    dc_task task;
    int *ndone;
} grow_task;

static void grow_work(dc_task *task, dc_backend *be) {
    grow_backend *g = (grow_backend *)be;
    (void)task;
    g->ws = 1000; /* a step grew the workspace and kept a store */
    g->kept = 500;
}
static void grow_done(dc_task *task) { (*((grow_task *)task)->ndone)++; }

/* Runs one grow task on pool and waits for its done(). */
static void grow_once(uv_loop_t *loop, dc_worker_pool *pool, int *ndone) {
    grow_task t;
    memset(&t, 0, sizeof t);
    const int want = *ndone + 1;
    t.task.work = grow_work;
    t.task.done = grow_done;
    t.ndone = ndone;
    dc_worker_pool_submit(pool, &t.task);
    while (*ndone < want) uv_run(loop, UV_RUN_ONCE);
}

/* Waits up to 5 s for g's release count to reach n. */
static bool released_within(grow_backend *g, int n) {
    const uint64_t end = dc_clock_ns() + 5000000000ull;
    struct timespec ts = {0, 1000000};
    while (atomic_load(&g->released) < n && dc_clock_ns() < end) nanosleep(&ts, NULL);
    return atomic_load(&g->released) >= n;
}

static void test_idle_release(void **state) {
    (void)state;
    uv_loop_t loop;
    dc_worker_pool pool;
    dc_err err;
    grow_backend *g = NULL;
    int ndone = 0;
    struct timespec beyond = {0, 400000000}; /* past a release time of 200 ms */

    assert_int_equal(uv_loop_init(&loop), 0);
    assert_int_equal(dc_worker_pool_init(&pool, &loop, "t", 1, grow_factory, &g, &err), 0);
    dc_worker_pool_set_release(&pool, 200000000ull);
    dc_worker_held h = dc_worker_pool_held(&pool, 0);
    assert_true(h.workspace == 100 && h.kept == 0); /* published at start */
    nanosleep(&beyond, NULL);
    assert_int_equal(atomic_load(&g->released), 0); /* nothing ran: nothing to give back */

    const uint64_t t0 = dc_clock_ns();
    grow_once(&loop, &pool, &ndone);
    h = dc_worker_pool_held(&pool, 0);
    if (dc_clock_ns() - t0 < 150000000ull) { /* not yet idle for 200 ms */
        assert_int_equal(atomic_load(&g->released), 0);
        assert_true(h.workspace == 1000 && h.kept == 500);
    }
    assert_true(released_within(g, 1));
    assert_true(dc_clock_ns() - t0 >= 200000000ull);    /* not before the idle time */
    const uint64_t end = dc_clock_ns() + 5000000000ull; /* published right after */
    const struct timespec ms = {0, 1000000};
    while ((h = dc_worker_pool_held(&pool, 0)).workspace != 100 && dc_clock_ns() < end)
        nanosleep(&ms, NULL);
    assert_true(h.workspace == 100 && h.kept == 0);
    nanosleep(&beyond, NULL);
    assert_int_equal(atomic_load(&g->released), 1); /* once an idle period */

    grow_once(&loop, &pool, &ndone); /* a new period */
    assert_true(released_within(g, 2));
    dc_worker_pool_close(&pool);
    uv_run(&loop, UV_RUN_DEFAULT);

    /* no release time: never; one set later (a reload) wakes the sleeping
     * worker, which then gives back what it grew */
    assert_int_equal(dc_worker_pool_init(&pool, &loop, "t", 1, grow_factory, &g, &err), 0);
    grow_once(&loop, &pool, &ndone);
    nanosleep(&beyond, NULL);
    assert_int_equal(atomic_load(&g->released), 0);
    h = dc_worker_pool_held(&pool, 0);
    assert_true(h.workspace == 1000 && h.kept == 500);
    dc_worker_pool_set_release(&pool, 100000000ull);
    assert_true(released_within(g, 1));
    dc_worker_pool_close(&pool);
    uv_run(&loop, UV_RUN_DEFAULT);
    assert_int_equal(uv_loop_close(&loop), 0);
}

/* Fair sharing: with one worker held by owner 1, tasks queued by owners 1, 2
 * and 3 start in turn (least recently served owner first), not in arrival
 * order: one owner's backlog does not hold back the others. */
typedef struct fair_task {
    dc_task task;
    int id;
    int *order, *n;        /* start order, written on the worker */
    pthread_mutex_t *gate; /* held by the test until everything is queued */
} fair_task;

static void fair_task_work(dc_task *task, dc_backend *be) {
    fair_task *f = (fair_task *)task;
    (void)be;
    if (f->gate) {
        pthread_mutex_lock(f->gate);
        pthread_mutex_unlock(f->gate);
    }
    f->order[(*f->n)++] = f->id; /* one worker: no race */
}

static void fair_task_done(dc_task *task) { (void)task; }

/* The window both the workers and the NCCL links' threads wait in
 * (dc_window.h): where a time stands against it, and polling spends it
 * unless another was set meanwhile. */
static void test_window(void **state) {
    (void)state;
    dc_window w = {0, 0};
    assert_int_equal(dc_window_at(&w, 100), DC_WINDOW_NONE);
    assert_false(dc_window_set(&w, 300, 200, 100)); /* empty */
    assert_false(dc_window_set(&w, 50, 90, 100));   /* past */
    assert_true(dc_window_set(&w, 200, 300, 100));
    assert_int_equal(dc_window_at(&w, 100), DC_WINDOW_LATER);
    assert_int_equal(dc_window_at(&w, 200), DC_WINDOW_OPEN);
    assert_int_equal(dc_window_at(&w, 299), DC_WINDOW_OPEN);
    assert_true(dc_window_set(&w, 250, 400, 100)); /* merged */
    assert_true(w.from == 200 && w.to == 400);
    assert_true(dc_window_set(&w, 500, 600, 100)); /* apart: replaces */
    assert_true(w.from == 500 && w.to == 600);
    dc_window_spent(&w, 400); /* polled until another end: kept */
    assert_true(w.from == 500 && w.to == 600);
    dc_window_spent(&w, 600);
    assert_int_equal(dc_window_at(&w, 550), DC_WINDOW_NONE);
    assert_true(dc_window_set(&w, 700, 800, 100));
    assert_int_equal(dc_window_at(&w, 800), DC_WINDOW_NONE); /* past: dropped */
    assert_int_equal(w.to, 0);
}

static void test_fair_sharing(void **state) {
    (void)state;
    uv_loop_t loop;
    dc_worker_pool pool;
    dc_err err;
    int made = 0, order[8], n = 0;
    pthread_mutex_t gate = PTHREAD_MUTEX_INITIALIZER;
    /* id: owner * 10 + its own count; 10 is the task that holds the worker */
    static const int ids[8] = {10, 11, 12, 13, 14, 21, 22, 31};
    static const int want[8] = {10, 21, 31, 11, 22, 12, 13, 14};
    fair_task tasks[8];
    assert_int_equal(uv_loop_init(&loop), 0);
    assert_int_equal(dc_worker_pool_init(&pool, &loop, "f", 1, factory, &made, &err), 0);
    pthread_mutex_lock(&gate);
    for (int i = 0; i < 8; i++) {
        memset(&tasks[i], 0, sizeof tasks[i]);
        tasks[i].task.work = fair_task_work;
        tasks[i].task.done = fair_task_done;
        tasks[i].task.owner = (uint32_t)(ids[i] / 10);
        tasks[i].id = ids[i];
        tasks[i].order = order;
        tasks[i].n = &n;
        tasks[i].gate = i == 0 ? &gate : NULL;
        dc_worker_pool_submit(&pool, &tasks[i].task);
        if (i == 0) /* the worker has taken task 10 before the rest come */
            while (atomic_load(&pool.queued) != 0) sched_yield();
    }
    pthread_mutex_unlock(&gate);
    dc_worker_pool_close(&pool); /* runs everything queued */
    assert_int_equal(n, 8);
    for (int i = 0; i < 8; i++) {
        if (order[i] != want[i])
            print_message("position %d: task %d, want %d\n", i, order[i], want[i]);
        assert_int_equal(order[i], want[i]);
    }
    uv_run(&loop, UV_RUN_DEFAULT);
    assert_int_equal(uv_loop_close(&loop), 0);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_tasks_run_and_complete),
        cmocka_unit_test(test_expect_windows),
        cmocka_unit_test(test_window),
        cmocka_unit_test(test_fair_sharing),
        cmocka_unit_test(test_idle_release),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
