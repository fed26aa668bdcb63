/* Making an account's ledger state durable without blocking the loop: the
 * account is serialized on the loop, written (temp file, fsync, rename,
 * directory fsync: dc_ledger_write_file) on libuv's thread pool, and the
 * generation it holds is recorded back on the loop, where the waiters for it
 * are answered. */
#include "ledger.h"

#include <stdlib.h>

#include "log.h"
#include "metrics.h"

typedef struct ledger_write {
    uv_work_t req;
    dc_ledger *ledger;
    dc_ledger_account *acct;
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

static void start_write(dc_ledger *l, dc_ledger_account *acct);

static void ledger_write_work(uv_work_t *req) {
    ledger_write *w = req->data;
    w->rc = dc_ledger_write_file(w->path, w->buf, w->len, &w->err);
}

/* Tells every waiter whose generation this write covered. */
static void notify_waiters(dc_ledger_account *acct, uint64_t gen, int rc, const dc_err *err) {
    dc_ledger_waiter **pp = &acct->waiters, *ready = NULL;
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
    /* Callbacks may change the account (a failed spend refunds itself) and
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
    dc_ledger_account *acct = w->acct;

    l->writes_in_flight--;
    acct->writing = false;
    if (status != 0 && w->rc == 0)
        w->rc = dc_err_set(&w->err, DC_EINTERNAL, "ledger", "ledger write cancelled");
    if (l->metrics) dc_hist_add(&l->metrics->ledger_write, (uv_hrtime() - w->t0) / 1e9);
    if (w->rc == 0) {
        if (l->metrics) l->metrics->ledger_writes++;
        if (w->gen > acct->saved_gen) acct->saved_gen = w->gen;
    } else {
        if (l->metrics) l->metrics->ledger_write_errors++;
        dc_log_error("ledger: uid %u job '%s': %s", acct->uid, acct->job_id, w->err.msg);
    }
    notify_waiters(acct, w->gen, w->rc, &w->err);
    free(w->buf);
    free(w);
    /* What changed meanwhile (or was refunded by the waiters) goes next. */
    if (!acct->writing && acct->saved_gen < acct->gen && (acct->dirty || acct->waiters))
        start_write(l, acct);
}

static void start_write(dc_ledger *l, dc_ledger_account *acct) {
    ledger_write *w = calloc(1, sizeof *w);
    dc_err e;
    if (!w || dc_ledger_serialize(acct, &w->buf, &w->len) != 0) {
        free(w);
        dc_err_set(&e, DC_ENOSPACE, "ledger", "out of memory writing the ledger");
        if (l->metrics) l->metrics->ledger_write_errors++;
        notify_waiters(acct, acct->gen, DC_ENOSPACE, &e);
        return;
    }
    w->req.data = w;
    w->ledger = l;
    w->acct = acct;
    w->gen = acct->gen;
    w->t0 = uv_hrtime();
    dc_ledger_account_path(l, acct, w->path, sizeof w->path);
    acct->writing = true;
    acct->dirty = false;
    l->writes_in_flight++;
    uv_queue_work(l->loop, &w->req, ledger_write_work, ledger_write_done);
}

void dc_ledger_persist(dc_ledger_account *acct, dc_ledger_waiter *w) {
    dc_ledger *l = acct->ledger;
    if (w) {
        w->next = acct->waiters;
        acct->waiters = w;
    }
    if (!dc_ledger_persistent(l)) {
        acct->saved_gen = acct->gen;
        notify_waiters(acct, acct->gen, 0, NULL);
        return;
    }
    if (acct->saved_gen >= acct->gen) {
        notify_waiters(acct, acct->saved_gen, 0, NULL);
        return;
    }
    if (acct->writing) {
        acct->dirty = true;
        return;
    }
    start_write(l, acct);
}
