/* The ledger's files: one per account, "<uid>-<hex of job id>.ledger", text:
 *
 *   dpclip-ledger 2
 *   uid 1000
 *   job 72756e2d34
 *   delta 1.0000000000000001e-05
 *   budget_epsilon 0
 *   steps 1234
 *   insecure 1                 (only if spent under --insecure-fixed-seed)
 *   entry 0.01 1.1 1200        (q, sigma, steps: the history, at most 16)
 *   folded 34 r1 ... r151      (only if pairs were folded: steps and RDP)
 *   data_parallel 4 1.1 1200   (only if declared: world, sigma, highest
 *                               logical step charged)
 *   epsilon 3.02               (for people reading it; recomputed on load)
 *   end
 *
 * Version 1 files (no folded line, any number of entries) are read too.
 * Opening a ledger reads every file (a corrupt one stops the daemon);
 * accounts dropped from memory later are read back from here. */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include "ledger_int.h"

#define LEDGER_MAGIC_V1 "dpclip-ledger 1"
#define LEDGER_MAGIC "dpclip-ledger 2"

/* --- writing ------------------------------------------------------------------- */

static void path_of(const dc_ledger *l, uint32_t uid, const char *job_id, char *out, size_t n) {
    char hex[2 * DC_LEDGER_JOB_ID_MAX + 1];
    size_t k = 0;
    for (const unsigned char *p = (const unsigned char *)job_id; *p && k + 2 < sizeof hex;
         p++, k += 2)
        snprintf(hex + k, 3, "%02x", *p);
    hex[k] = '\0';
    snprintf(out, n, "%s/%u-%s.ledger", l->dir, uid, hex);
}

void dc_ledger_account_path(const dc_ledger *l, const dc_ledger_account *acct, char *out,
                            size_t n) {
    path_of(l, acct->uid, acct->job_id, out, n);
}

int dc_ledger_serialize(const dc_ledger_account *acct, char **out, size_t *len) {
    char *buf = NULL;
    size_t n = 0;
    FILE *f = open_memstream(&buf, &n);
    if (!f) return DC_ENOSPACE;
    fprintf(f, LEDGER_MAGIC "\nuid %u\njob ", acct->uid);
    for (const unsigned char *p = (const unsigned char *)acct->job_id; *p; p++)
        fprintf(f, "%02x", *p);
    fprintf(f, "\ndelta %.17g\nbudget_epsilon %.17g\nsteps %llu\n", acct->delta, acct->budget_eps,
            (unsigned long long)acct->steps);
    if (acct->insecure) fputs("insecure 1\n", f);
    for (size_t i = 0; i < acct->n_hist; i++)
        fprintf(f, "entry %.17g %.17g %llu\n", acct->hist[i].q, acct->hist[i].sigma,
                (unsigned long long)acct->hist[i].steps);
    if (acct->dp && acct->dp->world)
        fprintf(f, "data_parallel %u %.17g %llu\n", acct->dp->world, acct->dp->sigma,
                (unsigned long long)acct->dp->newest);
    if (acct->folded_steps) {
        fprintf(f, "folded %llu", (unsigned long long)acct->folded_steps);
        for (size_t k = 0; k < DC_RDP_N_ORDERS; k++) fprintf(f, " %.17g", acct->folded[k]);
        fputs("\n", f);
    }
    /* For people reading the file; recomputed from the entries on load. */
    fprintf(f, "epsilon %.17g\nend\n", acct->eps);
    if (fclose(f) != 0) {
        free(buf);
        return DC_ENOSPACE;
    }
    *out = buf;
    *len = n;
    return 0;
}

static int fsync_dir_of(const char *path) {
    char dir[512];
    const char *slash = strrchr(path, '/');
    int fd, rc;
    snprintf(dir, sizeof dir, "%.*s", slash && slash != path ? (int)(slash - path) : 1,
             slash ? path : ".");
    if ((fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC)) < 0) return -1;
    rc = fsync(fd);
    close(fd);
    return rc;
}

int dc_ledger_write_file(const char *path, const char *buf, size_t len, dc_err *err) {
    char tmp[600];
    size_t off = 0;
    int fd;

    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0640);
    if (fd < 0)
        return dc_err_set(err, DC_EUNAVAIL, "ledger", "cannot create %s: %s", tmp, strerror(errno));
    while (off < len) {
        ssize_t w = write(fd, buf + off, len - off);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) goto fail;
        off += (size_t)w;
    }
    /* The data must be on disk before the rename makes it the ledger, and
     * the rename on disk before anyone is told the spend is recorded. */
    if (fsync(fd) != 0) goto fail;
    if (close(fd) != 0) {
        fd = -1;
        goto fail;
    }
    fd = -1;
    if (rename(tmp, path) != 0) goto fail;
    if (fsync_dir_of(path) != 0)
        return dc_err_set(err, DC_EUNAVAIL, "ledger", "fsync of the ledger directory: %s",
                          strerror(errno));
    return 0;
fail:
    dc_err_set(err, DC_EUNAVAIL, "ledger", "cannot write %s: %s", tmp, strerror(errno));
    if (fd >= 0) close(fd);
    unlink(tmp);
    return DC_EUNAVAIL;
}

int dc_ledger_save(dc_ledger *l, dc_ledger_account *acct, dc_err *err) {
    char path[512], *buf;
    size_t len;
    uint64_t gen = acct->gen;
    int rc;
    if (!dc_ledger_persistent(l)) {
        acct->saved_gen = gen;
        return 0;
    }
    if (dc_ledger_serialize(acct, &buf, &len))
        return dc_err_set(err, DC_ENOSPACE, "ledger", "out of memory");
    dc_ledger_account_path(l, acct, path, sizeof path);
    rc = dc_ledger_write_file(path, buf, len, err);
    free(buf);
    if (rc == 0) acct->saved_gen = gen;
    return rc;
}

/* --- reading ------------------------------------------------------------------- */

static int unhex(const char *s, char *out, size_t n) {
    size_t len = strlen(s), k = 0;
    if (len % 2 || len / 2 >= n) return -1;
    for (size_t i = 0; i < len; i += 2) {
        unsigned v;
        if (sscanf(s + i, "%2x", &v) != 1 || v == 0) return -1;
        out[k++] = (char)v;
    }
    out[k] = '\0';
    return 0;
}

/* "folded N r1 ... r151": the folded steps and their summed curve. */
static int parse_folded(const char *s, unsigned long long *steps, double *rdp) {
    char *end;
    errno = 0;
    *steps = strtoull(s, &end, 10);
    if (errno || end == s || *steps == 0) return -1;
    for (size_t k = 0; k < DC_RDP_N_ORDERS; k++) {
        s = end;
        rdp[k] = strtod(s, &end);
        if (end == s || !(rdp[k] >= 0)) return -1;
    }
    return *end == '\0' ? 0 : -1;
}

/* Reads one account file into a new account (*out). */
static int load_file(dc_ledger *l, const char *path, FILE *f, dc_ledger_account **out,
                     dc_err *err) {
    char line[8192], job_id[DC_LEDGER_JOB_ID_MAX] = "";
    unsigned long long steps = 0, sum = 0, cnt, folded_steps = 0;
    unsigned uid = 0;
    double delta = l->default_delta, budget = 0, q, sigma, folded[DC_RDP_N_ORDERS];
    bool have_uid = false, have_job = false, ended = false, insecure = false, have_dp = false;
    unsigned dp_world = 0;
    double dp_sigma = 0;
    unsigned long long dp_newest = 0;
    int lineno = 0;
    dc_ledger_account *acct = NULL;
    const char *why = "unreadable";
    struct {
        double q, sigma;
        unsigned long long n;
    } *ent = NULL;
    size_t n_ent = 0;

    if (!fgets(line, sizeof line, f) ||
        (strcmp(line, LEDGER_MAGIC "\n") != 0 && strcmp(line, LEDGER_MAGIC_V1 "\n") != 0)) {
        why = "not a dpclip ledger file (bad first line)";
        goto bad;
    }
    lineno = 1;
    while (fgets(line, sizeof line, f)) {
        char key[32], val[256];
        lineno++;
        line[strcspn(line, "\n")] = '\0';
        if (strcmp(line, "end") == 0) {
            ended = true;
            break;
        }
        if (sscanf(line, "entry %lf %lf %llu", &q, &sigma, &cnt) == 3) {
            void *p = realloc(ent, (n_ent + 1) * sizeof *ent);
            if (!p || !(q >= 0 && q <= 1 && sigma >= 0)) {
                why = p ? "bad entry" : "out of memory";
                if (p) ent = p;
                goto bad;
            }
            ent = p;
            ent[n_ent].q = q;
            ent[n_ent].sigma = sigma;
            ent[n_ent].n = cnt;
            n_ent++;
            sum += cnt;
            continue;
        }
        if (strncmp(line, "data_parallel ", 14) == 0) {
            char tail;
            /* An account's world and sigma bound what its shares release, and
             * its highest step keeps numbers from being taken again: a file
             * that garbles them is not read as an account without them. */
            if (have_dp ||
                sscanf(line + 14, "%u %lf %llu %c", &dp_world, &dp_sigma, &dp_newest, &tail) != 3 ||
                dp_world < 2 || dp_world > DC_LEDGER_DP_WORLD_MAX ||
                !(dp_sigma > 0 && isfinite(dp_sigma)) || dp_newest >= (1ull << 63)) {
                why = "bad data_parallel line";
                goto bad;
            }
            have_dp = true;
            continue;
        }
        if (strncmp(line, "folded ", 7) == 0) {
            if (folded_steps || parse_folded(line + 7, &folded_steps, folded) != 0) {
                why = "bad folded line";
                goto bad;
            }
            sum += folded_steps;
            continue;
        }
        val[0] = '\0';
        if (sscanf(line, "%31s %255s", key, val) < 1) continue;
        if (strcmp(key, "uid") == 0 && sscanf(val, "%u", &uid) == 1) have_uid = true;
        else if (strcmp(key, "job") == 0 && unhex(val, job_id, sizeof job_id) == 0) have_job = true;
        else if (strcmp(key, "delta") == 0 && sscanf(val, "%lf", &delta) == 1) continue;
        else if (strcmp(key, "budget_epsilon") == 0 && sscanf(val, "%lf", &budget) == 1) continue;
        else if (strcmp(key, "steps") == 0 && sscanf(val, "%llu", &steps) == 1) continue;
        else if (strcmp(key, "insecure") == 0 && strcmp(val, "1") == 0) insecure = true;
        else if (strcmp(key, "epsilon") == 0) continue;
        else {
            why = "unknown or malformed line";
            goto bad;
        }
    }
    if (!ended || !have_uid || !have_job || sum != steps || !(delta > 0 && delta < 1)) {
        why = !ended         ? "truncated (no 'end' line)"
              : sum != steps ? "entries do not add up to "
                               "'steps'"
                             : "missing uid, job or delta";
        lineno = 0;
        goto bad;
    }
    if (dc_ledger_account_find(l, uid, job_id)) {
        free(ent);
        return dc_err_set(err, DC_EINTERNAL, "ledger", "%s: a second file for uid %u job '%s'",
                          path, uid, job_id);
    }
    if (!(acct = dc_ledger_account_new(l, uid, job_id))) goto oom;
    acct->delta = delta;
    acct->budget_eps = budget;
    acct->insecure = insecure;
    if (folded_steps) {
        acct->folded_steps = folded_steps;
        memcpy(acct->folded, folded, sizeof acct->folded);
    }
    if (have_dp && dc_ledger_dp_restore(acct, dp_world, dp_sigma, dp_newest)) goto oom;
    for (size_t i = 0; i < n_ent; i++) {
        dc_ledger_entry *e = NULL;
        for (size_t k = 0; k < acct->n_hist && !e; k++)
            if (acct->hist[k].q == ent[i].q && acct->hist[k].sigma == ent[i].sigma)
                e = &acct->hist[k];
        /* A version 1 file may list more pairs than a history keeps: the
         * oldest are folded as they come. */
        if (!e && !(e = dc_ledger_add_entry(l, acct, ent[i].q, ent[i].sigma))) goto oom;
        e->steps += ent[i].n;
        e->used = i;
    }
    dc_ledger_recompute(acct);
    acct->gen = acct->saved_gen = n_ent; /* what the file holds is on disk */
    free(ent);
    *out = acct;
    return 0;
oom:
    free(ent);
    return dc_err_set(err, DC_ENOSPACE, "ledger", "out of memory loading %s", path);
bad:
    free(ent);
    if (lineno)
        return dc_err_set(err, DC_EINTERNAL, "ledger",
                          "%s:%d: %s; refusing to start with a "
                          "ledger that cannot be read (move the file away to reset that job)",
                          path, lineno, why);
    return dc_err_set(err, DC_EINTERNAL, "ledger",
                      "%s: %s; refusing to start with a ledger "
                      "that cannot be read (move the file away to reset that job)",
                      path, why);
}

static int load_path(dc_ledger *l, const char *path, dc_ledger_account **out, dc_err *err) {
    FILE *f = fopen(path, "re");
    int rc;
    if (!f) return dc_err_set(err, DC_EINTERNAL, "ledger", "%s: %s", path, strerror(errno));
    rc = load_file(l, path, f, out, err);
    fclose(f);
    return rc;
}

/* Reads the file of (uid, job id) back: *out is the account, or NULL when it
 * has no file. An error names the file. */
static int load_account(dc_ledger *l, uint32_t uid, const char *job_id, dc_ledger_account **out,
                        dc_err *err) {
    char path[600];
    FILE *f;
    int rc;
    *out = NULL;
    path_of(l, uid, job_id, path, sizeof path);
    /* A small local file, read on the loop as at start: only when a session
     * names an account that was dropped from memory. */
    if (!(f = fopen(path, "re"))) {
        if (errno == ENOENT) return 0;
        return dc_err_set(err, DC_EUNAVAIL, "ledger", "cannot read %s: %s", path, strerror(errno));
    }
    rc = load_file(l, path, f, out, err);
    fclose(f);
    if (rc == 0 && ((*out)->uid != uid || strcmp((*out)->job_id, job_id) != 0)) {
        /* Named for one job id, holding another's: not this account. */
        dc_ledger_account *acct = *out;
        l->accounts = acct->next;
        l->n_accounts--;
        dc_ledger_dp_free(acct);
        free(acct->hist);
        free(acct);
        *out = NULL;
        return dc_err_set(err, DC_EUNAVAIL, "ledger", "%s holds another job's account", path);
    }
    return rc;
}

/* --- opening an account: in memory, else its file, else a new one ---------------- */

int dc_ledger_account_open(dc_ledger *l, uint32_t uid, const char *job_id, dc_ledger_account **out,
                           dc_err *err) {
    dc_ledger_account *acct;
    uint64_t now = uv_hrtime();
    size_t len = strlen(job_id), n;
    int rc;

    *out = NULL;
    if (len >= DC_LEDGER_JOB_ID_MAX)
        return dc_err_set(err, DC_EINVAL, "hello.job_id",
                          "job id of %zu bytes: at most %d bytes "
                          "are allowed (a longer id would share an account with another job)",
                          len, DC_LEDGER_JOB_ID_MAX - 1);
    if ((acct = dc_ledger_account_find(l, uid, job_id))) {
        *out = acct;
        return 0;
    }
    if (now - l->swept_ns >= 1000000000u) dc_ledger_expire(l, now);
    if (l->max_jobs_per_uid && (n = dc_ledger_make_room(l, uid)) >= l->max_jobs_per_uid)
        return dc_err_set(err, DC_ENOSPACE, "ledger.max_jobs_per_uid",
                          "uid %u already has %zu jobs in the privacy ledger, the most "
                          "ledger.max_jobs_per_uid allows; a job's account goes once its "
                          "sessions have ended (ledger.job_idle_s after its last step)",
                          uid, n);
    if (dc_ledger_persistent(l) && (rc = load_account(l, uid, job_id, &acct, err)) != 0) return rc;
    if (!acct && !(acct = dc_ledger_account_new(l, uid, job_id)))
        return dc_err_set(err, DC_ENOSPACE, "ledger", "out of memory for the ledger");
    *out = acct;
    return 0;
}

dc_ledger_account *dc_ledger_account_get(dc_ledger *l, uint32_t uid, const char *job_id) {
    dc_ledger_account *acct;
    return dc_ledger_account_open(l, uid, job_id, &acct, NULL) == 0 ? acct : NULL;
}

static int ends_with(const char *s, const char *suffix) {
    size_t a = strlen(s), b = strlen(suffix);
    return a >= b && strcmp(s + a - b, suffix) == 0;
}

int dc_ledger_open(dc_ledger *l, const char *dir, double default_delta, dc_err *err) {
    char path[600];
    DIR *d;
    struct dirent *e;
    int rc = 0;

    memset(l, 0, sizeof *l);
    l->lock_fd = -1;
    l->default_delta = default_delta;
    if (!dir || !dir[0]) return 0;
    if (strlen(dir) >= sizeof l->dir - 80)
        return dc_err_set(err, DC_EINVAL, "ledger", "ledger directory path too long");
    snprintf(l->dir, sizeof l->dir, "%s", dir);
    if (mkdir(dir, 0750) != 0 && errno != EEXIST)
        return dc_err_set(err, DC_EUNAVAIL, "ledger", "cannot create %s: %s", dir, strerror(errno));
    snprintf(path, sizeof path, "%s/.lock", dir);
    l->lock_fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0640);
    if (l->lock_fd < 0)
        return dc_err_set(err, DC_EUNAVAIL, "ledger", "cannot open %s: %s", path, strerror(errno));
    if (flock(l->lock_fd, LOCK_EX | LOCK_NB) != 0) {
        close(l->lock_fd);
        l->lock_fd = -1;
        return dc_err_set(err, DC_EUNAVAIL, "ledger", "%s is in use by another dpclipd", dir);
    }
    if (!(d = opendir(dir))) {
        rc = dc_err_set(err, DC_EUNAVAIL, "ledger", "cannot read %s: %s", dir, strerror(errno));
        goto fail;
    }
    while ((e = readdir(d))) {
        dc_ledger_account *acct;
        snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
        /* A temp file is a write that never got renamed: the spend it held
         * was not acknowledged to anyone, and the previous file stands. */
        if (ends_with(e->d_name, ".ledger.tmp")) unlink(path);
        else if (ends_with(e->d_name, ".ledger") && (rc = load_path(l, path, &acct, err))) break;
    }
    closedir(d);
    if (rc) goto fail;
    return 0;
fail:
    dc_ledger_close(l);
    return rc;
}

void dc_ledger_close(dc_ledger *l) {
    dc_ledger_drop_accounts(l);
    l->n_accounts = 0;
    if (l->lock_fd >= 0) close(l->lock_fd);
    l->lock_fd = -1;
}
