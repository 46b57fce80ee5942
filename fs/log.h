// LogLine: one message of dtefs on stderr (the log file of a daemon).
//
// A line is written with one write(2), so lines from threads logging at the
// same time, or from mounts sharing a log file (O_APPEND), never interleave.
//
// Thread-safety: may be called from any thread.
#pragma once

#include <string_view>

namespace dte::fs {

// Writes `message` and a newline to stderr.
void LogLine(std::string_view message);

}  // namespace dte::fs
