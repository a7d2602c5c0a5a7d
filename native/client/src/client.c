/* SPDX-License-Identifier: Apache-2.0 */
/*
 * libvramd: connections, framing, fd passing and the session calls.
 * The wire format is docs/protocol.md; the messages come from rpc.proto
 * through protoc-c (see native/client/meson.build).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <poll.h>
#include <pwd.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "internal.h"
#include "rpc.pb-c.h"

typedef Vramd__Rpc__V1__Request Request;
typedef Vramd__Rpc__V1__Response Response;
typedef Vramd__Rpc__V1__SessionInfo PbSessionInfo;
typedef Vramd__Rpc__V1__Bo PbBo;
typedef Vramd__Rpc__V1__FileRef PbFileRef;

#define HEADER_SIZE 12
#define FRAME_VERSION 1
#define KIND_REQUEST 1
#define KIND_RESPONSE 2
#define DEFAULT_MAX_MESSAGE (1u << 20)   /* the daemon's default, used until Hello says otherwise */
#define MIN_MAX_MESSAGE 4096u            /* the protocol's minimum for max_message_bytes */
#define MAX_RX_MESSAGE (16u << 20)       /* the most this library ever receives in one packet */
#define TARGET_MESSAGE_BYTES (64u << 10) /* what AddBos messages aim for, as the Python client */
#define WAIT_SLACK_MS 5000               /* reply slack for a Wait with a timeout and no timeout_ms */
#define MAX_BACKENDS 16
#define FDMAP_SLOTS 512                  /* > 2 x 253: the fd -> index map of one message */
#define MAX_CONN_DUMPS 1024              /* dump sessions one connection keeps client state for */

/* A dump session this connection opened: what its commit needs (files.c). */
struct dump_entry {
    struct vramd_token token;
    struct vramd__dump d;
    bool failed;                         /* its commit failed: `failure` says why, again on a later Wait */
    struct vramd_error failure;
};

struct vramd_conn {
    int fd;
    bool broken;
    int timeout_ms;
    uint64_t next_id;
    uint32_t version;
    char server[64];
    struct vramd_limits limits;
    char backends[MAX_BACKENDS][32];
    unsigned n_backends;
    uint8_t *tx;
    size_t tx_cap;
    uint8_t *rx;
    size_t rx_cap;
    /* AddBos scratch: message BOs, their pointers, the fd -> index map */
    PbBo *bo_buf;
    PbBo **bo_ptrs;
    size_t bo_cap;
    uint32_t fdmap_gen;
    uint32_t fdmap_stamp[FDMAP_SLOTS];
    int fdmap_fd[FDMAP_SLOTS];
    uint16_t fdmap_index[FDMAP_SLOTS];
    int min_fd;                          /* vramd_options.min_fd */
    struct dump_entry *dumps;            /* the dump sessions it opened, until CloseSession */
    size_t n_dumps, cap_dumps;
    uint32_t *gpus;                      /* HelloReply.allowed_gpu_ids: the GPUs a BO may name */
    size_t n_gpus;                       /* 0: the daemon listed none (then no GPU is skipped) */
};

/* --- errors ---------------------------------------------------------------- */

static const struct {
    int code;
    const char *name;
    int errnum;
} codes[] = {
    {VRAMD_CODE_OK, "OK", 0},
    {VRAMD_CODE_PROTOCOL_ERROR, "PROTOCOL_ERROR", EPROTO},
    {VRAMD_CODE_PERMISSION_DENIED, "PERMISSION_DENIED", EACCES},
    {VRAMD_CODE_NOT_FOUND, "NOT_FOUND", ENOENT},
    {VRAMD_CODE_LIMIT_EXCEEDED, "LIMIT_EXCEEDED", E2BIG},
    {VRAMD_CODE_SHUTTING_DOWN, "SHUTTING_DOWN", ESHUTDOWN},
    {VRAMD_CODE_TIMEOUT, "TIMEOUT", ETIMEDOUT},
    {VRAMD_CODE_INTERNAL, "INTERNAL", EREMOTEIO},
    {VRAMD_CODE_UNSUPPORTED_PROTOCOL, "UNSUPPORTED_PROTOCOL", EPROTONOSUPPORT},
    {VRAMD_CODE_JOB_ERROR, "JOB_ERROR", EIO},
    {VRAMD_CODE_INVALID_REQUEST, "INVALID_REQUEST", EINVAL},
    {VRAMD_CODE_CANCELLED, "CANCELLED", ECANCELED},
    {VRAMD_CODE_INCOMPLETE_RESTORE, "INCOMPLETE_RESTORE", ENODATA},
    {VRAMD_CODE_BACKEND_ERROR, "BACKEND_ERROR", EIO},
    {VRAMD_CODE_UNMAPPED_RANGE, "UNMAPPED_RANGE", EFAULT},
    {VRAMD_CODE_TARGET_TOO_SMALL, "TARGET_TOO_SMALL", ENOSPC},
    {VRAMD_CODE_BAD_DESCRIPTOR, "BAD_DESCRIPTOR", EBADF},
    {VRAMD_CODE_BACKEND_UNAVAILABLE, "BACKEND_UNAVAILABLE", EOPNOTSUPP},
    {VRAMD_CODE_IMAGE_ERROR, "IMAGE_ERROR", EIO},
    {VRAMD_CODE_MANIFEST_MISSING, "MANIFEST_MISSING", ENOMSG},
    {VRAMD_CODE_UNSUPPORTED_VERSION, "UNSUPPORTED_VERSION", EOPNOTSUPP},
    {VRAMD_CODE_CORRUPT_MANIFEST, "CORRUPT_MANIFEST", EBADMSG},
    {VRAMD_CODE_CORRUPT_CHUNK, "CORRUPT_CHUNK", EBADMSG},
    {VRAMD_CODE_TRUNCATED_DATA, "TRUNCATED_DATA", EBADMSG},
    {VRAMD_CODE_FOREIGN_DATA_FILE, "FOREIGN_DATA_FILE", EBADMSG},
    {VRAMD_CODE_NO_SPACE, "NO_SPACE", ENOSPC},
    {VRAMD_CODE_READ_ONLY_FS, "READ_ONLY_FS", EROFS},
    {VRAMD_CODE_IO_ERROR, "IO_ERROR", EIO},
    {VRAMD_CODE_NOT_WRITABLE, "NOT_WRITABLE", EACCES},
    {VRAMD_CODE_PARENT_MISSING, "PARENT_MISSING", ENOENT},
    {VRAMD_CODE_PARENT_MISMATCH, "PARENT_MISMATCH", EBADMSG},
    {VRAMD_CODE_TOPOLOGY_ERROR, "TOPOLOGY_ERROR", ENODEV},
    {VRAMD_CODE_TOPOLOGY_MISMATCH, "TOPOLOGY_MISMATCH", ENODEV},
    {VRAMD_CODE_VRAMD_ERROR, "VRAMD_ERROR", EREMOTEIO},
};

const char *vramd_code_name(int code)
{
    if (code == VRAMD_CODE_LOCAL)
        return "LOCAL";
    for (size_t i = 0; i < sizeof codes / sizeof codes[0]; i++)
        if (codes[i].code == code)
            return codes[i].name;
    return "UNKNOWN";
}

int vramd_code_errno(int code)
{
    for (size_t i = 0; i < sizeof codes / sizeof codes[0]; i++)
        if (codes[i].code == code)
            return -codes[i].errnum;
    return -EREMOTEIO;
}

const char *vramd_strerror(int ret)
{
    if (ret >= 0)
        return "success";
    switch (-ret) {
    case ETIME:
        return "no reply from vramd in time (the connection is closed)";
    case ETIMEDOUT:
        return "the session still runs (Wait timed out)";
    case ENOTCONN:
        return "the connection to vramd is broken";
    case ECONNRESET:
        return "vramd closed the connection";
    case EPROTO:
        return "vramd protocol error";
    case EREMOTEIO:
        return "vramd reported an internal or unknown error";
    default: {
        const char *s = strerrordesc_np(-ret);
        return s ? s : "unknown error";
    }
    }
}

void vramd__clear_error(struct vramd_error *err)
{
    if (err)
        memset(err, 0, sizeof *err);
}

static void one_line(char *s)
{
    for (; *s; s++)
        if (*s == '\n' || *s == '\r')
            *s = ' ';
}

int vramd__fail(struct vramd_error *err, int errnum, int code, const char *fmt, ...)
{
    if (err) {
        va_list ap;
        memset(err, 0, sizeof *err);
        err->errnum = errnum;
        err->code = code;
        va_start(ap, fmt);
        vsnprintf(err->message, sizeof err->message, fmt, ap);
        va_end(ap);
        one_line(err->message);
    }
    return errnum;
}

static int fail_errno(struct vramd_error *err, int e, const char *what)
{
    return vramd__fail(err, -e, VRAMD_CODE_LOCAL, "%s: %s", what, strerrordesc_np(e) ? strerrordesc_np(e) : "error");
}

static void copy_str(char *dst, size_t size, const char *src)
{
    if (!src)
        src = "";
    size_t n = strnlen(src, size - 1);
    memcpy(dst, src, n);
    dst[n] = '\0';
}

static int error_from_pb(struct vramd_error *err, const Vramd__Rpc__V1__Error *e)
{
    int errnum = vramd_code_errno(e->code);
    if (err) {
        memset(err, 0, sizeof *err);
        err->errnum = errnum;
        err->code = e->code;
        copy_str(err->message, sizeof err->message, e->message);
        one_line(err->message);
        err->has_bo_id = e->has_bo_id;
        err->bo_id = e->bo_id;
        err->has_offset = e->has_offset;
        err->offset = e->offset;
    }
    return errnum;
}

/* --- fds ------------------------------------------------------------------- */

void vramd__close_fd(int fd)
{
    if (fd < 0)
        return;
    int saved = errno;
    (void)close(fd); /* Linux releases the fd even on EINTR: never retry */
    errno = saved;
}

int vramd__place_fd(int fd, int min_fd)
{
    if (min_fd <= 0 || fd >= min_fd)
        return fd;
    int nfd = fcntl(fd, F_DUPFD_CLOEXEC, min_fd);
    int e = errno;
    vramd__close_fd(fd);
    return nfd < 0 ? -e : nfd;
}

static int64_t now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* Wait for `events` on fd until deadline (-1: none).  0 ready, -ETIME, or -errno. */
static int wait_fd(int fd, short events, int64_t deadline)
{
    for (;;) {
        int t = -1;
        if (deadline >= 0) {
            int64_t left = deadline - now_ms();
            if (left <= 0)
                return -ETIME;
            t = left > INT_MAX ? INT_MAX : (int)left;
        }
        struct pollfd p = {.fd = fd, .events = events};
        int r = poll(&p, 1, t);
        if (r > 0)
            return 0; /* readable, writable, or POLLHUP/POLLERR: the next call says which */
        if (r == 0)
            continue; /* re-check the deadline */
        if (errno != EINTR)
            return -errno;
    }
}

/* --- options, paths -------------------------------------------------------- */

void vramd_options_init(struct vramd_options *opts)
{
    if (opts)
        memset(opts, 0, sizeof *opts);
}

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

/* --- the daemon's authentication -------------------------------------------- */

/*
 * Whom a client trusts with its fds (the rule of vramd/paths.py, docs/protocol.md "Socket paths"): root,
 * this process's effective uid and the daemon user ($VRAMD_DAEMON_USER, a name or a uid; default "vramd";
 * a user that does not exist adds nothing), looked up only when a uid is neither root nor ours.
 */
struct trust {
    uid_t me;
    const char *user;
    bool looked_up, has_daemon;
    uid_t daemon;
};

static void trust_init(struct trust *t)
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
static int check_socket_path(const char *path, struct trust *t, struct vramd_error *err)
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
static int check_peer(int fd, const char *path, struct trust *t, struct vramd_error *err)
{
    struct ucred cred;
    socklen_t len = sizeof cred;
    if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) < 0)
        return fail_errno(err, errno, "getsockopt(SO_PEERCRED)");
    if (trusted(t, cred.uid))
        return 0;
    return vramd__fail(err, -EPERM, VRAMD_CODE_LOCAL, "untrusted vramd socket %s: its listener (pid %d) runs as uid %u;"
                       " trusted: uid 0, %u, daemon user %s", path, (int)cred.pid, (unsigned)cred.uid,
                       (unsigned)t->me, t->user);
}

/* --- connection ------------------------------------------------------------ */

static void mark_broken(struct vramd_conn *c)
{
    if (c->fd >= 0)
        vramd__close_fd(c->fd);
    c->fd = -1;
    c->broken = true;
}

static int ensure_buf(uint8_t **buf, size_t *cap, size_t need)
{
    if (*cap >= need)
        return 0;
    uint8_t *p = realloc(*buf, need);
    if (!p)
        return -ENOMEM;
    *buf = p;
    *cap = need;
    return 0;
}

static uint32_t max_message(const struct vramd_conn *c)
{
    uint32_t m = c->limits.max_message_bytes ? c->limits.max_message_bytes : DEFAULT_MAX_MESSAGE;
    return m > MAX_RX_MESSAGE ? MAX_RX_MESSAGE : m;
}

/* The largest reply accepted: replies are not bound by max_message_bytes (a GetStatus
 * carries the metrics text), so at least the protocol's default, at most MAX_RX_MESSAGE. */
static size_t max_reply(const struct vramd_conn *c)
{
    uint32_t m = max_message(c);
    return m < DEFAULT_MAX_MESSAGE ? DEFAULT_MAX_MESSAGE : m;
}

static void put_le32(uint8_t *p, uint32_t v)
{
    p[0] = (uint8_t)v;
    p[1] = (uint8_t)(v >> 8);
    p[2] = (uint8_t)(v >> 16);
    p[3] = (uint8_t)(v >> 24);
}

static uint32_t get_le32(const uint8_t *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

/* Close every fd that came with a packet: the daemon never sends any. */
static void close_received_fds(struct msghdr *msg)
{
    for (struct cmsghdr *cm = CMSG_FIRSTHDR(msg); cm; cm = CMSG_NXTHDR(msg, cm)) {
        if (cm->cmsg_level != SOL_SOCKET || cm->cmsg_type != SCM_RIGHTS)
            continue;
        size_t n = (cm->cmsg_len - CMSG_LEN(0)) / sizeof(int);
        const unsigned char *data = CMSG_DATA(cm);
        for (size_t i = 0; i < n; i++) {
            int fd;
            memcpy(&fd, data + i * sizeof fd, sizeof fd);
            vramd__close_fd(fd);
        }
    }
}

/*
 * Send one request with `nfds` fds attached and receive its response.
 * reply_ms: how long to wait for the reply (-1: as long as it takes).
 * Returns 0 or a negative code; *out is set whenever a response was decoded,
 * error replies included (the caller frees it).
 */
static int call(struct vramd_conn *c, Request *req, const int *fds, size_t nfds, int reply_ms, Response **out,
                struct vramd_error *err)
{
    *out = NULL;
    if (c->broken || c->fd < 0)
        return vramd__fail(err, -ENOTCONN, VRAMD_CODE_LOCAL, "the connection to vramd is broken");
    if (nfds > VRAMD_SCM_MAX_FD)
        return vramd__fail(err, -E2BIG, VRAMD_CODE_LOCAL, "%zu fds in one message (at most %d)", nfds,
                           VRAMD_SCM_MAX_FD);

    req->has_id = 1;
    req->id = c->next_id++;
    size_t body = protobuf_c_message_get_packed_size(&req->base);
    uint32_t limit = max_message(c);
    if (body > limit - HEADER_SIZE)
        return vramd__fail(err, -E2BIG, VRAMD_CODE_LOCAL, "request of %zu bytes exceeds the daemon's %u-byte limit",
                           body + HEADER_SIZE, limit);
    if (ensure_buf(&c->tx, &c->tx_cap, HEADER_SIZE + body) < 0)
        return fail_errno(err, ENOMEM, "request buffer");
    memcpy(c->tx, "VRDP", 4);
    c->tx[4] = FRAME_VERSION;
    c->tx[5] = KIND_REQUEST;
    c->tx[6] = c->tx[7] = 0;
    put_le32(c->tx + 8, (uint32_t)body);
    if (protobuf_c_message_pack(&req->base, c->tx + HEADER_SIZE) != body)
        return vramd__fail(err, -EPROTO, VRAMD_CODE_LOCAL, "protobuf-c packed a different size than it measured");

    union {
        char buf[CMSG_SPACE(sizeof(int) * VRAMD_SCM_MAX_FD)];
        struct cmsghdr align;
    } ctl;
    struct iovec iov = {.iov_base = c->tx, .iov_len = HEADER_SIZE + body};
    struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1};
    if (nfds) {
        memset(ctl.buf, 0, CMSG_SPACE(sizeof(int) * nfds));
        msg.msg_control = ctl.buf;
        msg.msg_controllen = CMSG_SPACE(sizeof(int) * nfds);
        struct cmsghdr *cm = CMSG_FIRSTHDR(&msg);
        cm->cmsg_level = SOL_SOCKET;
        cm->cmsg_type = SCM_RIGHTS;
        cm->cmsg_len = CMSG_LEN(sizeof(int) * nfds);
        memcpy(CMSG_DATA(cm), fds, sizeof(int) * nfds);
    }

    int64_t deadline = c->timeout_ms > 0 ? now_ms() + c->timeout_ms : -1;
    for (;;) {
        ssize_t n = sendmsg(c->fd, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (n >= 0) {
            if ((size_t)n != iov.iov_len) { /* impossible on SEQPACKET; never trust the rest of the stream */
                mark_broken(c);
                return vramd__fail(err, -EPROTO, VRAMD_CODE_LOCAL, "short send (%zd of %zu bytes)", n, iov.iov_len);
            }
            break;
        }
        int e = errno;
        if (e == EINTR)
            continue;
        if (e == EAGAIN || e == EWOULDBLOCK) {
            int r = wait_fd(c->fd, POLLOUT, deadline);
            if (r == -ETIME) {
                mark_broken(c);
                return vramd__fail(err, -ETIME, VRAMD_CODE_LOCAL, "vramd took no request for %d ms; connection closed",
                                   c->timeout_ms);
            }
            if (r < 0) {
                mark_broken(c);
                return fail_errno(err, -r, "poll on the vramd socket");
            }
            continue;
        }
        if (e == EBADF || e == EMSGSIZE || e == ENOMEM || e == ENOBUFS || e == ETOOMANYREFS)
            /* nothing was sent: the connection is still in step */
            return fail_errno(err, e, e == EBADF ? "sending the request: an fd passed to vramd is not open"
                                                 : "sending the request to vramd");
        mark_broken(c);
        return fail_errno(err, e == EPIPE ? ECONNRESET : e, "sending the request to vramd");
    }

    /* receive */
    size_t rx_need = max_reply(c) + 1;
    if (ensure_buf(&c->rx, &c->rx_cap, rx_need) < 0) {
        mark_broken(c);
        return fail_errno(err, ENOMEM, "reply buffer");
    }
    int64_t rdeadline = reply_ms >= 0 ? now_ms() + reply_ms : -1;
    ssize_t got;
    struct msghdr rmsg;
    for (;;) {
        union {
            char buf[CMSG_SPACE(sizeof(int) * 8)];
            struct cmsghdr align;
        } rctl;
        struct iovec riov = {.iov_base = c->rx, .iov_len = c->rx_cap};
        memset(&rmsg, 0, sizeof rmsg);
        rmsg.msg_iov = &riov;
        rmsg.msg_iovlen = 1;
        rmsg.msg_control = rctl.buf;
        rmsg.msg_controllen = sizeof rctl.buf;
        got = recvmsg(c->fd, &rmsg, MSG_CMSG_CLOEXEC | MSG_DONTWAIT);
        if (got >= 0) {
            close_received_fds(&rmsg);
            break;
        }
        int e = errno;
        if (e == EINTR)
            continue;
        if (e == EAGAIN || e == EWOULDBLOCK) {
            int r = wait_fd(c->fd, POLLIN, rdeadline);
            if (r == -ETIME) {
                mark_broken(c);
                return vramd__fail(err, -ETIME, VRAMD_CODE_LOCAL, "no reply from vramd in %d ms; connection closed",
                                   reply_ms);
            }
            if (r < 0) {
                mark_broken(c);
                return fail_errno(err, -r, "poll on the vramd socket");
            }
            continue;
        }
        mark_broken(c);
        return fail_errno(err, e == EPIPE ? ECONNRESET : e, "receiving the reply from vramd");
    }
    if (got == 0) {
        mark_broken(c);
        return vramd__fail(err, -ECONNRESET, VRAMD_CODE_LOCAL, "vramd closed the connection");
    }
    if (rmsg.msg_flags & (MSG_TRUNC | MSG_CTRUNC) || (size_t)got > max_reply(c)) {
        mark_broken(c);
        return vramd__fail(err, -EPROTO, VRAMD_CODE_PROTOCOL_ERROR, "reply from vramd truncated (%zd bytes%s)", got,
                           rmsg.msg_flags & MSG_CTRUNC ? ", unexpected fds" : "");
    }
    const uint8_t *p = c->rx;
    if ((size_t)got < HEADER_SIZE || memcmp(p, "VRDP", 4) != 0 || p[4] != FRAME_VERSION || p[5] != KIND_RESPONSE ||
        p[6] || p[7] || get_le32(p + 8) != (uint32_t)(got - HEADER_SIZE)) {
        mark_broken(c);
        return vramd__fail(err, -EPROTO, VRAMD_CODE_PROTOCOL_ERROR, "bad frame header in a reply from vramd");
    }
    Response *resp = vramd__rpc__v1__response__unpack(NULL, (size_t)got - HEADER_SIZE, p + HEADER_SIZE);
    if (!resp) {
        mark_broken(c);
        return vramd__fail(err, -EPROTO, VRAMD_CODE_PROTOCOL_ERROR, "undecodable reply from vramd");
    }
    uint64_t rid = resp->has_id ? resp->id : 0;
    int code = resp->error ? resp->error->code : VRAMD_CODE_OK;
    if (rid == 0 && code != VRAMD_CODE_OK) {
        /* the daemon's connection-level refusal or protocol error: it closes the connection */
        int r = error_from_pb(err, resp->error);
        vramd__rpc__v1__response__free_unpacked(resp, NULL);
        mark_broken(c);
        return r;
    }
    if (rid != req->id) {
        vramd__rpc__v1__response__free_unpacked(resp, NULL);
        mark_broken(c);
        return vramd__fail(err, -EPROTO, VRAMD_CODE_PROTOCOL_ERROR, "reply for request %llu, expected %llu",
                           (unsigned long long)rid, (unsigned long long)req->id);
    }
    *out = resp;
    if (code != VRAMD_CODE_OK)
        return error_from_pb(err, resp->error);
    return 0;
}

static void free_response(Response *resp)
{
    if (resp)
        vramd__rpc__v1__response__free_unpacked(resp, NULL);
}

static int hello(struct vramd_conn *c, const char *name, struct vramd_error *err)
{
    uint32_t versions[] = {VRAMD_PROTOCOL_VERSION};
    char client[96];
    snprintf(client, sizeof client, "%s", name && *name ? name : "libvramd " VRAMD_VERSION_STRING);
    Vramd__Rpc__V1__Hello h = VRAMD__RPC__V1__HELLO__INIT;
    h.n_versions = 1;
    h.versions = versions;
    h.client = client;
    Request req = VRAMD__RPC__V1__REQUEST__INIT;
    req.body_case = VRAMD__RPC__V1__REQUEST__BODY_HELLO;
    req.hello = &h;
    Response *resp;
    int r = call(c, &req, NULL, 0, c->timeout_ms > 0 ? c->timeout_ms : -1, &resp, err);
    if (r < 0) {
        free_response(resp);
        return r;
    }
    if (resp->body_case != VRAMD__RPC__V1__RESPONSE__BODY_HELLO || !resp->hello) {
        free_response(resp);
        mark_broken(c);
        return vramd__fail(err, -EPROTO, VRAMD_CODE_PROTOCOL_ERROR, "Hello answered without a HelloReply");
    }
    const Vramd__Rpc__V1__HelloReply *hr = resp->hello;
    if (hr->version != VRAMD_PROTOCOL_VERSION) {
        uint32_t v = hr->version;
        free_response(resp);
        mark_broken(c);
        return vramd__fail(err, -EPROTONOSUPPORT, VRAMD_CODE_UNSUPPORTED_PROTOCOL,
                           "vramd chose protocol version %u, which this library does not speak", v);
    }
    c->version = hr->version;
    copy_str(c->server, sizeof c->server, hr->server);
    if (hr->limits) {
        const Vramd__Rpc__V1__Limits *l = hr->limits;
        c->limits.max_message_bytes = l->max_message_bytes;
        c->limits.max_fds_per_message = l->max_fds_per_message;
        c->limits.max_bos_per_session = l->max_bos_per_session;
        c->limits.max_sessions_per_uid = l->max_sessions_per_uid;
        c->limits.max_fds_per_session = l->max_fds_per_session;
    }
    if (!c->limits.max_message_bytes)
        c->limits.max_message_bytes = DEFAULT_MAX_MESSAGE;
    if (c->limits.max_message_bytes < MIN_MAX_MESSAGE) {
        uint32_t m = c->limits.max_message_bytes;
        free_response(resp);
        mark_broken(c);
        return vramd__fail(err, -EPROTO, VRAMD_CODE_PROTOCOL_ERROR, "vramd's max_message_bytes %u is below %u", m,
                           MIN_MAX_MESSAGE);
    }
    if (!c->limits.max_fds_per_message || c->limits.max_fds_per_message > VRAMD_SCM_MAX_FD)
        c->limits.max_fds_per_message = VRAMD_SCM_MAX_FD;
    c->n_backends = 0;
    for (size_t i = 0; i < hr->n_backends && c->n_backends < MAX_BACKENDS; i++) {
        const Vramd__Rpc__V1__BackendInfo *b = hr->backends[i];
        if (b && b->has_available && b->available && b->name)
            copy_str(c->backends[c->n_backends++], sizeof c->backends[0], b->name);
    }
    free(c->gpus);
    c->gpus = NULL, c->n_gpus = 0;
    if (hr->n_allowed_gpu_ids) {
        c->gpus = malloc(hr->n_allowed_gpu_ids * sizeof *c->gpus);
        if (!c->gpus) {
            free_response(resp);
            return fail_errno(err, ENOMEM, "the daemon's GPU list");
        }
        memcpy(c->gpus, hr->allowed_gpu_ids, hr->n_allowed_gpu_ids * sizeof *c->gpus);
        c->n_gpus = hr->n_allowed_gpu_ids;
    }
    free_response(resp);
    return 0;
}

/* Whether a BO may name this GPU (the daemon's list from Hello; with no list, every GPU may). */
static bool gpu_allowed(const struct vramd_conn *c, uint32_t gpu_id)
{
    for (size_t i = 0; i < c->n_gpus; i++)
        if (c->gpus[i] == gpu_id)
            return true;
    return c->n_gpus == 0;
}

static int conn_new(struct vramd_conn **out, int fd, const struct vramd_options *opts, struct vramd_error *err)
{
    struct vramd_conn *c = calloc(1, sizeof *c);
    if (!c) {
        vramd__close_fd(fd);
        return fail_errno(err, ENOMEM, "connection");
    }
    c->fd = fd;
    c->next_id = 1;
    c->min_fd = opts && opts->min_fd > 0 ? opts->min_fd : 0;
    c->timeout_ms = opts && opts->timeout_ms > 0 ? opts->timeout_ms : 0;
    int r = hello(c, opts ? opts->client_name : NULL, err);
    if (r < 0) {
        vramd_close(c);
        return r;
    }
    *out = c;
    return 0;
}

int vramd_connect_path(struct vramd_conn **out, const char *path, const struct vramd_options *opts,
                       struct vramd_error *err)
{
    vramd__clear_error(err);
    if (!out || !path)
        return vramd__fail(err, -EINVAL, VRAMD_CODE_LOCAL, "vramd_connect_path: NULL argument");
    *out = NULL;
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    size_t len = strlen(path);
    if (len == 0 || len >= sizeof sa.sun_path)
        return vramd__fail(err, -ENAMETOOLONG, VRAMD_CODE_LOCAL, "socket path of %zu bytes (at most %zu)", len,
                           sizeof sa.sun_path - 1);
    memcpy(sa.sun_path, path, len + 1);
    struct trust trust;
    trust_init(&trust);
    int r = check_socket_path(path, &trust, err);
    if (r < 0)
        return r;

    int fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return fail_errno(err, errno, "socket(AF_UNIX, SOCK_SEQPACKET)");
    int min_fd = opts ? opts->min_fd : 0;
    fd = vramd__place_fd(fd, min_fd);
    if (fd < 0)
        return vramd__fail(err, fd, VRAMD_CODE_LOCAL, "cannot place the socket at fd >= %d: %s", min_fd,
                           vramd_strerror(fd));
    int timeout_ms = opts && opts->timeout_ms > 0 ? opts->timeout_ms : 0;
    if (timeout_ms) { /* bounds connect() when the daemon's backlog is full */
        struct timeval tv = {.tv_sec = timeout_ms / 1000, .tv_usec = (timeout_ms % 1000) * 1000};
        if (setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv) < 0) {
            int e = errno;
            vramd__close_fd(fd);
            return fail_errno(err, e, "setsockopt(SO_SNDTIMEO)");
        }
    }
    do
        r = connect(fd, (struct sockaddr *)&sa, (socklen_t)(offsetof(struct sockaddr_un, sun_path) + len + 1));
    while (r < 0 && errno == EINTR);
    if (r < 0) {
        int e = errno;
        vramd__close_fd(fd);
        if (e == EAGAIN)
            return vramd__fail(err, -ETIME, VRAMD_CODE_LOCAL, "cannot connect to vramd at %s: no room in its backlog "
                               "within %d ms", path, timeout_ms);
        return vramd__fail(err, -e, VRAMD_CODE_LOCAL, "cannot connect to vramd at %s: %s", path,
                           strerrordesc_np(e) ? strerrordesc_np(e) : "error");
    }
    if (timeout_ms) {
        struct timeval tv = {0};
        if (setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv) < 0) {
            int e = errno;
            vramd__close_fd(fd);
            return fail_errno(err, e, "setsockopt(SO_SNDTIMEO)");
        }
    }
    if ((r = check_peer(fd, path, &trust, err)) < 0) {
        vramd__close_fd(fd);
        return r;
    }
    return conn_new(out, fd, opts, err);
}

int vramd_connect(struct vramd_conn **out, const struct vramd_options *opts, struct vramd_error *err)
{
    char path[sizeof(((struct sockaddr_un *)0)->sun_path)];
    vramd__clear_error(err);
    if (out)
        *out = NULL;
    int r = vramd_socket_path(path, sizeof path);
    if (r < 0)
        return vramd__fail(err, r, VRAMD_CODE_LOCAL, "the vramd socket path is too long for a unix socket");
    return vramd_connect_path(out, path, opts, err);
}

int vramd_connect_fd(struct vramd_conn **out, int fd, const struct vramd_options *opts, struct vramd_error *err)
{
    vramd__clear_error(err);
    if (!out) {
        vramd__close_fd(fd);
        return vramd__fail(err, -EINVAL, VRAMD_CODE_LOCAL, "vramd_connect_fd: NULL argument");
    }
    *out = NULL;
    if (fd < 0)
        return vramd__fail(err, -EBADF, VRAMD_CODE_LOCAL, "vramd_connect_fd: fd %d", fd);
    int type = 0, domain = 0;
    socklen_t tl = sizeof type, dl = sizeof domain;
    if (getsockopt(fd, SOL_SOCKET, SO_TYPE, &type, &tl) < 0 || getsockopt(fd, SOL_SOCKET, SO_DOMAIN, &domain, &dl) < 0) {
        int e = errno;
        if (e != EBADF)
            vramd__close_fd(fd);
        return fail_errno(err, e, "vramd_connect_fd: not a socket");
    }
    if (type != SOCK_SEQPACKET || domain != AF_UNIX) {
        vramd__close_fd(fd);
        return vramd__fail(err, -EPROTOTYPE, VRAMD_CODE_LOCAL, "vramd_connect_fd: not an AF_UNIX SOCK_SEQPACKET socket");
    }
    int flags = fcntl(fd, F_GETFD);
    if (flags < 0 || fcntl(fd, F_SETFD, flags | FD_CLOEXEC) < 0) {
        int e = errno;
        vramd__close_fd(fd);
        return fail_errno(err, e, "fcntl(FD_CLOEXEC)");
    }
    return conn_new(out, fd, opts, err);
}

void vramd_close(struct vramd_conn *c)
{
    if (!c)
        return;
    /* a dump this connection did not commit never will be: what it created goes, its lock is dropped */
    for (size_t i = 0; i < c->n_dumps; i++) {
        vramd__dump_abandon(&c->dumps[i].d);
        vramd__dump_release(&c->dumps[i].d);
    }
    free(c->dumps);
    if (c->fd >= 0)
        vramd__close_fd(c->fd);
    free(c->tx);
    free(c->rx);
    free(c->bo_buf);
    free(c->bo_ptrs);
    free(c->gpus);
    free(c);
}

int vramd_conn_fd(const struct vramd_conn *c)
{
    return c && !c->broken ? c->fd : -1;
}

bool vramd_conn_broken(const struct vramd_conn *c)
{
    return !c || c->broken;
}

uint32_t vramd_conn_version(const struct vramd_conn *c)
{
    return c ? c->version : 0;
}

const char *vramd_conn_server(const struct vramd_conn *c)
{
    return c ? c->server : "";
}

const struct vramd_limits *vramd_conn_limits(const struct vramd_conn *c)
{
    return c ? &c->limits : NULL;
}

bool vramd_conn_has_backend(const struct vramd_conn *c, const char *name)
{
    if (!c || !name)
        return false;
    for (unsigned i = 0; i < c->n_backends; i++)
        if (strcmp(c->backends[i], name) == 0)
            return true;
    return false;
}

/* --- tokens ---------------------------------------------------------------- */

void vramd_token_format(const struct vramd_token *t, char out[VRAMD_TOKEN_STRLEN + 1])
{
    static const char hex[] = "0123456789abcdef";
    for (int i = 0; i < VRAMD_TOKEN_BYTES; i++) {
        out[2 * i] = hex[t->bytes[i] >> 4];
        out[2 * i + 1] = hex[t->bytes[i] & 15];
    }
    out[VRAMD_TOKEN_STRLEN] = '\0';
}

static int hexval(char ch)
{
    if (ch >= '0' && ch <= '9')
        return ch - '0';
    if (ch >= 'a' && ch <= 'f')
        return ch - 'a' + 10;
    if (ch >= 'A' && ch <= 'F')
        return ch - 'A' + 10;
    return -1;
}

int vramd_token_parse(const char *text, struct vramd_token *t)
{
    if (!text || !t || strnlen(text, VRAMD_TOKEN_STRLEN + 1) != VRAMD_TOKEN_STRLEN)
        return -EINVAL;
    struct vramd_token tmp;
    for (int i = 0; i < VRAMD_TOKEN_BYTES; i++) {
        int hi = hexval(text[2 * i]), lo = hexval(text[2 * i + 1]);
        if (hi < 0 || lo < 0)
            return -EINVAL;
        tmp.bytes[i] = (uint8_t)(hi << 4 | lo);
    }
    *t = tmp;
    return 0;
}

/* --- sessions -------------------------------------------------------------- */

static void info_from_pb(struct vramd_session_info *info, const PbSessionInfo *s)
{
    if (!info || !s)
        return;
    memset(info, 0, sizeof *info);
    info->session_id = s->session_id;
    info->kind = s->kind;
    info->state = s->state;
    info->uid = s->uid;
    info->pid = s->pid;
    info->holders = s->holders;
    copy_str(info->label, sizeof info->label, s->label);
    if (s->progress) {
        info->progress.bos_total = s->progress->bos_total;
        info->progress.bos_done = s->progress->bos_done;
        info->progress.bytes_total = s->progress->bytes_total;
        info->progress.bytes_done = s->progress->bytes_done;
        info->progress.chunks_done = s->progress->chunks_done;
        info->progress.elapsed_s = s->progress->elapsed_s;
    }
    if (s->image) {
        info->has_image = true;
        info->image.bo_count = s->image->bo_count;
        info->image.data_files = s->image->data_files;
        info->image.bo_bytes = s->image->bo_bytes;
        info->image.stored_bytes = s->image->stored_bytes;
        info->image.zero_bytes = s->image->zero_bytes;
        info->image.chunk_size = s->image->chunk_size;
        copy_str(info->image.compression, sizeof info->image.compression, s->image->compression);
    }
    if (s->error && (int)s->error->code != VRAMD_CODE_OK)
        error_from_pb(&info->error, s->error);
}

/* A call whose reply body is a SessionInfo (also on error, when the daemon sends one). */
static int session_call(struct vramd_conn *c, Request *req, const int *fds, size_t nfds, int reply_ms,
                        struct vramd_session_info *info, PbSessionInfo **keep, Response **keep_resp,
                        struct vramd_error *err)
{
    Response *resp;
    if (info)
        memset(info, 0, sizeof *info);
    int r = call(c, req, fds, nfds, reply_ms, &resp, err);
    if (!resp)
        return r;
    bool has_body = resp->body_case == VRAMD__RPC__V1__RESPONSE__BODY_SESSION && resp->session;
    if (r == 0 && !has_body) {
        free_response(resp);
        mark_broken(c);
        return vramd__fail(err, -EPROTO, VRAMD_CODE_PROTOCOL_ERROR, "reply without the SessionInfo it must carry");
    }
    if (has_body)
        info_from_pb(info, resp->session);
    if (keep && has_body) {
        *keep = resp->session;
        *keep_resp = resp;
        return r;
    }
    free_response(resp);
    return r;
}

static int reply_ms(const struct vramd_conn *c)
{
    return c && c->timeout_ms > 0 ? c->timeout_ms : -1;
}

/* --- the client's dump sessions -------------------------------------------- */

static struct dump_entry *find_dump(struct vramd_conn *c, const struct vramd_token *t)
{
    for (size_t i = 0; i < c->n_dumps; i++)
        if (memcmp(c->dumps[i].token.bytes, t->bytes, VRAMD_TOKEN_BYTES) == 0)
            return &c->dumps[i];
    return NULL;
}

/* Forget a dump's client state: abandoned first unless committed (removes what it created, unlocks). */
static void drop_dump(struct vramd_conn *c, struct dump_entry *e)
{
    vramd__dump_abandon(&e->d);
    vramd__dump_release(&e->d);
    *e = c->dumps[--c->n_dumps];
}

static int add_dump(struct vramd_conn *c, const struct vramd_token *t, const struct vramd__dump *d,
                    struct vramd_error *err)
{
    if (c->n_dumps == c->cap_dumps) {
        size_t cap = c->cap_dumps ? 2 * c->cap_dumps : 4;
        struct dump_entry *p = realloc(c->dumps, cap * sizeof *p);
        if (!p)
            return fail_errno(err, ENOMEM, "dump session table");
        c->dumps = p;
        c->cap_dumps = cap;
    }
    struct dump_entry *e = &c->dumps[c->n_dumps++];
    memset(e, 0, sizeof *e);
    e->token = *t;
    e->d = *d;
    return 0;
}

static uint32_t message_budget(const struct vramd_conn *c);

/* fds one AttachFiles may carry, and whether a file may bring its O_DIRECT description too. */
static unsigned attach_max_fds(const struct vramd_conn *c, bool *direct)
{
    unsigned m = c->limits.max_fds_per_message;
    if (!m || m > VRAMD_SCM_MAX_FD)
        m = VRAMD_SCM_MAX_FD;
    *direct = m >= 2;
    return m;
}

/* One AttachFiles message; the fds stay the caller's. */
static int send_attach(struct vramd_conn *c, char *tok, PbFileRef **refs, size_t n, const int *fds, size_t nfds,
                       struct vramd_session_info *info, struct vramd_error *err)
{
    Vramd__Rpc__V1__AttachFiles af = VRAMD__RPC__V1__ATTACH_FILES__INIT;
    af.token = tok;
    af.n_files = n;
    af.files = refs;
    Request req = VRAMD__RPC__V1__REQUEST__INIT;
    req.body_case = VRAMD__RPC__V1__REQUEST__BODY_ATTACH_FILES;
    req.attach_files = &af;
    return session_call(c, &req, fds, nfds, reply_ms(c), info, NULL, NULL, err);
}

static void close_all(const int *fds, size_t n)
{
    for (size_t i = 0; i < n; i++)
        vramd__close_fd(fds[i]);
}

/*
 * Open and attach every file the OpenSession reply asked for: image 0 in dirs[0], image k in dirs[k]
 * (dirs[0] is -1 for a dump: its own files are not needed, they are made).  As many messages as the fd
 * and byte limits need; each message's fds are closed once it is sent (the daemon has its own).
 */
static int attach_needed(struct vramd_conn *c, char *tok, PbFileRef *const *needed, size_t n, const int *dirs,
                         size_t ndirs, struct vramd_session_info *info, struct vramd_error *err)
{
    bool direct;
    unsigned max_fds = attach_max_fds(c, &direct);
    uint32_t budget = message_budget(c);
    PbFileRef refs[VRAMD_SCM_MAX_FD];
    PbFileRef *ptrs[VRAMD_SCM_MAX_FD];
    int fds[VRAMD_SCM_MAX_FD];
    size_t i = 0;
    while (i < n) {
        size_t count = 0, nfds = 0, size = VRAMD_TOKEN_STRLEN + 8;
        for (; i < n; i++) {
            const PbFileRef *want = needed[i];
            uint32_t image = want && want->has_image ? want->image : 0;
            const char *name = want && want->name ? want->name : "";
            if (image >= ndirs || dirs[image] < 0 || !vramd__is_data_file_name(name)) {
                close_all(fds, nfds);
                mark_broken(c);
                return vramd__fail(err, -EPROTO, VRAMD_CODE_PROTOCOL_ERROR,
                                   "vramd asked for a file this client does not open: image %u, name '%.64s'",
                                   image, name);
            }
            unsigned need = direct ? 2 : 1;
            if (count && nfds + need > max_fds)
                break;
            PbFileRef *ref = &refs[count];
            PbFileRef init = VRAMD__RPC__V1__FILE_REF__INIT;
            *ref = init;
            ref->has_image = image != 0, ref->image = image;
            ref->name = (char *)name;
            ref->fd_index = (uint32_t)nfds, ref->has_fd_index = nfds != 0;
            ref->has_direct_fd_index = direct, ref->direct_fd_index = (uint32_t)nfds + 1;
            size_t bytes = protobuf_c_message_get_packed_size(&ref->base) + 8;
            if (count && size + bytes > budget)
                break;
            int fd, dfd;
            int r = vramd__open_image_file(dirs[image], name, direct, c->min_fd, &fd, &dfd, err);
            if (r < 0) {
                close_all(fds, nfds);
                return r;
            }
            fds[nfds++] = fd;
            ref->has_direct_fd_index = dfd >= 0;
            if (dfd >= 0)
                fds[nfds++] = dfd;
            ptrs[count++] = ref;
            size += bytes;
        }
        int r = send_attach(c, tok, ptrs, count, fds, nfds, info, err);
        close_all(fds, nfds);
        if (r < 0)
            return r;
    }
    return 0;
}

/*
 * A dump's own data files: for each GPU of bos[] that has none yet (a BO without gpu_id is GPU 0) and
 * that the daemon allows (HelloReply.allowed_gpu_ids), create every data file the daemon asked for
 * (data-<id>-<gpu>.vrd.tmp, then data-<id>-<gpu>-<k>.vrd.tmp for stripes k = 1 to data_files_per_gpu - 1)
 * and attach them, before the AddBos that needs them.
 * Stripe 0 goes in the first message that holds any of its GPU's files.  A file whose AttachFiles
 * failed is removed again.
 */
static int attach_dump_data(struct vramd_conn *c, struct dump_entry *e, char *tok, const struct vramd_bo *bos,
                            size_t n, struct vramd_error *err)
{
    bool direct;
    unsigned max_fds = attach_max_fds(c, &direct);
    PbFileRef refs[VRAMD_SCM_MAX_FD];
    PbFileRef *ptrs[VRAMD_SCM_MAX_FD];
    char names[VRAMD_SCM_MAX_FD][VRAMD__NAME_MAX];
    struct vramd__data_file made[VRAMD_SCM_MAX_FD];
    int fds[VRAMD_SCM_MAX_FD];
    uint32_t budget = message_budget(c);
    uint32_t stripes = e->d.stripes;
    size_t i = 0;
    uint32_t k = 0; /* the next file: stripe k of bos[i]'s GPU (k > 0: that GPU's files are being made) */
    while (i < n) {
        size_t count = 0, nfds = 0, size = VRAMD_TOKEN_STRLEN + 8;
        int r = 0;
        while (i < n) {
            uint32_t gpu = bos[i].has_gpu_id ? bos[i].gpu_id : 0;
            /* a GPU the daemon does not know gets no file: its BO's refusal names the BO */
            if (k == stripes || (k == 0 && (vramd__dump_has_gpu(&e->d, gpu) || !gpu_allowed(c, gpu)))) {
                i++, k = 0;
                continue;
            }
            /* a FileRef here: a name of at most 36 bytes, a gpu_id, a stripe and two indexes: under 64 bytes */
            if (count && (nfds + (direct ? 2 : 1) > max_fds || size + 64 > budget))
                break;
            int fd, dfd;
            r = vramd__dump_create_data(&e->d, gpu, k, direct, &fd, &dfd, err);
            if (r < 0)
                break;
            PbFileRef *ref = &refs[count];
            PbFileRef init = VRAMD__RPC__V1__FILE_REF__INIT;
            *ref = init;
            vramd__dump_data_name(&e->d, gpu, k, names[count]);
            ref->name = names[count];
            ref->has_gpu_id = 1, ref->gpu_id = gpu;
            ref->has_stripe = k != 0, ref->stripe = k;
            ref->fd_index = (uint32_t)nfds, ref->has_fd_index = nfds != 0;
            fds[nfds++] = fd;
            if (dfd >= 0) {
                ref->has_direct_fd_index = 1, ref->direct_fd_index = (uint32_t)nfds;
                fds[nfds++] = dfd;
            }
            made[count] = (struct vramd__data_file){.gpu_id = gpu, .stripe = k};
            ptrs[count++] = ref;
            size += 64;
            k++;
        }
        if (r == 0 && count)
            r = send_attach(c, tok, ptrs, count, fds, nfds, NULL, err);
        close_all(fds, nfds);
        if (r < 0) {
            for (size_t j = 0; j < count; j++)
                vramd__dump_drop_data(&e->d, made[j].gpu_id, made[j].stripe);
            return r;
        }
    }
    return 0;
}

/* End a session this call opened and cannot hand over (its files could not be attached). */
static void close_quietly(struct vramd_conn *c, const struct vramd_token *t)
{
    struct vramd_error ignored;
    if (!c->broken)
        (void)vramd_close_session(c, t, NULL, &ignored);
    struct dump_entry *e = find_dump(c, t);
    if (e)
        drop_dump(c, e);
}

int vramd_open_session(struct vramd_conn *c, const struct vramd_open_args *a, struct vramd_token *token,
                       struct vramd_session_info *info, struct vramd_error *err)
{
    struct vramd_error local;
    if (!err)
        err = &local;
    vramd__clear_error(err);
    if (!c || !a || !token)
        return vramd__fail(err, -EINVAL, VRAMD_CODE_LOCAL, "vramd_open_session: NULL argument");
    if (a->dir_fd < 0)
        return vramd__fail(err, -EBADF, VRAMD_CODE_LOCAL, "image directory fd %d", a->dir_fd);
    bool dump = a->kind == VRAMD_SESSION_DUMP;
    if (!dump && a->kind != VRAMD_SESSION_RESTORE && a->kind != VRAMD_SESSION_VERIFY)
        return vramd__fail(err, -EINVAL, VRAMD_CODE_LOCAL, "session kind %d (dump 1, restore 2, verify 3)", a->kind);
    size_t np = a->n_parent_dir_fds;
    if (np > VRAMD_MAX_PARENTS || (np && !a->parent_dir_fds))
        return vramd__fail(err, -EINVAL, VRAMD_CODE_LOCAL, "%zu parent directory fds (at most %d)", np,
                           VRAMD_MAX_PARENTS);
    for (size_t i = 0; i < np; i++)
        if (a->parent_dir_fds[i] < 0)
            return vramd__fail(err, -EBADF, VRAMD_CODE_LOCAL, "parent directory fd %d", a->parent_dir_fds[i]);
    if (c->broken)
        return vramd__fail(err, -ENOTCONN, VRAMD_CODE_LOCAL, "the connection to vramd is broken");
    if (dump && c->n_dumps >= MAX_CONN_DUMPS)
        return vramd__fail(err, -EMFILE, VRAMD_CODE_LOCAL,
                           "this connection holds %d dump sessions: close some (vramd_close_session)", MAX_CONN_DUMPS);

    /* the directories: image 0 is the session's own, image k its k-th parent */
    int dirs[1 + VRAMD_MAX_PARENTS];
    struct vramd__dump d;
    memset(&d, 0, sizeof d);
    if (dump) {
        int r = vramd__dump_begin(&d, a->dir_fd, a->parent_dir_fds, np, a->replace_parent, c->min_fd, err);
        if (r < 0)
            return r;
        dirs[0] = -1; /* a dump's own files are made, never asked for */
        for (size_t i = 0; i < np; i++)
            dirs[1 + i] = d.parent_fds[i];
    } else {
        dirs[0] = a->dir_fd;
        for (size_t i = 0; i < np; i++)
            dirs[1 + i] = a->parent_dir_fds[i];
    }
    /* the manifests: a restore's or verify's own, then the parents' (a dump has none of its own yet) */
    int fds[1 + VRAMD_MAX_PARENTS];
    uint32_t indexes[VRAMD_MAX_PARENTS];
    size_t nfds = 0;
    for (size_t k = dump ? 1 : 0; k <= np; k++) {
        int fd, unused;
        int r = vramd__open_image_file(dirs[k], VRAMD__MANIFEST_NAME, false, c->min_fd, &fd, &unused, err);
        if (r < 0) {
            if (r == -ENOENT) { /* say which image has none */
                char dir[PATH_MAX];
                vramd__dir_label(dirs[k], dir, sizeof dir);
                if (k == 0)
                    vramd__fail(err, r, VRAMD_CODE_LOCAL, "no image in %s: %s is missing", dir, VRAMD__MANIFEST_NAME);
                else
                    vramd__fail(err, r, VRAMD_CODE_LOCAL, "parent #%zu holds no image: %s/%s is missing", k, dir,
                                VRAMD__MANIFEST_NAME);
            }
            close_all(fds, nfds);
            if (dump)
                vramd__dump_release(&d);
            return r;
        }
        if (k > 0)
            indexes[k - 1] = (uint32_t)nfds;
        fds[nfds++] = fd;
    }

    Vramd__Rpc__V1__OpenSession o = VRAMD__RPC__V1__OPEN_SESSION__INIT;
    o.has_kind = 1;
    o.kind = (Vramd__Rpc__V1__SessionKind)a->kind;
    o.has_manifest_fd_index = !dump; /* index 0 */
    o.manifest_fd_index = 0;
    o.compression = a->compression && *a->compression ? (char *)a->compression : NULL;
    o.has_chunk_size = a->chunk_size != 0;
    o.chunk_size = a->chunk_size;
    o.label = a->label && *a->label ? (char *)a->label : NULL;
    o.has_allow_partial = a->allow_partial;
    o.allow_partial = a->allow_partial;
    o.n_parent_manifest_fd_indexes = np;
    o.parent_manifest_fd_indexes = indexes;
    o.parent_hint = a->parent_hint && *a->parent_hint ? (char *)a->parent_hint : NULL;
    o.has_no_dedup = a->no_dedup;
    o.no_dedup = a->no_dedup;
    o.has_replace_parent = a->replace_parent;
    o.replace_parent = a->replace_parent;
    Request req = VRAMD__RPC__V1__REQUEST__INIT;
    req.body_case = VRAMD__RPC__V1__REQUEST__BODY_OPEN_SESSION;
    req.open_session = &o;
    PbSessionInfo *s = NULL;
    Response *resp = NULL;
    int r = session_call(c, &req, fds, nfds, reply_ms(c), info, &s, &resp, err);
    close_all(fds, nfds); /* the daemon has its own */
    if (r < 0) {
        free_response(resp);
        if (dump)
            vramd__dump_release(&d);
        return r;
    }
    struct vramd_token t;
    r = vramd_token_parse(s->token, &t);
    bool lower = s->token && strspn(s->token, "0123456789abcdef") == VRAMD_TOKEN_STRLEN;
    if (r < 0 || !lower) {
        free_response(resp);
        if (dump)
            vramd__dump_release(&d);
        mark_broken(c);
        return vramd__fail(err, -EPROTO, VRAMD_CODE_PROTOCOL_ERROR, "OpenSession reply without a valid token");
    }
    if (dump) {
        if (!s->has_image_id || s->image_id.len != VRAMD__ID_BYTES) {
            free_response(resp);
            vramd__dump_release(&d);
            close_quietly(c, &t);
            return vramd__fail(err, -EPROTO, VRAMD_CODE_PROTOCOL_ERROR,
                               "OpenSession reply of a dump without the image id (16 bytes)");
        }
        /* how many data files it takes per GPU: 0 (a daemon older than the field) means one */
        uint32_t stripes = s->has_data_files_per_gpu && s->data_files_per_gpu ? s->data_files_per_gpu : 1;
        if (stripes > VRAMD__MAX_STRIPES) {
            free_response(resp);
            vramd__dump_release(&d);
            close_quietly(c, &t);
            return vramd__fail(err, -EPROTO, VRAMD_CODE_LOCAL,
                               "vramd asked for %u data files per GPU; the image format allows at most %d",
                               stripes, VRAMD__MAX_STRIPES);
        }
        memcpy(d.image_id, s->image_id.data, VRAMD__ID_BYTES);
        d.stripes = stripes;
        r = add_dump(c, &t, &d, err);
        if (r < 0) {
            free_response(resp);
            vramd__dump_release(&d);
            close_quietly(c, &t);
            return r;
        }
    }
    /* the files it needs: restore/verify the data files of the image and its parents, dump its parents' */
    if (s->n_files_needed) {
        char tok[VRAMD_TOKEN_STRLEN + 1];
        vramd_token_format(&t, tok);
        r = attach_needed(c, tok, s->files_needed, s->n_files_needed, dirs, 1 + np, info, err);
        if (r < 0) {
            struct vramd_error first = *err;
            free_response(resp);
            close_quietly(c, &t);
            *err = first;
            return r;
        }
    }
    free_response(resp);
    *token = t;
    return 0;
}

/* A request whose body names only the token: Start, GetProgress, CloseSession. */
static int token_call(struct vramd_conn *c, const struct vramd_token *t, int which, int within_ms,
                      struct vramd_session_info *info, struct vramd_error *err)
{
    vramd__clear_error(err);
    if (!c || !t)
        return vramd__fail(err, -EINVAL, VRAMD_CODE_LOCAL, "NULL argument");
    char tok[VRAMD_TOKEN_STRLEN + 1];
    vramd_token_format(t, tok);
    Request req = VRAMD__RPC__V1__REQUEST__INIT;
    Vramd__Rpc__V1__Start start = VRAMD__RPC__V1__START__INIT;
    Vramd__Rpc__V1__GetProgress prog = VRAMD__RPC__V1__GET_PROGRESS__INIT;
    Vramd__Rpc__V1__CloseSession cs = VRAMD__RPC__V1__CLOSE_SESSION__INIT;
    req.body_case = (Vramd__Rpc__V1__Request__BodyCase)which;
    switch (which) {
    case VRAMD__RPC__V1__REQUEST__BODY_START:
        start.token = tok;
        req.start = &start;
        break;
    case VRAMD__RPC__V1__REQUEST__BODY_GET_PROGRESS:
        prog.token = tok;
        req.get_progress = &prog;
        break;
    default:
        cs.token = tok;
        req.close_session = &cs;
        break;
    }
    return session_call(c, &req, NULL, 0, within_ms, info, NULL, NULL, err);
}

int vramd_start(struct vramd_conn *c, const struct vramd_token *t, struct vramd_session_info *info,
                struct vramd_error *err)
{
    vramd__clear_error(err);
    if (!c || !t)
        return vramd__fail(err, -EINVAL, VRAMD_CODE_LOCAL, "vramd_start: NULL argument");
    struct dump_entry *e = find_dump(c, t);
    if (!e || e->d.phase != VRAMD__DUMP_OPEN)
        return token_call(c, t, VRAMD__RPC__V1__REQUEST__BODY_START, reply_ms(c), info, err);
    if (c->broken)
        return vramd__fail(err, -ENOTCONN, VRAMD_CODE_LOCAL, "the connection to vramd is broken");
    /* a dump names the file its manifest goes into: the temporary the commit renames */
    int fd;
    int r = vramd__dump_manifest_tmp(&e->d, &fd, err);
    if (r < 0)
        return r;
    char tok[VRAMD_TOKEN_STRLEN + 1];
    vramd_token_format(t, tok);
    Vramd__Rpc__V1__Start start = VRAMD__RPC__V1__START__INIT;
    start.token = tok;
    start.has_manifest_fd_index = 1;
    start.manifest_fd_index = 0;
    Request req = VRAMD__RPC__V1__REQUEST__INIT;
    req.body_case = VRAMD__RPC__V1__REQUEST__BODY_START;
    req.start = &start;
    r = session_call(c, &req, &fd, 1, reply_ms(c), info, NULL, NULL, err);
    vramd__close_fd(fd);
    return r;
}

int vramd_progress(struct vramd_conn *c, const struct vramd_token *t, struct vramd_session_info *info,
                   struct vramd_error *err)
{
    return token_call(c, t, VRAMD__RPC__V1__REQUEST__BODY_GET_PROGRESS, reply_ms(c), info, err);
}

int vramd_close_session(struct vramd_conn *c, const struct vramd_token *t, struct vramd_session_info *info,
                        struct vramd_error *err)
{
    return vramd__close_session_within(c, t, reply_ms(c), info, err);
}

int vramd__close_session_within(struct vramd_conn *c, const struct vramd_token *t, int within_ms,
                                struct vramd_session_info *info, struct vramd_error *err)
{
    int r = token_call(c, t, VRAMD__RPC__V1__REQUEST__BODY_CLOSE_SESSION, within_ms, info, err);
    /* a dump not committed by now never will be: what it created goes (the daemon writes no name, so
     * even a session that still runs, if this call failed, cannot put an image in place) */
    struct dump_entry *e = c && t ? find_dump(c, t) : NULL;
    if (e)
        drop_dump(c, e);
    return r;
}

int vramd_wait(struct vramd_conn *c, const struct vramd_token *t, int timeout_ms, struct vramd_session_info *info,
               struct vramd_error *err)
{
    vramd__clear_error(err);
    if (!c || !t)
        return vramd__fail(err, -EINVAL, VRAMD_CODE_LOCAL, "vramd_wait: NULL argument");
    char tok[VRAMD_TOKEN_STRLEN + 1];
    vramd_token_format(t, tok);
    Vramd__Rpc__V1__Wait w = VRAMD__RPC__V1__WAIT__INIT;
    w.token = tok;
    int rms = -1;
    if (timeout_ms >= 0) {
        w.has_timeout_ms = 1;
        w.timeout_ms = (uint32_t)timeout_ms;
        int slack = c->timeout_ms > 0 ? c->timeout_ms : WAIT_SLACK_MS;
        rms = timeout_ms > INT_MAX - slack ? INT_MAX : timeout_ms + slack;
    }
    Request req = VRAMD__RPC__V1__REQUEST__INIT;
    req.body_case = VRAMD__RPC__V1__REQUEST__BODY_WAIT;
    req.wait = &w;
    struct vramd_session_info local_info;
    struct vramd_error local_err;
    if (!info)
        info = &local_info;
    if (!err)
        err = &local_err;
    int r = session_call(c, &req, NULL, 0, rms, info, NULL, NULL, err);
    struct dump_entry *e = find_dump(c, t);
    if (!e) {
        if (r == 0 && info->kind == VRAMD_SESSION_DUMP) /* DONE, but its commit is the opener's */
            return vramd__fail(err, -EXDEV, VRAMD_CODE_LOCAL,
                               "this dump session was opened on another connection: that one commits its image "
                               "(vramd_wait there)");
        return r;
    }
    if (r == 0 && info->state == VRAMD_STATE_DONE) {
        if (e->d.phase == VRAMD__DUMP_OPEN) {
            r = vramd__dump_commit(&e->d, err); /* the client's part: the image goes into place */
            if (r < 0) {
                e->failed = true;
                e->failure = *err;
            }
            return r;
        }
        if (e->failed) {
            *err = e->failure;
            return e->failure.errnum;
        }
        return e->d.phase == VRAMD__DUMP_COMMITTED
                   ? 0
                   : vramd__fail(err, -ECANCELED, VRAMD_CODE_LOCAL, "the dump's files were removed: not committed");
    }
    if (r == -ETIMEDOUT && err->code == VRAMD_CODE_TIMEOUT)
        return r; /* the session goes on */
    if (info->state == VRAMD_STATE_FAILED || info->state == VRAMD_STATE_CANCELLED || err->code == VRAMD_CODE_NOT_FOUND ||
        c->broken) {
        /* ended without an image, or can no longer be committed from here: remove what it created */
        struct vramd_error first = *err;
        vramd__dump_abandon(&e->d);
        *err = first;
    }
    return r;
}

int vramd_cancel(struct vramd_conn *c, const struct vramd_token *t, const char *reason,
                 struct vramd_session_info *info, struct vramd_error *err)
{
    vramd__clear_error(err);
    if (!c || !t)
        return vramd__fail(err, -EINVAL, VRAMD_CODE_LOCAL, "vramd_cancel: NULL argument");
    char tok[VRAMD_TOKEN_STRLEN + 1];
    vramd_token_format(t, tok);
    Vramd__Rpc__V1__Cancel cn = VRAMD__RPC__V1__CANCEL__INIT;
    cn.token = tok;
    cn.reason = reason && *reason ? (char *)reason : NULL;
    Request req = VRAMD__RPC__V1__REQUEST__INIT;
    req.body_case = VRAMD__RPC__V1__REQUEST__BODY_CANCEL;
    req.cancel = &cn;
    return session_call(c, &req, NULL, 0, reply_ms(c), info, NULL, NULL, err);
}

int vramd_cancel_by_id(struct vramd_conn *c, uint64_t session_id, const char *reason,
                       struct vramd_session_info *info, struct vramd_error *err)
{
    vramd__clear_error(err);
    if (!c)
        return vramd__fail(err, -EINVAL, VRAMD_CODE_LOCAL, "vramd_cancel_by_id: NULL argument");
    Vramd__Rpc__V1__Cancel cn = VRAMD__RPC__V1__CANCEL__INIT;
    cn.has_session_id = 1;
    cn.session_id = session_id;
    cn.reason = reason && *reason ? (char *)reason : NULL;
    Request req = VRAMD__RPC__V1__REQUEST__INIT;
    req.body_case = VRAMD__RPC__V1__REQUEST__BODY_CANCEL;
    req.cancel = &cn;
    return session_call(c, &req, NULL, 0, reply_ms(c), info, NULL, NULL, err);
}

int vramd_list_sessions(struct vramd_conn *c, struct vramd_session_entry *out, size_t cap, struct vramd_error *err)
{
    vramd__clear_error(err);
    if (!c || (cap && !out))
        return vramd__fail(err, -EINVAL, VRAMD_CODE_LOCAL, "vramd_list_sessions: NULL argument");
    Vramd__Rpc__V1__ListSessions ls = VRAMD__RPC__V1__LIST_SESSIONS__INIT;
    Request req = VRAMD__RPC__V1__REQUEST__INIT;
    req.body_case = VRAMD__RPC__V1__REQUEST__BODY_LIST_SESSIONS;
    req.list_sessions = &ls;
    Response *resp;
    int r = call(c, &req, NULL, 0, reply_ms(c), &resp, err);
    if (r < 0) {
        free_response(resp);
        return r;
    }
    if (resp->body_case != VRAMD__RPC__V1__RESPONSE__BODY_SESSIONS || !resp->sessions) {
        free_response(resp);
        mark_broken(c);
        return vramd__fail(err, -EPROTO, VRAMD_CODE_PROTOCOL_ERROR, "ListSessions answered without a SessionList");
    }
    size_t n = resp->sessions->n_sessions;
    if (n > INT_MAX) {
        free_response(resp);
        mark_broken(c);
        return vramd__fail(err, -EPROTO, VRAMD_CODE_PROTOCOL_ERROR, "%zu sessions listed", n);
    }
    for (size_t i = 0; i < n && i < cap; i++) {
        const PbSessionInfo *s = resp->sessions->sessions[i];
        struct vramd_session_entry *e = &out[i];
        memset(e, 0, sizeof *e);
        info_from_pb(&e->info, s);
        if (!s)
            continue;
        e->n_target_pids = s->n_target_pids;
        for (size_t k = 0; k < s->n_target_pids && k < VRAMD_MAX_TARGET_PIDS; k++)
            e->target_pids[k] = s->target_pids[k];
        e->rate_bytes_per_s = s->rate_bytes_per_s;
        e->age_s = s->age_s;
    }
    free_response(resp);
    return (int)n;
}

int vramd_status(struct vramd_conn *c, struct vramd_status *st, struct vramd_error *err)
{
    vramd__clear_error(err);
    if (!c || !st)
        return vramd__fail(err, -EINVAL, VRAMD_CODE_LOCAL, "vramd_status: NULL argument");
    Vramd__Rpc__V1__GetStatus gs = VRAMD__RPC__V1__GET_STATUS__INIT;
    Request req = VRAMD__RPC__V1__REQUEST__INIT;
    req.body_case = VRAMD__RPC__V1__REQUEST__BODY_GET_STATUS;
    req.get_status = &gs;
    Response *resp;
    int r = call(c, &req, NULL, 0, reply_ms(c), &resp, err);
    if (r < 0) {
        free_response(resp);
        return r;
    }
    if (resp->body_case != VRAMD__RPC__V1__RESPONSE__BODY_STATUS || !resp->status) {
        free_response(resp);
        mark_broken(c);
        return vramd__fail(err, -EPROTO, VRAMD_CODE_PROTOCOL_ERROR, "GetStatus answered without a StatusReply");
    }
    const Vramd__Rpc__V1__StatusReply *s = resp->status;
    memset(st, 0, sizeof *st);
    copy_str(st->server, sizeof st->server, s->server);
    st->version = s->version;
    st->uptime_s = s->uptime_s;
    st->connections = s->connections;
    st->sessions = s->sessions;
    st->staging_budget = s->staging_budget;
    st->staging_in_use = s->staging_in_use;
    st->draining = s->has_draining && s->draining;
    free_response(resp);
    return 0;
}

/* --- AddBos ---------------------------------------------------------------- */

/* Index of fd in this message's fd map, or -1 (then *slot is where to insert it). */
static int fdmap_find(struct vramd_conn *c, int fd, unsigned *slot)
{
    unsigned h = ((unsigned)fd * 2654435761u) % FDMAP_SLOTS;
    for (;;) {
        if (c->fdmap_stamp[h] != c->fdmap_gen) {
            *slot = h;
            return -1;
        }
        if (c->fdmap_fd[h] == fd)
            return c->fdmap_index[h];
        h = (h + 1) % FDMAP_SLOTS;
    }
}

static void fdmap_reset(struct vramd_conn *c)
{
    if (++c->fdmap_gen == 0) { /* wrapped: clear the stamps once */
        memset(c->fdmap_stamp, 0, sizeof c->fdmap_stamp);
        c->fdmap_gen = 1;
    }
}

static uint32_t message_budget(const struct vramd_conn *c)
{
    uint32_t m = max_message(c);
    uint32_t b = m - 1024; /* room for the header, the token, the Request wrapper */
    return b < TARGET_MESSAGE_BYTES ? b : TARGET_MESSAGE_BYTES;
}

int vramd_add_bos(struct vramd_conn *c, const struct vramd_token *t, const struct vramd_bo *bos, size_t n,
                  struct vramd_session_info *info, struct vramd_error *err)
{
    vramd__clear_error(err);
    if (!c || !t || (n && !bos))
        return vramd__fail(err, -EINVAL, VRAMD_CODE_LOCAL, "vramd_add_bos: NULL argument");
    if (n == 0)
        return vramd_progress(c, t, info, err);
    for (size_t i = 0; i < n; i++)
        if (bos[i].fd < 0) {
            int r = vramd__fail(err, -EBADF, VRAMD_CODE_LOCAL, "BO %llu: fd %d", (unsigned long long)bos[i].id,
                                bos[i].fd);
            if (err) {
                err->has_bo_id = true;
                err->bo_id = bos[i].id;
            }
            return r;
        }
    if (c->broken)
        return vramd__fail(err, -ENOTCONN, VRAMD_CODE_LOCAL, "the connection to vramd is broken");

    uint32_t budget = message_budget(c);
    unsigned max_fds = c->limits.max_fds_per_message;
    size_t cap = budget / 8 + 2; /* every BO costs at least 8 bytes of budget */
    if (c->bo_cap < cap) {
        PbBo *b = realloc(c->bo_buf, cap * sizeof *b);
        if (!b)
            return fail_errno(err, ENOMEM, "AddBos buffer");
        c->bo_buf = b;
        PbBo **p = realloc(c->bo_ptrs, cap * sizeof *p);
        if (!p)
            return fail_errno(err, ENOMEM, "AddBos buffer");
        c->bo_ptrs = p;
        c->bo_cap = cap;
    }
    char tok[VRAMD_TOKEN_STRLEN + 1];
    vramd_token_format(t, tok);
    int r = 0;
    struct dump_entry *dump = find_dump(c, t);
    if (dump && dump->d.phase == VRAMD__DUMP_OPEN && (r = attach_dump_data(c, dump, tok, bos, n, err)) < 0)
        return r; /* the data files of the BOs' GPUs, before the first AddBos that needs them */
    int fds[VRAMD_SCM_MAX_FD];
    size_t i = 0;
    while (i < n) {
        fdmap_reset(c);
        size_t count = 0, nfds = 0;
        size_t size = VRAMD_TOKEN_STRLEN + 8;
        for (; i < n; i++) {
            const struct vramd_bo *in = &bos[i];
            PbBo *bo = &c->bo_buf[count];
            PbBo init = VRAMD__RPC__V1__BO__INIT;
            *bo = init;
            bo->has_id = in->id != 0, bo->id = in->id;
            bo->has_gpu_id = in->has_gpu_id, bo->gpu_id = in->gpu_id;
            bo->has_size = in->size != 0, bo->size = in->size;
            bo->has_alloc_flags = in->alloc_flags != 0, bo->alloc_flags = in->alloc_flags;
            bo->has_va_addr = in->va_addr != 0, bo->va_addr = in->va_addr;
            bo->name = in->name && *in->name ? (char *)in->name : NULL;
            bo->backend = in->backend && *in->backend ? (char *)in->backend : NULL;
            bo->has_offset = in->offset != 0, bo->offset = in->offset;
            unsigned slot = 0;
            int idx = fdmap_find(c, in->fd, &slot);
            bool new_fd = idx < 0;
            bo->fd_index = new_fd ? (uint32_t)nfds : (uint32_t)idx;
            bo->has_fd_index = bo->fd_index != 0;
            size_t bo_bytes = protobuf_c_message_get_packed_size(&bo->base) + 8;
            if (count && (size + bo_bytes > budget || (new_fd && nfds >= max_fds) || count + 1 >= c->bo_cap))
                break;
            if (new_fd) {
                if (fcntl(in->fd, F_GETFD) < 0) {
                    int e = errno;
                    r = vramd__fail(err, -e, VRAMD_CODE_LOCAL, "BO %llu: fd %d: %s", (unsigned long long)in->id,
                                    in->fd, strerrordesc_np(e) ? strerrordesc_np(e) : "error");
                    if (err)
                        err->has_bo_id = true, err->bo_id = in->id;
                    return r;
                }
                c->fdmap_stamp[slot] = c->fdmap_gen;
                c->fdmap_fd[slot] = in->fd;
                c->fdmap_index[slot] = (uint16_t)nfds;
                fds[nfds++] = in->fd;
            }
            c->bo_ptrs[count++] = bo;
            size += bo_bytes;
        }
        Vramd__Rpc__V1__AddBos ab = VRAMD__RPC__V1__ADD_BOS__INIT;
        ab.token = tok;
        ab.n_bos = count;
        ab.bos = c->bo_ptrs;
        Request req = VRAMD__RPC__V1__REQUEST__INIT;
        req.body_case = VRAMD__RPC__V1__REQUEST__BODY_ADD_BOS;
        req.add_bos = &ab;
        r = session_call(c, &req, fds, nfds, reply_ms(c), i == n ? info : NULL, NULL, NULL, err);
        if (r < 0)
            return r;
    }
    return 0;
}
