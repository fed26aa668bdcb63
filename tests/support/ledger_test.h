/* Helpers of the tests that drive the privacy ledger through a real daemon
 * (test_service.c, test_service_ledger.c): the accountant's epsilon, /status
 * read with jansson, a job's entry there, and steps with privacy fields.
 * Header-only, as each test is one translation unit; include it after
 * <cmocka.h> and <jansson.h>. */
#ifndef DC_LEDGER_TEST_H
#define DC_LEDGER_TEST_H

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "accountant.h"
#include "harness.h"
#include "service.h"

static inline double accountant_eps(double q, double sigma, double steps, double delta) {
    double rdp[DC_RDP_N_ORDERS];
    if (steps == 0) return 0.0;
    dc_rdp_steps(q, sigma, dc_rdp_default_orders(), DC_RDP_N_ORDERS, rdp);
    for (int k = 0; k < DC_RDP_N_ORDERS; k++) rdp[k] *= steps;
    return dc_rdp_epsilon(dc_rdp_default_orders(), rdp, DC_RDP_N_ORDERS, delta, NULL);
}

static inline void assert_rel(double got, double want, double rtol) {
    if (!(fabs(got - want) <= rtol * fabs(want))) {
        fprintf(stderr, "got %.17g, want %.17g\n", got, want);
        fail();
    }
}

static inline json_t *get_status(const char *status_sock) {
    char *body = NULL;
    json_error_t je;
    json_t *root;
    int code = dc_http(status_sock, "GET", "/status", 10000, NULL, &body, NULL);
    if (code != 200) fprintf(stderr, "GET /status on %s: %d\n", status_sock, code);
    assert_int_equal(code, 200);
    root = json_loads(body, 0, &je);
    free(body);
    assert_non_null(root);
    return root;
}

/* The ledger's entry for (our uid, job), or NULL; borrowed from root. */
static inline json_t *ledger_job(json_t *root, const char *job) {
    size_t i;
    json_t *j;
    json_array_foreach(json_object_get(json_object_get(root, "ledger"), "jobs"), i,
                       j) if (strcmp(json_string_value(json_object_get(j, "job")), job) == 0 &&
                              json_integer_value(json_object_get(j, "uid")) ==
                                  (json_int_t)getuid()) return j;
    return NULL;
}

static inline long job_steps(const char *status_sock, const char *job) {
    json_t *root = get_status(status_sock), *j = ledger_job(root, job);
    long n = j ? (long)json_integer_value(json_object_get(j, "steps")) : -1;
    json_decref(root);
    return n;
}

static inline dpclip_client *connect_job(const char *sock, const char *job) {
    dpclip_client *c = NULL;
    dpclip_connect_opts o = {.client_name = "service-test", .job_id = job};
    int rc = dpclip_connect(sock, &o, &c);
    if (rc) fprintf(stderr, "connect: %s\n", dpclip_errmsg(c));
    assert_int_equal(rc, 0);
    return c;
}

/* Sets the step's privacy fields (rebuilding the wire step). */
static inline void set_privacy(dc_shm_step *s, float sigma, double q, double delta, double budget) {
    dpclip_clip_config cfg = s->cfg;
    cfg.noise_multiplier = sigma;
    cfg.sample_rate = q;
    cfg.target_delta = delta;
    cfg.target_epsilon = budget;
    assert_int_equal(dc_shm_step_set_config(s, &cfg), 0);
}

static inline int run(dpclip_client *c, dc_shm_step *s, double *eps, double *delta) {
    dpclip_result res;
    int rc = dpclip_run(c, s->step, &res);
    if (rc == 0) {
        if (eps) *eps = res.epsilon;
        if (delta) *delta = res.delta;
        dpclip_result_free(&res);
    }
    return rc;
}

#endif
