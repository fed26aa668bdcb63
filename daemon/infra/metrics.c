#include "metrics.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

const double dc_hist_bounds[DC_HIST_NB] = {5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4,
                                           5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2,
                                           5e-2, 0.1,  0.25,   0.5,  1.0,  10.0};

const char *const dc_phase_names[DC_PH_N] = {"validate", "ledger", "queue", "wait_input",
                                             "run",      "reply",  "norms", "reduction",
                                             "clipping", "noise"};

const char *const dc_req_names[DC_REQ_N] = {"hello",     "register_buffer", "release_buffer",
                                            "clip_step", "register_event",  "ping",
                                            "other"};

const char *dc_code_name(int code) {
    static const char *names[] = {"ok",
                                  "invalid_argument",
                                  "not_found",
                                  "permission_denied",
                                  "failed_precondition",
                                  "resource_exhausted",
                                  "non_finite",
                                  "protocol",
                                  "internal",
                                  "unavailable",
                                  "unimplemented"};
    _Static_assert(sizeof names / sizeof names[0] == DC_CODE_N, "a name for every dc_code");
    return code >= 0 && code < DC_CODE_N ? names[code] : "unknown";
}

/* --- strings ---------------------------------------------------------------- */

static bool sbuf_reserve(dc_sbuf *b, size_t more) {
    size_t cap;
    char *p;
    if (b->oom) return false;
    if (b->len + more + 1 <= b->cap) return true;
    cap = b->cap ? b->cap : 1024;
    while (cap < b->len + more + 1) cap *= 2;
    if (!(p = realloc(b->p, cap))) {
        b->oom = true;
        return false;
    }
    b->p = p;
    b->cap = cap;
    return true;
}

void dc_sbuf_printf(dc_sbuf *b, const char *fmt, ...) {
    va_list ap;
    int n;
    char small[256];
    va_start(ap, fmt);
    n = vsnprintf(small, sizeof small, fmt, ap);
    va_end(ap);
    if (n < 0 || !sbuf_reserve(b, (size_t)n)) return;
    if ((size_t)n < sizeof small) {
        memcpy(b->p + b->len, small, (size_t)n + 1);
    } else {
        va_start(ap, fmt);
        vsnprintf(b->p + b->len, (size_t)n + 1, fmt, ap);
        va_end(ap);
    }
    b->len += (size_t)n;
}

void dc_sbuf_puts(dc_sbuf *b, const char *s) {
    size_t n = strlen(s);
    if (!sbuf_reserve(b, n)) return;
    memcpy(b->p + b->len, s, n + 1);
    b->len += n;
}

void dc_sbuf_json_str(dc_sbuf *b, const char *s) {
    dc_sbuf_puts(b, "\"");
    for (const unsigned char *p = (const unsigned char *)s; *p; p++) {
        if (*p == '"' || *p == '\\') dc_sbuf_printf(b, "\\%c", *p);
        else if (*p < 0x20 || *p >= 0x7f) dc_sbuf_printf(b, "\\u%04x", *p);
        else dc_sbuf_printf(b, "%c", *p);
    }
    dc_sbuf_puts(b, "\"");
}

void dc_sbuf_json_num(dc_sbuf *b, double v) {
    if (!isfinite(v)) dc_sbuf_puts(b, "null");
    else dc_sbuf_printf(b, "%.17g", v);
}

void dc_sbuf_prom_str(dc_sbuf *b, const char *s) {
    dc_sbuf_puts(b, "\"");
    for (const unsigned char *p = (const unsigned char *)s; *p; p++) {
        if (*p == '"' || *p == '\\') dc_sbuf_printf(b, "\\%c", *p);
        else if (*p == '\n') dc_sbuf_puts(b, "\\n");
        /* Label values are UTF-8: keep ASCII, show other bytes as \xNN text
         * so a job name can never make the exposition invalid. */
        else if (*p < 0x20 || *p >= 0x7f) dc_sbuf_printf(b, "\\\\x%02x", *p);
        else dc_sbuf_printf(b, "%c", *p);
    }
    dc_sbuf_puts(b, "\"");
}

void dc_sbuf_prom_num(dc_sbuf *b, double v) {
    if (isnan(v)) dc_sbuf_puts(b, "NaN");
    else if (isinf(v)) dc_sbuf_puts(b, v > 0 ? "+Inf" : "-Inf");
    else dc_sbuf_printf(b, "%.17g", v);
}

void dc_sbuf_free(dc_sbuf *b) {
    free(b->p);
    memset(b, 0, sizeof *b);
}

/* --- histograms --------------------------------------------------------------- */

void dc_hist_add(dc_hist *h, double seconds) {
    int i = 0;
    while (i < DC_HIST_NB && seconds > dc_hist_bounds[i]) i++;
    h->bucket[i]++;
    h->count++;
    h->sum += seconds;
}

void dc_prom_head(dc_sbuf *b, const char *name, const char *type, const char *help) {
    dc_sbuf_printf(b, "# HELP %s %s\n# TYPE %s %s\n", name, help, name, type);
}

void dc_prom_hist(dc_sbuf *b, const char *name, const char *labels, const dc_hist *h) {
    uint64_t cum = 0;
    const char *sep = labels[0] ? "," : "";
    for (int i = 0; i < DC_HIST_NB; i++) {
        cum += h->bucket[i];
        dc_sbuf_printf(b, "%s_bucket{%s%sle=\"%g\"} %llu\n", name, labels, sep, dc_hist_bounds[i],
                       (unsigned long long)cum);
    }
    cum += h->bucket[DC_HIST_NB];
    dc_sbuf_printf(b, "%s_bucket{%s%sle=\"+Inf\"} %llu\n", name, labels, sep,
                   (unsigned long long)cum);
    dc_sbuf_printf(b, "%s_sum%s%s%s ", name, labels[0] ? "{" : "", labels, labels[0] ? "}" : "");
    dc_sbuf_prom_num(b, h->sum);
    dc_sbuf_printf(b, "\n%s_count%s%s%s %llu\n", name, labels[0] ? "{" : "", labels,
                   labels[0] ? "}" : "", (unsigned long long)h->count);
}
