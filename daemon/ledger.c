#include "ledger.h"

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

#define LEDGER_MAGIC "dpclip-ledger 1"

/* --- RDP curves -------------------------------------------------------------- */

/* The per-step curve of (q, sigma): from the job's history, the cache, or
 * computed (and cached). */
static const double *curve(dc_ledger *l, const dc_ledger_job *j, double q, double sigma) {
    dc_ledger_entry *e;
    if (j)
        for (size_t i = 0; i < j->n_hist; i++)
            if (j->hist[i].q == q && j->hist[i].sigma == sigma) return j->hist[i].rdp;
    for (size_t i = 0; i < l->n_cache; i++)
        if (l->cache[i].q == q && l->cache[i].sigma == sigma) return l->cache[i].rdp;
    e = &l->cache[l->next_cache];
    l->next_cache = (l->next_cache + 1) % (sizeof l->cache / sizeof l->cache[0]);
    if (l->n_cache < sizeof l->cache / sizeof l->cache[0]) l->n_cache++;
    e->q = q;
    e->sigma = sigma;
    e->steps = 0;
    dc_rdp_steps(q, sigma, dc_rdp_default_orders(), DC_RDP_N_ORDERS, e->rdp);
    return e->rdp;
}

static void recompute(dc_ledger_job *j) {
    const double *orders = dc_rdp_default_orders();
    j->steps = 0;
    for (size_t k = 0; k < DC_RDP_N_ORDERS; k++) j->rdp[k] = 0.0;
    for (size_t i = 0; i < j->n_hist; i++) {
        const dc_ledger_entry *e = &j->hist[i];
        j->steps += e->steps;
        for (size_t k = 0; k < DC_RDP_N_ORDERS; k++) j->rdp[k] += (double)e->steps * e->rdp[k];
    }
    if (j->steps == 0) {
        /* As Opacus: an empty history has spent nothing. */
        j->eps = 0.0;
        j->best_order = NAN;
    } else {
        j->eps = dc_rdp_epsilon(orders, j->rdp, DC_RDP_N_ORDERS, j->delta, &j->best_order);
    }
}

double dc_ledger_eps_at(const dc_ledger_job *j, double delta, double *best_order) {
    if (j->steps == 0) {
        if (best_order) *best_order = NAN;
        return 0.0;
    }
    return dc_rdp_epsilon(dc_rdp_default_orders(), j->rdp, DC_RDP_N_ORDERS, delta, best_order);
}

double dc_ledger_eps_after(dc_ledger *l, const dc_ledger_job *j, double q, double sigma,
                           double delta) {
    const double *c = curve(l, j, q, sigma);
    double tmp[DC_RDP_N_ORDERS];
    for (size_t k = 0; k < DC_RDP_N_ORDERS; k++) tmp[k] = j->rdp[k] + c[k];
    return dc_rdp_epsilon(dc_rdp_default_orders(), tmp, DC_RDP_N_ORDERS, delta, NULL);
}

/* --- jobs ------------------------------------------------------------------- */

dc_ledger_job *dc_ledger_job_find(dc_ledger *l, uint32_t uid, const char *job) {
    for (dc_ledger_job *j = l->jobs; j; j = j->next)
        if (j->uid == uid && strcmp(j->job, job) == 0) return j;
    return NULL;
}

static dc_ledger_job *job_new(dc_ledger *l, uint32_t uid, const char *job) {
    dc_ledger_job *j = calloc(1, sizeof *j);
    if (!j) return NULL;
    j->uid = uid;
    snprintf(j->job, sizeof j->job, "%s", job);
    j->delta = l->default_delta;
    j->best_order = NAN;
    j->next = l->jobs;
    l->jobs = j;
    l->n_jobs++;
    return j;
}

dc_ledger_job *dc_ledger_job_get(dc_ledger *l, uint32_t uid, const char *job) {
    dc_ledger_job *j = dc_ledger_job_find(l, uid, job);
    return j ? j : job_new(l, uid, job);
}

static dc_ledger_entry *find_entry(dc_ledger_job *j, double q, double sigma) {
    for (size_t i = 0; i < j->n_hist; i++)
        if (j->hist[i].q == q && j->hist[i].sigma == sigma) return &j->hist[i];
    return NULL;
}

/* Appends an entry with a computed curve and zero steps. */
static dc_ledger_entry *add_entry(dc_ledger *l, dc_ledger_job *j, double q, double sigma) {
    dc_ledger_entry *e;
    if (j->n_hist == j->cap_hist) {
        size_t cap = j->cap_hist ? 2 * j->cap_hist : 2;
        dc_ledger_entry *h = realloc(j->hist, cap * sizeof *h);
        if (!h) return NULL;
        j->hist = h;
        j->cap_hist = cap;
    }
    e = &j->hist[j->n_hist];
    memcpy(e->rdp, curve(l, j, q, sigma), sizeof e->rdp);
    e->q = q;
    e->sigma = sigma;
    e->steps = 0;
    j->n_hist++;
    return e;
}

int dc_ledger_spend(dc_ledger *l, dc_ledger_job *j, double q, double sigma, dc_err *err) {
    dc_ledger_entry *e = find_entry(j, q, sigma);
    if (!e && !(e = add_entry(l, j, q, sigma)))
        return dc_err_set(err, DC_ENOSPACE, "ledger", "out of memory for the ledger");
    e->steps++;
    recompute(j);
    j->gen++;
    return 0;
}

void dc_ledger_refund(dc_ledger_job *j, double q, double sigma) {
    dc_ledger_entry *e = find_entry(j, q, sigma);
    if (!e || e->steps == 0) return;
    if (--e->steps == 0) {
        size_t i = (size_t)(e - j->hist);
        memmove(&j->hist[i], &j->hist[i + 1], (j->n_hist - i - 1) * sizeof *e);
        j->n_hist--;
    }
    recompute(j);
    j->gen++;
}

void dc_ledger_job_terms(dc_ledger_job *j, double delta, double budget_eps) {
    bool changed = false;
    if (delta > 0 && delta != j->delta) {
        j->delta = delta;
        changed = true;
    }
    if (budget_eps > 0 && (j->budget_eps == 0 || budget_eps < j->budget_eps)) {
        j->budget_eps = budget_eps;
        changed = true;
    }
    if (changed) {
        recompute(j);
        j->gen++;
    }
}

/* --- files ------------------------------------------------------------------ */

void dc_ledger_job_path(const dc_ledger *l, const dc_ledger_job *j, char *out, size_t n) {
    char hex[2 * DC_LEDGER_JOB_MAX + 1];
    size_t k = 0;
    for (const unsigned char *p = (const unsigned char *)j->job; *p; p++, k += 2)
        snprintf(hex + k, 3, "%02x", *p);
    hex[k] = '\0';
    snprintf(out, n, "%s/%u-%s.ledger", l->dir, j->uid, hex);
}

int dc_ledger_serialize(const dc_ledger_job *j, char **out, size_t *len) {
    char *buf = NULL;
    size_t n = 0;
    FILE *f = open_memstream(&buf, &n);
    if (!f) return DC_ENOSPACE;
    fprintf(f, LEDGER_MAGIC "\nuid %u\njob ", j->uid);
    for (const unsigned char *p = (const unsigned char *)j->job; *p; p++) fprintf(f, "%02x", *p);
    fprintf(f, "\ndelta %.17g\nbudget_epsilon %.17g\nsteps %llu\n", j->delta, j->budget_eps,
            (unsigned long long)j->steps);
    for (size_t i = 0; i < j->n_hist; i++)
        fprintf(f, "entry %.17g %.17g %llu\n", j->hist[i].q, j->hist[i].sigma,
                (unsigned long long)j->hist[i].steps);
    /* For people reading the file; recomputed from the entries on load. */
    fprintf(f, "epsilon %.17g\nend\n", j->eps);
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
        return dc_err_set(err, DC_EUNAVAIL, "ledger", "cannot create %s: %s", tmp,
                          strerror(errno));
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

int dc_ledger_save(dc_ledger *l, dc_ledger_job *j, dc_err *err) {
    char path[512], *buf;
    size_t len;
    uint64_t gen = j->gen;
    int rc;
    if (!dc_ledger_persistent(l)) {
        j->saved_gen = gen;
        return 0;
    }
    if (dc_ledger_serialize(j, &buf, &len))
        return dc_err_set(err, DC_ENOSPACE, "ledger", "out of memory");
    dc_ledger_job_path(l, j, path, sizeof path);
    rc = dc_ledger_write_file(path, buf, len, err);
    free(buf);
    if (rc == 0) j->saved_gen = gen;
    return rc;
}

/* --- loading ---------------------------------------------------------------- */

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

static int load_job(dc_ledger *l, const char *path, dc_err *err) {
    FILE *f = fopen(path, "re");
    char line[512], job[DC_LEDGER_JOB_MAX] = "";
    unsigned long long steps = 0, sum = 0, cnt;
    unsigned uid = 0;
    double delta = l->default_delta, budget = 0, q, sigma;
    bool have_uid = false, have_job = false, ended = false;
    int lineno = 0;
    dc_ledger_job *j = NULL;
    const char *why = "unreadable";
    struct { double q, sigma; unsigned long long n; } *ent = NULL;
    size_t n_ent = 0;

    if (!f) return dc_err_set(err, DC_EINTERNAL, "ledger", "%s: %s", path, strerror(errno));

    if (!fgets(line, sizeof line, f) || strcmp(line, LEDGER_MAGIC "\n") != 0) {
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
        val[0] = '\0';
        if (sscanf(line, "%31s %255s", key, val) < 1) continue;
        if (strcmp(key, "uid") == 0 && sscanf(val, "%u", &uid) == 1) have_uid = true;
        else if (strcmp(key, "job") == 0 && unhex(val, job, sizeof job) == 0) have_job = true;
        else if (strcmp(key, "delta") == 0 && sscanf(val, "%lf", &delta) == 1) continue;
        else if (strcmp(key, "budget_epsilon") == 0 && sscanf(val, "%lf", &budget) == 1) continue;
        else if (strcmp(key, "steps") == 0 && sscanf(val, "%llu", &steps) == 1) continue;
        else if (strcmp(key, "epsilon") == 0) continue;
        else {
            why = "unknown or malformed line";
            goto bad;
        }
    }
    if (!ended || !have_uid || !have_job || sum != steps || !(delta > 0 && delta < 1)) {
        why = !ended ? "truncated (no 'end' line)" : sum != steps ? "entries do not add up to "
              "'steps'" : "missing uid, job or delta";
        lineno = 0;
        goto bad;
    }
    fclose(f);
    f = NULL;
    if (dc_ledger_job_find(l, uid, job)) {
        free(ent);
        return dc_err_set(err, DC_EINTERNAL, "ledger", "%s: a second file for uid %u job '%s'",
                          path, uid, job);
    }
    if (!(j = job_new(l, uid, job))) goto oom;
    j->delta = delta;
    j->budget_eps = budget;
    for (size_t i = 0; i < n_ent; i++) {
        dc_ledger_entry *e = find_entry(j, ent[i].q, ent[i].sigma);
        if (!e && !(e = add_entry(l, j, ent[i].q, ent[i].sigma))) goto oom;
        e->steps += ent[i].n;
    }
    recompute(j);
    free(ent);
    return 0;
oom:
    free(ent);
    return dc_err_set(err, DC_ENOSPACE, "ledger", "out of memory loading %s", path);
bad:
    if (f) fclose(f);
    free(ent);
    if (lineno)
        return dc_err_set(err, DC_EINTERNAL, "ledger", "%s:%d: %s; refusing to start with a "
                          "ledger that cannot be read (move the file away to reset that job)",
                          path, lineno, why);
    return dc_err_set(err, DC_EINTERNAL, "ledger", "%s: %s; refusing to start with a ledger "
                      "that cannot be read (move the file away to reset that job)", path, why);
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
        return dc_err_set(err, DC_EUNAVAIL, "ledger", "cannot create %s: %s", dir,
                          strerror(errno));
    snprintf(path, sizeof path, "%s/.lock", dir);
    l->lock_fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0640);
    if (l->lock_fd < 0)
        return dc_err_set(err, DC_EUNAVAIL, "ledger", "cannot open %s: %s", path,
                          strerror(errno));
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
        snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
        /* A temp file is a write that never got renamed: the spend it held
         * was not acknowledged to anyone, and the previous file stands. */
        if (ends_with(e->d_name, ".ledger.tmp")) unlink(path);
        else if (ends_with(e->d_name, ".ledger") && (rc = load_job(l, path, err))) break;
    }
    closedir(d);
    if (rc) goto fail;
    return 0;
fail:
    dc_ledger_close(l);
    return rc;
}

void dc_ledger_close(dc_ledger *l) {
    dc_ledger_job *j = l->jobs;
    while (j) {
        dc_ledger_job *next = j->next;
        free(j->hist);
        free(j);
        j = next;
    }
    l->jobs = NULL;
    l->n_jobs = 0;
    if (l->lock_fd >= 0) close(l->lock_fd);
    l->lock_fd = -1;
}
