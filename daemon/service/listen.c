#include "listen.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

/* A socket file left by a crashed daemon is stale and may be replaced; one a
 * live daemon answers on must not be stolen. */
static int socket_in_use(const struct sockaddr_un *addr) {
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    int live;
    if (fd < 0) return 0;
    live = connect(fd, (const struct sockaddr *)addr, sizeof *addr) == 0;
    close(fd);
    return live;
}

int dc_listen_unix(const char *path, unsigned mode, int gid, dc_err *err) {
    struct sockaddr_un addr;
    int fd;

    memset(&addr, 0, sizeof addr);
    addr.sun_family = AF_UNIX;
    if (strlen(path) >= sizeof addr.sun_path) {
        dc_err_set(err, DC_EINVAL, "socket", "%s: socket path longer than %zu bytes", path,
                   sizeof addr.sun_path - 1);
        return -1;
    }
    snprintf(addr.sun_path, sizeof addr.sun_path, "%s", path);

    fd = socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) {
        dc_err_set(err, DC_EINTERNAL, "socket", "socket: %s", strerror(errno));
        return -1;
    }
    if (bind(fd, (struct sockaddr *)&addr, sizeof addr) != 0) {
        struct stat st;
        if (errno != EADDRINUSE) goto fail_bind;
        if (socket_in_use(&addr)) {
            close(fd);
            dc_err_set(err, DC_EUNAVAIL, "socket",
                       "%s: another dpclipd is already serving this socket", path);
            return -1;
        }
        /* Replace a stale socket, but never some other kind of file. */
        if (lstat(path, &st) != 0 || !S_ISSOCK(st.st_mode)) {
            errno = EEXIST;
            goto fail_bind;
        }
        unlink(path);
        if (bind(fd, (struct sockaddr *)&addr, sizeof addr) != 0) goto fail_bind;
    }
    /* Group members (the trainers' group) may connect; nobody else. */
    if (chmod(path, mode) != 0) {
        dc_err_set(err, DC_EINTERNAL, "socket", "chmod %s: %s", path, strerror(errno));
        goto fail_unlink;
    }
    if (gid >= 0 && chown(path, (uid_t)-1, (gid_t)gid) != 0) {
        dc_err_set(err, DC_EPERM, "socket", "chown %s to group %d: %s", path, gid, strerror(errno));
        goto fail_unlink;
    }
    if (listen(fd, 128) != 0) {
        dc_err_set(err, DC_EINTERNAL, "socket", "listen: %s", strerror(errno));
        goto fail_unlink;
    }
    return fd;

fail_bind:
    dc_err_set(err, DC_EUNAVAIL, "socket", "bind %s: %s", path, strerror(errno));
    close(fd);
    return -1;
fail_unlink:
    unlink(path);
    close(fd);
    return -1;
}

int dc_listen_tcp_local(unsigned port, dc_err *err) {
    struct sockaddr_in addr;
    int fd, one = 1;
    memset(&addr, 0, sizeof addr);
    addr.sin_family = AF_INET;
    addr.sin_port = htons((uint16_t)port);
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) {
        dc_err_set(err, DC_EINTERNAL, "tcp_port", "socket: %s", strerror(errno));
        return -1;
    }
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (bind(fd, (struct sockaddr *)&addr, sizeof addr) != 0 || listen(fd, 64) != 0) {
        dc_err_set(err, DC_EUNAVAIL, "tcp_port", "127.0.0.1:%u: %s", port, strerror(errno));
        close(fd);
        return -1;
    }
    return fd;
}
