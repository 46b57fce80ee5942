// S3 options from the environment and the AWS shared files, with the
// environment passed in so tests need not change the process's.
//
// Shared files are INI text: "[section]" headers, "name = value" lines,
// '#' and ';' comment lines. The credentials file's sections are profile
// names; the config file's are "default" and "profile NAME".
//
// Thread-safety: pure functions (the files are read, never cached).
#pragma once

#include <functional>
#include <map>
#include <optional>
#include <string>
#include <string_view>

#include "store/base/status.h"
#include "store/s3_store.h"

namespace dte::internal {

// section -> name -> value. Lines that are neither headers nor assignments
// are ignored, as are assignments before the first header; later
// duplicates win. Names are lower-cased; values are trimmed.
using IniFile = std::map<std::string, std::map<std::string, std::string>>;
IniFile ParseIni(std::string_view text);

// The value of an environment variable; nullopt if unset or empty.
using EnvLookup = std::function<std::optional<std::string>(const char* name)>;

// S3OptionsFromEnvironment with the environment `env`.
Result<S3Options> S3OptionsFromEnv(const EnvLookup& env, const std::string& endpoint_override);

}  // namespace dte::internal
