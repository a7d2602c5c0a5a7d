/* SPDX-License-Identifier: Apache-2.0 */
/*
 * libvramd: the C client of the vramd daemon.
 *
 * vramd copies GPU buffer-object (BO) contents between file descriptors a
 * client hands it (dmabuf, memfd, /proc/<pid>/mem) and checkpoint images in
 * a directory.  This library speaks the daemon's RPC protocol, version 2
 * (docs/protocol.md, proto/vramd/pb/rpc.proto): a 12-byte frame plus one
 * protobuf message per AF_UNIX SOCK_SEQPACKET packet, fds as SCM_RIGHTS on
 * the same packet.
 *
 * Image files (protocol 2, docs/protocol.md "Image files: the client's
 * rights").  The caller still names an image by a directory fd, but the
 * daemon never gets it: this library opens every file of the image in the
 * caller's process, with the caller's rights (O_NOFOLLOW|O_NONBLOCK|
 * O_CLOEXEC), and hands the daemon file fds; it creates a dump's files (mode
 * 0600, owned by the caller) and does every operation on a name: the
 * directory's lock, the commit's renames and fsyncs, the removals.  So the
 * kernel checks the caller's access, not the daemon's, and a refused open is
 * a local error (VRAMD_CODE_LOCAL) naming the file.
 *
 * Calling conventions
 *   - Every call is blocking.  A connection (struct vramd_conn) must be used
 *     by one thread at a time; several threads may each use their own
 *     connection concurrently.  The library has no global mutable state
 *     except what the C library itself keeps (errno).
 *   - Every function that can fail returns 0 (or a documented non-negative
 *     value) on success and a negative errno-style code on failure, and fills
 *     *err (when err is not NULL) with the daemon's protocol code (or
 *     VRAMD_CODE_LOCAL for a failure on this side), a one-line message and,
 *     when known, the BO id and byte offset involved.
 *   - The library never aborts, never prints, installs no signal handler,
 *     starts no thread, and raises no SIGPIPE (sends use MSG_NOSIGNAL).
 *   - Every fd the library creates is close-on-exec, and is placed at or
 *     above vramd_options.min_fd when that is set.  fds the caller passes in
 *     (image directories, BO fds) stay the caller's: the kernel gives the
 *     daemon its own duplicates of BO fds, and the directories never reach
 *     it.  The image files the library opens are closed once the daemon has
 *     its copies; a dump keeps only its directory's lock and duplicates
 *     until its commit.  Any fd the daemon (wrongly) sends back is closed at
 *     once.  No fd leaks on any error path.
 *   - The library keeps per-connection state for the dump sessions a
 *     connection opened (what their commit needs), freed at
 *     vramd_close_session() and vramd_close(); at most 1024 at a time
 *     (-EMFILE past that).
 *   - A connection whose request/reply pairing can no longer be trusted (a
 *     client-side timeout, a protocol error, a hang-up) is marked broken;
 *     every later call on it fails with -ENOTCONN.  vramd_close() it.
 *
 * ABI 1.0 (the rules in one place; docs/protocol.md "libvramd's ABI" points here)
 *   - The library is libvramd.so.1 (soname), version 1.0.0; every exported
 *     symbol carries the version node VRAMD_1.0.  A later 1.x adds symbols in
 *     new nodes (VRAMD_1.1, ...) and never changes a 1.0 one; an incompatible
 *     change is libvramd.so.2.  native/client/abi/ holds the committed ABI
 *     baseline that CI compares every build with (libabigail's abidiff,
 *     plus members.py: every exported signature in depth and the enum values
 *     and constants of these headers; native/client/abi/check.sh, --update
 *     regenerates it for a reviewed addition).
 *   - Input structs are size-versioned: struct vramd_options, vramd_open_args,
 *     vramd_bo, vramd_criu_config and vramd_criu_bo begin with
 *     `uint32_t struct_size`.  Set it to sizeof the struct you were compiled
 *     with: the VRAMD_*_INIT initialisers and the *_init() functions do.
 *     0 means "the ABI 1.0 layout", so a struct zeroed or written with a
 *     designated initialiser as in 0.x (`{.kind = ..., .dir_fd = ...}`) keeps
 *     working.  Later versions only append members; the library reads a
 *     member only when struct_size covers it, so a program built against an
 *     older header runs unchanged on a newer library.  A struct_size larger
 *     than the library knows (a program built against a newer header) is
 *     accepted when every byte past what the library knows is zero (options
 *     it does not know are not asked for), else the call fails with -E2BIG,
 *     code VRAMD_CODE_LOCAL, the message naming the struct (as openat2 does);
 *     one smaller than the 1.0 layout is -EINVAL, and one above 1024 (more
 *     likely never set than a later struct: a program that fills a struct
 *     member by member must start from _init(), _INIT or memset) is -E2BIG
 *     without a byte past the library's layout being read.  A member added
 *     after 1.0 is read only when struct_size says so: a program that uses
 *     one must set struct_size (0 still means 1.0).
 *   - Arrays of input structs (vramd_bo[], vramd_criu_bo[]) are walked with the
 *     stride of their first element's struct_size (0: the 1.0 size); every
 *     element must carry the same size (0 and the 1.0 size count as the same),
 *     else -EINVAL.  So a program built against a later header that grows
 *     vramd_bo must set struct_size in every element (VRAMD_BO_INIT).
 *   - Choices are enums, not strings: enum vramd_backend and enum
 *     vramd_compression (+ compression_level), members appended to the 1.0
 *     structs.  The 0.x string members (vramd_bo.backend,
 *     vramd_open_args.compression, vramd_criu_config.backend / .compression)
 *     are still accepted, with the values they always took: the 0.x spelling.
 *     Set one or the other; both set and disagreeing is -EINVAL.
 *   - Output structs (struct vramd_error, vramd_session_info, vramd_progress,
 *     vramd_image_summary, vramd_session_entry, vramd_status, vramd_token,
 *     vramd_criu_ticket) are frozen at 1.0: their layout never changes.
 *     vramd_session_info, vramd_session_entry and vramd_status end in a
 *     reserved tail (zeroed by the library) that later versions may give a
 *     meaning; anything else new comes through new calls.  struct
 *     vramd_limits is the library's own (read through the pointer
 *     vramd_conn_limits returns): it may grow at its end.
 *   - Enum values and error codes are never renumbered; new ones may appear.
 */
#ifndef VRAMD_CLIENT_H
#define VRAMD_CLIENT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(__GNUC__) && !defined(VRAMD_NO_VISIBILITY)
#define VRAMD_API __attribute__((visibility("default")))
#else
#define VRAMD_API
#endif

#define VRAMD_PROTOCOL_VERSION 2
#define VRAMD_SCM_MAX_FD 253           /* fds in one packet, at most (kernel SCM_MAX_FD) */
#define VRAMD_SYSTEM_SOCKET "/run/vramd/vramd.sock"

/* Status codes: rpc.proto's Code enum, plus VRAMD_CODE_LOCAL. */
enum vramd_code {
    VRAMD_CODE_LOCAL = -1,             /* failed on this side (a syscall, bad arguments, ...) */
    VRAMD_CODE_OK = 0,
    VRAMD_CODE_PROTOCOL_ERROR = 1,
    VRAMD_CODE_PERMISSION_DENIED = 2,
    VRAMD_CODE_NOT_FOUND = 3,
    VRAMD_CODE_LIMIT_EXCEEDED = 4,
    VRAMD_CODE_SHUTTING_DOWN = 5,
    VRAMD_CODE_TIMEOUT = 6,
    VRAMD_CODE_INTERNAL = 7,
    VRAMD_CODE_UNSUPPORTED_PROTOCOL = 8,
    VRAMD_CODE_JOB_ERROR = 20,
    VRAMD_CODE_INVALID_REQUEST = 21,
    VRAMD_CODE_CANCELLED = 22,
    VRAMD_CODE_INCOMPLETE_RESTORE = 23,
    VRAMD_CODE_BACKEND_ERROR = 40,
    VRAMD_CODE_UNMAPPED_RANGE = 41,
    VRAMD_CODE_TARGET_TOO_SMALL = 42,
    VRAMD_CODE_BAD_DESCRIPTOR = 43,
    VRAMD_CODE_BACKEND_UNAVAILABLE = 44,
    VRAMD_CODE_IMAGE_ERROR = 60,
    VRAMD_CODE_MANIFEST_MISSING = 61,
    VRAMD_CODE_UNSUPPORTED_VERSION = 62,
    VRAMD_CODE_CORRUPT_MANIFEST = 63,
    VRAMD_CODE_CORRUPT_CHUNK = 64,
    VRAMD_CODE_TRUNCATED_DATA = 65,
    VRAMD_CODE_FOREIGN_DATA_FILE = 66,
    VRAMD_CODE_NO_SPACE = 67,
    VRAMD_CODE_READ_ONLY_FS = 68,
    VRAMD_CODE_IO_ERROR = 69,
    VRAMD_CODE_NOT_WRITABLE = 70,
    VRAMD_CODE_PARENT_MISSING = 71,
    VRAMD_CODE_PARENT_MISMATCH = 72,
    VRAMD_CODE_TOPOLOGY_ERROR = 80,
    VRAMD_CODE_TOPOLOGY_MISMATCH = 81,
    VRAMD_CODE_VRAMD_ERROR = 99,
};

/*
 * What went wrong.  The return value of a failing call is the same number as
 * `errnum`.  Daemon codes map onto errno values as follows (the code is the
 * precise answer; the errno is for callers that only pass a number up):
 *   PERMISSION_DENIED -EACCES, NOT_FOUND -ENOENT, LIMIT_EXCEEDED -E2BIG,
 *   SHUTTING_DOWN -ESHUTDOWN, TIMEOUT -ETIMEDOUT, PROTOCOL_ERROR -EPROTO,
 *   UNSUPPORTED_PROTOCOL -EPROTONOSUPPORT, INVALID_REQUEST -EINVAL,
 *   CANCELLED -ECANCELED, INCOMPLETE_RESTORE -ENODATA, UNMAPPED_RANGE -EFAULT,
 *   TARGET_TOO_SMALL -ENOSPC, BAD_DESCRIPTOR -EBADF,
 *   BACKEND_UNAVAILABLE and UNSUPPORTED_VERSION -EOPNOTSUPP,
 *   MANIFEST_MISSING -ENOMSG, NO_SPACE -ENOSPC, READ_ONLY_FS -EROFS,
 *   IO_ERROR -EIO, NOT_WRITABLE -EACCES, PARENT_MISSING -ENOENT, the other image codes -EBADMSG (IMAGE_ERROR
 *   -EIO), topology codes -ENODEV, JOB_ERROR and BACKEND_ERROR -EIO,
 *   INTERNAL, VRAMD_ERROR and codes this library does not know -EREMOTEIO
 *   (vramd_code_errno()).
 * Local failures: the syscall's errno; a reply that does not follow the
 * protocol -EPROTO (code PROTOCOL_ERROR; also a daemon that asks for a file
 * name the image format does not make); the daemon hanging up -ECONNRESET;
 * no reply within vramd_options.timeout_ms -ETIME (the connection is then
 * broken); a call on a broken connection -ENOTCONN.  An image file the
 * caller may not open -EACCES (the message names the file and the uid), a
 * missing one -ENOENT, a symbolic link -ELOOP, one that is not a regular
 * file -EINVAL (code FOREIGN_DATA_FILE, or CORRUPT_MANIFEST for the
 * manifest); a dump's directory that another dump holds -EBUSY.
 */
struct vramd_error {
    int errnum;                        /* the negative return value */
    int code;                          /* enum vramd_code */
    bool has_bo_id;
    bool has_offset;
    uint64_t bo_id;                    /* the BO involved, if has_bo_id */
    uint64_t offset;                   /* byte offset within that BO, if has_offset */
    char message[256];                 /* one line, NUL-terminated, possibly truncated */
};

/* The name of a code ("CORRUPT_CHUNK"); "UNKNOWN" for a number not listed. */
VRAMD_API const char *vramd_code_name(int code);
/* The negative errno value a daemon code maps to (0 for OK). */
VRAMD_API int vramd_code_errno(int code);
/* A static description of a return value of this library (like strerror(-ret)). */
VRAMD_API const char *vramd_strerror(int ret);

/* --- choices ----------------------------------------------------------------- */

/* How the daemon reaches a BO's memory (rpc.proto's Bo.backend; docs/protocol.md "Backends"). */
enum vramd_backend {
    VRAMD_BACKEND_AUTO = 0,            /* the daemon picks from the fd (or the 0.x string member says) */
    VRAMD_BACKEND_PROCMEM = 1,         /* "procmem": /proc/<pid>/mem of the process, offset = address */
    VRAMD_BACKEND_MMAP = 2,            /* "mmap": a dmabuf, memfd or file, mapped */
    VRAMD_BACKEND_SDMA = 3,            /* "sdma": a dmabuf of an amdgpu BO, copied by the GPU's SDMA engine */
};

/* How a dump compresses its chunks (docs/protocol.md, OpenSession's `compression`; docs/codecs.md). */
enum vramd_compression {
    VRAMD_COMPRESSION_DEFAULT = 0,     /* the daemon's default (or the 0.x string member says) */
    VRAMD_COMPRESSION_NONE = 1,        /* "none": chunks stored as they are */
    VRAMD_COMPRESSION_ZSTD = 2,        /* "zstd[:LEVEL]": one zstd frame per chunk */
    VRAMD_COMPRESSION_BPLANES = 3,     /* "bplanes[:LEVEL]": byte planes or zstd per chunk, by a trial */
    VRAMD_COMPRESSION_AUTO = 4,        /* "auto[:LEVEL]": bplanes' choice where it pays at the sink's speed */
};

/* The wire name of a backend ("procmem", "mmap", "sdma"); NULL for AUTO or a value not listed. */
VRAMD_API const char *vramd_backend_name(int backend);
/* The wire name of a compression mode ("none", "zstd", "bplanes", "auto"); NULL for DEFAULT or not listed. */
VRAMD_API const char *vramd_compression_name(int compression);

/* --- connections ---------------------------------------------------------- */

struct vramd_conn;

struct vramd_options {
    uint32_t struct_size;              /* sizeof(struct vramd_options); 0: the 1.0 layout (see "ABI 1.0") */
    /* fds the library creates go at or above this number (F_DUPFD_CLOEXEC),
     * image files, directory duplicates and locks included; 0: wherever the
     * kernel puts them. */
    int min_fd;
    /* Bound on each call's reply (and on connect), in ms; 0 waits as long
     * as it takes.  vramd_wait() with a timeout waits for its reply up to
     * that timeout plus this (or plus 5 s when this is 0); vramd_wait()
     * without one waits as long as the session runs (a daemon that dies
     * still ends it at once: the socket hangs up). */
    int timeout_ms;
    /* Free-form, for the daemon's logs ("criu-amdgpu 4.2"); NULL: "libvramd". */
    const char *client_name;
};

#define VRAMD_OPTIONS_INIT {.struct_size = sizeof(struct vramd_options)}
/* Defaults: struct_size set, min_fd 0, timeout_ms 0, client_name NULL. */
VRAMD_API void vramd_options_init(struct vramd_options *opts);

/*
 * The socket clients use, as vramctl resolves it: $VRAMD_SOCKET if set and
 * not empty; else the system socket (VRAMD_SYSTEM_SOCKET) if it exists; else
 * the user's own daemon's, $XDG_RUNTIME_DIR/vramd/vramd.sock, or without
 * XDG_RUNTIME_DIR /tmp/vramd-<uid>/vramd.sock, the latter never for root
 * (root gets the system socket's path).  The choice does not depend on
 * whether the socket can be trusted: connecting refuses an untrusted one,
 * it never falls back to the next.  In a setuid, setgid or file-capability
 * program (AT_SECURE) the environment is ignored (secure_getenv).
 * Returns the length written (without the NUL), or -ENAMETOOLONG.
 */
VRAMD_API int vramd_socket_path(char *buf, size_t size);

/*
 * Connecting by path authenticates the daemon before anything is sent
 * (docs/protocol.md, "Socket paths"; the same rule as the Python client and
 * vramctl).  The trusted uids are root, the caller's effective uid and the
 * daemon user: $VRAMD_DAEMON_USER (a name or a uid; ignored in an AT_SECURE
 * program: its caller may not widen its trust), default "vramd" (no such
 * user: none); a name is looked up in /etc/passwd itself, never through NSS
 * modules (the library may run in another root's mount namespace).  Before connect, every directory on the path (symbolic
 * links resolved, each link owned by a trusted uid) must be owned by a
 * trusted uid and writable by nobody else; a root-owned sticky directory
 * such as /tmp may be an ancestor, not the socket's own directory.  After
 * connect, the listener's SO_PEERCRED uid must be trusted.  Otherwise the
 * call fails with -EPERM and VRAMD_CODE_LOCAL, the message naming the path
 * and the uid at fault, and nothing has been sent.  A component that cannot
 * be examined fails as connect would (-ENOENT, -EACCES, -ENOTDIR, ...).
 */
/* Connect to vramd_socket_path() and negotiate with Hello. opts may be NULL. */
VRAMD_API int vramd_connect(struct vramd_conn **out, const struct vramd_options *opts, struct vramd_error *err);
/* Connect to `path` and negotiate with Hello. */
VRAMD_API int vramd_connect_path(struct vramd_conn **out, const char *path, const struct vramd_options *opts,
                                 struct vramd_error *err);
/*
 * Adopt `fd`, an AF_UNIX SOCK_SEQPACKET socket already connected to the
 * daemon (for example connected by another process before it switched
 * namespaces, and inherited), and negotiate with Hello on it.  The library
 * takes the fd over in every case: on failure it has been closed.  The fd
 * keeps its number (min_fd does not move it) and gets FD_CLOEXEC.  The
 * library does not authenticate this socket's peer (in a user namespace its
 * uid may not even map): whoever connected it vouches for it, and should
 * have checked the path and the peer as vramd_connect_path does.
 */
VRAMD_API int vramd_connect_fd(struct vramd_conn **out, int fd, const struct vramd_options *opts,
                               struct vramd_error *err);
/* Close the connection and free it.  NULL is a no-op.  Sessions it opened go
 * on (the daemon reaps them after its grace period if nobody holds them), but
 * a dump it opened and has not committed (vramd_wait) never will be: its
 * files are removed here and its directory unlocked. */
VRAMD_API void vramd_close(struct vramd_conn *conn);

/* The connection's socket fd (owned by the connection), -1 once broken. */
VRAMD_API int vramd_conn_fd(const struct vramd_conn *conn);
/* Whether a failure made the connection unusable. */
VRAMD_API bool vramd_conn_broken(const struct vramd_conn *conn);

/* What Hello returned.  The strings live as long as the connection. */
struct vramd_limits {
    uint32_t max_message_bytes;
    uint32_t max_fds_per_message;
    uint32_t max_bos_per_session;
    uint32_t max_sessions_per_uid;
    uint32_t max_fds_per_session;
};
VRAMD_API uint32_t vramd_conn_version(const struct vramd_conn *conn);
VRAMD_API const char *vramd_conn_server(const struct vramd_conn *conn);
VRAMD_API const struct vramd_limits *vramd_conn_limits(const struct vramd_conn *conn);
/* Whether the daemon lists backend `name` ("procmem", "mmap", "sdma") as available. */
VRAMD_API bool vramd_conn_has_backend(const struct vramd_conn *conn, const char *name);
/* The same by enum vramd_backend (false for VRAMD_BACKEND_AUTO and values not listed). */
VRAMD_API bool vramd_conn_has_backend_kind(const struct vramd_conn *conn, int backend);

/* --- sessions ------------------------------------------------------------- */

/* A session token: 128 bits.  The daemon writes it as 32 lowercase hex characters. */
#define VRAMD_TOKEN_BYTES 16
#define VRAMD_TOKEN_STRLEN 32
struct vramd_token {
    uint8_t bytes[VRAMD_TOKEN_BYTES];
};
/* Writes 32 hex characters and a NUL into out (33 bytes). */
VRAMD_API void vramd_token_format(const struct vramd_token *token, char out[VRAMD_TOKEN_STRLEN + 1]);
/* Parses exactly 32 hex characters; -EINVAL otherwise. */
VRAMD_API int vramd_token_parse(const char *text, struct vramd_token *token);

enum vramd_session_kind {
    VRAMD_SESSION_DUMP = 1,            /* BOs -> a new image in the directory */
    VRAMD_SESSION_RESTORE = 2,         /* the directory's image -> BOs */
    VRAMD_SESSION_VERIFY = 3,          /* read and check every chunk; takes no BOs */
};

enum vramd_session_state {
    VRAMD_STATE_UNSPECIFIED = 0,
    VRAMD_STATE_OPEN = 1,
    VRAMD_STATE_SEALED = 2,
    VRAMD_STATE_DONE = 3,
    VRAMD_STATE_FAILED = 4,
    VRAMD_STATE_CANCELLED = 5,
    VRAMD_STATE_CANCELLING = 6, /* cancel received, copies stopping; then CANCELLED (or FAILED) */
};

struct vramd_progress {
    uint32_t bos_total;
    uint32_t bos_done;
    uint64_t bytes_total;
    uint64_t bytes_done;
    uint64_t chunks_done;
    double elapsed_s;
};

struct vramd_image_summary {
    uint32_t bo_count;
    uint32_t data_files;
    uint64_t bo_bytes;
    uint64_t stored_bytes;
    uint64_t zero_bytes;
    uint64_t chunk_size;
    char compression[32];
};

/* A session as the daemon reports it (strings truncated to fit). */
struct vramd_session_info {
    uint64_t session_id;               /* for logs; not a credential */
    int kind;                          /* enum vramd_session_kind */
    int state;                         /* enum vramd_session_state */
    uint32_t uid;
    int32_t pid;
    uint32_t holders;
    char label[128];
    struct vramd_progress progress;
    bool has_image;
    struct vramd_image_summary image;
    struct vramd_error error;          /* why it failed or was cancelled; code OK otherwise */
    uint64_t reserved[8];              /* zero; frozen output struct: room for later versions */
};

struct vramd_open_args {
    uint32_t struct_size;              /* sizeof(struct vramd_open_args); 0: the 1.0 layout (see "ABI 1.0") */
    int kind;                          /* enum vramd_session_kind */
    int dir_fd;                        /* the image directory, O_RDONLY|O_DIRECTORY; stays the caller's (a dump
                                          keeps its own duplicate until it is committed or closed) */
    const char *compression;           /* dump, the 0.x spelling of compression_kind/_level: "none", "zstd[:LEVEL]",
                                          "bplanes[:LEVEL]", "auto[:LEVEL]"; NULL or "": daemon default */
    uint64_t chunk_size;               /* dump: bytes per chunk (multiple of 4 KiB); 0: daemon default */
    const char *label;                 /* free-form, for logs; may be NULL */
    bool allow_partial;                /* restore: image BOs may be left without a target */
    /* Incremental images (format v2).  Dump: the parent image's directory, then those of its own parents
     * (its chain); chunks they hold are referred to, not stored, and the commit marks the child in each
     * directory of the chain the caller may write (.child.<image id>).  Restore/verify: the image's
     * parents' directories, nearest first (its manifest's ParentRef list).  Each O_RDONLY|O_DIRECTORY,
     * stays the caller's.  At most VRAMD_MAX_PARENTS.  In CRIU: the --prev-images-dir chain. */
    const int *parent_dir_fds;
    size_t n_parent_dir_fds;
    const char *parent_hint;           /* dump: the parent's path relative to dir_fd's (recorded, never opened) */
    bool no_dedup;                     /* dump: store every chunk, even one the image holds already */
    bool replace_parent;               /* dump: replace an image incremental images need (they break) */
    /* ABI 1.0: the compression as an enum (the string above stays accepted; both set must agree) */
    int compression_kind;              /* dump: enum vramd_compression; DEFAULT: the string, or the daemon's */
    int compression_level;             /* dump: zstd level -7..22 for ZSTD, BPLANES, AUTO; 0: the default (1) */
    /* appended after ABI 1.0 (read where struct_size covers it) */
    uint64_t hold_s;                   /* restore: once no connection holds the session, the daemon keeps it this
                                          many seconds (at most its max_hold; not the grace period) for a client
                                          to come back by its token; 0: the grace period */
    /* appended in 1.2 (read where struct_size covers it) */
    int supply_fd;                     /* restore/verify: > 0 makes it a streamed session (docs/protocol.md,
                                          "Streamed sessions"): the read end of a pipe, or a connected unix
                                          SOCK_STREAM socket, over which the image's data files are said final
                                          while the session runs (16-byte messages, vramd/image/supply.py);
                                          stays the caller's (the daemon gets a duplicate).  0 or -1: none (0
                                          so that a zeroed struct, and a newer header's on an older library,
                                          asks for nothing: a supply on fd 0 must be dup'ed first); other
                                          negatives -EBADF; a dump with one -EINVAL.  Bytes the daemon may
                                          send back on a socket are for its writer, never read here. */
#ifdef VRAMD_ABI_TEST_EXTRA
    /* only in the ABI test's build (tests/test_libvramd_abi.py): an option appended as a later 1.x would */
    uint64_t abi_test_extra;
#endif
};

#define VRAMD_OPEN_ARGS_INIT {.struct_size = sizeof(struct vramd_open_args), .dir_fd = -1}
/* Defaults: struct_size set, dir_fd -1, everything else 0 / NULL / false (supply_fd 0: none). */
VRAMD_API void vramd_open_args_init(struct vramd_open_args *args);

#define VRAMD_MAX_PARENTS 64

/*
 * Open a session; *token receives its token.  info (may be NULL) is the last
 * reply (the OpenSession's, or that of the last AttachFiles).
 *   Dump: locks dir_fd (flock on its .lock file, created 0600 and checked to
 *   be the directory owner's or the caller's own regular file, as vramctl
 *   takes it; held until the commit or the end of the session; another dump,
 *   rm or gc holds it: -EBUSY; a .lock that is not such a file: -ELOOP,
 *   -EACCES or -EPERM),
 *   refuses a directory whose image incremental images need (.child.<id>
 *   marks; -EINVAL) unless replace_parent, and one that is also one of its
 *   parents (-EINVAL, always); removes the temporaries a crashed dump left;
 *   passes the parents' manifest.vrdm and attaches the parents' data files
 *   the daemon names.  Nothing in the directory changes until vramd_wait.
 *   A daemon that asks for more than 16 data files per GPU (more than the
 *   image format numbers) is refused: -EPROTO, code VRAMD_CODE_LOCAL, and
 *   the session is closed again.
 *   Restore/verify: opens manifest.vrdm in dir_fd and in each parent, then
 *   every data file the daemon names (image k in parent k), and attaches
 *   them (a verify starts once the last is attached).
 * A file that cannot be opened is a local error naming it (and the directory):
 * -ENOENT (a missing manifest.vrdm: "no image in DIR"), -EACCES naming the
 * uid whose rights were missing, -ELOOP for a symbolic link, -EINVAL for a
 * FIFO, socket or device under an image file's name.  A session the
 * daemon opened but whose files could not be attached is closed again.
 */
VRAMD_API int vramd_open_session(struct vramd_conn *conn, const struct vramd_open_args *args,
                                 struct vramd_token *token, struct vramd_session_info *info, struct vramd_error *err);

/* One BO.  Dump: where to read it and what to record; restore: where to write image BO `id`. */
struct vramd_bo {
    uint32_t struct_size;              /* sizeof(struct vramd_bo), the same in every element; 0: the 1.0 layout */
    uint64_t id;
    int fd;                            /* procmem: /proc/<pid>/mem; mmap/sdma: dmabuf, memfd, file; stays the caller's */
    uint64_t offset;                   /* procmem: address in that process; else offset in the fd */
    uint64_t size;                     /* dump: bytes; restore: ignored (the image has it) */
    const char *backend;               /* the 0.x spelling of backend_kind: "procmem", "mmap", "sdma"; NULL or "":
                                          chosen by the daemon from the fd */
    bool has_gpu_id;
    uint32_t gpu_id;                   /* dump: recorded (default 0); restore: lane (default: as saved) */
    uint64_t alloc_flags;              /* dump: recorded */
    uint64_t va_addr;                  /* dump: recorded */
    const char *name;                  /* dump: recorded; may be NULL */
    int backend_kind;                  /* ABI 1.0: enum vramd_backend; AUTO: the string above, or the daemon picks */
};

#define VRAMD_BO_INIT {.struct_size = sizeof(struct vramd_bo), .fd = -1}
/* Defaults: struct_size set, fd -1, everything else 0 / NULL / false. */
VRAMD_API void vramd_bo_init(struct vramd_bo *bo);

/*
 * Give the session `n` BOs.  The list is split into as many AddBos messages
 * as the negotiated limits need (bytes per message, fds per message, never
 * more than 253 fds in one packet); each distinct fd is attached once per
 * message.  Returns when the daemon has taken every message; info (may be
 * NULL) is the last reply.  A failure part-way leaves the earlier messages
 * taken (and, for a job error, fails the whole session: see the protocol).
 * Dump: before the first BO of a GPU (a BO without gpu_id is GPU 0), the
 * GPU's data files are created in the image directory and attached: as many
 * as the daemon asked for at OpenSession (1 to 16), the first as
 * data-<image id>-<gpu id>.vrd.tmp, file k (1 to 15) as
 * data-<image id>-<gpu id>-<k as one hex digit>.vrd.tmp.  A GPU the daemon
 * did not list at Hello gets no file: the daemon refuses its BO, naming it.
 */
VRAMD_API int vramd_add_bos(struct vramd_conn *conn, const struct vramd_token *token, const struct vramd_bo *bos,
                            size_t n, struct vramd_session_info *info, struct vramd_error *err);

/* No more BOs: the session completes when every copy has landed.  Dump: the
 * manifest's temporary (.manifest.vrdm.<image id>.tmp) is created and handed
 * over; the daemon writes and fsyncs every file, vramd_wait commits them. */
VRAMD_API int vramd_start(struct vramd_conn *conn, const struct vramd_token *token, struct vramd_session_info *info,
                          struct vramd_error *err);

/* The session's state and progress.  Any call naming a token (this one
 * included) makes this connection a holder of the session. */
VRAMD_API int vramd_progress(struct vramd_conn *conn, const struct vramd_token *token,
                             struct vramd_session_info *info, struct vramd_error *err);

#define VRAMD_WAIT_FOREVER (-1)
/*
 * The barrier: returns 0 once the session has ended DONE (a dump's image is
 * committed, a restore's bytes have landed and the daemon has closed its
 * copies of the fds), or the session's error.  timeout_ms >= 0 bounds the
 * wait: -ETIMEDOUT with err->code VRAMD_CODE_TIMEOUT if the session still
 * runs then; the session goes on and the connection stays usable.  0 polls.
 * info (may be NULL) is filled in every case where the daemon answered.
 * Dump: the commit happens here, in the caller's process, on the connection
 * that opened the session (on another one a DONE dump is -EXDEV, and nothing
 * is committed): the data files are renamed into place, the child is marked
 * in its parents' directories (each under that directory's lock, taken
 * shared at vramd_open_session; one the caller does not own or may not
 * write, or whose owner is not the image directory's, is neither locked nor
 * marked; one another dump holds is -EBUSY),
 * the manifest is renamed to manifest.vrdm (the commit point), the directory
 * is fsynced, the replaced image's data files are removed, and so are the
 * marks in those parents that name this directory with another image id,
 * and the directory is unlocked.  A commit that fails before the manifest's rename (a local
 * error naming the file) removes everything the dump created, and the
 * directory keeps the image it had.  A session that ended FAILED or
 * CANCELLED has its files removed too.  A later Wait repeats the outcome.
 */
VRAMD_API int vramd_wait(struct vramd_conn *conn, const struct vramd_token *token, int timeout_ms,
                         struct vramd_session_info *info, struct vramd_error *err);

/* Cancel a running session (no-op if it has ended).  reason may be NULL. */
VRAMD_API int vramd_cancel(struct vramd_conn *conn, const struct vramd_token *token, const char *reason,
                           struct vramd_session_info *info, struct vramd_error *err);

/*
 * The operator's cancel: cancel any uid's session by its session_id (as
 * vramd_session_info and vramd_list_sessions report it).  Only uid 0 and the
 * daemon's own uid may: any other uid gets -EACCES, code PERMISSION_DENIED
 * (the message names the session id); no such session -ENOENT, NOT_FOUND.
 * The connection does not become a holder.  No-op if the session has ended.
 * reason may be NULL.  info (may be NULL) is the session as it was answered.
 */
VRAMD_API int vramd_cancel_by_id(struct vramd_conn *conn, uint64_t session_id, const char *reason,
                                 struct vramd_session_info *info, struct vramd_error *err);

/* One entry of vramd_list_sessions: the session and what only the listing carries. */
#define VRAMD_MAX_TARGET_PIDS 8
struct vramd_session_entry {
    struct vramd_session_info info;
    /* the processes whose memory it copies: pids of the /proc/<pid>/mem fds it was given, ascending
     * (the first VRAMD_MAX_TARGET_PIDS; n_target_pids counts them all) */
    int32_t target_pids[VRAMD_MAX_TARGET_PIDS];
    size_t n_target_pids;
    double rate_bytes_per_s;           /* running: over the last few seconds; ended: its average */
    double age_s;                      /* seconds since it opened */
    uint64_t reserved[4];              /* zero; frozen output struct: room for later versions */
};

/*
 * The sessions the daemon shows this connection's uid: its own, or for uid 0
 * and the daemon's own uid every uid's (the admin listing).  Fills at most
 * `cap` entries of `out` (out may be NULL when cap is 0) and returns the
 * number of sessions listed, which may exceed cap.  Tokens are never listed.
 */
VRAMD_API int vramd_list_sessions(struct vramd_conn *conn, struct vramd_session_entry *out, size_t cap,
                                  struct vramd_error *err);

/* End the session (cancelling it if it runs), close its fds, forget its token.
 * A dump not committed by then has its files removed and its directory
 * unlocked (also when this call fails: the daemon never puts an image in
 * place by itself). */
VRAMD_API int vramd_close_session(struct vramd_conn *conn, const struct vramd_token *token,
                                  struct vramd_session_info *info, struct vramd_error *err);

struct vramd_status {
    char server[64];
    uint32_t version;
    double uptime_s;
    uint32_t connections;
    uint32_t sessions;
    uint64_t staging_budget;
    uint64_t staging_in_use;
    bool draining;
    uint64_t reserved[8];              /* zero; frozen output struct: room for later versions */
};
VRAMD_API int vramd_status(struct vramd_conn *conn, struct vramd_status *status, struct vramd_error *err);

#ifdef __cplusplus
}
#endif

#endif /* VRAMD_CLIENT_H */
