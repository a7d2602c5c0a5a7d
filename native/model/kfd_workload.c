/*
 * kfd_workload.c - the EMULATED GPU PROCESS for the KFD model.
 *
 * THIS RUNS ON A MODEL, NOT A GPU.  A small ROCm-like process that links
 * nothing of CRIU or of the model: it finds the GPUs the way the ROCm thunk
 * does (KFD topology in sysfs), opens /dev/kfd and each GPU's render node,
 * acquires a VM per GPU, allocates BOs of mixed kinds and sizes, maps them
 * through the render nodes (the doorbell through /dev/kfd), fills them with
 * known bytes, and then, on SIGUSR1, checks every byte of every BO and writes
 * one report line.  Under the KFD model it runs with libvramd_kfd_model.so
 * preloaded (docs/kfd-model.md).
 *
 * Usage: kfd_workload [-m MiB per GPU (default 768)] [-g GPUS (default all)] [-s SMALL] [-c] [-r ROOT]
 *                     REPORT_FILE
 *   -s: SMALL more BOs of one page each (VRAM and GTT by turns), spread over the GPUs in use, after
 *       the ones -m makes (the many-small-BOs shape of a bench; at most MAX_SMALL).
 *   -c: fork a child first, before anything is opened, so the process is a tree: the child
 *       opens /dev/kfd itself (its own KFD process) and allocates its own BOs, the same kinds
 *       on the same GPUs with CHILD_MIB (4) MiB per GPU and other content than the parent's.
 *       CRIU's amdgpu plugin then restores BO contents in each restored task, not in its
 *       parallel worker.
 *   ROOT prefixes /dev/kfd, /dev/dri/renderD*, /sys/class/kfd (default "").
 * Prints "ready <pid> <bos> <bytes>" on stdout once filled (with -c: once the child's BOs are
 * filled too).  On SIGUSR1 it appends "ok <bos> <bytes>" or "bad bo <i> offset <o>" to
 * REPORT_FILE; with -c it first has the child check every byte of its BOs (SIGUSR1 to the
 * child, which answers in REPORT_FILE.child and with SIGUSR2) and appends one line
 * "<its own result>; child <the child's result>".  On SIGTERM it exits 0 (the child dies with it).
 * On SIGHUP it rewrites its first VRAM BO with new bytes (each SIGHUP another generation, which the
 * check then expects) and appends "changed bo <i> <bytes>" to REPORT_FILE: an incremental dump
 * after it has exactly that BO to store again.
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <unistd.h>
#include <linux/kfd_ioctl.h>

#define MAX_GPUS 8
#define MAX_SMALL 12288
#define MAX_SIZED 64             /* the BOs -m makes, all GPUs together */
#define MAX_BOS (MAX_SIZED + MAX_SMALL)
#define WRITABLE (1u << 31)      /* KFD_IOC_ALLOC_MEM_FLAGS_WRITABLE, unsigned */
#define CHILD_MIB 4
#define CHILD_SALT 1000          /* the child's BO i holds what a parent's BO i + 1000 would */
#define ANSWER_S 60              /* bound on waiting for the child's answer */

struct bo {
	uint64_t va, size;
	uint32_t flags, gpu;
	uint8_t *cpu;
};

static struct bo bos[MAX_BOS];
static unsigned nbos, salt, gen[MAX_BOS];
static volatile sig_atomic_t check_req, stop_req, change_req;

static void die(const char *what)
{
	fprintf(stderr, "kfd_workload: %s: %s\n", what, strerror(errno));
	exit(2);
}

static uint64_t word(unsigned i, uint64_t off)
{
	uint64_t x = ((uint64_t)(i + salt + 1) + ((uint64_t)gen[i] << 32)) * 0x9E3779B97F4A7C15ULL ^ off;
	x ^= x >> 31;
	x *= 0xBF58476D1CE4E5B9ULL;
	return x ^ (x >> 29);
}

static void fill(unsigned i)
{
	uint64_t *p = (uint64_t *)bos[i].cpu;
	for (uint64_t k = 0; k < bos[i].size / 8; k++)
		p[k] = word(i, k);
}

static long check(unsigned i)
{
	const uint64_t *p = (const uint64_t *)bos[i].cpu;
	for (uint64_t k = 0; k < bos[i].size / 8; k++)
		if (p[k] != word(i, k))
			return (long)(k * 8);
	return -1;
}

static void on_signal(int sig)
{
	if (sig == SIGUSR1)
		check_req = 1;
	else if (sig == SIGHUP)
		change_req = 1;
	else
		stop_req = 1;
}

/* Allocates one BO of `kind` at va on GPU g (gpu_id, its render node fd), maps and fills it.
 * Returns its bytes counted in the total (0 for the doorbell). */
static uint64_t add_bo(int kfd, int render, uint32_t gpu_id, unsigned g, uint32_t kind, uint64_t sz, uint64_t va)
{
	struct kfd_ioctl_alloc_memory_of_gpu_args a = {
		.va_addr = va, .size = sz, .gpu_id = gpu_id, .flags = kind | WRITABLE };
	if (ioctl(kfd, AMDKFD_IOC_ALLOC_MEMORY_OF_GPU, &a))
		die("AMDKFD_IOC_ALLOC_MEMORY_OF_GPU");
	int fd = kind == KFD_IOC_ALLOC_MEM_FLAGS_DOORBELL ? kfd : render;
	void *p = mmap((void *)(uintptr_t)va, sz, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED_NOREPLACE,
		       fd, (off_t)a.mmap_offset);
	if (p == MAP_FAILED)
		die("mmap of a BO");
	bos[nbos] = (struct bo){ .va = va, .size = sz, .flags = kind, .gpu = g, .cpu = p };
	if (kind == KFD_IOC_ALLOC_MEM_FLAGS_DOORBELL) {
		nbos++;
		return 0;
	}
	fill(nbos++);
	return sz;
}

/* Opens /dev/kfd (the calling process's KFD process) and the render nodes, acquires a VM
 * per GPU, allocates per_gpu bytes of BOs on each of the first use_gpus GPUs, then nsmall
 * one-page BOs over those GPUs, and fills them.
 * Returns their bytes. */
static uint64_t setup(const char *root, uint64_t per_gpu, unsigned use_gpus, unsigned nsmall)
{
	long pg = sysconf(_SC_PAGESIZE);
	char path[4096];
	snprintf(path, sizeof(path), "%s/dev/kfd", root);
	int kfd = open(path, O_RDWR | O_CLOEXEC);
	if (kfd < 0)
		die(path);
	/* the GPUs, as the thunk finds them: topology nodes with a gpu_id */
	uint32_t gpu_id[MAX_GPUS], minor[MAX_GPUS];
	int render[MAX_GPUS];
	unsigned ngpus = 0;
	for (unsigned n = 0; n < 64 && ngpus < MAX_GPUS; n++) {
		snprintf(path, sizeof(path), "%s/sys/class/kfd/kfd/topology/nodes/%u/gpu_id", root, n);
		FILE *f = fopen(path, "re");
		if (!f)
			continue;
		unsigned id = 0;
		int got = fscanf(f, "%u", &id);
		fclose(f);
		if (got != 1 || !id)
			continue;
		snprintf(path, sizeof(path), "%s/sys/class/kfd/kfd/topology/nodes/%u/properties", root, n);
		f = fopen(path, "re");
		if (!f)
			die(path);
		char key[128];
		unsigned long long val;
		minor[ngpus] = 0;
		while (fscanf(f, "%127s %llu", key, &val) == 2)
			if (!strcmp(key, "drm_render_minor"))
				minor[ngpus] = (uint32_t)val;
		fclose(f);
		gpu_id[ngpus] = id;
		snprintf(path, sizeof(path), "%s/dev/dri/renderD%u", root, minor[ngpus]);
		render[ngpus] = open(path, O_RDWR | O_CLOEXEC);
		if (render[ngpus] < 0)
			die(path);
		struct kfd_ioctl_acquire_vm_args av = { .drm_fd = (uint32_t)render[ngpus], .gpu_id = id };
		if (ioctl(kfd, AMDKFD_IOC_ACQUIRE_VM, &av))
			die("AMDKFD_IOC_ACQUIRE_VM");
		ngpus++;
	}
	if (!ngpus) {
		fprintf(stderr, "kfd_workload: no GPU in the KFD topology\n");
		exit(2);
	}
	/* per GPU: a doorbell page, then VRAM and GTT BOs from one page up to half the budget */
	uint64_t va = 1ull << 40, total = 0;
	for (unsigned g = 0; g < ngpus && g < use_gpus; g++) {
		uint64_t left = per_gpu, size = (uint64_t)pg;
		uint32_t kinds[] = { KFD_IOC_ALLOC_MEM_FLAGS_DOORBELL, KFD_IOC_ALLOC_MEM_FLAGS_VRAM,
				     KFD_IOC_ALLOC_MEM_FLAGS_GTT };
		for (unsigned k = 0; nbos < MAX_SIZED; k++) {
			uint32_t kind = k == 0 ? kinds[0] : kinds[1 + (k & 1)];
			uint64_t sz = kind == KFD_IOC_ALLOC_MEM_FLAGS_DOORBELL ? (uint64_t)pg : size;
			if (kind != KFD_IOC_ALLOC_MEM_FLAGS_DOORBELL) {
				if (!left)
					break;
				if (sz > left || (k > 1 && sz * 4 > left * 3))
					sz = left;          /* the last BO takes the rest */
				left -= sz;
				size = size * 8 + (uint64_t)pg * 3;
				size -= size % (uint64_t)pg;
			}
			total += add_bo(kfd, render[g], gpu_id[g], g, kind, sz, va);
			va += sz + (2ull << 20);
			va -= va % (2ull << 20);
		}
	}
	unsigned used = ngpus < use_gpus ? ngpus : use_gpus;
	for (unsigned k = 0; k < nsmall; k++) {
		unsigned g = k % used;
		uint32_t kind = (k / used) & 1 ? KFD_IOC_ALLOC_MEM_FLAGS_GTT : KFD_IOC_ALLOC_MEM_FLAGS_VRAM;
		total += add_bo(kfd, render[g], gpu_id[g], g, kind, (uint64_t)pg, va);
		va += 2ull << 20;
	}
	return total;
}

/* Checks every byte of every BO; the result line, without newline, into buf. */
static void result(char *buf, size_t len, uint64_t total)
{
	long bad = -1;
	unsigned i;
	for (i = 0; i < nbos && bad < 0; i++)
		if (bos[i].flags != KFD_IOC_ALLOC_MEM_FLAGS_DOORBELL)
			bad = check(i);
	if (bad >= 0)
		snprintf(buf, len, "bad bo %u offset %ld", i - 1, bad);
	else
		snprintf(buf, len, "ok %u %" PRIu64, nbos, total);
}

/* Waits (bounded) for the child's SIGUSR2; 0 if it came. */
static int child_answer(void)
{
	sigset_t usr2;
	sigemptyset(&usr2);
	sigaddset(&usr2, SIGUSR2);
	struct timespec t = { .tv_sec = ANSWER_S };
	int r;
	while ((r = sigtimedwait(&usr2, NULL, &t)) < 0 && errno == EINTR)
		;
	return r == SIGUSR2 ? 0 : -1;
}

int main(int argc, char **argv)
{
	uint64_t per_gpu = 768ull << 20;
	const char *root = "";
	unsigned use_gpus = MAX_GPUS;
	int opt, with_child = 0;
	unsigned nsmall = 0;
	while ((opt = getopt(argc, argv, "m:g:s:cr:")) != -1) {
		if (opt == 'm')
			per_gpu = strtoull(optarg, NULL, 0) << 20;
		else if (opt == 'g')
			use_gpus = (unsigned)strtoul(optarg, NULL, 0);
		else if (opt == 's')
			nsmall = (unsigned)strtoul(optarg, NULL, 0);
		else if (opt == 'c')
			with_child = 1;
		else if (opt == 'r')
			root = optarg;
		else
			return 2;
	}
	if (optind != argc - 1 || nsmall > MAX_SMALL) {
		fprintf(stderr, "usage: kfd_workload [-m MiB] [-g GPUS] [-s SMALL (<= %d)] [-c] [-r ROOT] REPORT_FILE\n",
			MAX_SMALL);
		return 2;
	}
	const char *report = argv[optind];
	struct sigaction sa;
	memset(&sa, 0, sizeof(sa));
	sa.sa_handler = on_signal;
	sigaction(SIGUSR1, &sa, NULL);
	sigaction(SIGTERM, &sa, NULL);
	sigaction(SIGHUP, &sa, NULL);
	sigset_t block, old, wait_mask;
	sigemptyset(&block);
	sigaddset(&block, SIGHUP);
	sigaddset(&block, SIGUSR1);
	sigaddset(&block, SIGUSR2);
	sigaddset(&block, SIGTERM);
	sigprocmask(SIG_BLOCK, &block, &old);
	wait_mask = old;                      /* SIGUSR2 only ever through sigtimedwait */
	sigaddset(&wait_mask, SIGUSR2);
	sigdelset(&wait_mask, SIGUSR1);
	sigdelset(&wait_mask, SIGTERM);
	sigdelset(&wait_mask, SIGHUP);
	char child_report[4096];
	snprintf(child_report, sizeof(child_report), "%s.child", report);
	pid_t parent = getpid(), child = 0;
	if (with_child) {                     /* before anything is opened: nothing GPU is inherited */
		child = fork();
		if (child < 0)
			die("fork");
		if (child == 0) {
			prctl(PR_SET_PDEATHSIG, SIGKILL);
			if (getppid() != parent)
				_exit(0);
			salt = CHILD_SALT;
			uint64_t total = setup(root, (uint64_t)CHILD_MIB << 20, use_gpus, 0);
			kill(parent, SIGUSR2);        /* filled */
			for (;;) {
				while (!check_req && !stop_req)
					sigsuspend(&wait_mask);
				if (stop_req)
					_exit(0);
				check_req = 0;
				char line[128];
				result(line, sizeof(line), total);
				FILE *f = fopen(child_report, "we");
				if (!f)
					die(child_report);
				fprintf(f, "%s\n", line);
				if (fclose(f))
					die(child_report);
				kill(parent, SIGUSR2);
			}
		}
	}
	uint64_t total = setup(root, per_gpu, use_gpus, nsmall);
	if (with_child && child_answer()) {
		fprintf(stderr, "kfd_workload: the child did not fill its BOs within %d s\n", ANSWER_S);
		kill(child, SIGKILL);
		return 2;
	}
	printf("ready %d %u %" PRIu64 "\n", getpid(), nbos, total);
	fflush(stdout);
	for (;;) {
		while (!check_req && !stop_req && !change_req)
			sigsuspend(&wait_mask);
		if (stop_req)
			return 0;
		if (change_req) {
			change_req = 0;
			unsigned i = 0;
			while (i < nbos && !(bos[i].flags & KFD_IOC_ALLOC_MEM_FLAGS_VRAM))
				i++;
			FILE *f = fopen(report, "ae");
			if (!f)
				die(report);
			if (i < nbos) {
				gen[i]++;
				fill(i);
				fprintf(f, "changed bo %u %" PRIu64 "\n", i, bos[i].size);
			} else {
				fprintf(f, "no VRAM bo\n");
			}
			fclose(f);
			continue;
		}
		check_req = 0;
		char line[128], theirs[128] = "no answer";
		result(line, sizeof(line), total);
		if (with_child) {
			unlink(child_report);
			if (kill(child, SIGUSR1) == 0 && child_answer() == 0) {
				FILE *c = fopen(child_report, "re");
				if (!c || !fgets(theirs, sizeof(theirs), c))
					snprintf(theirs, sizeof(theirs), "no report");
				if (c)
					fclose(c);
				theirs[strcspn(theirs, "\n")] = 0;
			}
		}
		FILE *f = fopen(report, "ae");
		if (!f)
			die(report);
		if (with_child)
			fprintf(f, "%s; child %s\n", line, theirs);
		else
			fprintf(f, "%s\n", line);
		fclose(f);
	}
}
