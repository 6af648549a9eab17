/*
 * A preload shim for the fault-injection tests (tests/durable_faults.rs):
 * makes chosen I/O calls of the process it is loaded into fail, on files
 * whose path contains INFERD_FAULTS_MATCH (default "/sessions/"), while the
 * control file named by INFERD_FAULTS holds the call's word:
 *   fsync         fsync and fdatasync fail with EIO (a failing disk)
 *   write-eio     write fails with EIO
 *   write-enospc  write fails with ENOSPC
 * The test writes and removes the control file while the server runs. Every
 * other call, and every call while the file is absent, goes through.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <unistd.h>

/* Whether `word` is armed for `fd`. Uses only calls this file does not wrap. */
static int armed(const char *word, int fd) {
    const char *control = getenv("INFERD_FAULTS");
    if (control == NULL) {
        return 0;
    }
    int saved = errno;
    int cfd = open(control, O_RDONLY | O_CLOEXEC);
    if (cfd < 0) {
        errno = saved;
        return 0;
    }
    char words[256];
    ssize_t n = read(cfd, words, sizeof words - 1);
    close(cfd);
    errno = saved;
    if (n <= 0) {
        return 0;
    }
    words[n] = '\0';
    if (strstr(words, word) == NULL) {
        return 0;
    }
    char link[64];
    char path[4096];
    snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
    ssize_t m = readlink(link, path, sizeof path - 1);
    errno = saved;
    if (m <= 0) {
        return 0;
    }
    path[m] = '\0';
    const char *match = getenv("INFERD_FAULTS_MATCH");
    return strstr(path, match != NULL ? match : "/sessions/") != NULL;
}

int fsync(int fd) {
    static int (*real)(int);
    if (real == NULL) {
        real = (int (*)(int))dlsym(RTLD_NEXT, "fsync");
    }
    if (armed("fsync", fd)) {
        errno = EIO;
        return -1;
    }
    return real(fd);
}

int fdatasync(int fd) {
    static int (*real)(int);
    if (real == NULL) {
        real = (int (*)(int))dlsym(RTLD_NEXT, "fdatasync");
    }
    if (armed("fsync", fd)) {
        errno = EIO;
        return -1;
    }
    return real(fd);
}

ssize_t write(int fd, const void *buf, size_t count) {
    static ssize_t (*real)(int, const void *, size_t);
    if (real == NULL) {
        real = (ssize_t (*)(int, const void *, size_t))dlsym(RTLD_NEXT, "write");
    }
    if (fd > 2 && armed("write-eio", fd)) {
        errno = EIO;
        return -1;
    }
    if (fd > 2 && armed("write-enospc", fd)) {
        errno = ENOSPC;
        return -1;
    }
    return real(fd, buf, count);
}
