/* SPDX-License-Identifier: Apache-2.0 */
/* libvramd: AttachFiles: the files a session needs handed to the daemon, as many messages as the fd and byte
 * limits take: an image's and its parents' files the OpenSession reply asks for, a dump's own data files
 * before the AddBos that needs them (session.h). */
#define _GNU_SOURCE
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "conn.h"
#include "session.h"

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
    return vramd__session_call(c, &req, fds, nfds, vramd__reply_ms(c), info, NULL, NULL, err);
}

void vramd__close_all(const int *fds, size_t n)
{
    for (size_t i = 0; i < n; i++)
        vramd__close_fd(fds[i]);
}

/*
 * Open and attach every file the OpenSession reply asked for: image 0 in dirs[0], image k in dirs[k]
 * (dirs[0] is -1 for a dump: its own files are not needed, they are made).  As many messages as the fd
 * and byte limits need; each message's fds are closed once it is sent (the daemon has its own).
 */
int vramd__attach_needed(struct vramd_conn *c, char *tok, PbFileRef *const *needed, size_t n, const int *dirs,
                         size_t ndirs, struct vramd_session_info *info, struct vramd_error *err)
{
    bool direct;
    unsigned max_fds = attach_max_fds(c, &direct);
    uint32_t budget = vramd__message_budget(c);
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
                vramd__close_all(fds, nfds);
                vramd__mark_broken(c);
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
                vramd__close_all(fds, nfds);
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
        vramd__close_all(fds, nfds);
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
int vramd__attach_dump_data(struct vramd_conn *c, struct dump_entry *e, char *tok, const struct vramd_bo *bos,
                            size_t n, struct vramd_error *err)
{
    bool direct;
    unsigned max_fds = attach_max_fds(c, &direct);
    PbFileRef refs[VRAMD_SCM_MAX_FD];
    PbFileRef *ptrs[VRAMD_SCM_MAX_FD];
    char names[VRAMD_SCM_MAX_FD][VRAMD__NAME_MAX];
    struct vramd__data_file made[VRAMD_SCM_MAX_FD];
    int fds[VRAMD_SCM_MAX_FD];
    uint32_t budget = vramd__message_budget(c);
    uint32_t stripes = e->d.stripes;
    size_t i = 0;
    uint32_t k = 0; /* the next file: stripe k of bos[i]'s GPU (k > 0: that GPU's files are being made) */
    while (i < n) {
        size_t count = 0, nfds = 0, size = VRAMD_TOKEN_STRLEN + 8;
        int r = 0;
        while (i < n) {
            uint32_t gpu = bos[i].has_gpu_id ? bos[i].gpu_id : 0;
            /* a GPU the daemon does not know gets no file: its BO's refusal names the BO */
            if (k == stripes || (k == 0 && (vramd__dump_has_gpu(&e->d, gpu) || !vramd__gpu_allowed(c, gpu)))) {
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
        vramd__close_all(fds, nfds);
        if (r < 0) {
            for (size_t j = 0; j < count; j++)
                vramd__dump_drop_data(&e->d, made[j].gpu_id, made[j].stripe);
            return r;
        }
    }
    return 0;
}
