/* Norm-group tests (test_groups.c, test_groups_nccl.c): members on a real
 * daemon, and the whole model's per-sample double-precision reference that
 * their results must equal. */
#ifndef DC_GROUP_TEST_H
#define DC_GROUP_TEST_H

#include <stdint.h>

#include "harness.h"

#define DC_GROUP_TEST_B 6    /* samples per step */
#define DC_GROUP_TEST_MAXM 4 /* members per group */

/* A client on sock joined to `group` as rank of size (link: across
 * daemons, or NULL); asserts that it worked. */
dpclip_client *dc_group_member(const char *sock, const char *group, uint32_t rank, uint32_t size,
                               uint32_t timeout_ms, int group_wise, const char *job,
                               dpclip_group_link *link);
dpclip_clip_config dc_group_config(float C, float sigma);
/* Submits every member's step, then waits for each; rcs[k] gets each code. */
void dc_group_run(dc_shm_step *st, int n, dpclip_result *res, int *rcs);
/* The whole model's per-sample squared norms (replicated layers once). */
void dc_group_sq(dc_shm_step *st, int n, double *tot);
/* A threshold between the middle two of the model's norms: it clips half. */
float dc_group_median(dc_shm_step *st, int n);
void dc_group_set_c(dc_shm_step *st, int n, float C, float sigma);
/* Whether the group steps checked next run in phases (groups.fuse off, a
 * fused step over the limits, groups across daemons): their clip phase
 * measures again and clips with the margin DC_PHASE_RECHECK_TOL on squared
 * norms (step_pass.h), which the reference coefficients then include. */
extern int dc_group_phased;
/* The bound rule (step.h DC_E_*) of the members' kernels: each member clips
 * by its own layers' certified error e (dc_clip_e_step), which the
 * reference coefficients then include. 0: the CPU backend's. */
extern unsigned dc_group_e_how;

/* Asserts norms, coefficients and every member's clipped sums against the
 * whole model's reference at threshold C. */
void dc_group_check(dc_shm_step *st, int n, const dpclip_result *res, float C);
/* The same at other bounds: norms and coefficients within norm_rtol, the
 * clipped sums within out_rtol/out_atol (the GPU's, for instance). */
void dc_group_check_tol(dc_shm_step *st, int n, const dpclip_result *res, float C, double norm_rtol,
                        double out_rtol, double out_atol);

/* A small transformer (embedding, LayerNorm, MLP, RMSNorm, head) and its
 * pipeline split over 2 members ([0]) and over 4 ([1]): layer l's stage. */
extern const dc_test_layer_spec dc_group_pp_model[6];
extern const int dc_group_pp_stage_of[2][6];

#endif
