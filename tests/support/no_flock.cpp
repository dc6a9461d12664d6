// LD_PRELOAD shim: a file system without locks, as Lustre mounted without
// -o flock looks to a process (every flock(2) fails with ENOLCK).
#include <cerrno>

extern "C" int flock(int, int) {
  errno = ENOLCK;
  return -1;
}
