/* SPDX-License-Identifier: Apache-2.0 */
/* libvramd: sessions: open (attach.c hands over the files the daemon needs), start, progress, wait (a dump's
 * commit), cancel, close; the dump sessions a connection keeps client state for. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdlib.h>
#include <string.h>

#include "abi.h"
#include "conn.h"
#include "session.h"

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

struct dump_entry *vramd__find_dump(struct vramd_conn *c, const struct vramd_token *t)
{
    for (size_t i = 0; i < c->n_dumps; i++)
        if (memcmp(c->dumps[i].token.bytes, t->bytes, VRAMD_TOKEN_BYTES) == 0)
            return &c->dumps[i];
    return NULL;
}

/* Forget a dump's client state: abandoned first unless committed (removes what it created, unlocks). */
void vramd__drop_dump(struct vramd_conn *c, struct dump_entry *e)
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
            return vramd__fail_errno(err, ENOMEM, "dump session table");
        c->dumps = p;
        c->cap_dumps = cap;
    }
    struct dump_entry *e = &c->dumps[c->n_dumps++];
    memset(e, 0, sizeof *e);
    e->token = *t;
    e->d = *d;
    return 0;
}

/* End a session this call opened and cannot hand over (its files could not be attached). */
static void close_quietly(struct vramd_conn *c, const struct vramd_token *t)
{
    struct vramd_error ignored;
    if (!c->broken)
        (void)vramd_close_session(c, t, NULL, &ignored);
    struct dump_entry *e = vramd__find_dump(c, t);
    if (e)
        vramd__drop_dump(c, e);
}

/* What vramd_open_session checks before anything is opened or sent. */
static int check_open_args(const struct vramd_conn *c, const struct vramd_open_args *a, struct vramd_error *err)
{
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
    if (a->supply_fd > 0 && dump)
        return vramd__fail(err, -EINVAL, VRAMD_CODE_LOCAL, "a dump takes no supply fd (streamed restores only)");
    if (a->supply_fd < -1 || (a->supply_fd > 0 && fcntl(a->supply_fd, F_GETFD) < 0))
        return vramd__fail(err, -EBADF, VRAMD_CODE_LOCAL, "supply fd %d", a->supply_fd);
    if (c->broken)
        return vramd__fail(err, -ENOTCONN, VRAMD_CODE_LOCAL, "the connection to vramd is broken");
    if (dump && c->n_dumps >= MAX_CONN_DUMPS)
        return vramd__fail(err, -EMFILE, VRAMD_CODE_LOCAL,
                           "this connection holds %d dump sessions: close some (vramd_close_session)", MAX_CONN_DUMPS);
    return 0;
}

/*
 * Open the manifests a session passes: a restore's or verify's own (dirs[0]; a dump has none of its own yet),
 * then each parent's (dirs[k]), appended to fds[*nfds]; indexes[k - 1] is parent k's index.  On failure the
 * ones opened here stay in fds[0..*nfds) for the caller to close.
 */
static int open_manifests(const int *dirs, size_t np, bool dump, int min_fd, int *fds, size_t *nfds,
                          uint32_t *indexes, struct vramd_error *err)
{
    for (size_t k = dump ? 1 : 0; k <= np; k++) {
        int fd, unused;
        int r = vramd__open_image_file(dirs[k], VRAMD__MANIFEST_NAME, false, min_fd, &fd, &unused, err);
        if (r == -ENOENT) { /* say which image has none */
            char dir[PATH_MAX];
            vramd__dir_label(dirs[k], dir, sizeof dir);
            if (k == 0)
                return vramd__fail(err, r, VRAMD_CODE_LOCAL, "no image in %s: %s is missing", dir,
                                   VRAMD__MANIFEST_NAME);
            return vramd__fail(err, r, VRAMD_CODE_LOCAL, "parent #%zu holds no image: %s/%s is missing", k, dir,
                               VRAMD__MANIFEST_NAME);
        }
        if (r < 0)
            return r;
        if (k > 0)
            indexes[k - 1] = (uint32_t)*nfds;
        fds[(*nfds)++] = fd;
    }
    return 0;
}

/* The OpenSession request of a (checked) vramd_open_args. */
static void open_request(const struct vramd_open_args *a, const char *compression, uint32_t *indexes,
                         Vramd__Rpc__V1__OpenSession *o)
{
    bool dump = a->kind == VRAMD_SESSION_DUMP;
    o->has_kind = 1;
    o->kind = (Vramd__Rpc__V1__SessionKind)a->kind;
    o->has_manifest_fd_index = !dump; /* index 0 */
    o->manifest_fd_index = 0;
    o->compression = (char *)compression;
    o->has_chunk_size = a->chunk_size != 0;
    o->chunk_size = a->chunk_size;
    o->label = a->label && *a->label ? (char *)a->label : NULL;
    o->has_allow_partial = a->allow_partial;
    o->allow_partial = a->allow_partial;
    o->n_parent_manifest_fd_indexes = a->n_parent_dir_fds;
    o->parent_manifest_fd_indexes = indexes;
    o->parent_hint = a->parent_hint && *a->parent_hint ? (char *)a->parent_hint : NULL;
    o->has_no_dedup = a->no_dedup;
    o->no_dedup = a->no_dedup;
    o->has_replace_parent = a->replace_parent;
    o->replace_parent = a->replace_parent;
    o->has_hold_s = a->hold_s != 0;
    o->hold_s = a->hold_s > UINT32_MAX ? UINT32_MAX : (uint32_t)a->hold_s;
}

/* A streamed session's supply fd, duplicated (close-on-exec, at or above min_fd) after the manifests in fds:
 * the request names its index; the duplicate is closed with them, the caller's stays open. */
static int add_supply(int supply_fd, int min_fd, int *fds, size_t *nfds, Vramd__Rpc__V1__OpenSession *o,
                      struct vramd_error *err)
{
    int fd = fcntl(supply_fd, F_DUPFD_CLOEXEC, min_fd);
    if (fd < 0)
        return vramd__fail(err, -errno, VRAMD_CODE_LOCAL, "supply fd %d: %s", supply_fd, strerror(errno));
    o->has_supply_fd_index = 1;
    o->supply_fd_index = (uint32_t)*nfds;
    fds[(*nfds)++] = fd;
    return 0;
}

/* A dump's OpenSession reply: its image id and data files per GPU into d.  -EPROTO when it lacks them. */
static int dump_from_reply(const PbSessionInfo *s, struct vramd__dump *d, struct vramd_error *err)
{
    if (!s->has_image_id || s->image_id.len != VRAMD__ID_BYTES)
        return vramd__fail(err, -EPROTO, VRAMD_CODE_PROTOCOL_ERROR,
                           "OpenSession reply of a dump without the image id (16 bytes)");
    /* how many data files it takes per GPU: 0 (a daemon older than the field) means one */
    uint32_t stripes = s->has_data_files_per_gpu && s->data_files_per_gpu ? s->data_files_per_gpu : 1;
    if (stripes > VRAMD__MAX_STRIPES)
        return vramd__fail(err, -EPROTO, VRAMD_CODE_LOCAL,
                           "vramd asked for %u data files per GPU; the image format allows at most %d", stripes,
                           VRAMD__MAX_STRIPES);
    memcpy(d->image_id, s->image_id.data, VRAMD__ID_BYTES);
    d->stripes = stripes;
    return 0;
}

int vramd_open_session(struct vramd_conn *c, const struct vramd_open_args *args, struct vramd_token *token,
                       struct vramd_session_info *info, struct vramd_error *err)
{
    struct vramd_error local;
    if (!err)
        err = &local;
    vramd__clear_error(err);
    if (!c || !args || !token)
        return vramd__fail(err, -EINVAL, VRAMD_CODE_LOCAL, "vramd_open_session: NULL argument");
    struct vramd_open_args a;
    char comp_buf[32];
    const char *compression;
    int r = vramd__abi_in(args, sizeof a, VRAMD__OPEN_ARGS_1_0, "vramd_open_args", &a, err);
    if (r == 0)
        r = check_open_args(c, &a, err);
    if (r == 0)
        r = vramd__compression_of(a.compression, a.compression_kind, a.compression_level, comp_buf, &compression, err);
    if (r < 0)
        return r;

    bool dump = a.kind == VRAMD_SESSION_DUMP;
    size_t np = a.n_parent_dir_fds;
    int dirs[1 + VRAMD_MAX_PARENTS]; /* image 0 is the session's own directory, image k its k-th parent */
    int fds[2 + VRAMD_MAX_PARENTS]; /* the manifests, then a streamed session's supply fd */
    uint32_t indexes[VRAMD_MAX_PARENTS];
    size_t nfds = 0;
    struct vramd__dump d;
    bool holds_dump = false;          /* d holds the directory's lock and duplicates (until added to c) */
    bool opened = false;              /* the daemon opened session t: a failure closes it again */
    struct vramd_token t;
    Response *resp = NULL;
    PbSessionInfo *s = NULL;
    memset(&d, 0, sizeof d);
    if (dump) {
        if ((r = vramd__dump_begin(&d, a.dir_fd, a.parent_dir_fds, np, a.replace_parent, c->min_fd, err)) < 0)
            return r;
        holds_dump = true;
        dirs[0] = -1; /* a dump's own files are made, never asked for */
        for (size_t i = 0; i < np; i++)
            dirs[1 + i] = d.parent_fds[i];
    } else {
        dirs[0] = a.dir_fd;
        for (size_t i = 0; i < np; i++)
            dirs[1 + i] = a.parent_dir_fds[i];
    }
    if ((r = open_manifests(dirs, np, dump, c->min_fd, fds, &nfds, indexes, err)) < 0)
        goto out;

    Vramd__Rpc__V1__OpenSession o = VRAMD__RPC__V1__OPEN_SESSION__INIT;
    open_request(&a, compression, indexes, &o);
    if (a.supply_fd > 0 && (r = add_supply(a.supply_fd, c->min_fd, fds, &nfds, &o, err)) < 0)
        goto out;
    Request req = VRAMD__RPC__V1__REQUEST__INIT;
    req.body_case = VRAMD__RPC__V1__REQUEST__BODY_OPEN_SESSION;
    req.open_session = &o;
    r = vramd__session_call(c, &req, fds, nfds, vramd__reply_ms(c), info, &s, &resp, err);
    vramd__close_all(fds, nfds); /* the daemon has its own */
    nfds = 0;
    if (r < 0)
        goto out;
    bool lower = s->token && strspn(s->token, "0123456789abcdef") == VRAMD_TOKEN_STRLEN;
    if (vramd_token_parse(s->token, &t) < 0 || !lower) {
        vramd__mark_broken(c);
        r = vramd__fail(err, -EPROTO, VRAMD_CODE_PROTOCOL_ERROR, "OpenSession reply without a valid token");
        goto out;
    }
    opened = true;
    if (dump) {
        if ((r = dump_from_reply(s, &d, err)) < 0 || (r = add_dump(c, &t, &d, err)) < 0)
            goto out;
        holds_dump = false; /* c's now: dropped with the session */
    }
    /* the files it needs: restore/verify the data files of the image and its parents, dump its parents' */
    if (s->n_files_needed) {
        char tok[VRAMD_TOKEN_STRLEN + 1];
        vramd_token_format(&t, tok);
        if ((r = vramd__attach_needed(c, tok, s->files_needed, s->n_files_needed, dirs, 1 + np, info, err)) < 0)
            goto out;
    }
    *token = t;
out:
    vramd__close_all(fds, nfds);
    vramd__free_response(resp);
    if (holds_dump)
        vramd__dump_release(&d);
    if (r < 0 && opened) { /* a session this call opened and cannot hand over */
        struct vramd_error first = *err;
        close_quietly(c, &t);
        *err = first;
    }
    return r;
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
    return vramd__session_call(c, &req, NULL, 0, within_ms, info, NULL, NULL, err);
}

int vramd_start(struct vramd_conn *c, const struct vramd_token *t, struct vramd_session_info *info,
                struct vramd_error *err)
{
    vramd__clear_error(err);
    if (!c || !t)
        return vramd__fail(err, -EINVAL, VRAMD_CODE_LOCAL, "vramd_start: NULL argument");
    struct dump_entry *e = vramd__find_dump(c, t);
    if (!e || e->d.phase != VRAMD__DUMP_OPEN)
        return token_call(c, t, VRAMD__RPC__V1__REQUEST__BODY_START, vramd__reply_ms(c), info, err);
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
    r = vramd__session_call(c, &req, &fd, 1, vramd__reply_ms(c), info, NULL, NULL, err);
    vramd__close_fd(fd);
    return r;
}

int vramd_progress(struct vramd_conn *c, const struct vramd_token *t, struct vramd_session_info *info,
                   struct vramd_error *err)
{
    return token_call(c, t, VRAMD__RPC__V1__REQUEST__BODY_GET_PROGRESS, vramd__reply_ms(c), info, err);
}

int vramd_close_session(struct vramd_conn *c, const struct vramd_token *t, struct vramd_session_info *info,
                        struct vramd_error *err)
{
    return vramd__close_session_within(c, t, vramd__reply_ms(c), info, err);
}

int vramd__close_session_within(struct vramd_conn *c, const struct vramd_token *t, int within_ms,
                                struct vramd_session_info *info, struct vramd_error *err)
{
    int r = token_call(c, t, VRAMD__RPC__V1__REQUEST__BODY_CLOSE_SESSION, within_ms, info, err);
    /* a dump not committed by now never will be: what it created goes (the daemon writes no name, so
     * even a session that still runs, if this call failed, cannot put an image in place) */
    struct dump_entry *e = c && t ? vramd__find_dump(c, t) : NULL;
    if (e)
        vramd__drop_dump(c, e);
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
    int r = vramd__session_call(c, &req, NULL, 0, rms, info, NULL, NULL, err);
    struct dump_entry *e = vramd__find_dump(c, t);
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
    return vramd__session_call(c, &req, NULL, 0, vramd__reply_ms(c), info, NULL, NULL, err);
}
