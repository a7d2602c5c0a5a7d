/*
 * kfd_model.c - the KFD MODEL (see kfd_model.h and docs/kfd-model.md).
 *
 * THIS IS A MODEL, NOT A GPU.  It stands for the amdkfd driver's CRIU ioctls
 * and the few memory ioctls a process needs to own BOs; it runs no queues, no
 * shaders, no DMA.  The rules and errnos follow the uapi header's comments and
 * the kernel's behaviour as docs/kfd-model.md states it, in our own code.
 *
 * State: one file "state" in the state directory, mapped MAP_SHARED by every
 * process that attaches, guarded by one process-shared robust mutex.  BO
 * memory: a window of the GPU's arena file renderD<minor> (sparse).  The kfd
 * stand-in file "kfd" backs the doorbell and MMIO-remap pages.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <limits.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <linux/capability.h>
#include <linux/kfd_ioctl.h>

#include "kfd_model.h"

/* The header spells WRITABLE as (1 << 31), a signed shift UBSan reports when
 * it is evaluated at run time; the same bit, unsigned: */
#define KFDM_WRITABLE (1u << 31)
_Static_assert(KFDM_WRITABLE == (uint32_t)KFD_IOC_ALLOC_MEM_FLAGS_WRITABLE, "WRITABLE bit");

#define KFDM_MAGIC 0x4b46444d53544154ULL      /* "KFDMSTAT" */
#define KFDM_VERSION 2
#define ARENA_SIZE (1ULL << 40)               /* sparse: 1 TiB of offsets per GPU */
#define ARENA_START (1ULL << 32)              /* like the DRM mmap offset space's start */
#define PRIV_MAGIC "KFDMPRV1"
#define PRIV_VERSION 1

enum proc_state { P_FREE = 0, P_RUNNING, P_RESTORED };

struct sproc {
	uint32_t state;
	int32_t pid;
	uint64_t starttime;     /* /proc/<pid>/stat field 22: tells a pid's incarnations apart */
	uint64_t gen;           /* token generation */
	uint32_t vm_mask;       /* GPUs (by index) whose VM the process acquired */
	uint32_t paused;        /* queues evicted by PROCESS_INFO */
	uint32_t next_idr;
	uint32_t nbos;
	uint32_t user_gpu_id[KFDM_MAX_GPUS];
};

struct sbo {
	uint32_t used;
	uint32_t proc;          /* slot */
	uint32_t gpu;           /* index */
	uint32_t flags;
	uint32_t idr;
	uint32_t pad;
	uint64_t va, size, offset;
};

struct sinject {
	int32_t err;
	uint32_t skip;
	uint32_t count;
	uint32_t pad;
};

struct sgpu {
	struct kfdm_gpu g;
	uint64_t next_off;
	uint64_t vram_used;
};

struct shared {
	uint64_t magic;
	uint32_t version;
	uint32_t ngpus;
	uint32_t kfd_minor;
	uint32_t pad;
	uint64_t instance;
	uint64_t next_gen;
	uint64_t dmabuf_seq;
	pthread_mutex_t lock;
	struct sgpu gpus[KFDM_MAX_GPUS];
	struct sproc procs[KFDM_MAX_PROCS];
	struct sbo bos[KFDM_MAX_BOS];
	struct sinject inj[KFDM_OP_COUNT];
	uint64_t calls[KFDM_OP_COUNT];
	uint64_t fails[KFDM_OP_COUNT];
	uint64_t stats[KFDM_STAT_COUNT];
};

struct kfdm {
	char dir[PATH_MAX];
	struct shared *s;
	dev_t arena_dev[KFDM_MAX_GPUS];    /* identity of each GPU's arena file */
	ino_t arena_ino[KFDM_MAX_GPUS];
	int kfd_fd;
};

struct priv_hdr {
	char magic[8];
	uint32_t version;
	uint32_t num_devices;
	uint32_t num_bos;
	uint32_t num_objects;
	uint64_t instance;
};
struct priv_dev { uint32_t user_gpu_id, actual_gpu_id; };
struct priv_bo { uint32_t idr, flags; uint64_t va; };

static const char *op_names[KFDM_OP_COUNT] = {
	"open", "get_version", "acquire_vm", "alloc", "free", "process_info",
	"checkpoint", "unpause", "restore", "resume", "queue",
};

const char *kfdm_op_name(enum kfdm_op op)
{
	return (unsigned)op < KFDM_OP_COUNT ? op_names[op] : "?";
}

static uint64_t page_size(void) { return (uint64_t)sysconf(_SC_PAGESIZE); }

/* open without going through libc: the identity shim (kfd_shim.c) wraps
 * libc's open, and the model must not re-enter it. */
static int raw_open(const char *path, int flags, ...)
{
	mode_t mode = 0;
	if (flags & O_CREAT) {
		va_list ap;
		va_start(ap, flags);
		mode = (mode_t)va_arg(ap, int);
		va_end(ap);
	}
	return (int)syscall(SYS_openat, AT_FDCWD, path, flags, mode);
}

/* fstat without going through libc: the identity shim answers libc's fstat
 * for the stand-in files with device numbers; the model needs the truth. */
static int raw_fstat(int fd, struct stat *st)
{
	return (int)syscall(SYS_newfstatat, fd, "", st, AT_EMPTY_PATH);
}

static uint64_t proc_starttime_raw(int pid);

/* The caller's time namespace boottime offset, in clock ticks.  /proc/<pid>/stat
 * reports a start time shifted by the READER's offset, and CRIU restores tasks
 * into a time namespace of their own: without this, a restored task and CRIU's
 * main process would not agree on whether a process is the same one. */
static int64_t boottime_offset_ticks(void)
{
	char buf[256];
	int fd = raw_open("/proc/self/timens_offsets", O_RDONLY | O_CLOEXEC);
	if (fd < 0)
		return 0;                       /* no time namespaces: no offset */
	ssize_t n = read(fd, buf, sizeof(buf) - 1);
	close(fd);
	if (n <= 0)
		return 0;
	buf[n] = 0;
	const char *b = strstr(buf, "boottime");
	long long sec = 0, nsec = 0;
	if (!b || sscanf(b + 8, "%lld %lld", &sec, &nsec) != 2)
		return 0;
	long hz = sysconf(_SC_CLK_TCK);
	return (int64_t)(sec * hz + nsec * hz / 1000000000LL);
}

/* The start time of PID in clock ticks since the host's boot; 0 if it is gone. */
static uint64_t proc_starttime(int pid)
{
	uint64_t t = proc_starttime_raw(pid);
	return t ? t - (uint64_t)boottime_offset_ticks() : 0;
}

/* the same process, allowing for the one tick the offset's rounding may cost */
static bool same_start(uint64_t a, uint64_t b)
{
	return a && b && (a > b ? a - b : b - a) <= 1;
}

static uint64_t proc_starttime_raw(int pid)
{
	char path[64], buf[1024];
	snprintf(path, sizeof(path), "/proc/%d/stat", pid);
	int fd = raw_open(path, O_RDONLY | O_CLOEXEC);
	if (fd < 0)
		return 0;
	ssize_t n = read(fd, buf, sizeof(buf) - 1);
	close(fd);
	if (n <= 0)
		return 0;
	buf[n] = 0;
	char *p = strrchr(buf, ')');      /* comm may hold spaces */
	if (!p)
		return 0;
	/* fields after comm: 3 state ... 22 starttime */
	int field = 2;
	for (p++; *p && field < 22; p++)
		if (*p == ' ')
			field++;
	return strtoull(p, NULL, 10);
}

static int tracer_of(int pid)
{
	char path[64], buf[4096];
	snprintf(path, sizeof(path), "/proc/%d/status", pid);
	int fd = raw_open(path, O_RDONLY | O_CLOEXEC);
	if (fd < 0)
		return -1;
	ssize_t n = read(fd, buf, sizeof(buf) - 1);
	close(fd);
	if (n <= 0)
		return -1;
	buf[n] = 0;
	char *t = strstr(buf, "\nTracerPid:");
	return t ? atoi(t + 11) : -1;
}

static bool has_cr_capability(void)
{
	struct __user_cap_header_struct h = { _LINUX_CAPABILITY_VERSION_3, 0 };
	struct __user_cap_data_struct d[2];
	memset(d, 0, sizeof(d));
	if (syscall(SYS_capget, &h, d))
		return false;
	uint64_t eff = (uint64_t)d[0].effective | ((uint64_t)d[1].effective << 32);
	return (eff >> 40 /* CAP_CHECKPOINT_RESTORE */ & 1) || (eff >> 21 /* CAP_SYS_ADMIN */ & 1);
}

/* Every refusal can say why: VRAMD_KFD_MODEL_LOG=<file> (or "-" for stderr)
 * appends one line per refused call, the errno last. */
__attribute__((format(printf, 2, 3))) static int refuse(int err, const char *fmt, ...)
{
	const char *log = getenv("VRAMD_KFD_MODEL_LOG");
	if (!log || !*log)
		return err;
	char msg[512];
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(msg, sizeof(msg), fmt, ap);
	va_end(ap);
	int fd = strcmp(log, "-") ? raw_open(log, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0600) : 2;
	if (fd >= 0) {
		dprintf(fd, "kfd-model[%d]: %s: %s\n", getpid(), msg, strerror(-err));
		if (fd != 2)
			close(fd);
	}
	return err;
}

static uint64_t fnv1a(const void *p, size_t n)
{
	const uint8_t *b = p;
	uint64_t h = 0xcbf29ce484222325ULL;
	for (size_t i = 0; i < n; i++)
		h = (h ^ b[i]) * 0x100000001b3ULL;
	return h;
}

static void lock(struct shared *s)
{
	int r = pthread_mutex_lock(&s->lock);
	if (r == EOWNERDEAD)        /* a process died holding it: the state is still consistent per op */
		pthread_mutex_consistent(&s->lock);
}

static void unlock(struct shared *s) { pthread_mutex_unlock(&s->lock); }

int kfdm_create(const char *dir, const struct kfdm_gpu *gpus, unsigned ngpus, unsigned kfd_minor_version)
{
	if (!dir || ngpus > KFDM_MAX_GPUS || (ngpus && !gpus))
		return -EINVAL;
	uint64_t pg = page_size();
	for (unsigned i = 0; i < ngpus; i++) {
		if (!gpus[i].gpu_id || gpus[i].minor < 128 || gpus[i].minor > 255)
			return -EINVAL;
		for (unsigned j = 0; j < i; j++)
			if (gpus[j].gpu_id == gpus[i].gpu_id || gpus[j].minor == gpus[i].minor)
				return -EINVAL;
	}
	char path[PATH_MAX];
	snprintf(path, sizeof(path), "%s/dmabuf", dir);
	if (mkdir(path, 0700) && errno != EEXIST)
		return -errno;
	for (unsigned i = 0; i < ngpus; i++) {
		snprintf(path, sizeof(path), "%s/renderD%u", dir, gpus[i].minor);
		int fd = raw_open(path, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
		if (fd < 0)
			return -errno;
		int r = ftruncate(fd, (off_t)ARENA_SIZE) ? -errno : 0;
		close(fd);
		if (r)
			return r;
	}
	snprintf(path, sizeof(path), "%s/kfd", dir);
	int fd = raw_open(path, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
	if (fd < 0)
		return -errno;
	int r = ftruncate(fd, (off_t)((1 + 2 * KFDM_MAX_GPUS) * pg)) ? -errno : 0;
	close(fd);
	if (r)
		return r;
	snprintf(path, sizeof(path), "%s/state", dir);
	fd = raw_open(path, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
	if (fd < 0)
		return -errno;
	if (ftruncate(fd, sizeof(struct shared))) {
		r = -errno;
		close(fd);
		return r;
	}
	struct shared *s = mmap(NULL, sizeof(*s), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
	close(fd);
	if (s == MAP_FAILED)
		return -errno;
	s->version = KFDM_VERSION;
	s->ngpus = ngpus;
	s->kfd_minor = kfd_minor_version;
	s->next_gen = 1;
	uint64_t inst = 0;
	int ufd = raw_open("/dev/urandom", O_RDONLY | O_CLOEXEC);
	if (ufd >= 0) {
		if (read(ufd, &inst, sizeof(inst)) != sizeof(inst))
			inst = 0;
		close(ufd);
	}
	s->instance = inst ? inst : (uint64_t)getpid();
	for (unsigned i = 0; i < ngpus; i++) {
		s->gpus[i].g = gpus[i];
		s->gpus[i].next_off = ARENA_START;
	}
	pthread_mutexattr_t a;
	pthread_mutexattr_init(&a);
	pthread_mutexattr_setpshared(&a, PTHREAD_PROCESS_SHARED);
	pthread_mutexattr_setrobust(&a, PTHREAD_MUTEX_ROBUST);
	pthread_mutex_init(&s->lock, &a);
	pthread_mutexattr_destroy(&a);
	__atomic_store_n(&s->magic, KFDM_MAGIC, __ATOMIC_RELEASE);
	munmap(s, sizeof(*s));
	return 0;
}

struct kfdm *kfdm_attach(const char *dir)
{
	struct kfdm *m = calloc(1, sizeof(*m));
	if (!m)
		return NULL;
	m->kfd_fd = -1;
	snprintf(m->dir, sizeof(m->dir), "%s", dir);
	char path[PATH_MAX + 32];
	snprintf(path, sizeof(path), "%s/state", dir);
	int fd = raw_open(path, O_RDWR | O_CLOEXEC);
	struct stat st;
	if (fd < 0 || raw_fstat(fd, &st) || (size_t)st.st_size != sizeof(struct shared)) {
		int e = fd < 0 ? errno : EINVAL;
		if (fd >= 0)
			close(fd);
		free(m);
		errno = e;
		return NULL;
	}
	m->s = mmap(NULL, sizeof(struct shared), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
	close(fd);
	if (m->s == MAP_FAILED || __atomic_load_n(&m->s->magic, __ATOMIC_ACQUIRE) != KFDM_MAGIC ||
	    m->s->version != KFDM_VERSION) {
		if (m->s != MAP_FAILED)
			munmap(m->s, sizeof(struct shared));
		free(m);
		errno = EINVAL;
		return NULL;
	}
	for (unsigned i = 0; i < m->s->ngpus; i++) {
		snprintf(path, sizeof(path), "%s/renderD%u", dir, m->s->gpus[i].g.minor);
		struct stat ast;
		int fd = raw_open(path, O_RDWR | O_CLOEXEC);
		if (fd < 0 || raw_fstat(fd, &ast)) {
			int e = errno;
			if (fd >= 0)
				close(fd);
			kfdm_detach(m);
			errno = e;
			return NULL;
		}
		close(fd);
		m->arena_dev[i] = ast.st_dev;
		m->arena_ino[i] = ast.st_ino;
	}
	return m;
}

void kfdm_detach(struct kfdm *m)
{
	if (!m)
		return;
	if (m->s)
		munmap(m->s, sizeof(struct shared));
	free(m);
}

const char *kfdm_dir(const struct kfdm *m) { return m->dir; }

static int gpu_index(struct shared *s, uint32_t gpu_id)
{
	for (unsigned i = 0; i < s->ngpus; i++)
		if (s->gpus[i].g.gpu_id == gpu_id)
			return (int)i;
	return -1;
}

static int user_gpu_index(struct shared *s, struct sproc *p, uint32_t user_gpu_id)
{
	for (unsigned i = 0; i < s->ngpus; i++)
		if (p->user_gpu_id[i] == user_gpu_id)
			return (int)i;
	return -1;
}

/* A transient fd of GPU GI's arena, for one pwrite or hole punch.  The model
 * keeps no fd open between calls: it runs inside processes whose fd table
 * others arrange (CRIU's restore closes what the restored task should not
 * have and needs its low numbers free), so it must neither hold nor take one. */
static int arena_open(struct kfdm *m, unsigned gi)
{
	char path[PATH_MAX + 32];
	snprintf(path, sizeof(path), "%s/renderD%u", m->dir, m->s->gpus[gi].g.minor);
	return raw_open(path, O_RDWR | O_CLOEXEC);
}

static bool is_arena(struct kfdm *m, unsigned gi, int fd)
{
	struct stat st;
	return !raw_fstat(fd, &st) && st.st_dev == m->arena_dev[gi] && st.st_ino == m->arena_ino[gi];
}

static void bo_release(struct kfdm *m, struct sbo *b)
{
	struct shared *s = m->s;
	if (b->flags & (KFD_IOC_ALLOC_MEM_FLAGS_VRAM | KFD_IOC_ALLOC_MEM_FLAGS_GTT)) {
		/* give the memory back; the offsets are never handed out again */
		int fd = arena_open(m, b->gpu);
		if (fd >= 0) {
			fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, (off_t)b->offset, (off_t)b->size);
			close(fd);
		}
		if (b->flags & KFD_IOC_ALLOC_MEM_FLAGS_VRAM)
			s->gpus[b->gpu].vram_used -= b->size;
	}
	s->procs[b->proc].nbos--;
	s->stats[KFDM_STAT_BOS_LIVE]--;
	s->stats[KFDM_STAT_BYTES_LIVE] -= b->size;
	memset(b, 0, sizeof(*b));
}

static void proc_release(struct kfdm *m, unsigned slot)
{
	struct shared *s = m->s;
	for (unsigned i = 0; i < KFDM_MAX_BOS; i++)
		if (s->bos[i].used && s->bos[i].proc == slot)
			bo_release(m, &s->bos[i]);
	memset(&s->procs[slot], 0, sizeof(s->procs[slot]));
	s->stats[KFDM_STAT_PROCS_LIVE]--;
}

static bool proc_alive(struct sproc *p)
{
	return p->state != P_FREE && same_start(proc_starttime(p->pid), p->starttime);
}

/* The injected failure for OP, if one is due (counts it down). */
static int injected(struct shared *s, enum kfdm_op op)
{
	struct sinject *j = &s->inj[op];
	if (!j->count)
		return 0;
	if (j->skip) {
		j->skip--;
		return 0;
	}
	j->count--;
	return -j->err;
}

int64_t kfdm_open(struct kfdm *m)
{
	struct shared *s = m->s;
	int pid = getpid();
	uint64_t st = proc_starttime(pid);
	int64_t ret;
	lock(s);
	s->calls[KFDM_OP_OPEN]++;
	ret = injected(s, KFDM_OP_OPEN);
	if (ret)
		goto out;
	int free_slot = -1;
	for (unsigned i = 0; i < KFDM_MAX_PROCS; i++)
		if (s->procs[i].state != P_FREE && !proc_alive(&s->procs[i]))
			proc_release(m, i);     /* its process is gone: the kernel frees it with the mm */
	for (unsigned i = 0; i < KFDM_MAX_PROCS; i++) {
		struct sproc *p = &s->procs[i];
		if (p->state != P_FREE && p->pid == pid && same_start(p->starttime, st)) {
			ret = (int64_t)(p->gen << 8 | i);
			goto out;
		}
		if (p->state == P_FREE && free_slot < 0)
			free_slot = (int)i;
	}
	if (free_slot < 0) {
		ret = -ENOMEM;
		goto out;
	}
	struct sproc *p = &s->procs[free_slot];
	memset(p, 0, sizeof(*p));
	p->state = P_RUNNING;
	p->pid = pid;
	p->starttime = st;
	p->gen = s->next_gen++;
	p->next_idr = 1;
	for (unsigned i = 0; i < s->ngpus; i++)
		p->user_gpu_id[i] = s->gpus[i].g.gpu_id;
	s->stats[KFDM_STAT_PROCS_LIVE]++;
	ret = (int64_t)(p->gen << 8 | (unsigned)free_slot);
out:
	if (ret < 0)
		s->fails[KFDM_OP_OPEN]++;
	unlock(s);
	return ret;
}

static struct sproc *token_proc(struct shared *s, int64_t token, unsigned *slot)
{
	if (token <= 0)
		return NULL;
	unsigned i = (unsigned)(token & 0xff);
	if (i >= KFDM_MAX_PROCS)
		return NULL;
	struct sproc *p = &s->procs[i];
	if (p->state == P_FREE || p->gen != (uint64_t)token >> 8)
		return NULL;
	*slot = i;
	return p;
}

/* Exports BO B as a "dmabuf": the arena opened through a name that states the
 * window, then unlinked.  Returns the fd or -errno. */
static int export_dmabuf(struct kfdm *m, struct sbo *b)
{
	struct shared *s = m->s;
	char arena[PATH_MAX + 32], name[PATH_MAX + 128];
	snprintf(arena, sizeof(arena), "%s/renderD%u", m->dir, s->gpus[b->gpu].g.minor);
	snprintf(name, sizeof(name), "%s/dmabuf/kfd-dmabuf.%d.%" PRIu64 "@%" PRIx64 "+%" PRIx64,
		 m->dir, getpid(), ++s->dmabuf_seq, b->offset, b->size);
	if (link(arena, name))
		return -errno;
	bool rw = b->flags & KFDM_WRITABLE;
	int fd = raw_open(name, (rw ? O_RDWR : O_RDONLY) | O_CLOEXEC);
	int e = errno;
	unlink(name);
	if (fd < 0)
		return -e;
	s->stats[KFDM_STAT_DMABUFS]++;
	return fd;
}

static size_t priv_size(uint32_t nd, uint32_t nb)
{
	return sizeof(struct priv_hdr) + nd * sizeof(struct priv_dev) + nb * sizeof(struct priv_bo) + 8;
}

static int op_process_info(struct kfdm *m, struct sproc *p, struct kfd_ioctl_criu_args *a)
{
	struct shared *s = m->s;
	if (!s->ngpus)
		return -ENODEV;
	p->paused = 1;                      /* queues evicted until UNPAUSE */
	a->pid = (uint32_t)p->pid;
	a->num_devices = s->ngpus;          /* the kernel has a device entry per GPU for every process */
	a->num_bos = p->nbos;
	a->num_objects = 0;                 /* queues, events, SVM ranges: not modelled */
	a->priv_data_size = priv_size(s->ngpus, p->nbos);
	return 0;
}

static int bo_cmp(const void *x, const void *y)
{
	const struct sbo *a = *(struct sbo *const *)x, *b = *(struct sbo *const *)y;
	if (a->gpu != b->gpu)
		return a->gpu < b->gpu ? -1 : 1;
	return a->idr < b->idr ? -1 : a->idr > b->idr;
}

/* this process's BOs in the kernel's order: per device, by handle */
static unsigned proc_bos(struct shared *s, unsigned slot, struct sbo **out)
{
	unsigned n = 0;
	for (unsigned i = 0; i < KFDM_MAX_BOS; i++)
		if (s->bos[i].used && s->bos[i].proc == slot)
			out[n++] = &s->bos[i];
	qsort(out, n, sizeof(*out), bo_cmp);
	return n;
}

static int op_checkpoint(struct kfdm *m, struct sproc *p, unsigned slot, struct kfd_ioctl_criu_args *a)
{
	struct shared *s = m->s;
	if (!a->devices || !a->bos || !a->priv_data)
		return refuse(-EINVAL, "CHECKPOINT: devices, bos or priv_data is NULL");
	if (!s->ngpus)
		return -ENODEV;
	if (!p->paused)
		return refuse(-EINVAL, "CHECKPOINT: queues not paused (PROCESS_INFO first)");                 /* PROCESS_INFO did not run first */
	if (a->num_devices != s->ngpus || a->num_bos != p->nbos || a->num_objects != 0 ||
	    a->priv_data_size != priv_size(s->ngpus, p->nbos))
		return refuse(-EINVAL, "CHECKPOINT: counts or priv_data_size differ from PROCESS_INFO's");                 /* not what PROCESS_INFO promised */
	/* not static: two states (two locks) may checkpoint at once in one process */
	struct sbo **list = malloc(KFDM_MAX_BOS * sizeof(*list));
	if (!list)
		return -ENOMEM;
	unsigned n = proc_bos(s, slot, list);
	struct kfd_criu_device_bucket *dev = (void *)(uintptr_t)a->devices;
	struct kfd_criu_bo_bucket *bo = (void *)(uintptr_t)a->bos;
	uint8_t *priv = (void *)(uintptr_t)a->priv_data;
	struct priv_hdr h;
	memset(&h, 0, sizeof(h));
	memcpy(h.magic, PRIV_MAGIC, 8);
	h.version = PRIV_VERSION;
	h.num_devices = s->ngpus;
	h.num_bos = n;
	h.instance = s->instance;
	uint8_t *w = priv;
	memcpy(w, &h, sizeof(h));
	w += sizeof(h);
	for (unsigned i = 0; i < s->ngpus; i++) {
		struct priv_dev d = { p->user_gpu_id[i], s->gpus[i].g.gpu_id };
		memcpy(w, &d, sizeof(d));
		w += sizeof(d);
		memset(&dev[i], 0, sizeof(dev[i]));
		dev[i].user_gpu_id = p->user_gpu_id[i];
		dev[i].actual_gpu_id = s->gpus[i].g.gpu_id;
	}
	unsigned i;
	int r = 0;
	for (i = 0; i < n; i++) {
		struct sbo *b = list[i];
		struct priv_bo pb = { b->idr, b->flags, b->va };
		memcpy(w, &pb, sizeof(pb));
		w += sizeof(pb);
		memset(&bo[i], 0, sizeof(bo[i]));
		bo[i].addr = b->va;
		bo[i].size = b->size;
		bo[i].offset = b->offset;
		bo[i].gpu_id = p->user_gpu_id[b->gpu];
		bo[i].alloc_flags = b->flags;
		bo[i].dmabuf_fd = KFD_INVALID_FD;
		if (b->flags & (KFD_IOC_ALLOC_MEM_FLAGS_VRAM | KFD_IOC_ALLOC_MEM_FLAGS_GTT)) {
			r = export_dmabuf(m, b);
			if (r < 0)
				break;
			bo[i].dmabuf_fd = (uint32_t)r;
			r = 0;
		}
	}
	if (r < 0) {                        /* the kernel closes what it exported */
		for (unsigned k = 0; k < i; k++)
			if (bo[k].dmabuf_fd != KFD_INVALID_FD) {
				close((int)bo[k].dmabuf_fd);
				bo[k].dmabuf_fd = KFD_INVALID_FD;
				s->stats[KFDM_STAT_DMABUFS]--;
			}
		free(list);
		return r;
	}
	free(list);
	uint64_t sum = fnv1a(priv, (size_t)(w - priv));
	memcpy(w, &sum, 8);
	return 0;
}

static int op_restore(struct kfdm *m, struct sproc *p, unsigned slot, struct kfd_ioctl_criu_args *a)
{
	struct shared *s = m->s;
	uint64_t pg = page_size();
	if (!a->devices || !a->bos || !a->priv_data)
		return refuse(-EINVAL, "RESTORE: devices, bos or priv_data is NULL");
	if (p->vm_mask || p->nbos || p->state != P_RUNNING || p->paused)
		return refuse(-EINVAL, "RESTORE: the process is not clean (VM acquired, BOs, restored or paused)");                 /* only a process that has done nothing yet */
	if (a->num_devices != s->ngpus || a->num_bos > KFDM_MAX_BOS ||
	    a->priv_data_size != priv_size(a->num_devices, a->num_bos))
		return refuse(-EINVAL, "RESTORE: num_devices %u (host has %u), num_bos %u or priv_data_size %llu do not fit", a->num_devices, s->ngpus, a->num_bos, (unsigned long long)a->priv_data_size);
	const uint8_t *priv = (const void *)(uintptr_t)a->priv_data;
	struct priv_hdr h;
	memcpy(&h, priv, sizeof(h));
	uint64_t sum;
	memcpy(&sum, priv + a->priv_data_size - 8, 8);
	if (memcmp(h.magic, PRIV_MAGIC, 8) || h.version != PRIV_VERSION || h.num_devices != a->num_devices ||
	    h.num_bos != a->num_bos || h.num_objects != a->num_objects ||
	    sum != fnv1a(priv, a->priv_data_size - 8))
		return refuse(-EINVAL, "RESTORE: priv_data was not written by this model (magic, version, counts or checksum)");                 /* not private data this driver wrote */
	struct kfd_criu_device_bucket *dev = (void *)(uintptr_t)a->devices;
	struct kfd_criu_bo_bucket *bo = (void *)(uintptr_t)a->bos;
	const struct priv_bo *pbo = (const void *)(priv + sizeof(h) + a->num_devices * sizeof(struct priv_dev));
	uint32_t user[KFDM_MAX_GPUS] = { 0 };
	uint32_t seen = 0;
	for (unsigned i = 0; i < a->num_devices; i++) {
		int gi = gpu_index(s, dev[i].actual_gpu_id);
		if (gi < 0 || (seen >> gi & 1) || !dev[i].user_gpu_id)
			return refuse(-EINVAL, "RESTORE: device bucket %u: actual_gpu_id 0x%x unknown here or named twice", i, dev[i].actual_gpu_id);             /* no such GPU here (or named twice) */
		if (!is_arena(m, (unsigned)gi, (int)dev[i].drm_fd))
			return refuse(-EINVAL, "RESTORE: device bucket %u: drm_fd %u is not the render node of gpu 0x%x", i, dev[i].drm_fd, dev[i].actual_gpu_id);             /* drm_fd is not that GPU's render node */
		seen |= 1u << gi;
		user[gi] = dev[i].user_gpu_id;
	}
	uint64_t vram_need[KFDM_MAX_GPUS] = { 0 };
	unsigned free_bos = 0;
	for (unsigned i = 0; i < KFDM_MAX_BOS; i++)
		free_bos += !s->bos[i].used;
	if (a->num_bos > free_bos)
		return -ENOMEM;
	for (unsigned i = 0; i < a->num_bos; i++) {
		int gi = -1;
		for (unsigned k = 0; k < s->ngpus; k++)
			if (user[k] == bo[i].gpu_id)
				gi = (int)k;
		uint32_t type = bo[i].alloc_flags & (KFD_IOC_ALLOC_MEM_FLAGS_VRAM | KFD_IOC_ALLOC_MEM_FLAGS_GTT |
						     KFD_IOC_ALLOC_MEM_FLAGS_DOORBELL |
						     KFD_IOC_ALLOC_MEM_FLAGS_MMIO_REMAP);
		if (gi < 0 || !bo[i].size || bo[i].size % pg || bo[i].addr % pg || __builtin_popcount(type) != 1 ||
		    pbo[i].va != bo[i].addr || pbo[i].flags != bo[i].alloc_flags || !pbo[i].idr)
			return refuse(-EINVAL, "RESTORE: BO bucket %u (gpu_id 0x%x addr 0x%llx size 0x%llx flags 0x%x) is invalid or disagrees with priv_data", i, bo[i].gpu_id, (unsigned long long)bo[i].addr, (unsigned long long)bo[i].size, bo[i].alloc_flags);
		if (type & KFD_IOC_ALLOC_MEM_FLAGS_VRAM)
			vram_need[gi] += bo[i].size;
	}
	for (unsigned k = 0; k < s->ngpus; k++)
		if (s->gpus[k].vram_used + vram_need[k] > s->gpus[k].g.vram_size)
			return -ENOMEM;
	/* no failure below but an export's: undo everything then */
	memcpy(p->user_gpu_id, user, sizeof(user));
	p->vm_mask = seen;
	unsigned made = 0, bi = 0;
	int r = 0;
	for (; made < a->num_bos; made++) {
		while (s->bos[bi].used)
			bi++;
		struct sbo *b = &s->bos[bi];
		int gi = user_gpu_index(s, p, bo[made].gpu_id);
		b->used = 1;
		b->proc = slot;
		b->gpu = (uint32_t)gi;
		b->flags = bo[made].alloc_flags;
		b->idr = pbo[made].idr;
		b->va = bo[made].addr;
		b->size = bo[made].size;
		if (b->idr >= p->next_idr)
			p->next_idr = b->idr + 1;
		p->nbos++;
		s->stats[KFDM_STAT_BOS_LIVE]++;
		s->stats[KFDM_STAT_BYTES_LIVE] += b->size;
		bo[made].dmabuf_fd = KFD_INVALID_FD;
		if (b->flags & (KFD_IOC_ALLOC_MEM_FLAGS_VRAM | KFD_IOC_ALLOC_MEM_FLAGS_GTT)) {
			b->offset = s->gpus[gi].next_off;      /* fresh, zeroed memory */
			s->gpus[gi].next_off += b->size;
			if (b->flags & KFD_IOC_ALLOC_MEM_FLAGS_VRAM)
				s->gpus[gi].vram_used += b->size;
			r = export_dmabuf(m, b);
			if (r < 0) {
				made++;
				break;
			}
			bo[made].dmabuf_fd = (uint32_t)r;
			r = 0;
		} else {
			b->offset = (1 + 2 * (uint64_t)gi + !!(b->flags & KFD_IOC_ALLOC_MEM_FLAGS_MMIO_REMAP)) * pg;
		}
		bo[made].restored_offset = b->offset;
	}
	if (r < 0) {
		for (unsigned k = 0; k < made; k++)
			if (bo[k].dmabuf_fd != KFD_INVALID_FD) {
				close((int)bo[k].dmabuf_fd);
				bo[k].dmabuf_fd = KFD_INVALID_FD;
				s->stats[KFDM_STAT_DMABUFS]--;
			}
		for (unsigned i = 0; i < KFDM_MAX_BOS; i++)
			if (s->bos[i].used && s->bos[i].proc == slot)
				bo_release(m, &s->bos[i]);
		p->vm_mask = 0;
		p->next_idr = 1;
		for (unsigned i = 0; i < s->ngpus; i++)
			p->user_gpu_id[i] = s->gpus[i].g.gpu_id;
		return r;
	}
	p->state = P_RESTORED;              /* queues stay evicted until RESUME */
	return 0;
}

static int op_resume(struct kfdm *m, struct kfd_ioctl_criu_args *a)
{
	struct shared *s = m->s;
	for (unsigned i = 0; i < KFDM_MAX_PROCS; i++) {
		struct sproc *p = &s->procs[i];
		if (p->state != P_FREE && p->pid == (int32_t)a->pid && proc_alive(p)) {
			/* the kernel resumes what RESTORE blocked; a process it did not
			 * restore has nothing blocked, and RESUME succeeds doing nothing */
			p->state = P_RUNNING;
			return 0;
		}
	}
	return refuse(-ESRCH, "RESUME: no live KFD process with pid %u", a->pid);
}

static int op_alloc(struct kfdm *m, struct sproc *p, unsigned slot, struct kfd_ioctl_alloc_memory_of_gpu_args *a)
{
	struct shared *s = m->s;
	uint64_t pg = page_size();
	int gi = user_gpu_index(s, p, a->gpu_id);
	if (gi < 0)
		return refuse(-EINVAL, "ALLOC: gpu_id 0x%x unknown", a->gpu_id);
	if (!(p->vm_mask >> gi & 1))
		return refuse(-EINVAL, "ALLOC: no VM acquired on gpu 0x%x", a->gpu_id);                 /* AMDKFD_IOC_ACQUIRE_VM first */
	uint32_t type = a->flags & (KFD_IOC_ALLOC_MEM_FLAGS_VRAM | KFD_IOC_ALLOC_MEM_FLAGS_GTT |
				    KFD_IOC_ALLOC_MEM_FLAGS_DOORBELL | KFD_IOC_ALLOC_MEM_FLAGS_MMIO_REMAP |
				    KFD_IOC_ALLOC_MEM_FLAGS_USERPTR);
	if (__builtin_popcount(type) != 1 || (type & KFD_IOC_ALLOC_MEM_FLAGS_USERPTR))
		return refuse(-EINVAL, "ALLOC: flags 0x%x: not exactly one of VRAM, GTT, DOORBELL, MMIO_REMAP", a->flags);                 /* userptr BOs are not modelled */
	if (!a->size || a->size % pg || a->va_addr % pg)
		return refuse(-EINVAL, "ALLOC: size 0x%llx or va 0x%llx not page-aligned", (unsigned long long)a->size, (unsigned long long)a->va_addr);
	if ((type & (KFD_IOC_ALLOC_MEM_FLAGS_DOORBELL | KFD_IOC_ALLOC_MEM_FLAGS_MMIO_REMAP)) && a->size != pg)
		return refuse(-EINVAL, "ALLOC: a doorbell or MMIO BO is one page, not 0x%llx", (unsigned long long)a->size);
	if ((type & KFD_IOC_ALLOC_MEM_FLAGS_VRAM) && s->gpus[gi].vram_used + a->size > s->gpus[gi].g.vram_size)
		return -ENOMEM;
	if ((type & (KFD_IOC_ALLOC_MEM_FLAGS_VRAM | KFD_IOC_ALLOC_MEM_FLAGS_GTT)) &&
	    s->gpus[gi].next_off + a->size > ARENA_SIZE)
		return -ENOMEM;
	struct sbo *b = NULL;
	for (unsigned i = 0; i < KFDM_MAX_BOS && !b; i++)
		if (!s->bos[i].used)
			b = &s->bos[i];
	if (!b)
		return -ENOMEM;
	b->used = 1;
	b->proc = slot;
	b->gpu = (uint32_t)gi;
	b->flags = a->flags;
	b->idr = p->next_idr++;
	b->va = a->va_addr;
	b->size = a->size;
	if (type & (KFD_IOC_ALLOC_MEM_FLAGS_VRAM | KFD_IOC_ALLOC_MEM_FLAGS_GTT)) {
		b->offset = s->gpus[gi].next_off;
		s->gpus[gi].next_off += a->size;
		if (type & KFD_IOC_ALLOC_MEM_FLAGS_VRAM)
			s->gpus[gi].vram_used += a->size;
	} else {
		b->offset = (1 + 2 * (uint64_t)gi + !!(type & KFD_IOC_ALLOC_MEM_FLAGS_MMIO_REMAP)) * pg;
	}
	p->nbos++;
	s->stats[KFDM_STAT_BOS_LIVE]++;
	s->stats[KFDM_STAT_BYTES_LIVE] += b->size;
	a->handle = (uint64_t)p->user_gpu_id[gi] << 32 | b->idr;
	a->mmap_offset = b->offset;
	return 0;
}

static struct sbo *find_bo(struct shared *s, struct sproc *p, unsigned slot, uint64_t handle)
{
	int gi = user_gpu_index(s, p, (uint32_t)(handle >> 32));
	if (gi < 0)
		return NULL;
	for (unsigned i = 0; i < KFDM_MAX_BOS; i++) {
		struct sbo *b = &s->bos[i];
		if (b->used && b->proc == slot && b->gpu == (uint32_t)gi && b->idr == (uint32_t)handle)
			return b;
	}
	return NULL;
}

static int op_acquire_vm(struct kfdm *m, struct sproc *p, struct kfd_ioctl_acquire_vm_args *a)
{
	struct shared *s = m->s;
	int gi = user_gpu_index(s, p, a->gpu_id);
	if (gi < 0)
		return refuse(-EINVAL, "ACQUIRE_VM: gpu_id 0x%x unknown", a->gpu_id);
	if (!is_arena(m, (unsigned)gi, (int)a->drm_fd))
		return refuse(-EINVAL, "ACQUIRE_VM: drm_fd %u is not the render node of gpu 0x%x", a->drm_fd, a->gpu_id);
	p->vm_mask |= 1u << gi;
	return 0;
}

int kfdm_ioctl(struct kfdm *m, int64_t token, unsigned long req, void *arg)
{
	struct shared *s = m->s;
	enum kfdm_op op;
	struct kfd_ioctl_criu_args *ca = arg;
	switch (req) {
	case AMDKFD_IOC_GET_VERSION: op = KFDM_OP_GET_VERSION; break;
	case AMDKFD_IOC_ACQUIRE_VM: op = KFDM_OP_ACQUIRE_VM; break;
	case AMDKFD_IOC_ALLOC_MEMORY_OF_GPU: op = KFDM_OP_ALLOC; break;
	case AMDKFD_IOC_FREE_MEMORY_OF_GPU: op = KFDM_OP_FREE; break;
	case AMDKFD_IOC_CRIU_OP:
		if (!arg)
			return -EFAULT;
		switch (ca->op) {
		case KFD_CRIU_OP_PROCESS_INFO: op = KFDM_OP_PROCESS_INFO; break;
		case KFD_CRIU_OP_CHECKPOINT: op = KFDM_OP_CHECKPOINT; break;
		case KFD_CRIU_OP_UNPAUSE: op = KFDM_OP_UNPAUSE; break;
		case KFD_CRIU_OP_RESTORE: op = KFDM_OP_RESTORE; break;
		case KFD_CRIU_OP_RESUME: op = KFDM_OP_RESUME; break;
		default: return -EINVAL;
		}
		break;
	default:
		return -ENOTTY;                 /* not modelled (queues, events, SVM, ...) */
	}
	if (!arg)
		return -EFAULT;
	int r;
	lock(s);
	s->calls[op]++;
	unsigned slot = 0;
	struct sproc *p = token_proc(s, token, &slot);
	if (!p) {
		r = -EBADF;
		goto out;
	}
	/* only the process that opened /dev/kfd may use the fd; CRIU ops also
	 * from its ptrace parent (the dumper); CRIU ops need the capability */
	bool own = p->pid == getpid() && same_start(p->starttime, proc_starttime(getpid()));
	if (!own && !(req == AMDKFD_IOC_CRIU_OP && tracer_of(p->pid) == getpid())) {
		r = -EBADF;
		goto out;
	}
	if (req == AMDKFD_IOC_CRIU_OP && !has_cr_capability()) {
		r = -EACCES;
		goto out;
	}
	r = injected(s, op);
	if (r)
		goto out;
	switch (op) {
	case KFDM_OP_GET_VERSION: {
		struct kfd_ioctl_get_version_args *v = arg;
		v->major_version = KFD_IOCTL_MAJOR_VERSION;
		v->minor_version = s->kfd_minor;
		break;
	}
	case KFDM_OP_ACQUIRE_VM: r = op_acquire_vm(m, p, arg); break;
	case KFDM_OP_ALLOC: r = op_alloc(m, p, slot, arg); break;
	case KFDM_OP_FREE: {
		struct sbo *b = find_bo(s, p, slot, ((struct kfd_ioctl_free_memory_of_gpu_args *)arg)->handle);
		if (!b)
			r = -EINVAL;
		else
			bo_release(m, b);
		break;
	}
	case KFDM_OP_PROCESS_INFO: r = op_process_info(m, p, ca); break;
	case KFDM_OP_CHECKPOINT: r = op_checkpoint(m, p, slot, ca); break;
	case KFDM_OP_UNPAUSE:
		if (!p->paused)
			r = -EINVAL;
		else
			p->paused = 0;
		break;
	case KFDM_OP_RESTORE: r = op_restore(m, p, slot, ca); break;
	case KFDM_OP_RESUME: r = op_resume(m, ca); break;
	default: r = -EINVAL;
	}
out:
	if (r < 0)
		s->fails[op]++;
	unlock(s);
	return r;
}

int kfdm_queue_write(struct kfdm *m, int64_t token, uint64_t handle, uint64_t off, const void *src, size_t len)
{
	struct shared *s = m->s;
	int r = 0;
	lock(s);
	s->calls[KFDM_OP_QUEUE]++;
	unsigned slot;
	struct sproc *p = token_proc(s, token, &slot);
	struct sbo *b = p ? find_bo(s, p, slot, handle) : NULL;
	if (!p || p->pid != getpid()) {
		r = -EBADF;
	} else if ((r = injected(s, KFDM_OP_QUEUE))) {
	} else if (p->paused || p->state == P_RESTORED) {
		s->stats[KFDM_STAT_PAUSED_REFUSED]++;
		r = -EAGAIN;
	} else if (!b || !(b->flags & (KFD_IOC_ALLOC_MEM_FLAGS_VRAM | KFD_IOC_ALLOC_MEM_FLAGS_GTT)) ||
		   off > b->size || len > b->size - off) {
		r = -EINVAL;
	} else {
		const uint8_t *q = src;
		uint64_t at = b->offset + off;
		int fd = arena_open(m, b->gpu);
		if (fd < 0)
			r = -errno;
		while (fd >= 0 && len) {
			ssize_t n = pwrite(fd, q, len, (off_t)at);
			if (n <= 0) {
				r = n < 0 ? -errno : -EIO;
				break;
			}
			q += n;
			at += (uint64_t)n;
			len -= (size_t)n;
		}
		if (fd >= 0)
			close(fd);
	}
	if (r < 0)
		s->fails[KFDM_OP_QUEUE]++;
	unlock(s);
	return r;
}

int kfdm_inject(struct kfdm *m, enum kfdm_op op, int errno_value, unsigned skip, unsigned count)
{
	if ((unsigned)op >= KFDM_OP_COUNT || errno_value < 0)
		return -EINVAL;
	lock(m->s);
	m->s->inj[op].err = errno_value;
	m->s->inj[op].skip = skip;
	m->s->inj[op].count = errno_value ? count : 0;
	unlock(m->s);
	return 0;
}

void kfdm_counters(struct kfdm *m, uint64_t calls[KFDM_OP_COUNT], uint64_t fails[KFDM_OP_COUNT],
		   uint64_t stats[KFDM_STAT_COUNT])
{
	lock(m->s);
	if (calls)
		memcpy(calls, m->s->calls, sizeof(m->s->calls));
	if (fails)
		memcpy(fails, m->s->fails, sizeof(m->s->fails));
	if (stats)
		memcpy(stats, m->s->stats, sizeof(m->s->stats));
	unlock(m->s);
}

int kfdm_paused(struct kfdm *m, int pid)
{
	int r = -ESRCH;
	lock(m->s);
	for (unsigned i = 0; i < KFDM_MAX_PROCS; i++) {
		struct sproc *p = &m->s->procs[i];
		if (p->state != P_FREE && p->pid == pid && proc_alive(p))
			r = p->paused || p->state == P_RESTORED;
	}
	unlock(m->s);
	return r;
}
