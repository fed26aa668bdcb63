/* Listening sockets for the daemon's endpoints (the trainers' socket and the
 * status socket), created by the daemon itself when systemd did not pass
 * them. */
#ifndef DC_LISTEN_H
#define DC_LISTEN_H

#include "dc_err.h"

/* Binds a non-blocking Unix stream socket at path and listens. A socket file
 * left by a dead daemon is replaced; one a live process answers on is not
 * stolen (DC_EUNAVAIL), and any other kind of file is left alone. Sets the
 * file's mode, and its group when gid >= 0. Returns the fd, or -1 with err
 * set. */
int dc_listen_unix(const char *path, unsigned mode, int gid, dc_err *err);
/* A non-blocking TCP socket listening on 127.0.0.1:port, or -1 (err). */
int dc_listen_tcp_local(unsigned port, dc_err *err);

#endif
