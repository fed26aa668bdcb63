/* Worker threads: where steps run, so the libuv loop never blocks.
 *
 * A pool owns N threads, each with its own backend instance (scratch memory
 * is per backend, so workers never share it; for CUDA one pool of one worker
 * per GPU owns that GPU's context and streams). The loop thread submits tasks;
 * a worker runs task->work(task, backend); completed tasks are handed back to
 * the loop thread through a uv_async_t, which calls task->done(task) there.
 *
 * Ownership: the pool never owns tasks; the submitter keeps each task alive
 * until its done callback has run. */
#ifndef DC_WORKER_H
#define DC_WORKER_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <uv.h>

#include "backend.h"
#include "dc_window.h"

typedef struct dc_worker_pool dc_worker_pool;
typedef struct dc_task dc_task;
/* A task: one piece of work for a pool (a step or one of its phases, a
 * GPU's handle to open or close, ...), embedded first in the submitter's own
 * struct. Not a "job": that word is the user's privacy account (job id). */
struct dc_task {
    dc_task *next;                               /* pool-internal queue link */
    dc_task *n_next;                             /* pool-internal notice link */
    dc_worker_pool *pool;                        /* set by dc_worker_pool_submit */
    uint32_t owner;                              /* who the work is for (a uid); see below */
    void (*work)(dc_task *task, dc_backend *be); /* on a worker thread */
    /* Optional: on the loop thread, after work() called dc_task_notify
     * and before done() (a step's "enqueued" notice). */
    void (*notice)(dc_task *task);
    void (*done)(dc_task *task); /* on the loop thread */
};

/* Makes backend instance `index` for a worker; called on the creating thread. */
typedef int (*dc_backend_factory)(void *arg, int index, dc_backend **out, dc_err *err);

/* Fair sharing: a free worker takes, among the queued tasks, one whose owner
 * has the fewest tasks running now, and among those the owner served least
 * recently (then the oldest task). So owners are served in turn whatever
 * they queue, and one owner's backlog does not hold back another's next
 * task; with limits.max_step_gflop bounding each task, a newcomer waits at
 * most about one task per worker. Owners are remembered in a small table
 * (DC_WORKER_OWNERS); one forgotten counts as never served. */
#define DC_WORKER_OWNERS 64

struct dc_worker_pool {
    uv_async_t async; /* wakes the loop when tasks complete */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    dc_task *q_head, *q_tail; /* waiting to run */
    dc_task *d_head, *d_tail; /* finished, waiting for done() */
    dc_task *n_head, *n_tail; /* notified, waiting for notice() */
    bool stopping;
    atomic_uint queued; /* tasks waiting: workers spin on it lock-free */
    uint64_t spin_ns;   /* how long an idle worker polls before sleeping */
    /* A window (under mu) in which a task is expected: an idle worker
     * sleeps until it opens, then polls until it ends (dc_window.h). */
    dc_window win;
    int n;
    int busy;            /* tasks submitted and not yet done() */
    uint32_t *running;   /* [n] owner of each worker's task (under mu) */
    bool *has_task;      /* [n] */
    uint64_t served_seq; /* tasks started, the clock of `served` */
    struct {
        uint32_t owner;
        uint64_t last; /* served_seq when its last task started; 0 = free slot */
    } served[DC_WORKER_OWNERS];
    /* Idle release (dc_worker_pool_set_release; 0: never): when worker i's
     * last task since its backend gave its memory back ended, 0 for none
     * (under mu). */
    uint64_t release_ns;
    uint64_t *last;
    /* [n] what each worker's backend holds, as it was after its last task
     * or release (dc_worker_pool_held) */
    _Atomic uint64_t *held_ws, *held_kept;
    pthread_t *threads;
    dc_backend **backends;
    char name[16];
    /* Optional: called on the loop thread once the pool's handle is closed
     * (after dc_worker_pool_close, in a later loop turn), when the pool's
     * memory may go. */
    void (*closed)(dc_worker_pool *p);
    void *closed_arg;
};

int dc_worker_pool_init(dc_worker_pool *p, uv_loop_t *loop, const char *name, int n,
                        dc_backend_factory factory, void *factory_arg, dc_err *err);
void dc_worker_pool_submit(dc_worker_pool *p, dc_task *task);
/* From task->work on the worker thread: have task->notice run on the loop
 * thread soon (before task->done). At most once per task. */
void dc_task_notify(dc_task *task);
/* An idle worker polls for new tasks this long before sleeping on the
 * condition variable: waking a sleeping thread on an idle core costs tens of
 * microseconds on many machines (VMs especially), more than a small step.
 * Set before submitting; 0 disables. */
void dc_worker_pool_set_spin(dc_worker_pool *p, uint64_t spin_ns);
/* A task is expected between from_ns and to_ns (CLOCK_MONOTONIC, the clock
 * of uv_hrtime): an idle worker is awake and polling then, so the task does
 * not pay a sleeping thread's wake-up (the same cost as above) when it
 * comes. Windows merge (earliest start, latest end); a window already past
 * is ignored. Any thread. */
void dc_worker_pool_expect(dc_worker_pool *p, uint64_t from_ns, uint64_t to_ns);
/* After a worker has run no task for idle_ns, its backend gives back the
 * memory it grew beyond its preallocation (dc_backend_release), once per
 * idle period: a daemon that served a job should not hold that job's peak
 * on a shared node. 0 (the default): never. Any time (a reload). */
void dc_worker_pool_set_release(dc_worker_pool *p, uint64_t idle_ns);
/* What worker `i`'s backend held after its last task or release: device
 * workspace and kept stores (dc_backend_workspace_bytes, _kept_bytes).
 * Any thread. */
typedef struct dc_worker_held {
    uint64_t workspace, kept;
} dc_worker_held;
dc_worker_held dc_worker_pool_held(const dc_worker_pool *p, int i);
/* Tasks submitted and not completed yet (loop thread only). */
int dc_worker_pool_busy(const dc_worker_pool *p);
/* Stops the threads after the queued tasks ran, runs the remaining done()
 * callbacks, destroys the backends and closes the async handle (the pool
 * memory must stay valid until the loop has processed the close: p->closed
 * says when). */
void dc_worker_pool_close(dc_worker_pool *p);

#endif
