/*
 * kfd_shim.c - the KFD model's IDENTITY EMULATION: an LD_PRELOAD library
 * (built with kfd_model.c into libvramd_kfd_model.so) for criu and for the
 * emulated GPU process.  See docs/kfd-model.md, "Identity emulation".
 *
 * THIS IS A MODEL, NOT A GPU.  With VRAMD_KFD_STATE=<state dir> set, the
 * stand-in files of that state directory (its "kfd" file and its per-GPU
 * arenas "renderD<minor>", under whatever name they are reached, e.g. bind
 * mounts at /dev/kfd and /dev/dri/renderD<minor> in a private mount
 * namespace) read as character devices to stat/fstat/fstatat/statx: kfd as
 * VRAMD_KFD_MAJOR:0, render nodes as 226:<minor>.  open() of the kfd file
 * opens the caller's KFD process in the model and keeps its token in the
 * open file description's position (so a dup, an SCM_RIGHTS copy or CRIU's
 * drained fd name the same KFD process); ioctl() on it goes to the model.
 * DRM ioctls on a render node: PRIME_FD_TO_HANDLE for the model's dmabufs,
 * the rest -EINVAL (GEM_LIST_HANDLES: the kernel lacks it, the plugin then
 * sees no render-node BOs).  Everything else passes through, by raw system
 * calls, so the shim never calls itself.  A dmabuf (an fd of an arena opened
 * through a "kfd-dmabuf.*" name) is left as a regular file.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/sysmacros.h>
#include <unistd.h>
#include <libdrm/drm.h>

#include "kfd_model.h"

#define EXPORT __attribute__((visibility("default")))
#define DRM_MAJOR 226
#define DEFAULT_KFD_MAJOR 238

enum kind { K_NONE = 0, K_KFD, K_RENDER };

static struct {
	pthread_once_t once;
	struct kfdm *m;
	unsigned major;
	unsigned n;
	dev_t dev[KFDM_MAX_GPUS + 1];
	ino_t ino[KFDM_MAX_GPUS + 1];
	unsigned minor[KFDM_MAX_GPUS + 1];     /* 0 = kfd */
} S = { .once = PTHREAD_ONCE_INIT };

static int raw_statat(int dirfd, const char *path, struct stat *st, int flags)
{
	return (int)syscall(SYS_newfstatat, dirfd, path, st, flags);
}

static void init(void)
{
	const char *dir = getenv("VRAMD_KFD_STATE");
	const char *maj = getenv("VRAMD_KFD_MAJOR");
	S.major = maj && *maj ? (unsigned)strtoul(maj, NULL, 0) : DEFAULT_KFD_MAJOR;
	if (!dir || !*dir)
		return;
	int e = errno;
	S.m = kfdm_attach(dir);
	if (!S.m) {
		fprintf(stderr, "vramd kfd shim: cannot attach the KFD model state %s: %s\n", dir, strerror(errno));
		errno = e;
		return;
	}
	char path[PATH_MAX];
	struct stat st;
	snprintf(path, sizeof(path), "%s/kfd", dir);
	if (!raw_statat(AT_FDCWD, path, &st, 0)) {
		S.dev[S.n] = st.st_dev;
		S.ino[S.n] = st.st_ino;
		S.minor[S.n++] = 0;
	}
	for (unsigned minor = 128; minor < 256 && S.n <= KFDM_MAX_GPUS; minor++) {
		snprintf(path, sizeof(path), "%s/renderD%u", dir, minor);
		if (!raw_statat(AT_FDCWD, path, &st, 0)) {
			S.dev[S.n] = st.st_dev;
			S.ino[S.n] = st.st_ino;
			S.minor[S.n++] = minor;
		}
	}
	errno = e;
}

static enum kind kind_of(const struct stat *st, unsigned *minor)
{
	pthread_once(&S.once, init);
	if (!S.m || !S_ISREG(st->st_mode))
		return K_NONE;
	for (unsigned i = 0; i < S.n; i++)
		if (S.dev[i] == st->st_dev && S.ino[i] == st->st_ino) {
			*minor = S.minor[i];
			return S.minor[i] ? K_RENDER : K_KFD;
		}
	return K_NONE;
}

/* A dmabuf of the model is an arena fd opened through a kfd-dmabuf.* name. */
static bool fd_is_dmabuf(int fd)
{
	char link[64], path[PATH_MAX];
	snprintf(link, sizeof(link), "/proc/self/fd/%d", fd);
	ssize_t n = readlink(link, path, sizeof(path) - 1);
	if (n <= 0)
		return false;
	path[n] = 0;
	const char *slash = strrchr(path, '/');
	return slash && !strncmp(slash + 1, "kfd-dmabuf.", 11);
}

static void disguise(struct stat *st, enum kind k, unsigned minor)
{
	st->st_mode = S_IFCHR | (st->st_mode & 07777);
	st->st_rdev = k == K_KFD ? makedev(S.major, 0) : makedev(DRM_MAJOR, minor);
	st->st_size = 0;
	st->st_blocks = 0;
}

static int fix_fd(int fd, struct stat *st)
{
	unsigned minor;
	enum kind k = kind_of(st, &minor);
	if (k == K_NONE || (k == K_RENDER && fd_is_dmabuf(fd)))
		return 0;
	disguise(st, k, minor);
	return 0;
}

static int fix_path(struct stat *st)
{
	unsigned minor;
	enum kind k = kind_of(st, &minor);
	if (k != K_NONE)
		disguise(st, k, minor);
	return 0;
}

EXPORT int fstat(int fd, struct stat *st)
{
	if (syscall(SYS_fstat, fd, st))
		return -1;
	return fix_fd(fd, st);
}
EXPORT int fstat64(int fd, struct stat64 *st) __attribute__((alias("fstat")));

EXPORT int fstatat(int dirfd, const char *path, struct stat *st, int flags)
{
	if (raw_statat(dirfd, path, st, flags))
		return -1;
	if ((flags & AT_EMPTY_PATH) && !*path)
		return fix_fd(dirfd, st);
	return fix_path(st);
}
EXPORT int fstatat64(int dirfd, const char *path, struct stat64 *st, int flags) __attribute__((alias("fstatat")));

EXPORT int stat(const char *path, struct stat *st)
{
	return fstatat(AT_FDCWD, path, st, 0);
}
EXPORT int stat64(const char *path, struct stat64 *st) __attribute__((alias("stat")));

EXPORT int lstat(const char *path, struct stat *st)
{
	return fstatat(AT_FDCWD, path, st, AT_SYMLINK_NOFOLLOW);
}
EXPORT int lstat64(const char *path, struct stat64 *st) __attribute__((alias("lstat")));

/* the pre-2.33 glibc entry points, for binaries built against them */
EXPORT int __fxstat(int ver, int fd, struct stat *st) { (void)ver; return fstat(fd, st); }
EXPORT int __fxstat64(int ver, int fd, struct stat64 *st) { (void)ver; return fstat(fd, (struct stat *)st); }
EXPORT int __xstat(int ver, const char *p, struct stat *st) { (void)ver; return stat(p, st); }
EXPORT int __xstat64(int ver, const char *p, struct stat64 *st) { (void)ver; return stat(p, (struct stat *)st); }
EXPORT int __lxstat(int ver, const char *p, struct stat *st) { (void)ver; return lstat(p, st); }
EXPORT int __lxstat64(int ver, const char *p, struct stat64 *st) { (void)ver; return lstat(p, (struct stat *)st); }
EXPORT int __fxstatat(int ver, int d, const char *p, struct stat *st, int f) { (void)ver; return fstatat(d, p, st, f); }
EXPORT int __fxstatat64(int ver, int d, const char *p, struct stat64 *st, int f)
{
	(void)ver;
	return fstatat(d, p, (struct stat *)st, f);
}

EXPORT int statx(int dirfd, const char *path, int flags, unsigned mask, struct statx *sx)
{
	if (syscall(SYS_statx, dirfd, path, flags, mask, sx))
		return -1;
	struct stat st;
	int r = ((flags & AT_EMPTY_PATH) && !*path) ? (int)syscall(SYS_fstat, dirfd, &st)
							     : raw_statat(dirfd, path, &st, flags & AT_SYMLINK_NOFOLLOW);
	if (r)
		return 0;
	unsigned minor;
	enum kind k = kind_of(&st, &minor);
	if (k == K_NONE || (k == K_RENDER && (flags & AT_EMPTY_PATH) && !*path && fd_is_dmabuf(dirfd)))
		return 0;
	sx->stx_mode = (uint16_t)(S_IFCHR | (sx->stx_mode & 07777));
	sx->stx_rdev_major = k == K_KFD ? S.major : DRM_MAJOR;
	sx->stx_rdev_minor = k == K_KFD ? 0 : minor;
	sx->stx_size = 0;
	sx->stx_blocks = 0;
	return 0;
}

/* After a real open: an fd of the kfd file gets its KFD process's token.  An
 * O_PATH open does not open the device (the kernel calls no open method), so
 * it gets none: CRIU reads mappings through O_PATH opens of map_files. */
static int after_open(int fd, int flags)
{
	if (fd < 0 || (flags & O_PATH))
		return fd;
	struct stat st;
	unsigned minor;
	if (syscall(SYS_fstat, fd, &st) || kind_of(&st, &minor) != K_KFD)
		return fd;
	int64_t tok = kfdm_open(S.m);
	if (tok < 0 || lseek(fd, (off_t)tok, SEEK_SET) < 0) {
		int e = tok < 0 ? (int)-tok : errno;
		close(fd);
		errno = e;
		return -1;
	}
	return fd;
}

static mode_t mode_arg(int flags, va_list ap)
{
	return (flags & (O_CREAT | __O_TMPFILE)) ? (mode_t)va_arg(ap, int) : 0;
}

EXPORT int openat(int dirfd, const char *path, int flags, ...)
{
	va_list ap;
	va_start(ap, flags);
	mode_t mode = mode_arg(flags, ap);
	va_end(ap);
	return after_open((int)syscall(SYS_openat, dirfd, path, flags, mode), flags);
}
EXPORT int openat64(int dirfd, const char *path, int flags, ...) __attribute__((alias("openat")));

EXPORT int open(const char *path, int flags, ...)
{
	va_list ap;
	va_start(ap, flags);
	mode_t mode = mode_arg(flags, ap);
	va_end(ap);
	return after_open((int)syscall(SYS_openat, AT_FDCWD, path, flags, mode), flags);
}
EXPORT int open64(const char *path, int flags, ...) __attribute__((alias("open")));
EXPORT int __open_2(const char *path, int flags) { return open(path, flags); }
EXPORT int __open64_2(const char *path, int flags) { return open(path, flags); }
EXPORT int __openat_2(int d, const char *path, int flags) { return openat(d, path, flags); }
EXPORT int __openat64_2(int d, const char *path, int flags) { return openat(d, path, flags); }

static int drm_ioctl(int fd, unsigned minor, unsigned long req, void *arg)
{
	(void)minor;
	(void)fd;
	if (req == DRM_IOCTL_PRIME_FD_TO_HANDLE) {
		struct drm_prime_handle *h = arg;
		char link[64], path[PATH_MAX];
		snprintf(link, sizeof(link), "/proc/self/fd/%d", h->fd);
		ssize_t n = readlink(link, path, sizeof(path) - 1);
		if (n <= 0)
			return -EBADF;
		path[n] = 0;
		char *at = strrchr(path, '@');
		unsigned long long off;
		if (!fd_is_dmabuf(h->fd) || !at || sscanf(at + 1, "%llx", &off) != 1)
			return -EINVAL;                 /* not a dmabuf of this device */
		h->handle = (uint32_t)(off >> 12);      /* one GEM handle per BO, stable per file */
		return 0;
	}
	return -EINVAL;
}

EXPORT int ioctl(int fd, unsigned long req, ...)
{
	va_list ap;
	va_start(ap, req);
	void *arg = va_arg(ap, void *);
	va_end(ap);
	struct stat st;
	unsigned minor = 0;
	enum kind k = K_NONE;
	if (!syscall(SYS_fstat, fd, &st))
		k = kind_of(&st, &minor);
	if (k == K_KFD) {
		off_t tok = lseek(fd, 0, SEEK_CUR);
		int r = kfdm_ioctl(S.m, (int64_t)tok, req, arg);
		if (r < 0) {
			errno = -r;
			return -1;
		}
		return r;
	}
	if (k == K_RENDER && !fd_is_dmabuf(fd)) {
		int r = drm_ioctl(fd, minor, req, arg);
		if (r < 0) {
			errno = -r;
			return -1;
		}
		return r;
	}
	return (int)syscall(SYS_ioctl, fd, req, arg);
}

/* MODEL-ONLY: the model state the shim serves (NULL without VRAMD_KFD_STATE). */
EXPORT struct kfdm *vramd_kfd_shim_model(void)
{
	pthread_once(&S.once, init);
	return S.m;
}
