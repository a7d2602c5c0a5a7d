/* SPDX-License-Identifier: Apache-2.0 */
/* libvramd: AddBos: a session's BOs, split into messages that fit the negotiated limits. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "abi.h"
#include "conn.h"
#include "session.h"

static int add_bos(struct vramd_conn *c, const struct vramd_token *t, const struct vramd_bo *bos, size_t n,
                   struct vramd_session_info *info, struct vramd_error *err);

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

uint32_t vramd__message_budget(const struct vramd_conn *c)
{
    uint32_t m = vramd__max_message(c);
    uint32_t b = m - 1024; /* room for the header, the token, the Request wrapper */
    return b < TARGET_MESSAGE_BYTES ? b : TARGET_MESSAGE_BYTES;
}

/* The BOs' own checks before anything is sent: an fd, a backend its two spellings agree on. */
static int check_bos(const struct vramd_bo *bos, size_t n, struct vramd_error *err)
{
    for (size_t i = 0; i < n; i++) {
        char what[48];
        const char *backend;
        int r = 0;
        snprintf(what, sizeof what, "BO %llu", (unsigned long long)bos[i].id);
        if (bos[i].fd < 0)
            r = vramd__fail(err, -EBADF, VRAMD_CODE_LOCAL, "%s: fd %d", what, bos[i].fd);
        else
            r = vramd__backend_of(bos[i].backend, bos[i].backend_kind, &backend, what, err);
        if (r < 0) {
            if (err) {
                err->has_bo_id = true;
                err->bo_id = bos[i].id;
            }
            return r;
        }
    }
    return 0;
}

int vramd_add_bos(struct vramd_conn *c, const struct vramd_token *t, const struct vramd_bo *bos, size_t n,
                  struct vramd_session_info *info, struct vramd_error *err)
{
    vramd__clear_error(err);
    if (!c || !t || (n && !bos))
        return vramd__fail(err, -EINVAL, VRAMD_CODE_LOCAL, "vramd_add_bos: NULL argument");
    if (n == 0)
        return vramd_progress(c, t, info, err);
    size_t stride;
    int r = vramd__abi_stride(bos, n, sizeof *bos, VRAMD__BO_1_0, "vramd_bo", &stride, err);
    if (r < 0)
        return r;
    struct vramd_bo *copy = NULL; /* the BOs in this library's layout, where the caller's is another */
    if (stride != sizeof *bos) {
        copy = malloc(n * sizeof *copy);
        if (!copy)
            return vramd__fail_errno(err, ENOMEM, "vramd_add_bos");
        for (size_t i = 0; i < n; i++)
            vramd__abi_elem(bos, stride, i, sizeof *copy, &copy[i]);
        bos = copy;
    }
    r = add_bos(c, t, bos, n, info, err);
    free(copy);
    return r;
}

/* vramd_add_bos on BOs in this library's layout. */
static int add_bos(struct vramd_conn *c, const struct vramd_token *t, const struct vramd_bo *bos, size_t n,
                   struct vramd_session_info *info, struct vramd_error *err)
{
    int r = check_bos(bos, n, err);
    if (r < 0)
        return r;
    if (c->broken)
        return vramd__fail(err, -ENOTCONN, VRAMD_CODE_LOCAL, "the connection to vramd is broken");

    uint32_t budget = vramd__message_budget(c);
    unsigned max_fds = c->limits.max_fds_per_message;
    size_t cap = budget / 8 + 2; /* every BO costs at least 8 bytes of budget */
    if (c->bo_cap < cap) {
        PbBo *b = realloc(c->bo_buf, cap * sizeof *b);
        if (!b)
            return vramd__fail_errno(err, ENOMEM, "AddBos buffer");
        c->bo_buf = b;
        PbBo **p = realloc(c->bo_ptrs, cap * sizeof *p);
        if (!p)
            return vramd__fail_errno(err, ENOMEM, "AddBos buffer");
        c->bo_ptrs = p;
        c->bo_cap = cap;
    }
    char tok[VRAMD_TOKEN_STRLEN + 1];
    vramd_token_format(t, tok);
    struct dump_entry *dump = vramd__find_dump(c, t);
    if (dump && dump->d.phase == VRAMD__DUMP_OPEN && (r = vramd__attach_dump_data(c, dump, tok, bos, n, err)) < 0)
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
            const char *backend;
            (void)vramd__backend_of(in->backend, in->backend_kind, &backend, "", NULL); /* checked: check_bos */
            bo->backend = (char *)backend;
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
        r = vramd__session_call(c, &req, fds, nfds, vramd__reply_ms(c), i == n ? info : NULL, NULL, NULL, err);
        if (r < 0)
            return r;
    }
    return 0;
}
