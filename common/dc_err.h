/* Error codes and the error record every stage fills in. Codes match proto
 * ErrorCode and the public DPCLIP_E* values (client/dpclip.h). */
#ifndef DC_ERR_H
#define DC_ERR_H

#include <stdarg.h>
#include <stdio.h>

typedef enum dc_code {
    DC_OK = 0,
    DC_EINVAL = 1,     /* INVALID_ARGUMENT */
    DC_ENOTFOUND = 2,  /* NOT_FOUND */
    DC_EPERM = 3,      /* PERMISSION_DENIED */
    DC_EPRECOND = 4,   /* FAILED_PRECONDITION */
    DC_ENOSPACE = 5,   /* RESOURCE_EXHAUSTED */
    DC_ENONFINITE = 6, /* NON_FINITE */
    DC_EPROTO = 7,     /* PROTOCOL */
    DC_EINTERNAL = 8,  /* INTERNAL */
    DC_EUNAVAIL = 9,   /* UNAVAILABLE */
    DC_EUNIMPL = 10    /* UNIMPLEMENTED */
} dc_code;
/* How many codes there are, DC_OK included: the size of a table by code. */
#define DC_CODE_N (DC_EUNIMPL + 1)

/* field: dotted path into the request, e.g.
 * "clip_step.layers[2].linear.activations.shape"; empty when not about one. */
typedef struct dc_err {
    dc_code code;
    char field[128];
    char msg[384];
} dc_err;

#if defined(__GNUC__)
#define DC_PRINTF(a, b) __attribute__((format(printf, a, b)))
#else
#define DC_PRINTF(a, b)
#endif

/* Sets *e (if non-NULL) and returns code, so callers can `return dc_err_set(...)`. */
static inline DC_PRINTF(4, 5) int dc_err_set(dc_err *e, dc_code code, const char *field,
                                             const char *fmt, ...) {
    if (e) {
        va_list ap;
        e->code = code;
        snprintf(e->field, sizeof e->field, "%s", field ? field : "");
        va_start(ap, fmt);
        vsnprintf(e->msg, sizeof e->msg, fmt, ap);
        va_end(ap);
    }
    return (int)code;
}

static inline void dc_err_clear(dc_err *e) {
    if (e) {
        e->code = DC_OK;
        e->field[0] = '\0';
        e->msg[0] = '\0';
    }
}

#endif
