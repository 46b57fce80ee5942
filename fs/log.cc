#include "fs/log.h"

#include <unistd.h>

#include <cerrno>
#include <string>

namespace dte::fs {

void LogLine(std::string_view message) {
  std::string line(message);
  line += '\n';
  const char* p = line.data();
  size_t left = line.size();
  while (left > 0) {  // a short write only happens on a full disk or a signal
    const ssize_t n = ::write(STDERR_FILENO, p, left);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;  // nowhere to report it
    p += n;
    left -= static_cast<size_t>(n);
  }
}

}  // namespace dte::fs
