#include "worker.h"

#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "dc_clock.h"
#include "log.h"

typedef struct worker_arg {
    dc_worker_pool *pool;
    int index;
} worker_arg;

/* Polls the lock-free counter until a task shows up or `end` passes. */
static void worker_spin_until(dc_worker_pool *p, uint64_t end) {
    do {
        for (int i = 0; i < 64; i++)
            if (atomic_load_explicit(&p->queued, memory_order_acquire)) return;
        sched_yield();
    } while (dc_clock_ns() < end);
}

/* With mu held: sleeps until t (CLOCK_MONOTONIC) or a signal. */
static void wait_until(dc_worker_pool *p, uint64_t t) {
    struct timespec ts = {(time_t)(t / 1000000000u), (long)(t % 1000000000u)};
    pthread_cond_timedwait(&p->cv, &p->mu, &ts);
}

/* With mu held and nothing queued: waits (polling or sleeping, releasing mu
 * meanwhile) until a task is queued, the pool stops, the expectation window
 * changes, or `until` comes (this worker's idle release; 0: none). Returns
 * with mu held. */
static void worker_idle(dc_worker_pool *p, bool just_ran, uint64_t until) {
    uint64_t now = dc_clock_ns();
    dc_window_now at = dc_window_at(&p->win, now);
    if (at == DC_WINDOW_OPEN) {
        uint64_t end = p->win.to;
        pthread_mutex_unlock(&p->mu);
        worker_spin_until(p, end);
        pthread_mutex_lock(&p->mu);
        dc_window_spent(&p->win, end);
        return;
    }
    if (just_ran && p->spin_ns) {
        pthread_mutex_unlock(&p->mu);
        worker_spin_until(p, now + p->spin_ns);
        pthread_mutex_lock(&p->mu);
        return;
    }
    if (at == DC_WINDOW_LATER) {
        /* Sleep until the window opens (or something changes). */
        wait_until(p, until && until < p->win.from ? until : p->win.from);
        return;
    }
    if (until) wait_until(p, until);
    else pthread_cond_wait(&p->cv, &p->mu);
}

/* What worker i's backend holds now, for dc_worker_pool_held. */
static void publish(dc_worker_pool *p, int i) {
    atomic_store_explicit(&p->held_ws[i], dc_backend_workspace_bytes(p->backends[i]),
                          memory_order_relaxed);
    atomic_store_explicit(&p->held_kept[i], dc_backend_kept_bytes(p->backends[i]),
                          memory_order_relaxed);
}

/* With mu held: when worker i's idle release is due, 0 for none. */
static uint64_t release_at(const dc_worker_pool *p, int i) {
    return p->release_ns && p->last[i] ? p->last[i] + p->release_ns : 0;
}

/* When owner's last task started (0 = not remembered). */
static uint64_t owner_last(const dc_worker_pool *p, uint32_t owner) {
    for (int i = 0; i < DC_WORKER_OWNERS; i++)
        if (p->served[i].last && p->served[i].owner == owner) return p->served[i].last;
    return 0;
}

static void owner_served(dc_worker_pool *p, uint32_t owner) {
    int slot = 0;
    uint64_t oldest = UINT64_MAX;
    p->served_seq++;
    for (int i = 0; i < DC_WORKER_OWNERS; i++) {
        if (p->served[i].last && p->served[i].owner == owner) {
            slot = i;
            break;
        }
        if (p->served[i].last < oldest) { /* a free slot (0) wins, else the LRU */
            oldest = p->served[i].last;
            slot = i;
        }
    }
    p->served[slot].owner = owner;
    p->served[slot].last = p->served_seq;
}

static int owner_running(const dc_worker_pool *p, uint32_t owner) {
    int n = 0;
    for (int i = 0; i < p->n; i++) n += p->has_task[i] && p->running[i] == owner;
    return n;
}

/* Unlinks and returns the queued task to run next (the fair-sharing rule in
 * worker.h), with mu held and the queue not empty. */
static dc_task *pick_task(dc_worker_pool *p) {
    dc_task *best = NULL, *best_prev = NULL, *prev = NULL;
    int best_run = 0;
    uint64_t best_last = 0;
    for (dc_task *t = p->q_head; t; prev = t, t = t->next) {
        int run = owner_running(p, t->owner);
        uint64_t last = owner_last(p, t->owner);
        if (!best || run < best_run || (run == best_run && last < best_last)) {
            best = t;
            best_prev = prev;
            best_run = run;
            best_last = last;
        }
    }
    if (best_prev) best_prev->next = best->next;
    else p->q_head = best->next;
    if (p->q_tail == best) p->q_tail = best_prev;
    best->next = NULL;
    owner_served(p, best->owner);
    return best;
}

static void *worker_main(void *arg) {
    worker_arg wa = *(worker_arg *)arg;
    dc_worker_pool *p = wa.pool;
    bool just_ran = false;
    free(arg);

    pthread_mutex_lock(&p->mu);
    for (;;) {
        while (!p->q_head && !p->stopping) {
            const uint64_t due = release_at(p, wa.index);
            if (due && dc_clock_ns() >= due) { /* idle long enough: give memory back */
                p->last[wa.index] = 0;         /* given back: nothing until a task runs */
                pthread_mutex_unlock(&p->mu);
                dc_backend_release(p->backends[wa.index]);
                publish(p, wa.index);
                pthread_mutex_lock(&p->mu);
                continue;
            }
            worker_idle(p, just_ran, due);
            just_ran = false;
        }
        if (!p->q_head) break; /* stopping and nothing queued */
        dc_task *task = pick_task(p);
        p->running[wa.index] = task->owner;
        p->has_task[wa.index] = true;
        atomic_fetch_sub_explicit(&p->queued, 1, memory_order_relaxed);
        /* The task a window waited for came: the window is spent. */
        if (dc_window_at(&p->win, dc_clock_ns()) == DC_WINDOW_OPEN) dc_window_clear(&p->win);
        pthread_mutex_unlock(&p->mu);

        task->work(task, p->backends[wa.index]);
        publish(p, wa.index);

        pthread_mutex_lock(&p->mu);
        p->has_task[wa.index] = false;
        p->last[wa.index] = dc_clock_ns();
        task->next = NULL;
        if (p->d_tail) p->d_tail->next = task;
        else p->d_head = task;
        p->d_tail = task;
        just_ran = true;
        /* uv_async_send is the one libuv call that is safe from any thread. */
        uv_async_send(&p->async);
    }
    pthread_mutex_unlock(&p->mu);
    return NULL;
}

static void pool_drain(dc_worker_pool *p) {
    dc_task *list, *notices;
    pthread_mutex_lock(&p->mu);
    list = p->d_head;
    p->d_head = p->d_tail = NULL;
    notices = p->n_head;
    p->n_head = p->n_tail = NULL;
    pthread_mutex_unlock(&p->mu);
    /* A task notifies before it finishes, so when both are here its notice
     * goes first. */
    while (notices) {
        dc_task *next = notices->n_next;
        notices->notice(notices);
        notices = next;
    }
    while (list) {
        dc_task *next = list->next;
        p->busy--;
        list->done(list);
        list = next;
    }
}

static void on_async(uv_async_t *a) { pool_drain(a->data); }

/* Frees what init allocated: the first n backends (NULL ones are skipped
 * by dc_backend_destroy) and the per-thread arrays. */
static void pool_release(dc_worker_pool *p, int n) {
    if (p->backends)
        for (int i = 0; i < n; i++) dc_backend_destroy(p->backends[i]);
    free(p->backends);
    free(p->threads);
    free(p->running);
    free(p->has_task);
    free(p->last);
    free(p->held_ws);
    free(p->held_kept);
    p->backends = NULL;
    p->threads = NULL;
    p->running = NULL;
    p->has_task = NULL;
    p->last = NULL;
    p->held_ws = p->held_kept = NULL;
}

int dc_worker_pool_init(dc_worker_pool *p, uv_loop_t *loop, const char *name, int n,
                        dc_backend_factory factory, void *factory_arg, dc_err *err) {
    int started = 0, rc;

    memset(p, 0, sizeof *p);
    atomic_init(&p->queued, 0);
    snprintf(p->name, sizeof p->name, "%s", name);
    if (n < 1) n = 1;
    p->threads = calloc((size_t)n, sizeof *p->threads);
    p->backends = calloc((size_t)n, sizeof *p->backends);
    p->running = calloc((size_t)n, sizeof *p->running);
    p->has_task = calloc((size_t)n, sizeof *p->has_task);
    p->last = calloc((size_t)n, sizeof *p->last);
    p->held_ws = calloc((size_t)n, sizeof *p->held_ws);
    p->held_kept = calloc((size_t)n, sizeof *p->held_kept);
    if (!p->threads || !p->backends || !p->running || !p->has_task || !p->last || !p->held_ws ||
        !p->held_kept) {
        rc = dc_err_set(err, DC_ENOSPACE, "", "out of memory");
        goto fail;
    }
    for (int i = 0; i < n; i++) {
        if ((rc = factory(factory_arg, i, &p->backends[i], err))) goto fail;
        publish(p, i);
    }
    pthread_mutex_init(&p->mu, NULL);
    {
        /* Timed waits are on the monotonic clock, the clock of the windows. */
        pthread_condattr_t ca;
        pthread_condattr_init(&ca);
        pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
        pthread_cond_init(&p->cv, &ca);
        pthread_condattr_destroy(&ca);
    }
    if (uv_async_init(loop, &p->async, on_async) != 0) {
        rc = dc_err_set(err, DC_EINTERNAL, "", "uv_async_init failed");
        goto fail_sync;
    }
    p->async.data = p;
    p->n = n;
    for (; started < n; started++) {
        worker_arg *wa = malloc(sizeof *wa);
        if (wa) {
            wa->pool = p;
            wa->index = started;
        }
        if (!wa || pthread_create(&p->threads[started], NULL, worker_main, wa) != 0) {
            free(wa);
            rc = dc_err_set(err, DC_EINTERNAL, "", "cannot start worker thread");
            goto fail_threads;
        }
    }
    return 0;

fail_threads:
    /* Threads already started have nothing queued: stop and join them. */
    pthread_mutex_lock(&p->mu);
    p->stopping = true;
    pthread_cond_broadcast(&p->cv);
    pthread_mutex_unlock(&p->mu);
    for (int i = 0; i < started; i++) pthread_join(p->threads[i], NULL);
    uv_close((uv_handle_t *)&p->async, NULL);
fail_sync:
    pthread_mutex_destroy(&p->mu);
    pthread_cond_destroy(&p->cv);
fail:
    pool_release(p, n);
    return rc;
}

void dc_task_notify(dc_task *task) {
    dc_worker_pool *p = task->pool;
    pthread_mutex_lock(&p->mu);
    task->n_next = NULL;
    if (p->n_tail) p->n_tail->n_next = task;
    else p->n_head = task;
    p->n_tail = task;
    uv_async_send(&p->async);
    pthread_mutex_unlock(&p->mu);
}

void dc_worker_pool_submit(dc_worker_pool *p, dc_task *task) {
    task->next = NULL;
    task->pool = p;
    p->busy++;
    pthread_mutex_lock(&p->mu);
    if (p->q_tail) p->q_tail->next = task;
    else p->q_head = task;
    p->q_tail = task;
    atomic_fetch_add_explicit(&p->queued, 1, memory_order_release);
    pthread_cond_signal(&p->cv);
    pthread_mutex_unlock(&p->mu);
}

int dc_worker_pool_busy(const dc_worker_pool *p) { return p->busy; }

void dc_worker_pool_set_spin(dc_worker_pool *p, uint64_t spin_ns) { p->spin_ns = spin_ns; }

void dc_worker_pool_set_release(dc_worker_pool *p, uint64_t idle_ns) {
    if (!p->threads) return;
    pthread_mutex_lock(&p->mu);
    p->release_ns = idle_ns;
    pthread_mutex_unlock(&p->mu);
    pthread_cond_broadcast(&p->cv); /* a sleeping worker takes the new time */
}

dc_worker_held dc_worker_pool_held(const dc_worker_pool *p, int i) {
    dc_worker_held h = {0, 0};
    if (!p->held_ws || i < 0 || i >= p->n) return h;
    h.workspace = atomic_load_explicit(&p->held_ws[i], memory_order_relaxed);
    h.kept = atomic_load_explicit(&p->held_kept[i], memory_order_relaxed);
    return h;
}

void dc_worker_pool_expect(dc_worker_pool *p, uint64_t from_ns, uint64_t to_ns) {
    bool wake;
    if (!p->threads) return;
    pthread_mutex_lock(&p->mu);
    /* A sleeping worker recomputes its wake-up time. */
    wake = dc_window_set(&p->win, from_ns, to_ns, dc_clock_ns()) && !p->q_head;
    pthread_mutex_unlock(&p->mu);
    if (wake) pthread_cond_signal(&p->cv);
}

static void on_async_closed(uv_handle_t *h) {
    dc_worker_pool *p = h->data;
    if (p->closed) p->closed(p);
}

void dc_worker_pool_close(dc_worker_pool *p) {
    if (!p->threads) return;
    pthread_mutex_lock(&p->mu);
    p->stopping = true;
    pthread_cond_broadcast(&p->cv);
    pthread_mutex_unlock(&p->mu);
    for (int i = 0; i < p->n; i++) pthread_join(p->threads[i], NULL);
    pool_drain(p);
    pool_release(p, p->n);
    pthread_mutex_destroy(&p->mu);
    pthread_cond_destroy(&p->cv);
    uv_close((uv_handle_t *)&p->async, on_async_closed);
    dc_log_debug("worker pool %s stopped", p->name);
}
