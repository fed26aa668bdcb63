/* Making a job's ledger state durable without blocking the loop: the job is
 * serialized on the loop, written (temp file, fsync, rename, directory
 * fsync: dc_ledger_write_file) on libuv's thread pool, and the generation
 * it holds is recorded back on the loop, where the waiters for it are
 * answered. */
#include "ledger.h"

#include <stdlib.h>

#include "log.h"
#include "metrics.h"

typedef struct ledger_write {
    uv_work_t req;
    dc_ledger *ledger;
    dc_ledger_job *job;
    uint64_t gen;
    char path[600];
    char *buf;
    size_t len;
    int rc;
    dc_err err;
    uint64_t t0;
} ledger_write;

void dc_ledger_store_init(dc_ledger *l, uv_loop_t *loop, dc_metrics *m) {
    l->loop = loop;
    l->metrics = m;
    l->writes_in_flight = 0;
}

static void start_write(dc_ledger *l, dc_ledger_job *job);

static void ledger_write_work(uv_work_t *req) {
    ledger_write *w = req->data;
    w->rc = dc_ledger_write_file(w->path, w->buf, w->len, &w->err);
}

/* Tells every waiter whose generation this write covered. */
static void notify_waiters(dc_ledger_job *job, uint64_t gen, int rc, const dc_err *err) {
    dc_ledger_waiter **pp = &job->waiters, *ready = NULL;
    while (*pp) {
        dc_ledger_waiter *w = *pp;
        if (w->gen <= gen) {
            *pp = w->next;
            w->next = ready;
            ready = w;
        } else {
            pp = &w->next;
        }
    }
    /* Callbacks may change the job (a failed spend refunds itself) and
     * queue new waiters: they run after the list is settled. */
    while (ready) {
        dc_ledger_waiter *w = ready;
        ready = w->next;
        w->done(w, rc, err);
    }
}

static void ledger_write_done(uv_work_t *req, int status) {
    ledger_write *w = req->data;
    dc_ledger *l = w->ledger;
    dc_ledger_job *job = w->job;

    l->writes_in_flight--;
    job->writing = false;
    if (status != 0 && w->rc == 0)
        w->rc = dc_err_set(&w->err, DC_EINTERNAL, "ledger", "ledger write cancelled");
    if (l->metrics) dc_hist_add(&l->metrics->ledger_write, (uv_hrtime() - w->t0) / 1e9);
    if (w->rc == 0) {
        if (l->metrics) l->metrics->ledger_writes++;
        if (w->gen > job->saved_gen) job->saved_gen = w->gen;
    } else {
        if (l->metrics) l->metrics->ledger_write_errors++;
        dc_log_error("ledger: uid %u job '%s': %s", job->uid, job->job, w->err.msg);
    }
    notify_waiters(job, w->gen, w->rc, &w->err);
    free(w->buf);
    free(w);
    /* What changed meanwhile (or was refunded by the waiters) goes next. */
    if (!job->writing && job->saved_gen < job->gen && (job->dirty || job->waiters))
        start_write(l, job);
}

static void start_write(dc_ledger *l, dc_ledger_job *job) {
    ledger_write *w = calloc(1, sizeof *w);
    dc_err e;
    if (!w || dc_ledger_serialize(job, &w->buf, &w->len) != 0) {
        free(w);
        dc_err_set(&e, DC_ENOSPACE, "ledger", "out of memory writing the ledger");
        if (l->metrics) l->metrics->ledger_write_errors++;
        notify_waiters(job, job->gen, DC_ENOSPACE, &e);
        return;
    }
    w->req.data = w;
    w->ledger = l;
    w->job = job;
    w->gen = job->gen;
    w->t0 = uv_hrtime();
    dc_ledger_job_path(l, job, w->path, sizeof w->path);
    job->writing = true;
    job->dirty = false;
    l->writes_in_flight++;
    uv_queue_work(l->loop, &w->req, ledger_write_work, ledger_write_done);
}

void dc_ledger_persist(dc_ledger_job *job, dc_ledger_waiter *w) {
    dc_ledger *l = job->ledger;
    if (w) {
        w->next = job->waiters;
        job->waiters = w;
    }
    if (!dc_ledger_persistent(l)) {
        job->saved_gen = job->gen;
        notify_waiters(job, job->gen, 0, NULL);
        return;
    }
    if (job->saved_gen >= job->gen) {
        notify_waiters(job, job->saved_gen, 0, NULL);
        return;
    }
    if (job->writing) {
        job->dirty = true;
        return;
    }
    start_write(l, job);
}
