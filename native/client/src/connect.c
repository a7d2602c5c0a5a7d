/* SPDX-License-Identifier: Apache-2.0 */
/* libvramd: connections: connect (path, fd), Hello, close, what Hello said. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/time.h>
#include <unistd.h>

#include "abi.h"
#include "auth.h"
#include "conn.h"
#include "session.h"


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
    int r = vramd__call_for(c, &req, VRAMD__RPC__V1__RESPONSE__BODY_HELLO, vramd__reply_ms(c), &resp,
                            "Hello answered without a HelloReply", err);
    if (r < 0)
        return r;
    const Vramd__Rpc__V1__HelloReply *hr = resp->hello;
    if (hr->version != VRAMD_PROTOCOL_VERSION) {
        vramd__mark_broken(c);
        r = vramd__fail(err, -EPROTONOSUPPORT, VRAMD_CODE_UNSUPPORTED_PROTOCOL,
                        "vramd chose protocol version %u, which this library does not speak", hr->version);
        goto out;
    }
    c->version = hr->version;
    vramd__copy_str(c->server, sizeof c->server, hr->server);
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
        vramd__mark_broken(c);
        r = vramd__fail(err, -EPROTO, VRAMD_CODE_PROTOCOL_ERROR, "vramd's max_message_bytes %u is below %u",
                        c->limits.max_message_bytes, MIN_MAX_MESSAGE);
        goto out;
    }
    if (!c->limits.max_fds_per_message || c->limits.max_fds_per_message > VRAMD_SCM_MAX_FD)
        c->limits.max_fds_per_message = VRAMD_SCM_MAX_FD;
    c->n_backends = 0;
    for (size_t i = 0; i < hr->n_backends && c->n_backends < MAX_BACKENDS; i++) {
        const Vramd__Rpc__V1__BackendInfo *b = hr->backends[i];
        if (b && b->has_available && b->available && b->name)
            vramd__copy_str(c->backends[c->n_backends++], sizeof c->backends[0], b->name);
    }
    free(c->gpus);
    c->gpus = NULL, c->n_gpus = 0;
    if (hr->n_allowed_gpu_ids) {
        c->gpus = malloc(hr->n_allowed_gpu_ids * sizeof *c->gpus);
        if (!c->gpus) {
            r = vramd__fail_errno(err, ENOMEM, "the daemon's GPU list");
            goto out;
        }
        memcpy(c->gpus, hr->allowed_gpu_ids, hr->n_allowed_gpu_ids * sizeof *c->gpus);
        c->n_gpus = hr->n_allowed_gpu_ids;
    }
out:
    vramd__free_response(resp);
    return r;
}

/* Whether a BO may name this GPU (the daemon's list from Hello; with no list, every GPU may). */
bool vramd__gpu_allowed(const struct vramd_conn *c, uint32_t gpu_id)
{
    for (size_t i = 0; i < c->n_gpus; i++)
        if (c->gpus[i] == gpu_id)
            return true;
    return c->n_gpus == 0;
}

/* The caller's options (NULL: the defaults) in this library's layout (client.h, "ABI 1.0"). */
static int options_of(const struct vramd_options *in, struct vramd_options *o, struct vramd_error *err)
{
    if (!in) {
        vramd_options_init(o);
        return 0;
    }
    int r = vramd__abi_in(in, sizeof *o, VRAMD__OPTIONS_1_0, "vramd_options", o, err);
    if (r == 0) {
        o->min_fd = o->min_fd > 0 ? o->min_fd : 0;
        o->timeout_ms = o->timeout_ms > 0 ? o->timeout_ms : 0;
    }
    return r;
}

/* A connection on fd (taken over in every case), negotiated with Hello. */
static int conn_new(struct vramd_conn **out, int fd, const struct vramd_options *o, struct vramd_error *err)
{
    struct vramd_conn *c = calloc(1, sizeof *c);
    if (!c) {
        vramd__close_fd(fd);
        return vramd__fail_errno(err, ENOMEM, "connection");
    }
    c->fd = fd;
    c->next_id = 1;
    c->min_fd = o->min_fd;
    c->timeout_ms = o->timeout_ms;
    int r = hello(c, o->client_name, err);
    if (r < 0) {
        vramd_close(c);
        return r;
    }
    *out = c;
    return 0;
}

/* Set (timeout_ms) or clear (0) SO_SNDTIMEO, which bounds connect() when the daemon's backlog is full. */
static int connect_bound(int fd, int timeout_ms, struct vramd_error *err)
{
    struct timeval tv = {.tv_sec = timeout_ms / 1000, .tv_usec = (timeout_ms % 1000) * 1000};
    if (setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv) < 0)
        return vramd__fail_errno(err, errno, "setsockopt(SO_SNDTIMEO)");
    return 0;
}

int vramd_connect_path(struct vramd_conn **out, const char *path, const struct vramd_options *opts,
                       struct vramd_error *err)
{
    vramd__clear_error(err);
    if (!out || !path)
        return vramd__fail(err, -EINVAL, VRAMD_CODE_LOCAL, "vramd_connect_path: NULL argument");
    *out = NULL;
    struct vramd_options o;
    int r = options_of(opts, &o, err);
    if (r < 0)
        return r;
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    size_t len = strlen(path);
    if (len == 0 || len >= sizeof sa.sun_path)
        return vramd__fail(err, -ENAMETOOLONG, VRAMD_CODE_LOCAL, "socket path of %zu bytes (at most %zu)", len,
                           sizeof sa.sun_path - 1);
    memcpy(sa.sun_path, path, len + 1);
    struct trust trust;
    vramd__trust_init(&trust);
    if ((r = vramd__check_socket_path(path, &trust, err)) < 0)
        return r;

    int fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return vramd__fail_errno(err, errno, "socket(AF_UNIX, SOCK_SEQPACKET)");
    fd = vramd__place_fd(fd, o.min_fd);
    if (fd < 0)
        return vramd__fail(err, fd, VRAMD_CODE_LOCAL, "cannot place the socket at fd >= %d: %s", o.min_fd,
                           vramd_strerror(fd));
    if (o.timeout_ms && (r = connect_bound(fd, o.timeout_ms, err)) < 0)
        goto fail;
    do
        r = connect(fd, (struct sockaddr *)&sa, (socklen_t)(offsetof(struct sockaddr_un, sun_path) + len + 1));
    while (r < 0 && errno == EINTR);
    if (r < 0) {
        int e = errno;
        if (e == EAGAIN)
            r = vramd__fail(err, -ETIME, VRAMD_CODE_LOCAL, "cannot connect to vramd at %s: no room in its backlog "
                            "within %d ms", path, o.timeout_ms);
        else
            r = vramd__fail(err, -e, VRAMD_CODE_LOCAL, "cannot connect to vramd at %s: %s", path,
                            strerrordesc_np(e) ? strerrordesc_np(e) : "error");
        goto fail;
    }
    if ((o.timeout_ms && (r = connect_bound(fd, 0, err)) < 0) || (r = vramd__check_peer(fd, path, &trust, err)) < 0)
        goto fail;
    return conn_new(out, fd, &o, err);
fail:
    vramd__close_fd(fd);
    return r;
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
    struct vramd_options o;
    int r;
    if (!out) {
        r = vramd__fail(err, -EINVAL, VRAMD_CODE_LOCAL, "vramd_connect_fd: NULL argument");
        goto fail;
    }
    *out = NULL;
    if (fd < 0)
        return vramd__fail(err, -EBADF, VRAMD_CODE_LOCAL, "vramd_connect_fd: fd %d", fd);
    int type = 0, domain = 0;
    socklen_t tl = sizeof type, dl = sizeof domain;
    if (getsockopt(fd, SOL_SOCKET, SO_TYPE, &type, &tl) < 0 || getsockopt(fd, SOL_SOCKET, SO_DOMAIN, &domain, &dl) < 0) {
        int e = errno;
        r = vramd__fail_errno(err, e, "vramd_connect_fd: not a socket");
        if (e == EBADF)
            return r; /* nothing to close */
        goto fail;
    }
    if (type != SOCK_SEQPACKET || domain != AF_UNIX) {
        r = vramd__fail(err, -EPROTOTYPE, VRAMD_CODE_LOCAL, "vramd_connect_fd: not an AF_UNIX SOCK_SEQPACKET socket");
        goto fail;
    }
    int flags = fcntl(fd, F_GETFD);
    if (flags < 0 || fcntl(fd, F_SETFD, flags | FD_CLOEXEC) < 0) {
        r = vramd__fail_errno(err, errno, "fcntl(FD_CLOEXEC)");
        goto fail;
    }
    if ((r = options_of(opts, &o, err)) < 0)
        goto fail;
    return conn_new(out, fd, &o, err);
fail:
    vramd__close_fd(fd);
    return r;
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

bool vramd_conn_has_backend_kind(const struct vramd_conn *c, int backend)
{
    const char *name = vramd_backend_name(backend);
    return name && vramd_conn_has_backend(c, name);
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
