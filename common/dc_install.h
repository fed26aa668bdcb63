/* Where the installed dpclipd.conf is, for dpclipd and dpclipctl.
 *
 * `cmake --install build --prefix X` installs to a prefix chosen after the
 * build was configured, and puts the config where GNUInstallDirs puts X's
 * sysconfdir (cmake/install_paths.cmake.in): /etc for the prefixes / and
 * /usr, /etc/opt/NAME for /opt/NAME, else X/etc. A program installed as
 * X/<its configured dir>/name (sbin for dpclipd, bin for dpclipctl) finds
 * its prefix from its own path and applies the same rule, so it reads the
 * config of the install it belongs to. Anywhere else (a build tree), or with
 * absolute install dirs, it is the configured path. The build defines
 * DPCLIP_CONFIG_PATH, DPCLIP_SYSCONFDIR, DPCLIP_SBINDIR and DPCLIP_BINDIR. */
#ifndef DC_INSTALL_H
#define DC_INSTALL_H

#include <stdio.h>
#include <string.h>
#include <unistd.h>

#ifndef DPCLIP_CONFIG_PATH
#define DPCLIP_CONFIG_PATH "/etc/dpclip/dpclipd.conf"
#endif
#ifndef DPCLIP_SYSCONFDIR
#define DPCLIP_SYSCONFDIR "/etc"
#endif
#ifndef DPCLIP_SBINDIR
#define DPCLIP_SBINDIR "sbin"
#endif
#ifndef DPCLIP_BINDIR
#define DPCLIP_BINDIR "bin"
#endif

/* The config path for a program installed in `dir` (DPCLIP_SBINDIR or
 * DPCLIP_BINDIR) into out[n]. */
static inline void dc_install_config_path(const char *dir, char *out, size_t n) {
    char exe[4096], *slash;
    size_t len, dl = strlen(dir);
    ssize_t got = readlink("/proc/self/exe", exe, sizeof exe - 1);

    snprintf(out, n, "%s", DPCLIP_CONFIG_PATH);
    if (got <= 0 || dir[0] == '/' || DPCLIP_SYSCONFDIR[0] == '/') return;
    exe[got] = '\0';
    if (!(slash = strrchr(exe, '/'))) return;
    *slash = '\0'; /* the program's directory */
    len = strlen(exe);
    if (len <= dl || exe[len - dl - 1] != '/' || strcmp(exe + len - dl, dir) != 0) return;
    exe[len - dl - 1] = '\0'; /* its prefix ("" for /) */
    if (!exe[0] || strcmp(exe, "/usr") == 0)
        snprintf(out, n, "/%s/dpclip/dpclipd.conf", DPCLIP_SYSCONFDIR);
    else if (strncmp(exe, "/opt/", 5) == 0)
        snprintf(out, n, "/%s%s/dpclip/dpclipd.conf", DPCLIP_SYSCONFDIR, exe);
    else snprintf(out, n, "%s/%s/dpclip/dpclipd.conf", exe, DPCLIP_SYSCONFDIR);
}

#endif
