/* The daemon's counters and histograms, and the text builders that render
 * them (Prometheus text exposition format 0.0.4, and JSON for /status).
 *
 * Threads: a dc_metrics is owned by the loop thread, which both updates it
 * (at request and step completion) and renders it (status.c asks the loop
 * for a rendering), so it needs no lock. */
#ifndef DC_METRICS_H
#define DC_METRICS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "dc_err.h"

/* --- a growable string --------------------------------------------------- */

typedef struct dc_sbuf {
    char *p; /* NUL-terminated; owned; NULL until the first append */
    size_t len, cap;
    bool oom; /* an append failed: the contents are incomplete */
} dc_sbuf;

void dc_sbuf_printf(dc_sbuf *b, const char *fmt, ...) DC_PRINTF(2, 3);
void dc_sbuf_puts(dc_sbuf *b, const char *s);
/* A JSON string literal (quotes included). Bytes outside printable ASCII
 * are escaped as \u00XX, so any client-chosen name yields valid JSON. */
void dc_sbuf_json_str(dc_sbuf *b, const char *s);
/* A JSON number; null for NaN and infinities (JSON has neither). */
void dc_sbuf_json_num(dc_sbuf *b, double v);
/* A Prometheus label value (quotes included), escaped per the format. */
void dc_sbuf_prom_str(dc_sbuf *b, const char *s);
/* A Prometheus sample value: +Inf, -Inf, NaN or %.17g. */
void dc_sbuf_prom_num(dc_sbuf *b, double v);
void dc_sbuf_free(dc_sbuf *b);

/* --- histograms (seconds) ------------------------------------------------- */

#define DC_HIST_NB 18
/* Upper bounds in seconds: 5 us .. 10 s, roughly x2.5 apart. */
extern const double dc_hist_bounds[DC_HIST_NB];

typedef struct dc_hist {
    uint64_t bucket[DC_HIST_NB + 1]; /* non-cumulative; the last is +Inf */
    uint64_t count;
    double sum;
} dc_hist;

void dc_hist_add(dc_hist *h, double seconds);
/* # HELP/# TYPE lines are the caller's; this writes the _bucket (cumulative),
 * _sum and _count samples with `labels` (e.g. `phase="queue"`, may be ""). */
void dc_prom_hist(dc_sbuf *b, const char *name, const char *labels, const dc_hist *h);
/* # HELP and # TYPE lines. */
void dc_prom_head(dc_sbuf *b, const char *name, const char *type, const char *help);

/* --- the daemon's metrics --------------------------------------------------- */

/* Where a step's time goes, loop-side and worker-side (uv_hrtime stamps). */
typedef enum dc_phase {
    DC_PH_VALIDATE = 0, /* decode to validated step + budget check */
    DC_PH_LEDGER,       /* waiting for the spend to be on disk */
    DC_PH_QUEUE,        /* submitted, waiting for a worker */
    DC_PH_WAIT_INPUT,   /* GPU: the daemon's stream waiting on the client's event
                         * (measured on the GPU when the backend times phases) */
    DC_PH_RUN,          /* the backend's step: norms, clipping, sums, noise */
    DC_PH_REPLY,        /* worker done to reply queued */
    /* parts of run, timed by the backend (dc_run_phase; GPU: CUDA events) */
    DC_PH_NORMS,     /* per-sample norms */
    DC_PH_REDUCTION, /* norms reduced over layers, coefficients */
    DC_PH_CLIPPING,  /* clipped sums */
    DC_PH_NOISE,     /* noise, division, checks, outputs written */
    DC_PH_N
} dc_phase;

extern const char *const dc_phase_names[DC_PH_N];

typedef enum dc_req_kind {
    DC_REQ_HELLO = 0,
    DC_REQ_REGISTER,
    DC_REQ_RELEASE,
    DC_REQ_STEP,
    DC_REQ_EVENT,
    DC_REQ_PING,
    DC_REQ_OTHER,
    DC_REQ_N
} dc_req_kind;

extern const char *const dc_req_names[DC_REQ_N];
/* Lower-case names of dc_code values ("invalid_argument", ...). */
const char *dc_code_name(int code);

typedef struct dc_metrics {
    uint64_t requests[DC_REQ_N];
    uint64_t errors[DC_CODE_N]; /* error replies by dc_code */
    uint64_t steps_ok, steps_failed;
    uint64_t layers, samples;  /* in successful steps */
    uint64_t bytes_referenced; /* input tensor bytes named by successful steps */
    uint64_t sessions_total, sessions_refused;
    uint64_t budget_refusals;
    uint64_t ledger_writes, ledger_write_errors;
    uint64_t reloads, reload_errors;
    uint64_t compute_ns; /* backends' own time, successful steps */
    dc_hist phase[DC_PH_N];
    dc_hist step;         /* request decoded to reply queued */
    dc_hist ledger_write; /* one crash-safe account file write */
} dc_metrics;

/* Counts an error reply; a code outside dc_code counts as internal. */
static inline void dc_metrics_error(dc_metrics *m, int code) {
    m->errors[code >= 0 && code < DC_CODE_N ? code : DC_EINTERNAL]++;
}

#endif
