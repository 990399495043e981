/* A storage-fault shim for the tests (LD_PRELOAD): fails the N-th call of one file
 * operation on paths that contain a given text, the way a full disk, a quota, a failing
 * device or a read-only remount would.
 *
 *   FACESHARD_FAULT="OP:N:ERR[:TEXT]"
 *     OP    open | write | fsync | rename | close (opens and closes for writing only)
 *     N     the call (1-based) among this process's calls of OP on matching paths
 *     ERR   ENOSPC | EDQUOT | EIO | EROFS | short (write: half the bytes are written and
 *           that count returned, once; for fwrite, with errno ENOSPC, since stdio writes
 *           the rest of a partial write itself); a trailing "+" keeps failing from the N-th call
 *           on (a disk that stays full)
 *     TEXT  a part of the path (write/fsync/close: the path the descriptor was opened
 *           with; rename: either name); empty or absent: every path
 *   FACESHARD_FAULT_COUNT=FILE  appends, at exit, "OP COUNT" for each operation's matching
 *           calls (to find the ordinals to walk)
 *   FACESHARD_FAULT_LOG=FILE    appends one line when the fault fires
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

enum { OP_OPEN, OP_WRITE, OP_FSYNC, OP_RENAME, OP_CLOSE, OP_COUNT };
static const char* kOps[OP_COUNT] = {"open", "write", "fsync", "rename", "close"};

static int g_ready, g_op = -1, g_err, g_short, g_sticky;
static long g_n;
static char g_text[512];
static long g_calls[OP_COUNT];
#define MAX_FD 4096
static char* g_paths[MAX_FD];  /* path each descriptor was opened with (matching ones only) */
static char g_writes[MAX_FD];  /* opened for writing (only such a close can lose data) */

static void report_counts(void) {
  const char* f = getenv("FACESHARD_FAULT_COUNT");
  if (!f) return;
  FILE* out = fopen(f, "a");
  if (!out) return;
  for (int i = 0; i < OP_COUNT; ++i) fprintf(out, "%s %ld\n", kOps[i], g_calls[i]);
  fclose(out);
}

static void init(void) {
  if (g_ready) return;
  g_ready = 1;
  const char* spec = getenv("FACESHARD_FAULT");
  if (getenv("FACESHARD_FAULT_COUNT")) atexit(report_counts);
  if (!spec || !*spec) {
    g_text[0] = 0;
    return;
  }
  char op[16] = {0}, err[16] = {0};
  long n = 0;
  g_text[0] = 0;
  if (sscanf(spec, "%15[^:]:%ld:%15[^:]:%511[^\n]", op, &n, err, g_text) < 3) return;
  for (int i = 0; i < OP_COUNT; ++i)
    if (!strcmp(op, kOps[i])) g_op = i;
  size_t el = strlen(err);
  if (el && err[el - 1] == '+') g_sticky = 1, err[el - 1] = 0;
  g_n = n;
  if (!strcmp(err, "ENOSPC")) g_err = ENOSPC;
  else if (!strcmp(err, "EDQUOT")) g_err = EDQUOT;
  else if (!strcmp(err, "EIO")) g_err = EIO;
  else if (!strcmp(err, "EROFS")) g_err = EROFS;
  else if (!strcmp(err, "short")) g_short = 1, g_err = EIO;
  else g_op = -1;
}

static int matches(const char* path) { return path && (!g_text[0] || strstr(path, g_text)); }

/* Counts a call of op on a matching path; 1 when this call must fail. */
static int hit(int op) {
  long k = ++g_calls[op];
  if (op != g_op) return 0;
  int fire = g_sticky ? k >= g_n : k == g_n;
  if (fire) {
    const char* log = getenv("FACESHARD_FAULT_LOG");
    if (log) {
      FILE* out = fopen(log, "a");
      if (out) fprintf(out, "fault: %s call %ld: %s\n", kOps[op], k, g_short ? "short" : strerror(g_err)), fclose(out);
    }
  }
  return fire;
}

static void remember(int fd, const char* path, int writes) {
  if (fd < 0 || fd >= MAX_FD) return;
  free(g_paths[fd]);
  g_paths[fd] = matches(path) ? strdup(path) : NULL;
  g_writes[fd] = (char)writes;
}
#define WRITES(flags) (((flags) & (O_WRONLY | O_RDWR | O_CREAT)) != 0)

#define REAL(name) static __typeof__(&name) real_##name; if (!real_##name) real_##name = (__typeof__(&name))dlsym(RTLD_NEXT, #name)

static int open_common(const char* path, int flags) {
  init();
  /* Only opens that create or write count: reading a file back is not a write fault. */
  return (flags & (O_WRONLY | O_RDWR | O_CREAT)) && matches(path) && hit(OP_OPEN);
}

int open(const char* path, int flags, ...) {
  REAL(open);
  mode_t mode = 0;
  if (flags & (O_CREAT | O_TMPFILE)) { va_list a; va_start(a, flags); mode = va_arg(a, mode_t); va_end(a); }
  if (open_common(path, flags)) { errno = g_err; return -1; }
  int fd = real_open(path, flags, mode);
  remember(fd, path, WRITES(flags));
  return fd;
}
int open64(const char* path, int flags, ...) {
  REAL(open64);
  mode_t mode = 0;
  if (flags & (O_CREAT | O_TMPFILE)) { va_list a; va_start(a, flags); mode = va_arg(a, mode_t); va_end(a); }
  if (open_common(path, flags)) { errno = g_err; return -1; }
  int fd = real_open64(path, flags, mode);
  remember(fd, path, WRITES(flags));
  return fd;
}
int openat(int dir, const char* path, int flags, ...) {
  REAL(openat);
  mode_t mode = 0;
  if (flags & (O_CREAT | O_TMPFILE)) { va_list a; va_start(a, flags); mode = va_arg(a, mode_t); va_end(a); }
  if (open_common(path, flags)) { errno = g_err; return -1; }
  int fd = real_openat(dir, path, flags, mode);
  remember(fd, path, WRITES(flags));
  return fd;
}
int openat64(int dir, const char* path, int flags, ...) {
  REAL(openat64);
  mode_t mode = 0;
  if (flags & (O_CREAT | O_TMPFILE)) { va_list a; va_start(a, flags); mode = va_arg(a, mode_t); va_end(a); }
  if (open_common(path, flags)) { errno = g_err; return -1; }
  int fd = real_openat64(dir, path, flags, mode);
  remember(fd, path, WRITES(flags));
  return fd;
}

static int tracked(int fd) { return fd >= 0 && fd < MAX_FD && g_paths[fd]; }

ssize_t write(int fd, const void* buf, size_t n) {
  REAL(write);
  init();
  if (tracked(fd) && hit(OP_WRITE)) {
    if (g_short && n > 1) {
      g_op = -1; /* once */
      return real_write(fd, buf, n / 2);
    }
    errno = g_err;
    return -1;
  }
  return real_write(fd, buf, n);
}

int fsync(int fd) {
  REAL(fsync);
  init();
  if (tracked(fd) && hit(OP_FSYNC)) { errno = g_err; return -1; }
  return real_fsync(fd);
}

int close(int fd) {
  REAL(close);
  init();
  int fail = tracked(fd) && g_writes[fd] && hit(OP_CLOSE);
  if (fd >= 0 && fd < MAX_FD) { free(g_paths[fd]); g_paths[fd] = NULL; }
  int r = real_close(fd);
  if (fail) { errno = g_err; return -1; }
  return r;
}

int rename(const char* from, const char* to) {
  REAL(rename);
  init();
  if ((matches(from) || matches(to)) && hit(OP_RENAME)) { errno = g_err; return -1; }
  return real_rename(from, to);
}

/* stdio: the library's own calls inside fopen/fflush do not come through here, so the
 * stream functions the program calls are interposed too (fwrite and fflush count as
 * writes, fclose as a close). */
FILE* fopen(const char* path, const char* mode) {
  REAL(fopen);
  init();
  const int writes = mode && (strchr(mode, 'w') || strchr(mode, 'a') || strchr(mode, '+'));
  if (writes && matches(path) && hit(OP_OPEN)) { errno = g_err; return NULL; }
  FILE* f = real_fopen(path, mode);
  if (f) remember(fileno(f), path, writes);
  return f;
}
FILE* fopen64(const char* path, const char* mode) { return fopen(path, mode); }

size_t fwrite(const void* buf, size_t size, size_t n, FILE* f) {
  REAL(fwrite);
  init();
  if (tracked(fileno(f)) && hit(OP_WRITE)) {
    if (g_short && n > 1) {
      /* stdio writes the rest of a partial write(2) itself: a short fwrite means the write
       * after the partial one failed, as when the disk fills in the middle. */
      g_op = -1;
      size_t done = real_fwrite(buf, size, n / 2, f);
      errno = ENOSPC;
      return done;
    }
    errno = g_err;
    return 0;
  }
  return real_fwrite(buf, size, n, f);
}

int fflush(FILE* f) {
  REAL(fflush);
  init();
  if (f && tracked(fileno(f)) && hit(OP_WRITE)) { errno = g_err; return EOF; }
  return real_fflush(f);
}

int fclose(FILE* f) {
  REAL(fclose);
  init();
  int fd = f ? fileno(f) : -1;
  int fail = tracked(fd) && g_writes[fd] && hit(OP_CLOSE);
  if (fd >= 0 && fd < MAX_FD) { free(g_paths[fd]); g_paths[fd] = NULL; }
  int r = real_fclose(f);
  if (fail) { errno = g_err; return EOF; }
  return r;
}
