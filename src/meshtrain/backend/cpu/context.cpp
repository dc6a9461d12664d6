#include "meshtrain/backend/cpu/context.h"

#include <omp.h>
#include <sched.h>

namespace meshtrain::cpu {

int available_cores() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof set, &set) != 0) return 1;
  int n = CPU_COUNT(&set);
  return n > 0 ? n : 1;
}

}  // namespace meshtrain::cpu
