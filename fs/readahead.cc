#include "fs/readahead.h"

#include <fcntl.h>

#include <charconv>
#include <sstream>
#include <vector>

#include "store/base/posix_file.h"

namespace dte::fs {
namespace {

bool IsOctal(char c) { return c >= '0' && c <= '7'; }

// mountinfo escapes space, tab, newline and backslash in paths as \ooo.
std::string Unescape(const std::string& s) {
  std::string out;
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] == '\\' && i + 3 < s.size() && IsOctal(s[i + 1]) && IsOctal(s[i + 2]) &&
        IsOctal(s[i + 3])) {
      out.push_back(
          static_cast<char>((s[i + 1] - '0') * 64 + (s[i + 2] - '0') * 8 + (s[i + 3] - '0')));
      i += 3;
    } else {
      out.push_back(s[i]);
    }
  }
  return out;
}

}  // namespace

// A line: id parent major:minor root mountpoint options [optional...] - fstype source super-options
Result<std::string> BdiFromMountinfo(std::string_view mountinfo, const std::string& mountpoint) {
  std::istringstream in{std::string(mountinfo)};
  std::string found;
  for (std::string line; std::getline(in, line);) {
    std::istringstream fields(line);
    std::vector<std::string> f;
    for (std::string w; fields >> w;) f.push_back(w);
    size_t dash = 6;
    while (dash < f.size() && f[dash] != "-") ++dash;
    if (dash + 1 >= f.size() || Unescape(f[4]) != mountpoint) continue;
    if (f[dash + 1].rfind("fuse", 0) != 0) continue;
    found = "/sys/class/bdi/" + f[2];
  }
  if (found.empty()) return NotFound("no FUSE mount at " + mountpoint + " in mountinfo");
  return found;
}

Result<std::string> MountBdi(const std::string& mountpoint) {
  ASSIGN_OR_RETURN(std::string info, ReadWholeFile("/proc/self/mountinfo"));
  return BdiFromMountinfo(info, mountpoint);
}

Status WriteReadaheadKb(const std::string& bdi, uint64_t kb) {
  const std::string path = bdi + "/read_ahead_kb";
  ASSIGN_OR_RETURN(ScopedFd fd, OpenFile(path, O_WRONLY));
  const std::string text = std::to_string(kb) + "\n";
  RETURN_IF_ERROR(WriteAll(fd.get(), text.data(), text.size(), path));
  return fd.Close(path);
}

Result<uint64_t> ReadReadaheadKb(const std::string& bdi) {
  const std::string path = bdi + "/read_ahead_kb";
  ASSIGN_OR_RETURN(std::string text, ReadWholeFile(path));
  uint64_t kb = 0;
  auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), kb);
  if (ec != std::errc() || end == text.data()) return Internal(path + ": not a number: " + text);
  return kb;
}

}  // namespace dte::fs
