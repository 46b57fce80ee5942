// Background work yields to readers.
//
// Thread-safety: affects the calling thread only.
#pragma once

namespace dte::fs {

// Lowers the calling thread to nice 10 and the lowest best-effort I/O
// priority (Linux applies both per thread id). Failures are ignored: the
// work still runs, only not politely.
void LowerThreadPriority();

}  // namespace dte::fs
