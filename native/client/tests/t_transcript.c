/* SPDX-License-Identifier: Apache-2.0 */
/*
 * libvramd acting out a transcript's "setup" (tests/transcripts/README.md), as the Python client does in
 * vramd/testing/transcript_drive.py: tests/test_transcripts.py runs it against a scripted fake daemon that
 * checks every packet it sends.  Only the public API (vramd/client.h, vramd/criu.h).
 *
 *   libvramd-transcript SCRIPT      one action per line (test_transcripts.py writes it from the setup):
 *     socket PATH
 *     bo ID MEMFD_SIZE SIZE HAS_GPU GPU BACKEND NAME FD_OF OFFSET ALLOC_FLAGS VA_ADDR
 *                                                     ("-": none; FD_OF: an earlier BO whose memfd this one shares)
 *     connect | disconnect | add_bos | start | progress | close_session | criu_restore_barrier
 *     open KIND DIR COMPRESSION CHUNK_SIZE LABEL ALLOW_PARTIAL PARENT_HINT PARENTS NO_DEDUP REPLACE_PARENT SUPPLY
 *                                     (PARENTS: a,b or -; SUPPLY 1: a streamed session, its supply pipe's read
 *                                      end passed and both ends closed after the call: the supply ends at once)
 *     wait TIMEOUT_MS (-1: none) | cancel REASON
 *     criu_restore_submit DIR LABEL BACKEND ALLOW_PARTIAL PARENTS
 *     expect OUTCOME          (after an action: the outcome it expects; "ok" without one)
 * prints "ACTION OUTCOME" per action run ("ok", the daemon's code, PROTOCOL_ERROR, HANGUP, BROKEN: a call on
 * a connection an earlier failure broke), up to the first whose outcome is not the one it expects; then
 * closes the connection.  Exit 0 unless the script itself is bad (2).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "vramd/client.h"
#include "vramd/criu.h"

#define MAX_BOS 512
#define MAX_DIRS 16
#define MAX_WORDS 16

struct driver {
    char socket[256];
    struct vramd_conn *conn;
    struct vramd_token token;
    struct vramd_bo bos[MAX_BOS];
    struct vramd_criu_bo criu_bos[MAX_BOS];
    char names[MAX_BOS][64];
    char backends[MAX_BOS][16];
    bool own_fd[MAX_BOS];
    size_t n_bos;
    int dir_fds[MAX_DIRS];
    size_t n_dirs;
};

static const char *opt(const char *w)
{
    return strcmp(w, "-") == 0 ? NULL : w;
}

static int open_dir(struct driver *d, const char *path)
{
    int fd = open(path, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd >= 0 && d->n_dirs < MAX_DIRS)
        d->dir_fds[d->n_dirs++] = fd;
    return fd;
}

/* PARENTS "a,b" -> their directory fds in `fds`; their count. */
static size_t parents(struct driver *d, char *list, int *fds)
{
    size_t n = 0;
    if (!opt(list))
        return 0;
    for (char *save = NULL, *p = strtok_r(list, ",", &save); p && n < MAX_DIRS; p = strtok_r(NULL, ",", &save))
        fds[n++] = open_dir(d, p);
    return n;
}

static int add_bo(struct driver *d, char **w)
{
    size_t i = d->n_bos++;
    unsigned long long id = strtoull(w[1], NULL, 10);
    int fd = -1;
    if (opt(w[8])) { /* an earlier BO's memfd */
        unsigned long long of = strtoull(w[8], NULL, 10);
        for (size_t j = 0; j < i; j++)
            if (d->bos[j].id == of)
                fd = d->bos[j].fd;
        if (fd < 0)
            return -1;
    } else {
        char memfd_name[64];
        snprintf(memfd_name, sizeof memfd_name, "tx-bo-%llu", id);
        fd = memfd_create(memfd_name, MFD_CLOEXEC);
        if (fd < 0 || ftruncate(fd, (off_t)strtoull(w[2], NULL, 10)) < 0)
            return -1;
        d->own_fd[i] = true;
    }
    snprintf(d->names[i], sizeof d->names[i], "%s", w[7]);
    snprintf(d->backends[i], sizeof d->backends[i], "%s", w[6]);
    d->bos[i] = (struct vramd_bo){.id = id,
                                  .fd = fd,
                                  .offset = strtoull(w[9], NULL, 10),
                                  .size = strtoull(w[3], NULL, 10),
                                  .backend = opt(d->backends[i]),
                                  .has_gpu_id = atoi(w[4]) != 0,
                                  .gpu_id = (uint32_t)strtoul(w[5], NULL, 10),
                                  .alloc_flags = strtoull(w[10], NULL, 10),
                                  .va_addr = strtoull(w[11], NULL, 10),
                                  .name = opt(d->names[i])};
    d->criu_bos[i] = (struct vramd_criu_bo){.id = id, .fd = fd, .offset = d->bos[i].offset};
    return 0;
}

static void criu_config(const struct driver *d, struct vramd_criu_config *cfg, const char *label,
                        const char *backend, const int *pfds, size_t np)
{
    vramd_criu_config_init(cfg);
    cfg->socket_path = d->socket;
    cfg->timeout_ms = 30000;
    cfg->label = label;
    cfg->backend = backend;
    cfg->parent_dir_fds = pfds;
    cfg->n_parent_dir_fds = np;
}

/* One action: 0 or the library's negative return. */
static int act(struct driver *d, char **w, size_t n, struct vramd_error *err)
{
    const char *a = w[0];
    int pfds[MAX_DIRS];
    if (strcmp(a, "connect") == 0) {
        struct vramd_options o;
        vramd_options_init(&o);
        o.timeout_ms = 30000;
        return vramd_connect_path(&d->conn, d->socket, &o, err);
    }
    if (strcmp(a, "disconnect") == 0) {
        vramd_close(d->conn);
        d->conn = NULL;
        return 0;
    }
    if (strcmp(a, "open") == 0 && n == 12) {
        int kind = strcmp(w[1], "dump") == 0      ? VRAMD_SESSION_DUMP
                   : strcmp(w[1], "restore") == 0 ? VRAMD_SESSION_RESTORE
                                                  : VRAMD_SESSION_VERIFY;
        size_t np = parents(d, w[8], pfds);
        struct vramd_open_args args = {.kind = kind,
                                       .dir_fd = open_dir(d, w[2]),
                                       .compression = opt(w[3]),
                                       .chunk_size = strtoull(w[4], NULL, 10),
                                       .label = opt(w[5]),
                                       .allow_partial = atoi(w[6]) != 0,
                                       .parent_hint = opt(w[7]),
                                       .parent_dir_fds = pfds,
                                       .n_parent_dir_fds = np,
                                       .no_dedup = atoi(w[9]) != 0,
                                       .replace_parent = atoi(w[10]) != 0};
        int supply[2] = {-1, -1};
        if (atoi(w[11]) != 0) { /* supply_fd is past the 1.0 layout: the struct says how far it goes */
            if (pipe2(supply, O_CLOEXEC))
                return -errno;
            args.struct_size = sizeof args;
            args.supply_fd = supply[0];
        }
        int r = vramd_open_session(d->conn, &args, &d->token, NULL, err);
        for (int i = 0; i < 2; i++)
            if (supply[i] >= 0)
                close(supply[i]);
        return r;
    }
    if (strcmp(a, "add_bos") == 0)
        return vramd_add_bos(d->conn, &d->token, d->bos, d->n_bos, NULL, err);
    if (strcmp(a, "start") == 0)
        return vramd_start(d->conn, &d->token, NULL, err);
    if (strcmp(a, "progress") == 0)
        return vramd_progress(d->conn, &d->token, NULL, err);
    if (strcmp(a, "wait") == 0 && n == 2)
        return vramd_wait(d->conn, &d->token, atoi(w[1]), NULL, err);
    if (strcmp(a, "cancel") == 0 && n == 2)
        return vramd_cancel(d->conn, &d->token, opt(w[1]), NULL, err);
    if (strcmp(a, "close_session") == 0)
        return vramd_close_session(d->conn, &d->token, NULL, err);
    if (strcmp(a, "criu_restore_submit") == 0 && n == 6) {
        struct vramd_criu_config cfg;
        size_t np = parents(d, w[5], pfds);
        criu_config(d, &cfg, opt(w[2]), opt(w[3]), pfds, np);
        cfg.allow_partial = atoi(w[4]) != 0;
        struct vramd_criu_ticket ticket;
        int r = vramd_criu_restore_submit(&cfg, open_dir(d, w[1]), d->criu_bos, d->n_bos, 0, &ticket, err);
        if (r == 0)
            d->token = ticket.token;
        return r;
    }
    if (strcmp(a, "criu_restore_barrier") == 0) {
        struct vramd_criu_config cfg;
        criu_config(d, &cfg, NULL, NULL, NULL, 0);
        struct vramd_criu_ticket ticket = {.pid = (int32_t)getpid(), .token = d->token};
        return vramd_criu_restore_barrier(&cfg, &ticket, NULL, err);
    }
    fprintf(stderr, "t_transcript: bad action line: %s (%zu words)\n", a, n);
    exit(2);
}

/* What a failure is called in a transcript's outcomes (as transcript_drive.outcome names Python's). */
static const char *outcome(int r, const struct vramd_error *err)
{
    static char buf[64];
    if (r == -ECONNRESET || r == -EPIPE)
        return "HANGUP";
    if (r == -ENOTCONN)
        return "BROKEN";
    if (err->code != VRAMD_CODE_LOCAL)
        return vramd_code_name(err->code);
    if (r == -EPROTO)
        return "PROTOCOL_ERROR";
    snprintf(buf, sizeof buf, "LOCAL:%s", strerrorname_np(-r) ? strerrorname_np(-r) : "?");
    return buf;
}

int main(int argc, char **argv)
{
    if (argc != 2) {
        fprintf(stderr, "usage: %s SCRIPT\n", argv[0]);
        return 2;
    }
    FILE *f = fopen(argv[1], "r");
    if (!f) {
        perror(argv[1]);
        return 2;
    }
    static struct driver d;
    char line[4096];
    char last[64] = "";      /* the action run last and its outcome, until its "expect" line (or the next) */
    char result[64] = "ok";
    while (fgets(line, sizeof line, f)) {
        char *w[MAX_WORDS];
        size_t n = 0;
        for (char *save = NULL, *p = strtok_r(line, " \n", &save); p && n < MAX_WORDS; p = strtok_r(NULL, " \n", &save))
            w[n++] = p;
        if (n == 0)
            continue;
        if (strcmp(w[0], "expect") == 0 && n == 2) {
            if (last[0] && strcmp(result, w[1]) != 0)
                break;
            last[0] = '\0';
            continue;
        }
        if (last[0] && strcmp(result, "ok") != 0) /* an action with no "expect" expects ok */
            break;
        if (strcmp(w[0], "socket") == 0 && n == 2) {
            snprintf(d.socket, sizeof d.socket, "%s", w[1]);
            continue;
        }
        if (strcmp(w[0], "bo") == 0 && n == 12) {
            if (d.n_bos >= MAX_BOS || add_bo(&d, w) < 0) {
                perror("t_transcript: bo");
                return 2;
            }
            continue;
        }
        struct vramd_error err;
        memset(&err, 0, sizeof err);
        int r = act(&d, w, n, &err);
        snprintf(last, sizeof last, "%s", w[0]);
        snprintf(result, sizeof result, "%s", r == 0 ? "ok" : outcome(r, &err));
        printf("%s %s\n", last, result);
        if (r < 0)
            fprintf(stderr, "t_transcript: %s: %d %s\n", w[0], r, err.message);
    }
    fclose(f);
    vramd_close(d.conn);
    for (size_t i = 0; i < d.n_bos; i++)
        if (d.own_fd[i])
            close(d.bos[i].fd);
    for (size_t i = 0; i < d.n_dirs; i++)
        close(d.dir_fds[i]);
    return 0;
}
