/* SPDX-License-Identifier: Apache-2.0 */
/*
 * libvramd: the transport (conn.h): one request and its reply on a connection.  vramd__call encodes the
 * frame (frame.c), sends it (send_frame), receives the reply (recv_frame), decodes it and checks that it
 * answers this request (check_reply).  Any doubt about the pairing of requests and replies marks the
 * connection broken.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <poll.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

#include "conn.h"

void vramd__mark_broken(struct vramd_conn *c)
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

uint32_t vramd__max_message(const struct vramd_conn *c)
{
    uint32_t m = c->limits.max_message_bytes ? c->limits.max_message_bytes : DEFAULT_MAX_MESSAGE;
    return m > MAX_RX_MESSAGE ? MAX_RX_MESSAGE : m;
}

/* The largest reply accepted: replies are not bound by max_message_bytes (a GetStatus
 * carries the metrics text), so at least the protocol's default, at most MAX_RX_MESSAGE. */
static size_t max_reply(const struct vramd_conn *c)
{
    uint32_t m = vramd__max_message(c);
    return m < DEFAULT_MAX_MESSAGE ? DEFAULT_MAX_MESSAGE : m;
}

int vramd__reply_ms(const struct vramd_conn *c)
{
    return c && c->timeout_ms > 0 ? c->timeout_ms : -1;
}

/* Send the frame in c->tx (len bytes) with its fds; a failure that leaves the stream in doubt breaks c. */
static int send_frame(struct vramd_conn *c, size_t len, const int *fds, size_t nfds, struct vramd_error *err)
{
    union vramd__fd_ctl ctl;
    struct iovec iov = {.iov_base = c->tx, .iov_len = len};
    struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1};
    vramd__frame_put_fds(&msg, &ctl, fds, nfds);
    int64_t deadline = c->timeout_ms > 0 ? vramd__now_ms() + c->timeout_ms : -1;
    for (;;) {
        ssize_t n = sendmsg(c->fd, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (n >= 0) {
            if ((size_t)n == len)
                return 0;
            vramd__mark_broken(c); /* impossible on SEQPACKET; never trust the rest of the stream */
            return vramd__fail(err, -EPROTO, VRAMD_CODE_LOCAL, "short send (%zd of %zu bytes)", n, len);
        }
        int e = errno;
        if (e == EINTR)
            continue;
        if (e == EAGAIN || e == EWOULDBLOCK) {
            int r = vramd__wait_fd(c->fd, POLLOUT, deadline);
            if (r == 0)
                continue;
            vramd__mark_broken(c);
            if (r == -ETIME)
                return vramd__fail(err, -ETIME, VRAMD_CODE_LOCAL, "vramd took no request for %d ms; connection closed",
                                   c->timeout_ms);
            return vramd__fail_errno(err, -r, "poll on the vramd socket");
        }
        if (e == EBADF || e == EMSGSIZE || e == ENOMEM || e == ENOBUFS || e == ETOOMANYREFS)
            /* nothing was sent: the connection is still in step */
            return vramd__fail_errno(err, e, e == EBADF ? "sending the request: an fd passed to vramd is not open"
                                                        : "sending the request to vramd");
        vramd__mark_broken(c);
        return vramd__fail_errno(err, e == EPIPE ? ECONNRESET : e, "sending the request to vramd");
    }
}

/* Receive one packet into c->rx within reply_ms (-1: no bound); *got its length.  Any fd it carries is closed.
 * Every failure breaks c. */
static int recv_frame(struct vramd_conn *c, int reply_ms, size_t *got, struct vramd_error *err)
{
    if (ensure_buf(&c->rx, &c->rx_cap, max_reply(c) + 1) < 0) {
        vramd__mark_broken(c);
        return vramd__fail_errno(err, ENOMEM, "reply buffer");
    }
    int64_t deadline = reply_ms >= 0 ? vramd__now_ms() + reply_ms : -1;
    for (;;) {
        union {
            char buf[CMSG_SPACE(sizeof(int) * 8)];
            struct cmsghdr align;
        } ctl;
        struct iovec iov = {.iov_base = c->rx, .iov_len = c->rx_cap};
        struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = ctl.buf, .msg_controllen = sizeof ctl.buf};
        ssize_t n = recvmsg(c->fd, &msg, MSG_CMSG_CLOEXEC | MSG_DONTWAIT);
        if (n > 0) {
            vramd__frame_close_fds(&msg);
            if (msg.msg_flags & (MSG_TRUNC | MSG_CTRUNC) || (size_t)n > max_reply(c)) {
                vramd__mark_broken(c);
                return vramd__fail(err, -EPROTO, VRAMD_CODE_PROTOCOL_ERROR, "reply from vramd truncated (%zd bytes%s)",
                                   n, msg.msg_flags & MSG_CTRUNC ? ", unexpected fds" : "");
            }
            *got = (size_t)n;
            return 0;
        }
        if (n == 0) {
            vramd__frame_close_fds(&msg);
            vramd__mark_broken(c);
            return vramd__fail(err, -ECONNRESET, VRAMD_CODE_LOCAL, "vramd closed the connection");
        }
        int e = errno;
        if (e == EINTR)
            continue;
        if (e == EAGAIN || e == EWOULDBLOCK) {
            int r = vramd__wait_fd(c->fd, POLLIN, deadline);
            if (r == 0)
                continue;
            vramd__mark_broken(c);
            if (r == -ETIME)
                return vramd__fail(err, -ETIME, VRAMD_CODE_LOCAL, "no reply from vramd in %d ms; connection closed",
                                   reply_ms);
            return vramd__fail_errno(err, -r, "poll on the vramd socket");
        }
        vramd__mark_broken(c);
        return vramd__fail_errno(err, e == EPIPE ? ECONNRESET : e, "receiving the reply from vramd");
    }
}

/* Whether resp answers request `id`: 0 (resp's own error, if any, in *err: its errno), or a broken connection. */
static int check_reply(struct vramd_conn *c, uint64_t id, const Response *resp, struct vramd_error *err)
{
    uint64_t rid = resp->has_id ? resp->id : 0;
    int code = resp->error ? resp->error->code : VRAMD_CODE_OK;
    if (rid == 0 && code != VRAMD_CODE_OK) {
        /* the daemon's connection-level refusal or protocol error: it closes the connection */
        vramd__mark_broken(c);
        return vramd__error_from_pb(err, resp->error);
    }
    if (rid != id) {
        vramd__mark_broken(c);
        return vramd__fail(err, -EPROTO, VRAMD_CODE_PROTOCOL_ERROR, "reply for request %llu, expected %llu",
                           (unsigned long long)rid, (unsigned long long)id);
    }
    return code != VRAMD_CODE_OK ? vramd__error_from_pb(err, resp->error) : 0;
}

int vramd__call(struct vramd_conn *c, Request *req, const int *fds, size_t nfds, int reply_ms, Response **out,
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
    size_t body = vramd__frame_body_size(req);
    uint32_t limit = vramd__max_message(c);
    if (body > limit - VRAMD__FRAME_HEADER)
        return vramd__fail(err, -E2BIG, VRAMD_CODE_LOCAL, "request of %zu bytes exceeds the daemon's %u-byte limit",
                           body + VRAMD__FRAME_HEADER, limit);
    if (ensure_buf(&c->tx, &c->tx_cap, VRAMD__FRAME_HEADER + body) < 0)
        return vramd__fail_errno(err, ENOMEM, "request buffer");
    if (vramd__frame_encode(req, body, c->tx) < 0)
        return vramd__fail(err, -EPROTO, VRAMD_CODE_LOCAL, "protobuf-c packed a different size than it measured");
    size_t got = 0;
    int r = send_frame(c, VRAMD__FRAME_HEADER + body, fds, nfds, err);
    if (r == 0)
        r = recv_frame(c, reply_ms, &got, err);
    if (r < 0)
        return r;
    const char *why;
    Response *resp;
    if (vramd__frame_decode(c->rx, got, &resp, &why) < 0) {
        vramd__mark_broken(c);
        return vramd__fail(err, -EPROTO, VRAMD_CODE_PROTOCOL_ERROR, "%s", why);
    }
    r = check_reply(c, req->id, resp, err);
    if (c->broken) {
        vramd__free_response(resp);
        return r;
    }
    *out = resp;
    return r;
}

int vramd__call_for(struct vramd_conn *c, Request *req, int body, int reply_ms, Response **out, const char *missing,
                    struct vramd_error *err)
{
    int r = vramd__call(c, req, NULL, 0, reply_ms, out, err);
    if (r == 0 && (*out)->body_case != (Vramd__Rpc__V1__Response__BodyCase)body) {
        vramd__mark_broken(c);
        r = vramd__fail(err, -EPROTO, VRAMD_CODE_PROTOCOL_ERROR, "%s", missing);
    }
    if (r < 0) {
        vramd__free_response(*out);
        *out = NULL;
    }
    return r;
}

int vramd__session_call(struct vramd_conn *c, Request *req, const int *fds, size_t nfds, int reply_ms,
                        struct vramd_session_info *info, PbSessionInfo **keep, Response **keep_resp,
                        struct vramd_error *err)
{
    Response *resp;
    if (info)
        memset(info, 0, sizeof *info);
    int r = vramd__call(c, req, fds, nfds, reply_ms, &resp, err);
    if (!resp)
        return r;
    bool has_body = resp->body_case == VRAMD__RPC__V1__RESPONSE__BODY_SESSION && resp->session;
    if (r == 0 && !has_body) {
        vramd__free_response(resp);
        vramd__mark_broken(c);
        return vramd__fail(err, -EPROTO, VRAMD_CODE_PROTOCOL_ERROR, "reply without the SessionInfo it must carry");
    }
    if (has_body)
        vramd__info_from_pb(info, resp->session);
    if (keep && has_body) {
        *keep = resp->session;
        *keep_resp = resp;
        return r;
    }
    vramd__free_response(resp);
    return r;
}
