/*
 * test_kfd_shim.c - tests of the KFD model's identity emulation (kfd_shim.c).
 *
 * THIS TESTS A MODEL, NOT A GPU.  The program links libvramd_kfd_model.so,
 * whose stat/open/ioctl family comes before libc's, creates a state
 * directory, re-executes itself with VRAMD_KFD_STATE naming it, and then
 * checks what CRIU and its amdgpu plugin would see: the stand-ins read as
 * character devices (kfd VRAMD_KFD_MAJOR:0, render nodes 226:<minor>) by
 * path, by fd and through /proc/self/map_files; the model's dmabufs stay
 * regular files; ioctls on a kfd fd (its dups, a copy received over
 * SCM_RIGHTS by a ptrace parent) reach the model; DRM PRIME import; other
 * fds pass through untouched.
 *
 * Run: python native/model/build.py --test OUT_DIR
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/ptrace.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <sys/wait.h>
#include <unistd.h>
#include <linux/kfd_ioctl.h>
#include <libdrm/drm.h>
#include <libdrm/amdgpu_drm.h>

#include "kfd_model.h"

#include "test_check.h"
#define ERR(call, e) do { errno = 0; CHECK_EQ((call), -1); CHECK_EQ(errno, (e)); } while (0)

#define KFD_MAJOR 240
static const struct kfdm_gpu GPUS[2] = {
	{ .gpu_id = 0x1111, .minor = 130, .vram_size = 1ull << 32 },
	{ .gpu_id = 0x2222, .minor = 131, .vram_size = 1ull << 32 },
};
static char kfd_path[300], render_path[2][300];
static long pg;

static void is_chr(const struct stat *st, unsigned maj, unsigned min, int line)
{
	if (!S_ISCHR(st->st_mode) || major(st->st_rdev) != maj || minor(st->st_rdev) != min || st->st_size)
		fail(line, "mode %o rdev %u:%u size %lld, expected a character device %u:%u",
		     st->st_mode, major(st->st_rdev), minor(st->st_rdev), (long long)st->st_size, maj, min);
}
#define IS_CHR(st, a, b) is_chr(st, a, b, __LINE__)

static void test_a_stat(void)
{
	g_test = "a: the stand-ins are character devices";
	struct stat st;
	OK(stat(kfd_path, &st));
	IS_CHR(&st, KFD_MAJOR, 0);
	OK(lstat(render_path[1], &st));
	IS_CHR(&st, 226, 131);
	OK(fstatat(AT_FDCWD, render_path[0], &st, 0));
	IS_CHR(&st, 226, 130);
	struct stat64 st64;
	OK(stat64(render_path[0], &st64));
	CHECK(S_ISCHR(st64.st_mode));
	struct statx sx;
	OK(statx(AT_FDCWD, kfd_path, 0, STATX_BASIC_STATS, &sx));
	CHECK(S_ISCHR(sx.stx_mode));
	CHECK_EQ(sx.stx_rdev_major, KFD_MAJOR);
	int fd = open(render_path[0], O_RDWR | O_CLOEXEC);
	CHECK(fd >= 0);
	OK(fstat(fd, &st));
	IS_CHR(&st, 226, 130);
	OK(fstatat(fd, "", &st, AT_EMPTY_PATH));
	IS_CHR(&st, 226, 130);
	close(fd);
	OK(stat("/proc/self/exe", &st));                 /* anything else: untouched */
	CHECK(S_ISREG(st.st_mode));
	ERR(stat("/nonexistent/kfd", &st), ENOENT);
}

struct proc {
	int kfd, render[2];
};

static void proc_open(struct proc *p)
{
	p->kfd = open(kfd_path, O_RDWR | O_CLOEXEC);
	CHECK(p->kfd >= 0);
	for (int i = 0; i < 2; i++) {
		p->render[i] = open(render_path[i], O_RDWR | O_CLOEXEC);
		CHECK(p->render[i] >= 0);
		struct kfd_ioctl_acquire_vm_args a = { .drm_fd = (uint32_t)p->render[i], .gpu_id = GPUS[i].gpu_id };
		OK(ioctl(p->kfd, AMDKFD_IOC_ACQUIRE_VM, &a));
	}
}

static uint8_t *alloc_map(struct proc *p, int gi, uint64_t va, uint64_t size, uint32_t flags, int fill)
{
	struct kfd_ioctl_alloc_memory_of_gpu_args a = { .va_addr = va, .size = size, .gpu_id = GPUS[gi].gpu_id,
							.flags = flags | (1u << 31) };
	OK(ioctl(p->kfd, AMDKFD_IOC_ALLOC_MEMORY_OF_GPU, &a));
	int fd = flags & (KFD_IOC_ALLOC_MEM_FLAGS_DOORBELL | KFD_IOC_ALLOC_MEM_FLAGS_MMIO_REMAP) ? p->kfd
											      : p->render[gi];
	uint8_t *m = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, (off_t)a.mmap_offset);
	CHECK(m != MAP_FAILED);
	memset(m, fill, size);
	return m;
}

static void test_b_ioctls(void)
{
	g_test = "b: open and ioctl reach the model";
	struct proc p;
	proc_open(&p);
	struct kfd_ioctl_get_version_args v = { 0 };
	OK(ioctl(p.kfd, AMDKFD_IOC_GET_VERSION, &v));
	CHECK_EQ(v.major_version, 1);
	CHECK_EQ(v.minor_version, 9);
	off_t tok = lseek(p.kfd, 0, SEEK_CUR);
	CHECK(tok > 0);
	int opath = open(kfd_path, O_PATH | O_CLOEXEC);      /* opens no device: no token, no error */
	CHECK(opath >= 0);
	struct stat pst;
	OK(fstat(opath, &pst));
	IS_CHR(&pst, KFD_MAJOR, 0);
	close(opath);
	int again = open(kfd_path, O_RDWR);                  /* same process, same KFD process */
	CHECK_EQ(lseek(again, 0, SEEK_CUR), tok);
	int d = dup(again);
	OK(ioctl(d, AMDKFD_IOC_GET_VERSION, &v));
	close(d);
	close(again);
	ERR(ioctl(p.kfd, AMDKFD_IOC_CREATE_QUEUE, &v), ENOTTY);
	uint8_t *vram = alloc_map(&p, 0, 1ull << 34, 2 * (uint64_t)pg, KFD_IOC_ALLOC_MEM_FLAGS_VRAM, 0x41);
	alloc_map(&p, 1, 1ull << 35, (uint64_t)pg, KFD_IOC_ALLOC_MEM_FLAGS_DOORBELL, 0);
	/* what CRIU's smaps parsing sees for the mappings */
	char mf[128];
	snprintf(mf, sizeof(mf), "/proc/self/map_files/%lx-%lx", (unsigned long)vram,
		 (unsigned long)vram + 2 * (unsigned long)pg);
	int mfd = open(mf, O_RDONLY);
	CHECK(mfd >= 0);
	struct stat st;
	OK(fstat(mfd, &st));
	IS_CHR(&st, 226, 130);
	close(mfd);
	/* the dump side, in the process itself */
	struct kfd_ioctl_criu_args a = { .op = KFD_CRIU_OP_PROCESS_INFO };
	OK(ioctl(p.kfd, AMDKFD_IOC_CRIU_OP, &a));
	CHECK_EQ(a.num_bos, 2);
	CHECK_EQ(a.pid, getpid());
	struct kfd_criu_device_bucket dev[2];
	struct kfd_criu_bo_bucket bo[2];
	uint8_t priv[512];
	a.devices = (uintptr_t)dev;
	a.bos = (uintptr_t)bo;
	a.priv_data = (uintptr_t)priv;
	a.op = KFD_CRIU_OP_CHECKPOINT;
	OK(ioctl(p.kfd, AMDKFD_IOC_CRIU_OP, &a));
	int dmabuf = (int)bo[0].dmabuf_fd;
	OK(fstat(dmabuf, &st));
	CHECK(S_ISREG(st.st_mode));                          /* a dmabuf is not a render node */
	struct drm_prime_handle h = { .fd = dmabuf };
	OK(ioctl(p.render[0], DRM_IOCTL_PRIME_FD_TO_HANDLE, &h));
	CHECK(h.handle != 0);
	struct drm_prime_handle h2 = { .fd = dmabuf };
	OK(ioctl(p.render[0], DRM_IOCTL_PRIME_FD_TO_HANDLE, &h2));
	CHECK_EQ(h2.handle, h.handle);
	uint8_t *view = mmap(NULL, bo[0].size, PROT_READ, MAP_SHARED, dmabuf, (off_t)bo[0].offset);
	CHECK(view != MAP_FAILED);
	CHECK(view[0] == 0x41 && view[bo[0].size - 1] == 0x41);
	munmap(view, bo[0].size);
	h.fd = p.kfd;
	ERR(ioctl(p.render[0], DRM_IOCTL_PRIME_FD_TO_HANDLE, &h), EINVAL);
	union drm_amdgpu_gem_create gc;
	memset(&gc, 0, sizeof(gc));
	ERR(ioctl(p.render[0], DRM_IOCTL_AMDGPU_GEM_CREATE, &gc), EINVAL);   /* no GEM on the model */
	close(dmabuf);
	a.op = KFD_CRIU_OP_UNPAUSE;
	OK(ioctl(p.kfd, AMDKFD_IOC_CRIU_OP, &a));
	int pfd[2];
	OK(pipe(pfd));
	CHECK_EQ(write(pfd[1], "xy", 2), 2);
	int n = -1;
	OK(ioctl(pfd[0], FIONREAD, &n));                     /* other fds: the real ioctl */
	CHECK_EQ(n, 2);
	close(pfd[0]);
	close(pfd[1]);
}

static void send_fd(int sock, int fd)
{
	char c = 'f';
	struct iovec iov = { &c, 1 };
	char buf[CMSG_SPACE(sizeof(int))];
	struct msghdr msg = { .msg_iov = &iov, .msg_iovlen = 1, .msg_control = buf, .msg_controllen = sizeof(buf) };
	struct cmsghdr *cm = CMSG_FIRSTHDR(&msg);
	cm->cmsg_level = SOL_SOCKET;
	cm->cmsg_type = SCM_RIGHTS;
	cm->cmsg_len = CMSG_LEN(sizeof(int));
	memcpy(CMSG_DATA(cm), &fd, sizeof(int));
	CHECK_EQ(sendmsg(sock, &msg, 0), 1);
}

static int recv_fd(int sock)
{
	char c;
	struct iovec iov = { &c, 1 };
	char buf[CMSG_SPACE(sizeof(int))];
	struct msghdr msg = { .msg_iov = &iov, .msg_iovlen = 1, .msg_control = buf, .msg_controllen = sizeof(buf) };
	CHECK_EQ(recvmsg(sock, &msg, 0), 1);
	int fd;
	memcpy(&fd, CMSG_DATA(CMSG_FIRSTHDR(&msg)), sizeof(int));
	return fd;
}

/* CRIU's dumper gets the task's kfd fd from the parasite over SCM_RIGHTS. */
static void test_c_drained_fd(void)
{
	g_test = "c: a drained fd names the task's KFD process";
	int sv[2];
	OK(socketpair(AF_UNIX, SOCK_SEQPACKET, 0, sv));
	pid_t pid = fork();
	CHECK(pid >= 0);
	if (pid == 0) {
		close(sv[0]);
		struct proc p;
		proc_open(&p);
		alloc_map(&p, 1, 1ull << 36, (uint64_t)pg, KFD_IOC_ALLOC_MEM_FLAGS_GTT, 7);
		send_fd(sv[1], p.kfd);
		char c;
		CHECK_EQ(read(sv[1], &c, 1), 1);
		_exit(0);
	}
	close(sv[1]);
	int fd = recv_fd(sv[0]);
	struct stat st;
	OK(fstat(fd, &st));
	IS_CHR(&st, KFD_MAJOR, 0);                           /* what dump_chrdev switches on */
	struct kfd_ioctl_criu_args a = { .op = KFD_CRIU_OP_PROCESS_INFO };
	ERR(ioctl(fd, AMDKFD_IOC_CRIU_OP, &a), EBADF);       /* not the tracer yet */
	OK((int)ptrace(PTRACE_SEIZE, pid, 0, 0));
	OK(ioctl(fd, AMDKFD_IOC_CRIU_OP, &a));
	CHECK_EQ(a.pid, pid);
	CHECK_EQ(a.num_bos, 1);
	a.op = KFD_CRIU_OP_UNPAUSE;
	OK(ioctl(fd, AMDKFD_IOC_CRIU_OP, &a));
	CHECK_EQ(write(sv[0], "q", 1), 1);
	int status;
	CHECK_EQ(waitpid(pid, &status, 0), pid);
	CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
	close(fd);
	close(sv[0]);
}

int main(int argc, char **argv)
{
	pg = sysconf(_SC_PAGESIZE);
	const char *state = getenv("VRAMD_KFD_STATE");
	if (!state || !*state) {
		/* set up, then run again with the shim configured from the start */
		char dir[300];
		snprintf(dir, sizeof(dir), "%s/kfd-shim-test.XXXXXX", argc > 1 ? argv[1] : "/dev/shm");
		CHECK(mkdtemp(dir) != NULL);
		int r = kfdm_create(dir, GPUS, 2, 9);
		if (r)
			fail(__LINE__, "kfdm_create(%s): %s", dir, strerror(-r));
		setenv("VRAMD_KFD_STATE", dir, 1);
		char maj[16];
		snprintf(maj, sizeof(maj), "%d", KFD_MAJOR);
		setenv("VRAMD_KFD_MAJOR", maj, 1);
		pid_t pid = fork();
		CHECK(pid >= 0);
		if (pid == 0) {
			execv(argv[0], argv);
			fail(__LINE__, "execv: %s", strerror(errno));
		}
		int status;
		CHECK_EQ(waitpid(pid, &status, 0), pid);
		char cmd[400];
		snprintf(cmd, sizeof(cmd), "rm -rf '%s'", dir);
		if (system(cmd))
			fprintf(stderr, "warning: could not remove %s\n", dir);
		return WIFEXITED(status) ? WEXITSTATUS(status) : 1;
	}
	snprintf(kfd_path, sizeof(kfd_path), "%s/kfd", state);
	for (int i = 0; i < 2; i++)
		snprintf(render_path[i], sizeof(render_path[i]), "%s/renderD%u", state, GPUS[i].minor);
	test_a_stat();
	test_b_ioctls();
	test_c_drained_fd();
	printf("ALL KFD SHIM TESTS PASSED\n");
	return 0;
}
