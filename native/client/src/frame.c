/* SPDX-License-Identifier: Apache-2.0 */
/* libvramd: the frame codec (frame.h): frames in and out of buffers, fds in and out of control messages. */
#define _GNU_SOURCE
#include <errno.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "frame.h"

#define FRAME_MAGIC "VRDP"
#define FRAME_VERSION 1
#define KIND_REQUEST 1
#define KIND_RESPONSE 2

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

size_t vramd__frame_body_size(const Request *req)
{
    return protobuf_c_message_get_packed_size(&req->base);
}

int vramd__frame_encode(const Request *req, size_t body, uint8_t *buf)
{
    memcpy(buf, FRAME_MAGIC, 4);
    buf[4] = FRAME_VERSION;
    buf[5] = KIND_REQUEST;
    buf[6] = buf[7] = 0;
    put_le32(buf + 8, (uint32_t)body);
    return protobuf_c_message_pack(&req->base, buf + VRAMD__FRAME_HEADER) == body ? 0 : -EPROTO;
}

int vramd__frame_decode(const uint8_t *p, size_t n, Response **out, const char **why)
{
    *out = NULL;
    if (n < VRAMD__FRAME_HEADER || memcmp(p, FRAME_MAGIC, 4) != 0 || p[4] != FRAME_VERSION || p[5] != KIND_RESPONSE ||
        p[6] || p[7] || get_le32(p + 8) != (uint32_t)(n - VRAMD__FRAME_HEADER)) {
        *why = "bad frame header in a reply from vramd";
        return -EPROTO;
    }
    *out = vramd__rpc__v1__response__unpack(NULL, n - VRAMD__FRAME_HEADER, p + VRAMD__FRAME_HEADER);
    if (!*out) {
        *why = "undecodable reply from vramd";
        return -EPROTO;
    }
    return 0;
}

void vramd__free_response(Response *resp)
{
    if (resp)
        vramd__rpc__v1__response__free_unpacked(resp, NULL);
}

void vramd__frame_put_fds(struct msghdr *msg, union vramd__fd_ctl *ctl, const int *fds, size_t nfds)
{
    if (!nfds)
        return;
    memset(ctl->buf, 0, CMSG_SPACE(sizeof(int) * nfds));
    msg->msg_control = ctl->buf;
    msg->msg_controllen = CMSG_SPACE(sizeof(int) * nfds);
    struct cmsghdr *cm = CMSG_FIRSTHDR(msg);
    cm->cmsg_level = SOL_SOCKET;
    cm->cmsg_type = SCM_RIGHTS;
    cm->cmsg_len = CMSG_LEN(sizeof(int) * nfds);
    memcpy(CMSG_DATA(cm), fds, sizeof(int) * nfds);
}

void vramd__frame_close_fds(struct msghdr *msg)
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

/* --- the daemon's messages as the public structs --------------------------- */

int vramd__error_from_pb(struct vramd_error *err, const Vramd__Rpc__V1__Error *e)
{
    int errnum = vramd_code_errno(e->code);
    if (err) {
        memset(err, 0, sizeof *err);
        err->errnum = errnum;
        err->code = e->code;
        vramd__copy_str(err->message, sizeof err->message, e->message);
        vramd__one_line(err->message);
        err->has_bo_id = e->has_bo_id;
        err->bo_id = e->bo_id;
        err->has_offset = e->has_offset;
        err->offset = e->offset;
    }
    return errnum;
}

void vramd__info_from_pb(struct vramd_session_info *info, const PbSessionInfo *s)
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
    vramd__copy_str(info->label, sizeof info->label, s->label);
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
        vramd__copy_str(info->image.compression, sizeof info->image.compression, s->image->compression);
    }
    if (s->error && (int)s->error->code != VRAMD_CODE_OK)
        vramd__error_from_pb(&info->error, s->error);
}
