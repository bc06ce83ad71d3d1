// Preloaded (LD_PRELOAD) by scripts/segv_probe.sh: on SIGSEGV / SIGBUS print the native backtrace to stderr, then
// die of the signal as before. The GPU host has no gdb; faulthandler, when enabled, still prints Python's frames
// first and then hands the signal on to this handler.
#define _GNU_SOURCE
#include <execinfo.h>
#include <signal.h>
#include <stdio.h>

static void handler(int sig) {
  void* frames[64];
  const int n = backtrace(frames, 64);
  dprintf(2, "=== native backtrace (signal %d) ===\n", sig);
  backtrace_symbols_fd(frames, n, 2);
  signal(sig, SIG_DFL);
  raise(sig);
}

__attribute__((constructor)) static void install(void) {
  signal(SIGSEGV, handler);
  signal(SIGBUS, handler);
}
