// The kernel readahead window of a FUSE mount.
//
// The kernel reads ahead of a sequential reader by the window of the
// mount's backing device info, /sys/class/bdi/<major>:<minor>/read_ahead_kb
// for the mount's st_dev. FUSE caps that value at the max_readahead of the
// INIT reply when it processes the reply, and the kernel offers at most its
// default (128 KiB) there, so a larger window can only be written to sysfs
// after INIT, by root. dtefs does that when the first request arrives (the
// kernel holds requests until INIT is processed), on a thread of its own
// (fs/dtefs.cc), before any file is opened.
//
// Thread-safety: pure functions and independent file accesses.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "store/base/status.h"

namespace dte::fs {

// The bdi directory ("/sys/class/bdi/0:52") of the FUSE mount at
// `mountpoint` (a canonical path) as listed in `mountinfo` (the content of
// /proc/self/mountinfo); the last such mount if several are stacked.
// NotFound if there is none.
Result<std::string> BdiFromMountinfo(std::string_view mountinfo, const std::string& mountpoint);

// Same, reading /proc/self/mountinfo. Sends no request to the mount, so the
// filesystem's own daemon may call it.
Result<std::string> MountBdi(const std::string& mountpoint);

Status WriteReadaheadKb(const std::string& bdi, uint64_t kb);
Result<uint64_t> ReadReadaheadKb(const std::string& bdi);

}  // namespace dte::fs
