// The host cores this process may run on.
#pragma once

namespace meshtrain {

// Cores in this process's affinity mask (sched_getaffinity), at least 1.
int available_cores();

}  // namespace meshtrain
