#include "store/internal/s3_config.h"

#include <cctype>
#include <cerrno>
#include <cstdlib>

#include "store/base/posix_file.h"
#include "store/base/units.h"

namespace dte {
namespace internal {
namespace {

std::string_view Trim(std::string_view s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.front()))) s.remove_prefix(1);
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.remove_suffix(1);
  return s;
}

std::string Lower(std::string_view s) {
  std::string out(s);
  for (char& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

// The file's sections, or none if it does not exist. Messages name the file
// only: its content holds secrets.
Result<IniFile> ReadIni(const std::string& path) {
  auto text = ReadWholeFile(path);
  if (!text.ok() && text.status().code() == Code::kNotFound) return IniFile{};
  if (!text.ok()) return InvalidArgument("cannot read AWS file " + path);
  return ParseIni(*text);
}

const std::map<std::string, std::string>* Section(const IniFile& file, const std::string& name) {
  auto it = file.find(name);
  return it == file.end() ? nullptr : &it->second;
}

std::string Get(const std::map<std::string, std::string>* section, const std::string& name) {
  if (section == nullptr) return "";
  auto it = section->find(name);
  return it == section->end() ? "" : it->second;
}

struct SharedFiles {
  std::string profile;
  bool explicit_profile = false;
  std::string credentials_path, config_path;
  IniFile credentials, config;
  const std::map<std::string, std::string>* cred_section = nullptr;
  const std::map<std::string, std::string>* config_section = nullptr;
};

Result<SharedFiles> LoadSharedFiles(const EnvLookup& env) {
  SharedFiles f;
  auto profile = env("AWS_PROFILE");
  if (!profile) profile = env("AWS_DEFAULT_PROFILE");
  f.explicit_profile = profile.has_value();
  f.profile = profile.value_or("default");
  const std::string home = env("HOME").value_or("");
  f.credentials_path = env("AWS_SHARED_CREDENTIALS_FILE").value_or(home + "/.aws/credentials");
  f.config_path = env("AWS_CONFIG_FILE").value_or(home + "/.aws/config");
  ASSIGN_OR_RETURN(f.credentials, ReadIni(f.credentials_path));
  ASSIGN_OR_RETURN(f.config, ReadIni(f.config_path));
  f.cred_section = Section(f.credentials, f.profile);
  f.config_section = Section(f.config, f.profile == "default" ? "default" : "profile " + f.profile);
  if (f.explicit_profile && f.cred_section == nullptr && f.config_section == nullptr) {
    return InvalidArgument("AWS profile \"" + f.profile + "\" (from AWS_PROFILE) is in neither " +
                           f.credentials_path + " nor " + f.config_path);
  }
  return f;
}

Status LoadKeys(const EnvLookup& env, const SharedFiles& f, S3Options* o) {
  auto id = env("AWS_ACCESS_KEY_ID");
  auto secret = env("AWS_SECRET_ACCESS_KEY");
  if (id || secret) {
    if (!id || !secret) {
      return InvalidArgument(std::string(id ? "AWS_ACCESS_KEY_ID" : "AWS_SECRET_ACCESS_KEY") +
                             " is set but " + (id ? "AWS_SECRET_ACCESS_KEY" : "AWS_ACCESS_KEY_ID") +
                             " is not");
    }
    o->access_key = *id;
    o->secret_key = *secret;
    o->session_token = env("AWS_SESSION_TOKEN").value_or("");
    return Status::Ok();
  }
  for (const auto& [section, path] : {std::pair{f.cred_section, &f.credentials_path},
                                      std::pair{f.config_section, &f.config_path}}) {
    const std::string key_id = Get(section, "aws_access_key_id");
    const std::string key = Get(section, "aws_secret_access_key");
    if (key_id.empty() && key.empty()) continue;
    if (key_id.empty() || key.empty()) {
      return InvalidArgument("AWS profile \"" + f.profile + "\" in " + *path +
                             " has only one of aws_access_key_id and aws_secret_access_key");
    }
    o->access_key = key_id;
    o->secret_key = key;
    o->session_token = Get(section, "aws_session_token");
    return Status::Ok();
  }
  return Status::Ok();  // anonymous
}

// The integer in `name`, within [lo, hi]; nullopt when unset. DTE_ values
// hold no secrets, so a bad one is quoted.
Result<std::optional<int64_t>> EnvInteger(const EnvLookup& env, const char* name, int64_t lo,
                                          int64_t hi) {
  auto text = env(name);
  if (!text) return std::optional<int64_t>();
  int64_t v = 0;
  bool ok = text->size() <= 12;
  for (char c : *text) {
    ok = ok && c >= '0' && c <= '9';
    if (ok) v = v * 10 + (c - '0');
  }
  if (!ok || v < lo || v > hi) {
    return InvalidArgument(std::string(name) + " is \"" + *text + "\"; use an integer from " +
                           std::to_string(lo) + " to " + std::to_string(hi));
  }
  return std::optional<int64_t>(v);
}

// A part or copy size in `name` (a size such as "8MiB"), 5 MiB to 5 GiB;
// *out is left alone when unset.
Status EnvPartSize(const EnvLookup& env, const char* name, uint64_t* out) {
  auto text = env(name);
  if (!text) return Status::Ok();
  auto size = ParseByteSize(*text);
  constexpr uint64_t kMiB = uint64_t{1} << 20;
  if (!size.ok() || *size < 5 * kMiB || *size > 5 * 1024 * kMiB) {
    return InvalidArgument(std::string(name) + " is \"" + *text +
                           "\"; use a size from 5MiB to 5GiB");
  }
  *out = *size;
  return Status::Ok();
}

// Retry, stall and multipart settings (docs/s3.md, "Tuning"): for tests that
// need fast retries and for links that need other limits.
Status LoadTuning(const EnvLookup& env, S3Options* o) {
  using std::chrono::milliseconds;
  using std::chrono::seconds;
  ASSIGN_OR_RETURN(auto attempts, EnvInteger(env, "DTE_S3_MAX_ATTEMPTS", 1, 100));
  ASSIGN_OR_RETURN(auto base, EnvInteger(env, "DTE_S3_RETRY_BASE_MS", 0, 60000));
  ASSIGN_OR_RETURN(auto cap, EnvInteger(env, "DTE_S3_RETRY_MAX_MS", 0, 600000));
  ASSIGN_OR_RETURN(auto stall, EnvInteger(env, "DTE_S3_LOW_SPEED_TIME", 1, 3600));
  ASSIGN_OR_RETURN(auto slow, EnvInteger(env, "DTE_S3_LOW_SPEED_LIMIT", 1, int64_t{1} << 30));
  ASSIGN_OR_RETURN(auto connect, EnvInteger(env, "DTE_S3_CONNECT_TIMEOUT_MS", 1, 600000));
  ASSIGN_OR_RETURN(auto parallel, EnvInteger(env, "DTE_S3_PARALLEL_PARTS", 1, 64));
  if (attempts) o->retry.max_attempts = static_cast<int>(*attempts);
  if (base) o->retry.base_delay = milliseconds(*base);
  if (cap) o->retry.max_delay = milliseconds(*cap);
  if (stall) o->low_speed_time = seconds(*stall);
  if (slow) o->low_speed_limit = static_cast<long>(*slow);
  if (connect) o->connect_timeout = milliseconds(*connect);
  if (parallel) o->parallel_parts = static_cast<int>(*parallel);
  RETURN_IF_ERROR(EnvPartSize(env, "DTE_S3_PART_SIZE", &o->part_size));
  RETURN_IF_ERROR(EnvPartSize(env, "DTE_S3_MAX_COPY_SIZE", &o->max_copy_bytes));
  return EnvPartSize(env, "DTE_S3_COPY_PART_SIZE", &o->copy_part_size);
}

}  // namespace

IniFile ParseIni(std::string_view text) {
  IniFile file;
  std::map<std::string, std::string>* section = nullptr;
  while (!text.empty()) {
    const size_t eol = text.find('\n');
    std::string_view line = Trim(text.substr(0, eol));
    text.remove_prefix(eol == std::string_view::npos ? text.size() : eol + 1);
    if (line.empty() || line[0] == '#' || line[0] == ';') continue;
    if (line.front() == '[') {
      if (line.back() != ']') continue;
      section = &file[std::string(Trim(line.substr(1, line.size() - 2)))];
      continue;
    }
    const size_t eq = line.find('=');
    if (eq == std::string_view::npos || section == nullptr) continue;
    (*section)[Lower(Trim(line.substr(0, eq)))] = std::string(Trim(line.substr(eq + 1)));
  }
  return file;
}

Result<S3Options> S3OptionsFromEnv(const EnvLookup& env, const std::string& endpoint_override) {
  S3Options o;
  ASSIGN_OR_RETURN(SharedFiles files, LoadSharedFiles(env));
  RETURN_IF_ERROR(LoadKeys(env, files, &o));
  o.endpoint = endpoint_override;
  for (const char* name : {"AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"}) {
    if (o.endpoint.empty()) o.endpoint = env(name).value_or("");
  }
  if (o.endpoint.empty()) o.endpoint = Get(files.config_section, "endpoint_url");
  std::string region = env("AWS_REGION").value_or(env("AWS_DEFAULT_REGION").value_or(""));
  if (region.empty()) region = Get(files.config_section, "region");
  if (!region.empty()) o.region = region;
  for (char c : o.region) {
    if (!std::isalnum(static_cast<unsigned char>(c)) && c != '-') {
      return InvalidArgument("AWS region \"" + o.region + "\" is not a region name");
    }
  }
  o.path_style = !o.endpoint.empty();
  if (auto style = env("DTE_S3_ADDRESSING_STYLE")) {
    if (*style != "path" && *style != "virtual") {
      return InvalidArgument("DTE_S3_ADDRESSING_STYLE is \"" + *style + "\"; use path or virtual");
    }
    o.path_style = *style == "path";
  }
  o.spool_dir = env("DTE_SPOOL_DIR").value_or("");
  RETURN_IF_ERROR(LoadTuning(env, &o));
  return o;
}

}  // namespace internal

Result<S3Options> S3OptionsFromEnvironment(const std::string& endpoint_override) {
  return internal::S3OptionsFromEnv(
      [](const char* name) -> std::optional<std::string> {
        const char* v = std::getenv(name);
        if (v == nullptr || *v == '\0') return std::nullopt;
        return std::string(v);
      },
      endpoint_override);
}

}  // namespace dte
