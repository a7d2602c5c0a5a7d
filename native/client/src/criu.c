/* SPDX-License-Identifier: Apache-2.0 */
/* libvramd: the CRIU hook adapter (vramd/criu.h): dump, restore submit / attach / finish / barrier (ticket.c:
 * the tickets and their shared table). */
#define _GNU_SOURCE
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "abi.h"
#include "session.h"

void vramd_criu_config_init(struct vramd_criu_config *cfg)
{
    if (cfg)
        *cfg = (struct vramd_criu_config)VRAMD_CRIU_CONFIG_INIT;
}

void vramd_criu_bo_init(struct vramd_criu_bo *bo)
{
    if (bo)
        *bo = (struct vramd_criu_bo)VRAMD_CRIU_BO_INIT;
}

/* The caller's config (NULL: the defaults) in this library's layout.  Where the call takes the socket over
 * (`takes_socket`), a config it cannot take has its sock_fd closed all the same: sock_fd is a 1.0 member, at
 * the same place in every layout, whatever struct_size says. */
static int config_of(const struct vramd_criu_config *in, bool takes_socket, struct vramd_criu_config *cfg,
                     struct vramd_error *err)
{
    if (!in) {
        vramd_criu_config_init(cfg);
        return 0;
    }
    int r = vramd__abi_in(in, sizeof *cfg, VRAMD__CRIU_CONFIG_1_0, "vramd_criu_config", cfg, err);
    if (r < 0 && takes_socket && in->sock_fd >= 0)
        vramd__close_fd(in->sock_fd);
    return r;
}

static int open_conn(const struct vramd_criu_config *cfg, struct vramd_conn **conn, struct vramd_error *err)
{
    struct vramd_options o;
    vramd_options_init(&o);
    o.min_fd = cfg->min_fd;
    o.timeout_ms = cfg->timeout_ms;
    o.client_name = cfg->client_name;
    if (cfg->sock_fd >= 0)
        return vramd_connect_fd(conn, cfg->sock_fd, &o, err);
    if (cfg->socket_path)
        return vramd_connect_path(conn, cfg->socket_path, &o, err);
    return vramd_connect(conn, &o, err);
}

/* The BOs (stride bytes apart) as libvramd's generic records (malloc'd; NULL on ENOMEM). */
static struct vramd_bo *to_bos(const struct vramd_criu_config *cfg, const struct vramd_criu_bo *bos, size_t stride,
                               size_t n, bool restore)
{
    struct vramd_bo *out = calloc(n ? n : 1, sizeof *out);
    if (!out)
        return NULL;
    for (size_t i = 0; i < n; i++) {
        struct vramd_criu_bo in;
        vramd__abi_elem(bos, stride, i, sizeof in, &in);
        vramd_bo_init(&out[i]);
        out[i].id = in.id;
        out[i].fd = in.fd;
        out[i].offset = in.offset;
        out[i].backend = cfg->backend;
        out[i].backend_kind = cfg->backend_kind;
        if (!restore) { /* a restore runs each BO in the lane its image records */
            out[i].size = in.size;
            out[i].has_gpu_id = true;
            out[i].gpu_id = in.gpu_id;
            out[i].alloc_flags = in.alloc_flags;
            out[i].va_addr = in.va_addr;
        }
    }
    return out;
}

/*
 * The opening vramd_criu_dump and vramd_criu_restore_submit share: the config in this library's layout
 * (*cfg), its choices checked, the BOs as vramd_bo records (*list, the caller frees it), a connection
 * (*conn) and a session on dir_fd (*t).  On failure nothing is held (cfg->sock_fd is closed: the call takes it
 * over in every case) and, where the session was opened, it is closed again.
 */
static int criu_begin(const struct vramd_criu_config *in, int dir_fd, const struct vramd_criu_bo *bos, size_t n,
                      bool restore, struct vramd_criu_config *cfg, struct vramd_bo **list, struct vramd_conn **conn,
                      struct vramd_token *t, struct vramd_error *err)
{
    const char *what = restore ? "vramd_criu_restore_submit" : "vramd_criu_dump";
    const char *backend, *compression;
    char comp_buf[32];
    size_t stride = sizeof(struct vramd_criu_bo);
    *list = NULL;
    *conn = NULL;
    int r = config_of(in, true, cfg, err);
    if (r < 0)
        return r;
    if (n && !bos) {
        r = vramd__fail(err, -EINVAL, VRAMD_CODE_LOCAL, restore ? "%s: NULL argument" : "%s: NULL BO list", what);
        goto fail;
    }
    if ((r = vramd__backend_of(cfg->backend, cfg->backend_kind, &backend, "vramd_criu_config", err)) < 0 ||
        (!restore && (r = vramd__compression_of(cfg->compression, cfg->compression_kind, cfg->compression_level,
                                                comp_buf, &compression, err)) < 0) ||
        (n && (r = vramd__abi_stride(bos, n, sizeof(struct vramd_criu_bo), VRAMD__CRIU_BO_1_0, "vramd_criu_bo",
                                     &stride, err)) < 0))
        goto fail;
    if (!(*list = to_bos(cfg, bos, stride, n, restore))) {
        r = vramd__fail(err, -ENOMEM, VRAMD_CODE_LOCAL, "%s: out of memory", what);
        goto fail;
    }
    if ((r = open_conn(cfg, conn, err)) < 0) /* it took the socket over */
        goto out;
    struct vramd_open_args a = VRAMD_OPEN_ARGS_INIT;
    a.kind = restore ? VRAMD_SESSION_RESTORE : VRAMD_SESSION_DUMP;
    a.dir_fd = dir_fd;
    a.label = cfg->label;
    a.parent_dir_fds = cfg->parent_dir_fds;
    a.n_parent_dir_fds = cfg->n_parent_dir_fds;
    a.supply_fd = cfg->supply_fd; /* a dump's is refused */
    if (restore) {
        a.allow_partial = cfg->allow_partial;
        a.hold_s = cfg->hold_s ? cfg->hold_s : UINT32_MAX; /* the daemon grants at most its max_hold */
    } else {
        a.compression = cfg->compression;
        a.compression_kind = cfg->compression_kind;
        a.compression_level = cfg->compression_level;
        a.chunk_size = cfg->chunk_size;
        a.parent_hint = cfg->parent_hint;
    }
    if ((r = vramd_open_session(*conn, &a, t, NULL, err)) < 0)
        goto out;
    return 0;
fail:
    if (cfg->sock_fd >= 0)
        vramd__close_fd(cfg->sock_fd);
out:
    vramd_close(*conn);
    *conn = NULL;
    free(*list);
    *list = NULL;
    return r;
}

/*
 * Close a session after a failure, keeping the first error in *err: CloseSession cancels it and returns once
 * its job has stopped, so no copy of it still writes into the caller's BOs.  A connection that broke (a reply
 * timed out, the daemon hung up) cannot carry it: a new connection does, by the session's token, where the
 * config names a socket path (or none: the default) rather than a socket it handed over.  If that fails too,
 * the daemon cancels the session once its grace period is over.
 */
static void abandon(const struct vramd_criu_config *cfg, struct vramd_conn *c, const struct vramd_token *t)
{
    struct vramd_error ignored;
    if (!vramd_conn_broken(c)) {
        (void)vramd_close_session(c, t, NULL, &ignored);
        return;
    }
    if (cfg->sock_fd >= 0)
        return;
    struct vramd_conn *again = NULL;
    if (open_conn(cfg, &again, &ignored) == 0) {
        (void)vramd_close_session(again, t, NULL, &ignored);
        vramd_close(again);
    }
}

/* Wait (bounded by cfg->wait_timeout_ms: then cancel), then close the session. */
static int wait_and_close(const struct vramd_criu_config *cfg, struct vramd_conn *c, const struct vramd_token *t,
                          struct vramd_session_info *info, struct vramd_error *err)
{
    int timeout = cfg->wait_timeout_ms > 0 ? cfg->wait_timeout_ms : VRAMD_WAIT_FOREVER;
    int r = vramd_wait(c, t, timeout, info, err);
    if (r == -ETIMEDOUT && err)
        vramd__fail(err, r, VRAMD_CODE_TIMEOUT, "the copies did not finish within %d ms; session cancelled",
                    cfg->wait_timeout_ms);
    if (r < 0) {
        if (r == -ETIMEDOUT) { /* CloseSession cancels it; its job may not stop within the bound either */
            struct vramd_error ignored;
            if (!vramd_conn_broken(c))
                (void)vramd__close_session_within(c, t, cfg->wait_timeout_ms, NULL, &ignored);
        } else {
            abandon(cfg, c, t);
        }
        return r;
    }
    struct vramd_error cerr;
    int rc = vramd_close_session(c, t, NULL, &cerr);
    if (rc < 0 && err)
        *err = cerr;
    return rc;
}

int vramd_criu_dump(const struct vramd_criu_config *config, int dir_fd, const struct vramd_criu_bo *bos, size_t n,
                    struct vramd_session_info *info, struct vramd_error *err)
{
    struct vramd_criu_config cfg;
    struct vramd_bo *list;
    struct vramd_conn *c;
    struct vramd_token t;
    vramd__clear_error(err);
    int r = criu_begin(config, dir_fd, bos, n, false, &cfg, &list, &c, &t, err);
    if (r < 0)
        return r;
    r = vramd_add_bos(c, &t, list, n, NULL, err);
    if (r == 0)
        r = vramd_start(c, &t, NULL, err);
    if (r == 0)
        r = wait_and_close(&cfg, c, &t, info, err);
    else
        abandon(&cfg, c, &t);
    free(list);
    vramd_close(c);
    return r;
}

int vramd_criu_restore_submit(const struct vramd_criu_config *config, int dir_fd, const struct vramd_criu_bo *bos,
                              size_t n, pid_t pid, struct vramd_criu_ticket *ticket, struct vramd_error *err)
{
    struct vramd_criu_config cfg;
    struct vramd_bo *list;
    struct vramd_conn *c;
    struct vramd_token t;
    vramd__clear_error(err);
    if (!ticket) {
        struct vramd_criu_config dflt;
        if (config_of(config, true, &dflt, NULL) == 0 && dflt.sock_fd >= 0)
            vramd__close_fd(dflt.sock_fd);
        return vramd__fail(err, -EINVAL, VRAMD_CODE_LOCAL, "vramd_criu_restore_submit: NULL argument");
    }
    int r = criu_begin(config, dir_fd, bos, n, true, &cfg, &list, &c, &t, err);
    if (r < 0)
        return r;
    r = vramd_add_bos(c, &t, list, n, NULL, err);
    if (r == 0)
        r = vramd_start(c, &t, NULL, err);
    if (r < 0)
        abandon(&cfg, c, &t);
    free(list);
    vramd_close(c);
    if (r == 0) {
        ticket->pid = pid ? (int32_t)pid : (int32_t)getpid();
        ticket->token = t;
    }
    return r;
}

int vramd_criu_restore_attach(const struct vramd_criu_config *config, const struct vramd_criu_ticket *ticket,
                              struct vramd_conn **conn, struct vramd_error *err)
{
    struct vramd_criu_config cfg;
    vramd__clear_error(err);
    int r = config_of(config, true, &cfg, err);
    if (r < 0)
        return r;
    if (!ticket || !conn) {
        if (cfg.sock_fd >= 0)
            vramd__close_fd(cfg.sock_fd);
        return vramd__fail(err, -EINVAL, VRAMD_CODE_LOCAL, "vramd_criu_restore_attach: NULL argument");
    }
    *conn = NULL;
    struct vramd_conn *c = NULL;
    if ((r = open_conn(&cfg, &c, err)) < 0)
        return r;
    r = vramd_progress(c, &ticket->token, NULL, err); /* any request with the token makes us a holder */
    if (r < 0) {
        vramd_close(c);
        return r;
    }
    *conn = c;
    return 0;
}

int vramd_criu_restore_finish(const struct vramd_criu_config *config, struct vramd_conn *conn,
                              const struct vramd_criu_ticket *ticket, struct vramd_session_info *info,
                              struct vramd_error *err)
{
    struct vramd_criu_config cfg;
    vramd__clear_error(err);
    int r = config_of(config, false, &cfg, err);
    if (r < 0)
        return r;
    if (!conn || !ticket)
        return vramd__fail(err, -EINVAL, VRAMD_CODE_LOCAL, "vramd_criu_restore_finish: NULL argument");
    return wait_and_close(&cfg, conn, &ticket->token, info, err);
}

int vramd_criu_restore_barrier(const struct vramd_criu_config *cfg, const struct vramd_criu_ticket *ticket,
                               struct vramd_session_info *info, struct vramd_error *err)
{
    struct vramd_conn *c = NULL;
    int r = vramd_criu_restore_attach(cfg, ticket, &c, err);
    if (r < 0)
        return r;
    r = vramd_criu_restore_finish(cfg, c, ticket, info, err);
    vramd_close(c);
    return r;
}
