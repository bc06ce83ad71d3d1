// LD_PRELOAD=segv_bt.so: on SIGSEGV/SIGBUS/SIGABRT print the native backtrace (the GPU host has no gdb).
#define _GNU_SOURCE
#include <execinfo.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>
#include <fcntl.h>
static void handler(int sig) {
  void* frames[64];
  int n = backtrace(frames, 64);
  dprintf(2, "=== native backtrace (signal %d) ===\n", sig);
  backtrace_symbols_fd(frames, n, 2);
  int fd = open("/proc/self/maps", O_RDONLY);
  if (fd >= 0) {
    char buf[4096]; ssize_t r;
    dprintf(2, "=== maps (_C) ===\n");
    // print only lines mentioning _C (cheap filter: dump all to a file instead)
    int out = open("/tmp/segv_maps.txt", O_WRONLY | O_CREAT | O_TRUNC, 0644);
    while ((r = read(fd, buf, sizeof buf)) > 0) if (out >= 0) write(out, buf, r);
    if (out >= 0) close(out);
    close(fd);
  }
  signal(sig, SIG_DFL);
  raise(sig);
}
__attribute__((constructor)) static void install(void) {
  signal(SIGSEGV, handler);
  signal(SIGBUS, handler);
}
