/*
 * The process CRIU dumps and restores in the CRIU plugin test: it holds
 * MIB mebibytes of private anonymous memory filled with a pattern (so every
 * page is present and CRIU must move every byte), says it is ready, then
 * sleeps.  On SIGUSR1 it checks the whole pattern and writes "ok <pid>" or
 * "bad <pid> <offset>" to RESULT (opened by path at that moment, so it also
 * works after a restore).
 *
 *     workload MIB READY_FILE RESULT_FILE [DEVICE]
 *
 * With DEVICE (e.g. /dev/loop-control) it also keeps that character device
 * open: a file CRIU cannot dump by itself, so CRIU hands it to the plugins'
 * DUMP_EXT_FILE / RESTORE_EXT_FILE hooks, as it does /dev/kfd.
 */
#include <fcntl.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

static volatile sig_atomic_t check_requested;

static void on_usr1(int sig)
{
	(void)sig;
	check_requested = 1;
}

static uint64_t word(uint64_t i)
{
	/* splitmix64 of the word index: not compressible, cheap to recompute */
	uint64_t z = i + 0x9e3779b97f4a7c15ull;

	z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
	z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
	return z ^ (z >> 31);
}

static void write_file(const char *path, const char *text)
{
	int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);

	if (fd < 0)
		return;
	if (write(fd, text, strlen(text)) < 0)
		perror("write");
	close(fd);
}

int main(int argc, char **argv)
{
	struct sigaction sa = { .sa_handler = on_usr1 };
	sigset_t block, waitmask;
	char line[128];
	uint64_t *mem;
	size_t words, i;

	if (argc != 4 && argc != 5) {
		fprintf(stderr, "usage: %s MIB READY_FILE RESULT_FILE [DEVICE]\n", argv[0]);
		return 2;
	}
	if (argc == 5 && open(argv[4], O_RDWR) < 0) { /* kept open for ever */
		perror(argv[4]);
		return 1;
	}
	words = ((size_t)strtoul(argv[1], NULL, 0) << 20) / sizeof(uint64_t);
	mem = mmap(NULL, words * sizeof(uint64_t), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	if (mem == MAP_FAILED) {
		perror("mmap");
		return 1;
	}
	for (i = 0; i < words; i++)
		mem[i] = word(i);
	sigemptyset(&block);
	sigaddset(&block, SIGUSR1);
	sigprocmask(SIG_BLOCK, &block, &waitmask);
	sigdelset(&waitmask, SIGUSR1);
	sigaction(SIGUSR1, &sa, NULL);

	snprintf(line, sizeof(line), "%d\n", getpid());
	write_file(argv[2], line);

	for (;;) {
		sigsuspend(&waitmask); /* SIGUSR1 is blocked everywhere else: none is lost */
		if (!check_requested)
			continue;
		check_requested = 0;
		for (i = 0; i < words && mem[i] == word(i); i++)
			;
		if (i == words)
			snprintf(line, sizeof(line), "ok %d\n", getpid());
		else
			snprintf(line, sizeof(line), "bad %d %zu\n", getpid(), i * sizeof(uint64_t));
		write_file(argv[3], line);
	}
}
