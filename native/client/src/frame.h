/* SPDX-License-Identifier: Apache-2.0 */
/*
 * libvramd internals: the frame codec (frame.c).  One packet is a 12-byte frame header ("VRDP", version 1,
 * kind, two zero bytes, the body's length, little endian) and one protobuf message (docs/protocol.md,
 * "Framing"); fds travel as one SCM_RIGHTS control message of the same packet.  Pure functions over
 * buffers: no socket, no connection state.  The conversions of the daemon's messages into the public
 * structs live here too.
 */
#ifndef VRAMD_FRAME_H
#define VRAMD_FRAME_H

#include <sys/socket.h>

#include "base.h"
#include "rpc.pb-c.h"

typedef Vramd__Rpc__V1__Request Request;
typedef Vramd__Rpc__V1__Response Response;
typedef Vramd__Rpc__V1__SessionInfo PbSessionInfo;
typedef Vramd__Rpc__V1__Bo PbBo;
typedef Vramd__Rpc__V1__FileRef PbFileRef;

#define VRAMD__FRAME_HEADER 12

/* Control-message room for the most fds one packet may carry. */
union vramd__fd_ctl {
    char buf[CMSG_SPACE(sizeof(int) * VRAMD_SCM_MAX_FD)];
    struct cmsghdr align;
};

/* The packed size of req's message (the frame's body). */
size_t vramd__frame_body_size(const Request *req);
/* req as one request frame in buf (VRAMD__FRAME_HEADER + body bytes, body = vramd__frame_body_size).
 * 0, or -EPROTO when protobuf-c packs another size than it measured. */
int vramd__frame_encode(const Request *req, size_t body, uint8_t *buf);
/* One received packet of n bytes as a response frame: 0 and *out (the caller frees it: vramd__free_response);
 * -EPROTO with *why naming what is wrong (a bad header, an undecodable message), *out NULL. */
int vramd__frame_decode(const uint8_t *p, size_t n, Response **out, const char **why);
void vramd__free_response(Response *resp);

/* Attach nfds fds (at most VRAMD_SCM_MAX_FD) to msg as one SCM_RIGHTS message in ctl; none: no control. */
void vramd__frame_put_fds(struct msghdr *msg, union vramd__fd_ctl *ctl, const int *fds, size_t nfds);
/* Close every fd that came with a received packet (the daemon sends none). */
void vramd__frame_close_fds(struct msghdr *msg);

/* The daemon's Error as *err (may be NULL); returns the errno its code maps to (vramd_code_errno). */
int vramd__error_from_pb(struct vramd_error *err, const Vramd__Rpc__V1__Error *e);
/* A SessionInfo as the public struct (info and s may be NULL: nothing is done). */
void vramd__info_from_pb(struct vramd_session_info *info, const PbSessionInfo *s);

#endif
