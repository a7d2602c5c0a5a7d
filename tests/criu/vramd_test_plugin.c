/*
 * A CRIU plugin for vramd's tests (never for production): loaded by a real
 * `criu dump/restore --libdir DIR`, it
 *
 *  - logs every hook it registers that fires, one line each, to the file
 *    named by $VRAMD_CRIU_LOG: monotonic and wall time, pid, ppid, whether
 *    this is the CRIU process that loaded the plugin, the hook, its args;
 *  - if built with libvramd (HAVE_LIBVRAMD) and $VRAMD_CRIU_MODE is
 *    "offload" or "sync": in POST_FORKING (CRIU main, right after the root
 *    task is forked, while that task restores its memory) creates one memfd
 *    per BO of $VRAMD_CRIU_BOS ("id:size,id:size,...") -- stand-ins for the
 *    dmabufs KFD returns -- and restores $VRAMD_CRIU_IMAGE into them through
 *    the vramd daemon at $VRAMD_CRIU_SOCKET.  "offload" starts the session
 *    and returns; RESUME_DEVICES_LATE waits for it (the barrier).  "sync"
 *    waits in POST_FORKING -- note that the root task, already forked, goes
 *    on restoring its memory meanwhile, so this still overlaps.  "serial"
 *    instead starts and waits in RESUME_DEVICES_LATE, after every task's
 *    memory is restored: no overlap, like BO contents restored inside the
 *    task.  After the wait the BOs' bytes, concatenated in
 *    $VRAMD_CRIU_BOS order, are checked against $VRAMD_CRIU_SHA256 unless
 *    $VRAMD_CRIU_VERIFY is "0".  With $VRAMD_CRIU_API=criu the session goes
 *    through vramd/criu.h (vramd_criu_restore_submit, which hangs up, and
 *    vramd_criu_restore_barrier) instead of client.h's calls on one held
 *    connection.  "task" is the split a GPU plugin needs: the restored task
 *    submits from RESTORE_EXT_FILE (on the device fd the workload keeps,
 *    $VRAMD_CRIU_EXT_DEV) and publishes its ticket in libvramd's shared
 *    table (set up in RESTORE_INIT); CRIU main takes it and waits in
 *    RESUME_DEVICES_LATE; the memfds reach CRIU main through CRIU's fdstore.
 *
 * Every step is logged; a failed restore or check is logged as "FAIL ...".
 * CRIU aborts the restore when POST_FORKING fails, but only debug-logs a
 * failed RESUME_DEVICES_LATE, so tests must read the log.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/sysmacros.h>
#include <time.h>
#include <unistd.h>

#include "criu-plugin.h"

#ifdef HAVE_LIBVRAMD
#include <openssl/evp.h>
#include <vramd/client.h>
#include <vramd/criu.h>
#endif

#define PLUGIN_NAME "vramd_test"

static int log_fd = -1;
static pid_t loader_pid; /* the CRIU process that ran init() */
static int stage_now = -1;

static const char *stage_name(int stage)
{
	switch (stage) {
	case CR_PLUGIN_STAGE__DUMP:
		return "DUMP";
	case CR_PLUGIN_STAGE__PRE_DUMP:
		return "PRE_DUMP";
	case CR_PLUGIN_STAGE__RESTORE:
		return "RESTORE";
	}
	return "?";
}

static void logf_(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

static void logf_(const char *fmt, ...)
{
	struct timespec mono, real;
	char buf[1024];
	va_list ap;
	int n, m;

	if (log_fd < 0)
		return;
	/*
	 * CLOCK_MONOTONIC is per time namespace, and CRIU restores tasks into a
	 * new one whose offset makes their monotonic clock go on from the dump's
	 * (timens-0.img): lines logged inside a restored task have a monotonic
	 * time seconds behind CRIU main's.  Compare processes by CLOCK_REALTIME.
	 */
	clock_gettime(CLOCK_MONOTONIC, &mono);
	clock_gettime(CLOCK_REALTIME, &real);
	n = snprintf(buf, sizeof(buf), "%ld.%09ld %ld.%06ld pid=%d ppid=%d role=%s stage=%s ", (long)mono.tv_sec,
		     mono.tv_nsec, (long)real.tv_sec, real.tv_nsec / 1000, getpid(), getppid(),
		     getpid() == loader_pid ? "criu-main" : "criu-child", stage_name(stage_now));
	va_start(ap, fmt);
	m = vsnprintf(buf + n, sizeof(buf) - n - 1, fmt, ap);
	va_end(ap);
	n += m < (int)(sizeof(buf) - n - 1) ? m : (int)(sizeof(buf) - n - 2);
	buf[n++] = '\n';
	if (getpid() != loader_pid) {
		/*
		 * A restored task (a fork of CRIU) has closed every fd it got from
		 * CRIU, and log_fd's number may now be one of the application's
		 * restored fds: never write there; open, write, close, leaving
		 * nothing behind in the task.
		 */
		const char *path = getenv("VRAMD_CRIU_LOG");
		int fd = path ? open(path, O_WRONLY | O_APPEND | O_CLOEXEC) : -1;

		if (fd >= 0) {
			if (write(fd, buf, n) < 0)
				n = 0;
			close(fd);
		}
		return;
	}
	if (write(log_fd, buf, n) < 0) /* O_APPEND: one line per write, whichever process */
		return;
}

/* the character device the workload keeps open ($VRAMD_CRIU_EXT_DEV): our "external file" */
static bool is_ext_dev(int fd)
{
	const char *dev = getenv("VRAMD_CRIU_EXT_DEV");
	struct stat want, got;

	return dev && !stat(dev, &want) && !fstat(fd, &got) && S_ISCHR(got.st_mode) && got.st_rdev == want.st_rdev;
}

/* --- the vramd restore (libvramd) ------------------------------------------ */

#ifdef HAVE_LIBVRAMD

enum mode { MODE_OFF, MODE_OFFLOAD, MODE_SYNC, MODE_SERIAL, MODE_TASK };
static const char *const mode_names[] = { "off", "offload", "sync", "serial", "task" };

/* CRIU's own fd store (criu/include/fdstore.h), which the amdgpu plugin uses too: it hands fds between
 * a restored task and CRIU main.  Resolved against the criu binary when it loads the plugin. */
extern int fdstore_add(int fd);
extern int fdstore_get(int id);

#define TASK_MAX_BOS 64
#define TABLE_SLOTS 16
/* memory shared by CRIU main and the restored tasks it forks (set up in RESTORE_INIT, task mode) */
struct task_shared {
	int nbos;
	int fdstore_ids[TASK_MAX_BOS]; /* the task's memfds, for CRIU main's check */
};

struct bo {
	uint64_t id, size;
	int fd;
};

static struct {
	int mode; /* enum mode */
	struct bo *bos;
	size_t nbos;
	int api_criu; /* $VRAMD_CRIU_API=criu: criu.h's submit/barrier instead of client.h's calls */
	struct vramd_conn *conn;
	struct vramd_token token;
	struct vramd_criu_ticket ticket;
	struct vramd_criu_table *table; /* task mode */
	struct task_shared *shared;
	int started, waited, failed;
	double t_start;
} vr;

static double now(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts); /* only compared within one process: see logf_() */
	return ts.tv_sec + ts.tv_nsec / 1e9;
}

/*
 * Bounds, so that a daemon that stops answering cannot hang CRIU (with every
 * task stopped) for ever: $VRAMD_CRIU_TIMEOUT_MS per call (default 30 s),
 * $VRAMD_CRIU_WAIT_TIMEOUT_MS for the barrier (default 600 s).
 */
static int env_ms(const char *name, int dflt)
{
	const char *v = getenv(name);

	return v && *v ? atoi(v) : dflt;
}

static int call_timeout_ms(void)
{
	return env_ms("VRAMD_CRIU_TIMEOUT_MS", 30000);
}

static int wait_timeout_ms(void)
{
	return env_ms("VRAMD_CRIU_WAIT_TIMEOUT_MS", 600000);
}

static int parse_bos(const char *spec)
{
	const char *p = spec;
	size_t cap = 0;

	if (!spec)
		return -1;

	while (p && *p) {
		char *end;
		uint64_t id = strtoull(p, &end, 0), size;

		if (*end != ':')
			return -1;
		size = strtoull(end + 1, &end, 0);
		if (*end && *end != ',')
			return -1;
		if (vr.nbos == cap) {
			cap = cap ? 2 * cap : 8;
			vr.bos = realloc(vr.bos, cap * sizeof(*vr.bos));
			if (!vr.bos)
				return -1;
		}
		vr.bos[vr.nbos++] = (struct bo){ .id = id, .size = size, .fd = -1 };
		p = *end ? end + 1 : end;
	}
	return vr.nbos ? 0 : -1;
}

static void close_bos(void)
{
	for (size_t i = 0; i < vr.nbos; i++)
		if (vr.bos[i].fd >= 0)
			close(vr.bos[i].fd);
	free(vr.bos);
	vr.bos = NULL;
	vr.nbos = 0;
}

/* SHA-256 of the BOs' bytes, concatenated in order, as lowercase hex */
static int digest_bos(char hex[65])
{
	unsigned char md[32];
	unsigned int mdlen = 0;
	EVP_MD_CTX *ctx = EVP_MD_CTX_new();
	int ret = -1;

	if (!ctx || !EVP_DigestInit_ex(ctx, EVP_sha256(), NULL))
		goto out;
	for (size_t i = 0; i < vr.nbos; i++) {
		void *p;

		if (!vr.bos[i].size)
			continue;
		p = mmap(NULL, vr.bos[i].size, PROT_READ, MAP_SHARED, vr.bos[i].fd, 0);
		if (p == MAP_FAILED)
			goto out;
		madvise(p, vr.bos[i].size, MADV_SEQUENTIAL);
		EVP_DigestUpdate(ctx, p, vr.bos[i].size);
		munmap(p, vr.bos[i].size);
	}
	if (!EVP_DigestFinal_ex(ctx, md, &mdlen))
		goto out;
	for (unsigned int i = 0; i < mdlen; i++)
		sprintf(hex + 2 * i, "%02x", md[i]);
	ret = 0;
out:
	EVP_MD_CTX_free(ctx);
	return ret;
}

static int restore_start(void)
{
	const char *image = getenv("VRAMD_CRIU_IMAGE"), *sock = getenv("VRAMD_CRIU_SOCKET");
	const char *spec = getenv("VRAMD_CRIU_BOS");
	int dir_fd = -1, ret = -1;

	vr.t_start = now();
	if (!image || !spec || parse_bos(spec)) {
		logf_("FAIL vramd: need VRAMD_CRIU_IMAGE and VRAMD_CRIU_BOS=id:size[,...] (got %s, %s)",
		      image ? image : "-", spec ? spec : "-");
		return -1;
	}
	for (size_t i = 0; i < vr.nbos; i++) {
		vr.bos[i].fd = memfd_create("vramd-criu-bo", MFD_CLOEXEC);
		if (vr.bos[i].fd < 0 || ftruncate(vr.bos[i].fd, vr.bos[i].size)) {
			logf_("FAIL vramd: memfd for BO %" PRIu64 ": %s", vr.bos[i].id, strerror(errno));
			return -1;
		}
	}
	dir_fd = open(image, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
	if (dir_fd < 0) {
		logf_("FAIL vramd: open %s: %s", image, strerror(errno));
		return -1;
	}
	if (vr.api_criu) {
		struct vramd_criu_config cfg;
		struct vramd_error err = { 0 };
		struct vramd_criu_bo *bos = calloc(vr.nbos, sizeof(*bos));
		char tok[VRAMD_TOKEN_STRLEN + 1];
		double t0 = now(), t1;

		if (!bos) {
			logf_("FAIL vramd: out of memory");
			goto out;
		}
		vramd_criu_config_init(&cfg);
		cfg.socket_path = sock;
		cfg.timeout_ms = call_timeout_ms();
		cfg.client_name = "criu-test-plugin";
		cfg.label = "criu-test";
		for (size_t i = 0; i < vr.nbos; i++)
			bos[i] = (struct vramd_criu_bo){ .struct_size = sizeof(struct vramd_criu_bo), .id = vr.bos[i].id, .fd = vr.bos[i].fd, .size = vr.bos[i].size };
		ret = vramd_criu_restore_submit(&cfg, dir_fd, bos, vr.nbos, 0, &vr.ticket, &err);
		free(bos);
		t1 = now();
		if (ret) {
			logf_("FAIL vramd: vramd_criu_restore_submit: %d %s: %s", ret, vramd_code_name(err.code), err.message);
			goto out;
		}
		vr.started = 1;
		vramd_token_format(&vr.ticket.token, tok);
		logf_("vramd: restore submitted (criu.h) ticket pid=%d token=%.8s...: %zu BOs; memfds %.3f s, submit %.3f s",
		      vr.ticket.pid, tok, vr.nbos, t0 - vr.t_start, t1 - t0);
		goto out;
	}
	{
		struct vramd_options opts;
		struct vramd_open_args args = { .struct_size = sizeof(args), .kind = VRAMD_SESSION_RESTORE, .dir_fd = dir_fd, .label = "criu-test" };
		struct vramd_session_info info;
		struct vramd_error err = { 0 };
		struct vramd_bo *bos = calloc(vr.nbos, sizeof(*bos));
		char tok[VRAMD_TOKEN_STRLEN + 1];
		double t0 = now(), t1, t2, t3;

		vramd_options_init(&opts);
		opts.client_name = "criu-test-plugin";
		opts.timeout_ms = call_timeout_ms();
		if (!bos) {
			logf_("FAIL vramd: out of memory");
			goto out;
		}
		for (size_t i = 0; i < vr.nbos; i++)
			bos[i] = (struct vramd_bo){ .struct_size = sizeof(struct vramd_bo), .id = vr.bos[i].id, .fd = vr.bos[i].fd, .size = vr.bos[i].size };
		ret = sock ? vramd_connect_path(&vr.conn, sock, &opts, &err) : vramd_connect(&vr.conn, &opts, &err);
		if (ret) {
			logf_("FAIL vramd: connect %s: %d %s: %s", sock ? sock : "(default)", ret, vramd_code_name(err.code),
			      err.message);
			free(bos);
			goto out;
		}
		t1 = now();
		ret = vramd_open_session(vr.conn, &args, &vr.token, &info, &err);
		if (ret) {
			logf_("FAIL vramd: open restore session: %d %s: %s", ret, vramd_code_name(err.code), err.message);
			free(bos);
			goto out;
		}
		vramd_token_format(&vr.token, tok);
		ret = vramd_add_bos(vr.conn, &vr.token, bos, vr.nbos, &info, &err);
		free(bos);
		if (ret) {
			logf_("FAIL vramd: add %zu BOs: %d %s: %s", vr.nbos, ret, vramd_code_name(err.code), err.message);
			goto out;
		}
		t2 = now();
		ret = vramd_start(vr.conn, &vr.token, &info, &err);
		if (ret) {
			logf_("FAIL vramd: start: %d %s: %s", ret, vramd_code_name(err.code), err.message);
			goto out;
		}
		t3 = now();
		vr.started = 1;
		logf_("vramd: restore session %" PRIu64 " token=%.8s... started: %zu BOs, %" PRIu64
		      " bytes; memfds %.3f s, connect %.3f s, open+add %.3f s, start %.3f s",
		      info.session_id, tok, vr.nbos, info.progress.bytes_total, t0 - vr.t_start, t1 - t0, t2 - t1, t3 - t2);
	}
out:
	close(dir_fd);
	return ret;
}

static int restore_wait(const char *where)
{
	const char *want = getenv("VRAMD_CRIU_SHA256"), *verify = getenv("VRAMD_CRIU_VERIFY");
	char hex[65] = "";
	double t0 = now(), t1, t2;
	int ret = -1;

	if (vr.api_criu) {
		struct vramd_criu_config cfg;
		struct vramd_session_info info;
		struct vramd_error err = { 0 };

		vramd_criu_config_init(&cfg);
		cfg.socket_path = getenv("VRAMD_CRIU_SOCKET");
		cfg.timeout_ms = call_timeout_ms();
		cfg.wait_timeout_ms = wait_timeout_ms();
		cfg.client_name = "criu-test-plugin";
		ret = vramd_criu_restore_barrier(&cfg, &vr.ticket, &info, &err);
		if (ret)
			logf_("FAIL vramd: vramd_criu_restore_barrier: %d %s: %s (bo %" PRIu64 " offset %" PRIu64 ")", ret,
			      vramd_code_name(err.code), err.message, err.has_bo_id ? err.bo_id : 0,
			      err.has_offset ? err.offset : 0);
		else
			logf_("vramd: session done (criu.h barrier): %" PRIu64 "/%" PRIu64 " bytes, %u/%u BOs, daemon elapsed %.3f s",
			      info.progress.bytes_done, info.progress.bytes_total, info.progress.bos_done,
			      info.progress.bos_total, info.progress.elapsed_s);
	} else {
		struct vramd_session_info info;
		struct vramd_error err = { 0 };

		ret = vramd_wait(vr.conn, &vr.token, wait_timeout_ms(), &info, &err);
		if (ret)
			logf_("FAIL vramd: wait: %d %s: %s (bo %" PRIu64 " offset %" PRIu64 ")", ret,
			      vramd_code_name(err.code), err.message, err.has_bo_id ? err.bo_id : 0,
			      err.has_offset ? err.offset : 0);
		else
			logf_("vramd: session done: %" PRIu64 "/%" PRIu64 " bytes, %u/%u BOs, daemon elapsed %.3f s",
			      info.progress.bytes_done, info.progress.bytes_total, info.progress.bos_done,
			      info.progress.bos_total, info.progress.elapsed_s);
		if (vramd_close_session(vr.conn, &vr.token, NULL, &err))
			logf_("vramd: close session: %s", err.message);
		vramd_close(vr.conn);
		vr.conn = NULL;
	}
	t1 = now();
	vr.waited = 1;
	logf_("vramd: waited in %s: %.3f s (%.3f s since start)", where, t1 - t0, t1 - vr.t_start);
	if (ret)
		return ret;
	if (verify && !strcmp(verify, "0"))
		return 0;
	if (digest_bos(hex)) {
		logf_("FAIL vramd: digest: %s", strerror(errno));
		return -1;
	}
	t2 = now();
	if (want && strcasecmp(want, hex)) {
		logf_("FAIL vramd: digest mismatch: got %s want %s (%.3f s)", hex, want, t2 - t1);
		return -1;
	}
	logf_("vramd: verify %s sha256=%s (%.3f s)", want ? "OK" : "UNCHECKED", hex, t2 - t1);
	return 0;
}

/* RESTORE_INIT, CRIU main, before forking: the ticket table and the fd ids, in memory the tasks inherit */
static int task_setup(void)
{
	size_t tsize = (vramd_criu_table_size(TABLE_SLOTS) + 63) & ~(size_t)63;
	size_t len = tsize + sizeof(struct task_shared);
	void *mem = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
	int ret;

	if (mem == MAP_FAILED) {
		logf_("FAIL vramd: mmap of the shared table: %s", strerror(errno));
		return -1;
	}
	ret = vramd_criu_table_init(mem, tsize, TABLE_SLOTS, &vr.table);
	if (ret) {
		logf_("FAIL vramd: vramd_criu_table_init: %d", ret);
		return -1;
	}
	vr.shared = (struct task_shared *)((char *)mem + tsize);
	vr.t_start = now();
	return 0;
}

/* RESTORE_EXT_FILE, inside the restored task: BOs (memfds here, dmabufs from KFD there), submit, publish */
static int task_submit(void)
{
	const char *image = getenv("VRAMD_CRIU_IMAGE"), *spec = getenv("VRAMD_CRIU_BOS");
	struct vramd_criu_config cfg;
	struct vramd_error err = { 0 };
	struct vramd_criu_bo *bos = NULL;
	struct vramd_criu_ticket ticket;
	char tok[VRAMD_TOKEN_STRLEN + 1];
	int dir_fd = -1, ret = -1;
	double t0 = now(), t1;

	if (!vr.table || !image || !spec || parse_bos(spec) || vr.nbos > TASK_MAX_BOS) {
		logf_("FAIL vramd: task mode needs RESTORE_INIT's table, VRAMD_CRIU_IMAGE, VRAMD_CRIU_BOS (<= %d)",
		      TASK_MAX_BOS);
		goto out;
	}
	bos = calloc(vr.nbos, sizeof(*bos));
	dir_fd = open(image, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
	if (!bos || dir_fd < 0) {
		logf_("FAIL vramd: open %s: %s", image, strerror(errno));
		goto out;
	}
	for (size_t i = 0; i < vr.nbos; i++) {
		vr.bos[i].fd = memfd_create("vramd-criu-bo", MFD_CLOEXEC);
		if (vr.bos[i].fd < 0 || ftruncate(vr.bos[i].fd, vr.bos[i].size)) {
			logf_("FAIL vramd: memfd: %s", strerror(errno));
			goto out;
		}
		bos[i] = (struct vramd_criu_bo){ .struct_size = sizeof(struct vramd_criu_bo), .id = vr.bos[i].id, .fd = vr.bos[i].fd, .size = vr.bos[i].size };
	}
	vramd_criu_config_init(&cfg);
	cfg.socket_path = getenv("VRAMD_CRIU_SOCKET");
	cfg.timeout_ms = call_timeout_ms();
	cfg.client_name = "criu-test-plugin (restored task)";
	cfg.label = "criu-test-task";
	ret = vramd_criu_restore_submit(&cfg, dir_fd, bos, vr.nbos, 0, &ticket, &err);
	if (ret) {
		logf_("FAIL vramd: vramd_criu_restore_submit: %d %s: %s", ret, vramd_code_name(err.code), err.message);
		goto out;
	}
	ret = vramd_criu_table_publish(vr.table, &ticket);
	if (ret) {
		logf_("FAIL vramd: vramd_criu_table_publish: %d", ret);
		goto out;
	}
	for (size_t i = 0; i < vr.nbos; i++) {
		vr.shared->fdstore_ids[i] = fdstore_add(vr.bos[i].fd);
		if (vr.shared->fdstore_ids[i] < 0) {
			logf_("FAIL vramd: fdstore_add");
			ret = -1;
			goto out;
		}
	}
	vr.shared->nbos = vr.nbos;
	t1 = now();
	vramd_token_format(&ticket.token, tok);
	logf_("vramd: restore submitted from the task (criu.h), ticket pid=%d token=%.8s... published: %zu BOs in %.3f s",
	      ticket.pid, tok, vr.nbos, t1 - t0);
out:
	if (dir_fd >= 0)
		close(dir_fd);
	free(bos);
	close_bos(); /* nothing of ours stays open in the restored task */
	return ret;
}

/* RESUME_DEVICES_LATE, CRIU main: this task's ticket, the barrier, then the BOs (from the fdstore) checked */
static int task_barrier(int pid)
{
	int ret = vramd_criu_table_take(vr.table, pid, &vr.ticket);

	if (ret) {
		logf_("FAIL vramd: no ticket for pid %d: %d", pid, ret);
		return -1;
	}
	vr.started = 1;
	if (parse_bos(getenv("VRAMD_CRIU_BOS")) || (int)vr.nbos != vr.shared->nbos) {
		logf_("FAIL vramd: %d BOs published, VRAMD_CRIU_BOS says otherwise", vr.shared->nbos);
		return -1;
	}
	for (size_t i = 0; i < vr.nbos; i++) {
		vr.bos[i].fd = fdstore_get(vr.shared->fdstore_ids[i]);
		if (vr.bos[i].fd < 0) {
			logf_("FAIL vramd: fdstore_get");
			return -1;
		}
	}
	return restore_wait("RESUME_DEVICES_LATE");
}

#endif /* HAVE_LIBVRAMD */

/* --- hooks ---------------------------------------------------------------- */

static int plugin_init(int stage)
{
	const char *path = getenv("VRAMD_CRIU_LOG");

	stage_now = stage;
	loader_pid = getpid();
	if (path && log_fd < 0)
		log_fd = open(path, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
#ifdef HAVE_LIBVRAMD
	{
		const char *mode = getenv("VRAMD_CRIU_MODE");

		vr.mode = MODE_OFF;
		for (int i = 0; mode && i < (int)(sizeof(mode_names) / sizeof(mode_names[0])); i++)
			if (!strcmp(mode, mode_names[i]))
				vr.mode = i;
		const char *api = getenv("VRAMD_CRIU_API");

		vr.api_criu = (api && !strcmp(api, "criu")) || vr.mode == MODE_TASK; /* task mode is criu.h only */
		logf_("init libvramd=yes mode=%s api=%s", mode_names[vr.mode], vr.api_criu ? "criu.h" : "client.h");
	}
#else
	logf_("init libvramd=no");
#endif
	return 0;
}

static void plugin_exit(int stage, int ret)
{
	stage_now = stage;
	logf_("exit ret=%d", ret);
#ifdef HAVE_LIBVRAMD
	if (vr.started && !vr.waited)
		logf_("FAIL vramd: session started but never waited for");
	if (vr.conn)
		vramd_close(vr.conn);
	vr.conn = NULL;
	close_bos();
#endif
	if (log_fd >= 0)
		close(log_fd);
	log_fd = -1;
}

CR_PLUGIN_REGISTER(PLUGIN_NAME, plugin_init, plugin_exit)

static int hook_restore_init(void)
{
	logf_("hook=RESTORE_INIT");
#ifdef HAVE_LIBVRAMD
	if (vr.mode == MODE_TASK && task_setup())
		return -1;
#endif
	return 0;
}
CR_PLUGIN_REGISTER_HOOK(CR_PLUGIN_HOOK__RESTORE_INIT, hook_restore_init)

static int hook_post_forking(void)
{
	logf_("hook=POST_FORKING");
#ifdef HAVE_LIBVRAMD
	if (vr.mode == MODE_OFFLOAD || vr.mode == MODE_SYNC) {
		if (restore_start())
			return -1; /* CRIU aborts the restore */
		if (vr.mode == MODE_SYNC && restore_wait("POST_FORKING"))
			return -1;
	}
#endif
	return 0;
}
CR_PLUGIN_REGISTER_HOOK(CR_PLUGIN_HOOK__POST_FORKING, hook_post_forking)

static int hook_resume_devices_late(int pid)
{
	logf_("hook=RESUME_DEVICES_LATE target_pid=%d", pid);
#ifdef HAVE_LIBVRAMD
	/* CRIU only debug-logs a failure here; it is called once per task, we act on the first */
	if (vr.mode == MODE_TASK)
		return task_barrier(pid);
	if (vr.mode == MODE_SERIAL && !vr.started && !vr.waited && restore_start())
		return -1;
	if ((vr.mode == MODE_OFFLOAD || vr.mode == MODE_SERIAL) && vr.started && !vr.waited)
		return restore_wait("RESUME_DEVICES_LATE");
#endif
	return 0;
}
CR_PLUGIN_REGISTER_HOOK(CR_PLUGIN_HOOK__RESUME_DEVICES_LATE, hook_resume_devices_late)

/* The rest only log: they tell which hooks CRIU calls for an ordinary process. */

static int hook_pause_devices(int pid)
{
	logf_("hook=PAUSE_DEVICES target_pid=%d", pid);
	return -ENOTSUP;
}
CR_PLUGIN_REGISTER_HOOK(CR_PLUGIN_HOOK__PAUSE_DEVICES, hook_pause_devices)

static int hook_checkpoint_devices(int pid)
{
	logf_("hook=CHECKPOINT_DEVICES target_pid=%d", pid);
	return -ENOTSUP;
}
CR_PLUGIN_REGISTER_HOOK(CR_PLUGIN_HOOK__CHECKPOINT_DEVICES, hook_checkpoint_devices)

static int hook_dump_devices_late(int id)
{
	logf_("hook=DUMP_DEVICES_LATE id=%d", id);
	return -ENOTSUP;
}
CR_PLUGIN_REGISTER_HOOK(CR_PLUGIN_HOOK__DUMP_DEVICES_LATE, hook_dump_devices_late)

static int hook_handle_device_vma(int fd, const struct stat *st)
{
	logf_("hook=HANDLE_DEVICE_VMA fd=%d rdev=%u:%u", fd, major(st->st_rdev), minor(st->st_rdev));
	return -ENOTSUP;
}
CR_PLUGIN_REGISTER_HOOK(CR_PLUGIN_HOOK__HANDLE_DEVICE_VMA, hook_handle_device_vma)

static int hook_dump_ext_file(int fd, int id)
{
	bool ours = is_ext_dev(fd);

	logf_("hook=DUMP_EXT_FILE fd=%d id=%d%s", fd, id, ours ? " (our device: taken)" : "");
	return ours ? 0 : -ENOTSUP;
}
CR_PLUGIN_REGISTER_HOOK(CR_PLUGIN_HOOK__DUMP_EXT_FILE, hook_dump_ext_file)

static int hook_restore_ext_file(int id, bool *retry_needed)
{
	const char *dev = getenv("VRAMD_CRIU_EXT_DEV");
	int fd;

	logf_("hook=RESTORE_EXT_FILE id=%d", id);
	if (!dev)
		return -ENOTSUP;
	*retry_needed = false; /* criu's files-ext.c leaves it uninitialised: garbage means "call again" */
	fd = open(dev, O_RDWR); /* CRIU moves it to the right number and sets its flags */
	if (fd < 0) {
		logf_("FAIL reopen %s: %s", dev, strerror(errno));
		return -1;
	}
#ifdef HAVE_LIBVRAMD
	if (vr.mode == MODE_TASK && task_submit()) {
		close(fd);
		return -1;
	}
#endif
	return fd;
}
CR_PLUGIN_REGISTER_HOOK(CR_PLUGIN_HOOK__RESTORE_EXT_FILE, hook_restore_ext_file)

static int hook_update_vma_map(const char *path, const uint64_t addr, const uint64_t old_pgoff, uint64_t *new_pgoff,
			       int *plugin_fd)
{
	(void)new_pgoff;
	(void)plugin_fd;
	logf_("hook=UPDATE_VMA_MAP path=%s addr=%#" PRIx64 " pgoff=%#" PRIx64, path, addr, old_pgoff);
	return -ENOTSUP;
}
CR_PLUGIN_REGISTER_HOOK(CR_PLUGIN_HOOK__UPDATE_VMA_MAP, hook_update_vma_map)
