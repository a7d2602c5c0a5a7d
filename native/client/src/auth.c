/* SPDX-License-Identifier: Apache-2.0 */
/* libvramd: the socket path and the daemon's authentication (docs/protocol.md "Socket paths"). */
#define _GNU_SOURCE
#include <errno.h>
#include <limits.h>
#include <pwd.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include "auth.h"


static bool is_root(void)
{
    return getuid() == 0 || geteuid() == 0;
}

int vramd_socket_path(char *buf, size_t size)
{
    char mine[PATH_MAX];
    /* secure_getenv: in a setuid, setgid or file-capability program (AT_SECURE) its caller's environment
       must not choose where the fds go; such a program gets the system socket, or names its own */
    const char *env = secure_getenv("VRAMD_SOCKET");
    const char *xdg = secure_getenv("XDG_RUNTIME_DIR");
    const char *path = VRAMD_SYSTEM_SOCKET; /* also root's when nothing else applies: never /tmp */
    struct stat st;
    int n;

    if (env && *env) {
        path = env;
    } else if (lstat(VRAMD_SYSTEM_SOCKET, &st) != 0 && ((xdg && *xdg) || !is_root())) {
        if (xdg && *xdg)
            n = snprintf(mine, sizeof mine, "%s/vramd/vramd.sock", xdg);
        else
            n = snprintf(mine, sizeof mine, "/tmp/vramd-%u/vramd.sock", (unsigned)getuid());
        if (n < 0 || (size_t)n >= sizeof mine)
            return -ENAMETOOLONG;
        path = mine;
    }
    size_t len = strlen(path);
    if (!buf || len >= size)
        return -ENAMETOOLONG;
    memcpy(buf, path, len + 1);
    return (int)len;
}

void vramd__trust_init(struct trust *t)
{
    const char *u = secure_getenv("VRAMD_DAEMON_USER"); /* AT_SECURE: the caller's environment widens no trust */
    memset(t, 0, sizeof *t);
    t->me = geteuid();
    t->user = u && *u ? u : "vramd";
}

static bool trusted(struct trust *t, uid_t uid)
{
    if (uid == 0 || uid == t->me)
        return true;
    if (!t->looked_up) {
        t->looked_up = true;
        const char *u = t->user;
        if (strspn(u, "0123456789") == strlen(u) && strlen(u) < 11) {
            unsigned long v = strtoul(u, NULL, 10);
            t->has_daemon = v <= UINT32_MAX && (uid_t)v != (uid_t)-1;
            t->daemon = (uid_t)v;
        } else {
            /* /etc/passwd itself, never NSS (getpwnam): the library may run where /etc is another root's (a task
               CRIU restores, in a container's mount namespace, still privileged), whose nsswitch.conf could make
               a lookup load and run that root's code */
            struct passwd pw, *res = NULL;
            char pwbuf[4096];
            FILE *f = fopen("/etc/passwd", "re");
            while (f && fgetpwent_r(f, &pw, pwbuf, sizeof pwbuf, &res) == 0) {
                if (strcmp(res->pw_name, u) == 0) {
                    t->has_daemon = true;
                    t->daemon = res->pw_uid;
                    break;
                }
            }
            if (f)
                fclose(f);
        }
    }
    return t->has_daemon && uid == t->daemon;
}

static int untrusted(struct vramd_error *err, const char *path, const char *what, const struct stat *st,
                     const char *why, struct trust *t)
{
    char du[48];
    if (t->has_daemon)
        snprintf(du, sizeof du, "%u", (unsigned)t->daemon);
    else
        snprintf(du, sizeof du, "none");
    /* the uid early: a long path must not truncate it away (256 bytes) */
    return vramd__fail(err, -EPERM, VRAMD_CODE_LOCAL, "untrusted vramd socket %s: uid %u owns %s (mode %04o; %s); "
                       "trusted: uid 0, %u, daemon user %s=%s", path, (unsigned)st->st_uid, what,
                       (unsigned)(st->st_mode & 07777), why, (unsigned)t->me, t->user, du);
}

/* A directory on the way: trusted owner, writable by nobody else; *ancestor_only: a root-owned sticky one. */
static int check_dir(const char *path, const char *dir, const struct stat *st, struct trust *t, bool *ancestor_only,
                     struct vramd_error *err)
{
    *ancestor_only = false;
    if (!S_ISDIR(st->st_mode))
        return vramd__fail(err, -ENOTDIR, VRAMD_CODE_LOCAL, "cannot connect to vramd at %s: %s is not a directory",
                           path, dir);
    if (!trusted(t, st->st_uid))
        return untrusted(err, path, dir, st, "not a trusted uid", t);
    if (st->st_mode & (S_IWGRP | S_IWOTH)) {
        if (st->st_uid == 0 && (st->st_mode & S_ISVTX)) {
            *ancestor_only = true;
            return 0;
        }
        return untrusted(err, path, dir, st, "writable by others", t);
    }
    return 0;
}

static int walk_failed(struct vramd_error *err, const char *path, int e)
{
    return vramd__fail(err, -e, VRAMD_CODE_LOCAL, "cannot connect to vramd at %s: %s", path,
                       strerrordesc_np(e) ? strerrordesc_np(e) : "error");
}

/*
 * Before connect: walk `path` a component at a time with lstat, resolving symbolic links here, and check
 * every directory on the way (check_dir), every link (a trusted owner) and that the socket's own directory
 * is not a sticky one others write.  0, -EPERM (untrusted, the message names the path and the owner), or
 * the -errno a component's lstat gave (as connect would: -ENOENT, -EACCES, ...).
 */
int vramd__check_socket_path(const char *path, struct trust *t, struct vramd_error *err)
{
    char rest[2 * PATH_MAX + 2], cur[PATH_MAX], next[PATH_MAX], tmp[2 * PATH_MAX + 2], link[PATH_MAX];
    struct stat st;
    bool ancestor_only;
    int r, links = 0;

    if (path[0] == '/') {
        snprintf(rest, sizeof rest, "%s", path);
    } else {
        if (!getcwd(cur, sizeof cur))
            return walk_failed(err, path, errno);
        snprintf(rest, sizeof rest, "%s/%s", cur, path);
    }
    strcpy(cur, "/");
    if (lstat(cur, &st) < 0)
        return walk_failed(err, path, errno);
    if ((r = check_dir(path, cur, &st, t, &ancestor_only, err)) < 0)
        return r;
    const char *p = rest;
    for (;;) {
        while (*p == '/')
            p++;
        if (!*p)
            return walk_failed(err, path, ENOTSOCK);
        const char *end = strchrnul(p, '/');
        size_t n = (size_t)(end - p);
        const char *after = end;
        while (*after == '/')
            after++;
        bool last = !*after;
        if (n == 1 && p[0] == '.') {
            p = end;
            continue;
        }
        if (n == 2 && p[0] == '.' && p[1] == '.') { /* cur is resolved: its parent was checked on the way down */
            char *slash = strrchr(cur, '/');
            if (slash == cur)
                cur[1] = '\0';
            else
                *slash = '\0';
            if (lstat(cur, &st) < 0)
                return walk_failed(err, path, errno);
            if ((r = check_dir(path, cur, &st, t, &ancestor_only, err)) < 0)
                return r;
            p = end;
            continue;
        }
        int k = snprintf(next, sizeof next, "%s%s%.*s", cur, strcmp(cur, "/") ? "/" : "", (int)n, p);
        if (k < 0 || (size_t)k >= sizeof next)
            return walk_failed(err, path, ENAMETOOLONG);
        if (lstat(next, &st) < 0)
            return walk_failed(err, path, errno);
        if (S_ISLNK(st.st_mode)) {
            if (!trusted(t, st.st_uid))
                return untrusted(err, path, next, &st, "a symbolic link of an untrusted uid", t);
            if (++links > 40)
                return walk_failed(err, path, ELOOP);
            ssize_t m = readlink(next, link, sizeof link);
            if (m < 0)
                return walk_failed(err, path, errno);
            if ((size_t)m >= sizeof link)
                return walk_failed(err, path, ENAMETOOLONG);
            link[m] = '\0';
            k = snprintf(tmp, sizeof tmp, "%s/%s", link, end);
            if (k < 0 || (size_t)k >= sizeof tmp)
                return walk_failed(err, path, ENAMETOOLONG);
            memcpy(rest, tmp, (size_t)k + 1);
            p = rest;
            if (link[0] == '/') {
                strcpy(cur, "/");
                if (lstat(cur, &st) < 0)
                    return walk_failed(err, path, errno);
                if ((r = check_dir(path, cur, &st, t, &ancestor_only, err)) < 0)
                    return r;
            }
            continue;
        }
        if (last) { /* the socket: its own directory must be one only trusted uids write */
            if (ancestor_only) {
                if (lstat(cur, &st) < 0)
                    return walk_failed(err, path, errno);
                return untrusted(err, path, cur, &st, "the socket's own directory, writable by others", t);
            }
            return 0;
        }
        if ((r = check_dir(path, next, &st, t, &ancestor_only, err)) < 0)
            return r;
        memcpy(cur, next, (size_t)k + 1);
        p = end;
    }
}

/* After connect, before anything is sent: the listener's credentials (as of its listen()) must be trusted. */
int vramd__check_peer(int fd, const char *path, struct trust *t, struct vramd_error *err)
{
    struct ucred cred;
    socklen_t len = sizeof cred;
    if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) < 0)
        return vramd__fail_errno(err, errno, "getsockopt(SO_PEERCRED)");
    if (trusted(t, cred.uid))
        return 0;
    return vramd__fail(err, -EPERM, VRAMD_CODE_LOCAL, "untrusted vramd socket %s: its listener (pid %d) runs as uid %u;"
                       " trusted: uid 0, %u, daemon user %s", path, (int)cred.pid, (unsigned)cred.uid,
                       (unsigned)t->me, t->user);
}
