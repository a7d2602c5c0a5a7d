/* SPDX-License-Identifier: Apache-2.0 */
/* libvramd internals: whom a client trusts with its fds (auth.c; docs/protocol.md "Socket paths"). */
#ifndef VRAMD_AUTH_H
#define VRAMD_AUTH_H

#include <sys/types.h>

#include "base.h"

/* Root, this process's effective uid and the daemon user ($VRAMD_DAEMON_USER, default "vramd"). */
struct trust {
    uid_t me;
    const char *user;
    bool looked_up, has_daemon;
    uid_t daemon;
};

void vramd__trust_init(struct trust *t);
/* Before connect: every directory and link on `path` belongs to a trusted uid and only trusted uids write the
 * socket's directory.  0, -EPERM (the message names the path and the owner), or the -errno of a component. */
int vramd__check_socket_path(const char *path, struct trust *t, struct vramd_error *err);
/* After connect, before anything is sent: the listener's uid (SO_PEERCRED) is trusted; else -EPERM. */
int vramd__check_peer(int fd, const char *path, struct trust *t, struct vramd_error *err);

#endif
