/* dpclipd's command line: the file it names (config_file.c) read on top of
 * the defaults, then every flag and --set over it (config.c's table), so
 * that flags override the file whatever their order. */
#include "config.h"

#include <getopt.h>
#include <limits.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

enum { O_CONFIG = 1000, O_CHECK, O_SET, O_NOGPU, O_READY, O_SEED, O_VERSION, O_HELP };

void dc_config_usage(FILE *f) {
    fprintf(f,
            "usage: dpclipd [options]\n"
            "  --config PATH          config file (default %s if it exists)\n"
            "  --check-config         validate the configuration, print it and exit\n"
            "  --set SECTION.KEY=VALUE  any setting of the config file\n",
            dc_config_default_path());
    dc_config_usage_keys(f);
    fprintf(f, "  --no-gpu               do not use GPUs even when present (daemon.gpu)\n"
               "  --ready-fd FD          write READY to FD once listening, then close it\n"
               "  --insecure-fixed-seed SEED\n"
               "                         TESTS ONLY: seed the noise generator with SEED instead\n"
               "                         of getrandom(); the noise is then predictable and the\n"
               "                         training is NOT private\n"
               "  --version, --help\n");
}

static int set_assignment(dc_config *c, const char *arg, dc_err *err) {
    char buf[512], *dot, *eq;
    snprintf(buf, sizeof buf, "%s", arg);
    eq = strchr(buf, '=');
    dot = strchr(buf, '.');
    if (!eq || !dot || dot > eq)
        return dc_err_set(err, DC_EINVAL, "set", "--set %s: expected SECTION.KEY=VALUE", arg);
    *dot = *eq = '\0';
    return dc_config_set(c, buf, dot + 1, eq + 1, "--set", err);
}

int dc_config_from_args(dc_config *c, int argc, char **argv, dc_config_action *action,
                        dc_err *err) {
    struct option opts[DC_CONFIG_KEYS_MAX + 10];
    const char *path = NULL;
    int n = 0, ch, idx, rc;
    unsigned long long v;

    for (size_t i = 0; i < dc_config_n_keys() && n < DC_CONFIG_KEYS_MAX; i++)
        if (dc_config_key_flag(i))
            opts[n++] = (struct option){dc_config_key_flag(i), required_argument, NULL, 0};
    opts[n++] = (struct option){"config", required_argument, NULL, O_CONFIG};
    opts[n++] = (struct option){"check-config", no_argument, NULL, O_CHECK};
    opts[n++] = (struct option){"set", required_argument, NULL, O_SET};
    opts[n++] = (struct option){"no-gpu", no_argument, NULL, O_NOGPU};
    opts[n++] = (struct option){"ready-fd", required_argument, NULL, O_READY};
    opts[n++] = (struct option){"insecure-fixed-seed", required_argument, NULL, O_SEED};
    opts[n++] = (struct option){"version", no_argument, NULL, O_VERSION};
    opts[n++] = (struct option){"help", no_argument, NULL, O_HELP};
    opts[n] = (struct option){NULL, 0, NULL, 0};

    *action = DC_CONFIG_RUN;
    dc_config_defaults(c);
    /* Pass 1: where the file is, and the actions; pass 2: the settings, so
     * that flags override the file whatever their order. */
    opterr = 0;
    optind = 0;
    while ((ch = getopt_long(argc, argv, "", opts, &idx)) != -1) {
        if (ch == O_CONFIG) path = optarg;
        else if (ch == O_CHECK) *action = DC_CONFIG_CHECK;
        else if (ch == O_HELP) *action = DC_CONFIG_HELP;
        else if (ch == O_VERSION && *action != DC_CONFIG_HELP) *action = DC_CONFIG_VERSION;
        else if (ch == '?' || ch == ':')
            return dc_err_set(err, DC_EINVAL, "", "unknown option or missing value: '%s'",
                              argv[optind - 1]);
    }
    if (optind < argc)
        return dc_err_set(err, DC_EINVAL, "", "unexpected argument '%s'", argv[optind]);
    if (*action == DC_CONFIG_HELP || *action == DC_CONFIG_VERSION) return 0;

    if (path) {
        if ((rc = dc_config_load_file(c, path, err))) return rc;
    } else if (access(dc_config_default_path(), F_OK) == 0) {
        if ((rc = dc_config_load_file(c, dc_config_default_path(), err))) return rc;
    }

    optind = 0;
    while ((ch = getopt_long(argc, argv, "", opts, &idx)) != -1) {
        switch (ch) {
        case 0:
            if ((rc = dc_config_set_flag(c, opts[idx].name, optarg, err))) return rc;
            break;
        case O_SET:
            if ((rc = set_assignment(c, optarg, err))) return rc;
            break;
        case O_NOGPU: c->gpu = false; break;
        case O_READY:
            if (dc_config_parse_ull(optarg, 10, &v) || v > INT_MAX)
                return dc_err_set(err, DC_EINVAL, "ready-fd",
                                  "--ready-fd: '%s' is not a file "
                                  "descriptor",
                                  optarg);
            c->ready_fd = (int)v;
            break;
        case O_SEED:
            if (dc_config_parse_ull(optarg, 0, &v))
                return dc_err_set(err, DC_EINVAL, "insecure-fixed-seed",
                                  "--insecure-fixed-seed: '%s' is not a number", optarg);
            c->fixed_seed = true;
            c->seed = v;
            break;
        default: break;
        }
    }
    return dc_config_validate(c, err);
}
