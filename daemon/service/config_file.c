/* dpclipd's config file: INI through inih (libinih-dev), each line handed
 * to dc_config_set with its file and line for messages; a setting may
 * appear once. Without inih only an empty file (--config /dev/null) is
 * read. */
#include "config.h"

#include <errno.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifdef DPCLIP_HAVE_INIH
#include <ini.h>

typedef struct ini_ctx {
    dc_config *c;
    const char *name;
    dc_err *err;
    int err_line;     /* first error our handler found; 0 = none */
    int line;         /* lines handed to inih so far */
    const char *text; /* string mode: what is left to read */
    FILE *f;          /* file mode */
    bool *seen;       /* per setting (dc_config_key_index): set once already */
} ini_ctx;

static int on_ini(void *user, const char *section, const char *name, const char *value) {
    ini_ctx *x = user;
    char where[DC_CONFIG_PATH_MAX + 16];
    int k;

    if (x->err_line) return 0; /* report the first problem only */
    snprintf(where, sizeof where, "%s:%d", x->name, x->line);
    k = dc_config_key_index(section, name);
    if (k >= 0 && x->seen[k]) {
        dc_err_set(x->err, DC_EINVAL, name, "%s: %s.%s is set twice", where, section, name);
        x->err_line = x->line;
        return 0;
    }
    if (dc_config_set(x->c, section, name, value, where, x->err) != 0) {
        x->err_line = x->line;
        return 0;
    }
    x->seen[k] = true; /* dc_config_set knew it: k >= 0 */
    return 1;
}

/* inih's reader callbacks (fgets-like): they count lines so that errors our
 * handler finds carry the right line number. */
static char *read_file_line(char *str, int num, void *stream) {
    ini_ctx *x = stream;
    char *r = fgets(str, num, x->f);
    if (r) x->line++;
    return r;
}

static char *read_string_line(char *str, int num, void *stream) {
    ini_ctx *x = stream;
    size_t n = 0;
    if (!*x->text || num < 2) return NULL;
    while (x->text[n] && x->text[n] != '\n' && n < (size_t)num - 2) n++;
    if (x->text[n] == '\n') n++;
    memcpy(str, x->text, n);
    str[n] = '\0';
    x->text += n;
    x->line++;
    return str;
}

static int parse_ini(ini_ctx *x, ini_reader reader) {
    int rc;
    if (!(x->seen = calloc(dc_config_n_keys(), sizeof *x->seen)))
        return dc_err_set(x->err, DC_ENOSPACE, "", "%s: out of memory reading it", x->name);
    rc = ini_parse_stream(reader, x, on_ini, x);
    free(x->seen);
    x->seen = NULL;
    if (rc == 0 && !x->err_line) return 0;
    if (rc > 0 && (!x->err_line || rc < x->err_line))
        return dc_err_set(x->err, DC_EINVAL, "",
                          "%s:%d: syntax error: expected '[section]' or "
                          "'key = value'",
                          x->name, rc);
    if (rc < 0 && !x->err_line)
        return dc_err_set(x->err, DC_ENOSPACE, "", "%s: out of memory reading it", x->name);
    return x->err ? (int)x->err->code : DC_EINVAL;
}

int dc_config_load_file(dc_config *c, const char *path, dc_err *err) {
    ini_ctx x;
    int rc;
    memset(&x, 0, sizeof x);
    x.c = c;
    x.name = path;
    x.err = err;
    if (!(x.f = fopen(path, "re")))
        return dc_err_set(err, DC_EINVAL, "", "%s: cannot open the config file: %s", path,
                          strerror(errno));
    rc = parse_ini(&x, read_file_line);
    fclose(x.f);
    if (rc == 0) snprintf(c->config_path, sizeof c->config_path, "%s", path);
    return rc;
}

int dc_config_load_string(dc_config *c, const char *text, const char *name, dc_err *err) {
    ini_ctx x;
    memset(&x, 0, sizeof x);
    x.c = c;
    x.name = name;
    x.err = err;
    x.text = text;
    return parse_ini(&x, read_string_line);
}

#else /* !DPCLIP_HAVE_INIH */
int dc_config_load_file(dc_config *c, const char *path, dc_err *err) {
    /* An empty file (/dev/null: "no config file") sets nothing: accept it. */
    FILE *f = fopen(path, "re");
    int ch = f ? fgetc(f) : 0;
    (void)c;
    if (!f)
        return dc_err_set(err, DC_EINVAL, "", "%s: cannot open the config file: %s", path,
                          strerror(errno));
    fclose(f);
    if (ch == EOF) return 0;
    return dc_err_set(err, DC_EUNIMPL, "",
                      "%s: this dpclipd was built without inih "
                      "(libinih-dev) and cannot read config files; use flags",
                      path);
}

int dc_config_load_string(dc_config *c, const char *text, const char *name, dc_err *err) {
    (void)c;
    (void)text;
    return dc_err_set(err, DC_EUNIMPL, "", "%s: built without inih", name);
}
#endif
