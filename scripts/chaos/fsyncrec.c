/* The fsync recorder of the chaos harness's power-loss faults (scripts/chaos/aof.py).
 *
 * Loaded into a broker server with LD_PRELOAD; CRL_FSYNC_LOG names the file it appends to.
 * Around every fsync/fdatasync of a file whose name ends in ".aof", it records
 *
 *     <wall-clock ns before the call> <wall-clock ns after it> <file size before the call> <path>\n
 *
 * once the call has returned 0. Every byte below that size was written before the call, so
 * it is on disk once the call returns: a power loss keeps at least that much of the file,
 * and every write the server finished before that moment (a client's reply comes after
 * its write) is in it. Redis 7.0 has no way to tell a client what is on disk (WAITAOF came
 * in 7.2); this is the server's own fsync, seen from outside, for Redis and Valkey alike.
 * One line per fsync (once a second with appendfsync everysec), each one write(2) to an
 * O_APPEND file, so lines from the server's threads and forked children never interleave.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

static int log_fd = -1;

static int log_file(void) {
    int fd = __atomic_load_n(&log_fd, __ATOMIC_ACQUIRE);
    if (fd >= 0) return fd;
    const char *path = getenv("CRL_FSYNC_LOG");
    if (path == NULL) return -1;
    fd = open(path, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0644);
    if (fd < 0) return -1;
    int expected = -1;
    if (!__atomic_compare_exchange_n(&log_fd, &expected, fd, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) {
        close(fd); /* another thread opened it first */
        return expected;
    }
    return fd;
}

/* The path of an AOF file behind fd, or 0 (not an .aof file: the manifest, a directory). */
static int aof_path(int fd, char *path, size_t size) {
    char link[64];
    snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
    ssize_t n = readlink(link, path, size - 1);
    if (n < 5) return 0;
    path[n] = '\0';
    return strcmp(path + n - 4, ".aof") == 0;
}

static int recorded(int (*sync)(int), int fd) {
    char path[4096];
    struct stat st;
    struct timespec now;
    int watched = aof_path(fd, path, sizeof path);
    clock_gettime(CLOCK_REALTIME, &now);
    if (watched && fstat(fd, &st) != 0) watched = 0;
    int result = sync(fd);
    struct timespec done;
    clock_gettime(CLOCK_REALTIME, &done);
    if (watched && result == 0) {
        int out = log_file();
        if (out >= 0) {
            char line[4200];
            int len = snprintf(line, sizeof line, "%lld %lld %lld %s\n",
                               (long long)now.tv_sec * 1000000000LL + now.tv_nsec,
                               (long long)done.tv_sec * 1000000000LL + done.tv_nsec,
                               (long long)st.st_size, path);
            if (len > 0 && (size_t)len < sizeof line && write(out, line, (size_t)len) < 0) {
                /* nothing to do: the harness then sees no record of this fsync */
            }
        }
    }
    return result;
}

int fsync(int fd) {
    static int (*real)(int);
    if (real == NULL) real = (int (*)(int))dlsym(RTLD_NEXT, "fsync");
    return recorded(real, fd);
}

int fdatasync(int fd) {
    static int (*real)(int);
    if (real == NULL) real = (int (*)(int))dlsym(RTLD_NEXT, "fdatasync");
    return recorded(real, fd);
}
