/* SPDX-License-Identifier: Apache-2.0 */
/*
 * libvramd's CRIU hook adapter: the few calls a CRIU device plugin (such as
 * amdgpu) makes at each hook to have vramd move the BO contents.
 * docs/criu-integration.md says which hook calls which.
 *
 *   dump, DUMP_EXT_FILE (CRIU's dumper, queues evicted):
 *       vramd_criu_dump()            open, add, start, wait, close: returns
 *                                    when the image is committed (by this
 *                                    call, in the dumper: the files are its)
 *   restore, RESTORE_EXT_FILE (inside the restored task):
 *       vramd_criu_restore_submit()  open (the image's files too, with the
 *                                    task's rights), add, start: returns at
 *                                    once with a ticket (pid + session token)
 *       vramd_criu_table_publish() or vramd_criu_ticket_send()
 *                                    hand the ticket to CRIU main
 *   restore, RESUME_DEVICES_LATE (CRIU main, once per restored task):
 *       vramd_criu_table_take() or vramd_criu_ticket_recv()
 *       vramd_criu_restore_barrier() attach by token, wait, close
 *
 * The calls follow client.h's conventions: blocking, no threads, no signal
 * handlers, no output, negative errno returns with *err filled, every fd
 * created close-on-exec and at or above config.min_fd, caller's fds stay
 * the caller's.  As everywhere in protocol 2, the image's files are opened
 * and created by the calling process with its own rights (client.h, "Image
 * files"): the dumper must be able to write dir_fd's directory, and the
 * restored task to read the image's files, as the plugin's own pages files
 * need today.
 */
#ifndef VRAMD_CRIU_H
#define VRAMD_CRIU_H

#include <sys/types.h>

#include "vramd/client.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Size-versioned (client.h, "ABI 1.0"): struct_size first, 0 meaning the 1.0 layout. */
struct vramd_criu_config {
    uint32_t struct_size;     /* sizeof(struct vramd_criu_config) (vramd_criu_config_init, VRAMD_CRIU_CONFIG_INIT) */
    const char *socket_path;  /* NULL: vramd_socket_path(); authenticated as vramd_connect_path() does
                                 (-EPERM, VRAMD_CODE_LOCAL: not the daemon's, nothing sent; a dump's refused
                                 .lock in dir_fd is -EPERM, VRAMD_CODE_LOCAL too: see vramd_open_session) */
    int sock_fd;              /* >= 0: a connected vramd socket to use instead of connecting (see
                                 vramd_connect_fd); the call takes it over and closes it. -1: connect */
    int min_fd;               /* fds created go at or above this (e.g. CRIU's service fd floor); 0: anywhere */
    int timeout_ms;           /* per-call reply bound (vramd_options.timeout_ms); 0: none */
    int wait_timeout_ms;      /* bound on the barrier's wait; 0: as long as the copy takes */
    const char *client_name;  /* for the daemon's logs; NULL: "libvramd" */
    const char *backend;      /* the 0.x spelling of backend_kind, for every BO: "sdma" for GPU BOs; NULL: the
                                 daemon picks from the fd */
    const char *compression;  /* dump, the 0.x spelling of compression_kind/_level (vramd_open_args.compression);
                                 NULL or "": the daemon's default */
    uint64_t chunk_size;      /* dump: 0: the daemon's default */
    const char *label;        /* for session lists and logs */
    bool allow_partial;       /* restore: image BOs without a target are not an error */
    /* Incremental images (format v2; vramd_open_args in client.h): CRIU's --prev-images-dir chain.  Dump:
     * the parent image's directory, then those of its own parents, nearest first; chunks they hold are
     * referred to, not stored.  Restore: the image's parents' directories, nearest first.  Each
     * O_RDONLY|O_DIRECTORY, opened by the caller, stays the caller's; at most VRAMD_MAX_PARENTS.
     * docs/criu-integration.md says how a plugin finds them. */
    const int *parent_dir_fds;
    size_t n_parent_dir_fds;
    const char *parent_hint;  /* dump: the parent's path relative to dir_fd's directory, e.g. "parent" (the
                                 link CRIU makes to --prev-images-dir); recorded for tools, never opened by
                                 the daemon; NULL: none recorded */
    /* ABI 1.0: the choices as enums (the strings above stay accepted; both set must agree: else -EINVAL) */
    int backend_kind;         /* enum vramd_backend, for every BO: VRAMD_BACKEND_SDMA for GPU BOs */
    int compression_kind;     /* dump: enum vramd_compression */
    int compression_level;    /* dump: zstd level for ZSTD, BPLANES, AUTO; 0: the default */
    /* appended after ABI 1.0 (read where struct_size covers it) */
    uint64_t hold_s;          /* restore_submit: the seconds the daemon keeps the session, once the call has hung
                                 up, for CRIU main's barrier (vramd_open_args.hold_s); 0: as long as the daemon
                                 allows (its max_hold) */
    /* appended in 1.2 (read where struct_size covers it) */
    int supply_fd;            /* restore_submit: > 0 streams the restore (vramd_open_args.supply_fd): a pipe's
                                 read end or a connected unix stream socket (e.g. `vramctl pull --serve`'s) that
                                 says how far each data file is final; stays the caller's.  0 or -1: none.  A
                                 dump with one is -EINVAL */
};

#define VRAMD_CRIU_CONFIG_INIT {.struct_size = sizeof(struct vramd_criu_config), .sock_fd = -1}
/* Defaults: struct_size set, sock_fd -1, everything else 0 / NULL / false (supply_fd 0: none). */
VRAMD_API void vramd_criu_config_init(struct vramd_criu_config *cfg);

/* One BO as a KFD CRIU ioctl describes it.  Size-versioned; an array's stride is its first element's size. */
struct vramd_criu_bo {
    uint32_t struct_size;     /* sizeof(struct vramd_criu_bo), the same in every element; 0: the 1.0 layout */
    uint64_t id;              /* stable across dump and restore, e.g. the BO bucket's index */
    int fd;                   /* the dmabuf fd from KFD_CRIU_OP_CHECKPOINT / _RESTORE; stays the caller's */
    uint64_t offset;          /* offset in fd (0 for a dmabuf) */
    uint64_t size;            /* dump: bytes; restore: ignored */
    uint32_t gpu_id;          /* the user (checkpoint) gpu id */
    uint64_t alloc_flags;     /* KFD_IOC_ALLOC_MEM_FLAGS_*, recorded */
    uint64_t va_addr;         /* GPU virtual address, recorded */
};

#define VRAMD_CRIU_BO_INIT {.struct_size = sizeof(struct vramd_criu_bo), .fd = -1}
/* Defaults: struct_size set, fd -1, everything else 0. */
VRAMD_API void vramd_criu_bo_init(struct vramd_criu_bo *bo);

/*
 * Dump: copy every BO into a new image in dir_fd and return once the image
 * is committed (or the first error; nothing is committed then, and nothing
 * this call created is left in dir_fd).  dir_fd is locked for the call: a
 * second dump into it meanwhile (or vramctl rm or gc) is -EBUSY, a .lock
 * that is not the directory owner's or the caller's own 0600 regular file
 * -ELOOP, -EACCES or -EPERM (vramd_open_session), all after connecting.  The caller may close its BO fds
 * when this returns: the daemon has closed its copies.  info (may be NULL)
 * receives the final session state (image summary).
 */
VRAMD_API int vramd_criu_dump(const struct vramd_criu_config *cfg, int dir_fd, const struct vramd_criu_bo *bos,
                              size_t n, struct vramd_session_info *info, struct vramd_error *err);

/* What CRIU main needs to find and wait for one restored task's copy. */
struct vramd_criu_ticket {
    int32_t pid;              /* the key CRIU main looks it up by (the pid RESUME_DEVICES_LATE gets) */
    struct vramd_token token;
};

/*
 * Restore, in the restored task: open a restore session on dir_fd (this
 * process opens manifest.vrdm and the data files and hands them over;
 * nothing of them stays open here), add the targets, start it and return at
 * once, with the copy running in the daemon.  ticket->pid is set to `pid` (0: getpid()).  The connection is
 * closed before returning: the session lives on for the hold it asked for
 * (cfg->hold_s; by default as long as the daemon's max_hold allows, not
 * only its grace period), so CRIU main must attach (vramd_criu_restore_attach
 * or _barrier) within it, or the daemon reaps (cancels) the session.  On failure every
 * session this call opened is closed (its copies stopped) before it
 * returns, so the caller can fall back to copying by itself; where the
 * connection broke (a reply timed out, the daemon hung up), over a new one
 * to cfg->socket_path.  Only with cfg->sock_fd (no path to connect to
 * again) is a session whose connection broke left to the daemon, which
 * cancels it when the grace period is over.
 */
VRAMD_API int vramd_criu_restore_submit(const struct vramd_criu_config *cfg, int dir_fd,
                                        const struct vramd_criu_bo *bos, size_t n, pid_t pid,
                                        struct vramd_criu_ticket *ticket, struct vramd_error *err);

/*
 * CRIU main: connect and present the ticket's token, which makes this
 * connection a holder of the session (the grace period no longer runs).
 * *conn is the caller's, for vramd_criu_restore_finish.
 */
VRAMD_API int vramd_criu_restore_attach(const struct vramd_criu_config *cfg, const struct vramd_criu_ticket *ticket,
                                        struct vramd_conn **conn, struct vramd_error *err);

/*
 * CRIU main: the barrier on an attached connection.  Waits until every copy
 * has landed (cfg->wait_timeout_ms bounds it; on expiry the session is
 * cancelled and closed, with the same bound on that reply, so the call
 * returns within about twice the bound even if the copies do not stop),
 * then closes the session.  0 when all bytes are in place.  The connection
 * stays the caller's.
 */
VRAMD_API int vramd_criu_restore_finish(const struct vramd_criu_config *cfg, struct vramd_conn *conn,
                                        const struct vramd_criu_ticket *ticket, struct vramd_session_info *info,
                                        struct vramd_error *err);

/* attach + finish + close: the whole barrier for one restored task. */
VRAMD_API int vramd_criu_restore_barrier(const struct vramd_criu_config *cfg, const struct vramd_criu_ticket *ticket,
                                         struct vramd_session_info *info, struct vramd_error *err);

/*
 * Handing tickets to CRIU main, way 1: over a socket the caller provides
 * (e.g. one end of a socketpair made before forking).  One 32-byte record
 * per ticket; any socket type works (records are read whole).  Sends use
 * MSG_NOSIGNAL; a non-socket fd is refused (-ENOTSOCK), since a write to a
 * pipe could raise SIGPIPE.  recv waits up to timeout_ms (-1: no bound).
 */
VRAMD_API int vramd_criu_ticket_send(int sock, const struct vramd_criu_ticket *ticket, struct vramd_error *err);
VRAMD_API int vramd_criu_ticket_recv(int sock, struct vramd_criu_ticket *ticket, int timeout_ms,
                                     struct vramd_error *err);

/*
 * Way 2: a table in memory shared by CRIU main and every restored task
 * (MAP_SHARED | MAP_ANONYMOUS, set up by CRIU main before it forks, as the
 * amdgpu plugin already does for its dmabuf table).  Lock-free; any number
 * of restored tasks publish concurrently; CRIU main takes each ticket once.
 */
struct vramd_criu_table;
/* Bytes a table of `slots` tickets needs. */
VRAMD_API size_t vramd_criu_table_size(unsigned slots);
/* Format `mem` (len bytes, zeroed or not) as an empty table. */
VRAMD_API int vramd_criu_table_init(void *mem, size_t len, unsigned slots, struct vramd_criu_table **table);
/* -ENOSPC when every slot is used. */
VRAMD_API int vramd_criu_table_publish(struct vramd_criu_table *table, const struct vramd_criu_ticket *ticket);
/* The ticket published for pid, taken out of the table; -ENOENT if none. */
VRAMD_API int vramd_criu_table_take(struct vramd_criu_table *table, int32_t pid, struct vramd_criu_ticket *ticket);
/* Take any ticket not taken yet (CRIU main's "wait for all"); -ENOENT when none is left. */
VRAMD_API int vramd_criu_table_take_any(struct vramd_criu_table *table, struct vramd_criu_ticket *ticket);

#ifdef __cplusplus
}
#endif

#endif /* VRAMD_CRIU_H */
