// SPDX-License-Identifier: Apache-2.0
/*
 * Description: live counters (phx_stats_source_add & co): argument checks,
 * a kind's names fixed by its first source, values published and read back
 * through the file's own tables (as phx.livestats reads them), a fill that
 * cannot read its counters keeping the last ones, the slot table full
 * (-ENOSPC) and a removed source's slot given back; forked children that
 * publish and unpublish while the parent's publishing thread waits.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "helpers.h"

#define CHECK(cond) T_CHECK(cond, "%s", "")
#include "phx.h"

/* The file's header fields this test needs (offsets as phx.livestats reads them). */
#define HDR_KINDS_OFF 16
#define HDR_KIND_SIZE 20
#define HDR_MAX_KINDS 24
#define HDR_SLOTS_OFF 28
#define HDR_SLOT_SIZE 32
#define HDR_MAX_SLOTS 36
#define SLOT_STATE 8
#define SLOT_KIND 12
#define SLOT_LABEL 40
#define SLOT_VALUES 136

static uint64_t counter = 1000;
static int fail_fill;

static void fill(void *arg, uint64_t *vals, uint32_t n)
{
	if (fail_fill)
		return;		/* as a fill that cannot take its lock now */
	vals[0] = counter;
	vals[1] = (uint64_t)(uintptr_t)arg;
	(void)n;
}

static uint32_t u32(const char *m, size_t off)
{
	uint32_t v;

	memcpy(&v, m + off, sizeof(v));
	return v;
}

/* The values of the live slot labelled @label, or -1 if none. */
static int find(const char *path, const char *label, uint64_t *v0, uint64_t *v1)
{
	struct stat st;
	int fd = open(path, O_RDONLY), ret = -1;
	char *m;
	uint32_t i;

	CHECK(fd >= 0);
	CHECK(fstat(fd, &st) == 0);
	m = mmap(NULL, st.st_size, PROT_READ, MAP_SHARED, fd, 0);
	CHECK(m != MAP_FAILED);
	CHECK(!memcmp(m, "PHXSTAT1", 8));
	for (i = 0; i < u32(m, HDR_MAX_SLOTS); i++) {
		const char *s = m + u32(m, HDR_SLOTS_OFF) + (size_t)i * u32(m, HDR_SLOT_SIZE);

		if (u32(s, SLOT_STATE) != 1 || strcmp(s + SLOT_LABEL, label))
			continue;
		/* its kind is named "test" in the kinds table */
		CHECK(!strcmp(m + u32(m, HDR_KINDS_OFF) +
			      (size_t)u32(s, SLOT_KIND) * u32(m, HDR_KIND_SIZE), "test"));
		memcpy(v0, s + SLOT_VALUES, 8);
		memcpy(v1, s + SLOT_VALUES + 8, 8);
		ret = 0;
		break;
	}
	munmap(m, st.st_size);
	close(fd);
	return ret;
}

/*
 * Children forked while a process publishes every millisecond (its thread
 * waking and waiting all the time) add, publish and remove a source of
 * their own.  Each must finish: the child's copy of the thread's wake-up
 * once counted the parent's waiting thread, and a broadcast in the child
 * could wait for it for ever (seen once in engine-backend's forked child).
 * Run in a child of its own, whose libphx starts publishing afresh with
 * that interval; SIGALRM ends a child that hangs.
 */
static int fork_children(const char *const *names)
{
	phx_stats_source *a, *c;
	int k, st;

	setenv("PHX_STATS_INTERVAL_MS", "1", 1);
	if (phx_stats_source_add("test", names, 2, "parent", fill, NULL, &a))
		return 1;
	for (k = 0; k < 300; k++) {
		pid_t pid = fork();

		if (pid < 0)
			return 1;
		if (!pid) {
			alarm(10);
			if (phx_stats_source_add("test", names, 2, "child", fill, NULL, &c))
				_exit(1);
			phx_stats_publish();
			phx_stats_source_remove(c);
			_exit(0);
		}
		if (waitpid(pid, &st, 0) != pid || !WIFEXITED(st) || WEXITSTATUS(st)) {
			fprintf(stderr, "forked child %d: status 0x%x\n", k, st);
			return 1;
		}
	}
	phx_stats_source_remove(a);
	return 0;
}

int main(void)
{
	static const char *const names[] = { "ops", "tag" };
	static const char *const other[] = { "ops", "bytes" };
	char dir[] = "/tmp/phx-stats-test.XXXXXX", path[4096], label[32];
	phx_stats_source *a, *b, *many[200];
	uint64_t v0, v1;
	int i, n, ret;

	CHECK(mkdtemp(dir));
	setenv("PHX_STATS_DIR", dir, 1);
	setenv("PHX_STATS_INTERVAL_MS", "60000", 1);	/* only phx_stats_publish() */
	CHECK(phx_stats_path(path, sizeof(path)) == -ENOENT);
	CHECK(phx_stats_publish() == -ENOENT);
	/* bad arguments */
	CHECK(phx_stats_source_add("test", names, 2, "a", fill, NULL, NULL) == -EINVAL);
	CHECK(phx_stats_source_add("", names, 2, "a", fill, NULL, &a) == -EINVAL && !a);
	CHECK(phx_stats_source_add("test", names, 0, "a", fill, NULL, &a) == -EINVAL);
	CHECK(phx_stats_source_add("test", names, 65, "a", fill, NULL, &a) == -EINVAL);
	CHECK(phx_stats_source_add("test", names, 2, "a", NULL, NULL, &a) == -EINVAL);
	CHECK(phx_stats_source_add("a-kind-name-of-forty-bytes-or-so-xx", names, 2, "a", fill,
				   NULL, &a) == -EINVAL);

	CHECK(phx_stats_source_add("test", names, 2, "first", fill, (void *)7, &a) == 0);
	n = phx_stats_path(path, sizeof(path));
	CHECK(n > 0 && (size_t)n == strlen(path) && !strncmp(path, dir, strlen(dir)));
	CHECK(phx_stats_path(path, 4) == -ERANGE);
	CHECK(phx_stats_path(path, sizeof(path)) == n);
	/* the kind's names are fixed by its first source */
	CHECK(phx_stats_source_add("test", other, 2, "x", fill, NULL, &b) == -EINVAL && !b);
	CHECK(phx_stats_source_add("test", names, 1, "x", fill, NULL, &b) == -EINVAL);

	CHECK(phx_stats_publish() == 0);
	CHECK(find(path, "first", &v0, &v1) == 0 && v0 == 1000 && v1 == 7);
	counter = 2000;
	CHECK(phx_stats_publish() == 0);
	CHECK(find(path, "first", &v0, &v1) == 0 && v0 == 2000);
	/* a fill that cannot read its counters: the last values stay */
	fail_fill = 1;
	counter = 3000;
	CHECK(phx_stats_publish() == 0);
	CHECK(find(path, "first", &v0, &v1) == 0 && v0 == 2000 && v1 == 7);
	fail_fill = 0;

	/* the slot table fills: -ENOSPC, then a removed source's slot is free again */
	for (i = 0; i < 200; i++) {
		snprintf(label, sizeof(label), "s%d", i);
		ret = phx_stats_source_add("test", names, 2, label, fill, NULL, &many[i]);
		if (ret)
			break;
	}
	CHECK(ret == -ENOSPC && i > 0 && i < 200);
	phx_stats_source_remove(a);
	CHECK(phx_stats_publish() == 0);
	CHECK(find(path, "first", &v0, &v1) == -1);
	CHECK(phx_stats_source_add("test", names, 2, "again", fill, (void *)9, &b) == 0);
	CHECK(phx_stats_publish() == 0);
	CHECK(find(path, "again", &v0, &v1) == 0 && v1 == 9);
	phx_stats_source_remove(b);
	while (i--)
		phx_stats_source_remove(many[i]);
	phx_stats_source_remove(NULL);
	ret = fork();
	CHECK(ret >= 0);
	if (!ret)
		_exit(fork_children(names));
	CHECK(waitpid(ret, &n, 0) == ret);
	T_CHECK(WIFEXITED(n) && !WEXITSTATUS(n), "forking publisher: status 0x%x", n);
	printf("stats-publish: ok (%s)\n", path);
	unlink(path);
	rmdir(dir);
	return 0;
}
