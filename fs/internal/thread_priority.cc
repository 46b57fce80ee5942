#include "fs/internal/thread_priority.h"

#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

namespace dte::fs {

void LowerThreadPriority() {
  const auto tid = static_cast<pid_t>(::syscall(SYS_gettid));
  ::setpriority(PRIO_PROCESS, static_cast<id_t>(tid), 10);
  constexpr int kWhoProcess = 1, kClassBestEffort = 2, kClassShift = 13, kLowest = 7;
  ::syscall(SYS_ioprio_set, kWhoProcess, tid, (kClassBestEffort << kClassShift) | kLowest);
}

}  // namespace dte::fs
