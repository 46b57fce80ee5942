#include "store/internal/s3_config.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "tests/testutil/memory_store.h"

namespace dte::internal {
namespace {

// A fake environment with HOME in a temporary directory.
class Env {
 public:
  Env() { vars_["HOME"] = home_.path(); }
  void Set(const std::string& name, const std::string& value) { vars_[name] = value; }
  void WriteFile(const std::string& rel, const std::string& text) {
    std::filesystem::create_directories(
        std::filesystem::path(home_.path() + "/" + rel).parent_path());
    std::ofstream(home_.path() + "/" + rel) << text;
  }
  const std::string& home() const { return home_.path(); }
  Result<S3Options> Options(const std::string& endpoint = "") const {
    return S3OptionsFromEnv(
        [this](const char* name) -> std::optional<std::string> {
          auto it = vars_.find(name);
          if (it == vars_.end() || it->second.empty()) return std::nullopt;
          return it->second;
        },
        endpoint);
  }

 private:
  test::ScopedTempDir home_;
  std::map<std::string, std::string> vars_;
};

constexpr const char* kCredentials = R"(
# comment
; another comment
[default]
aws_access_key_id = AKIDDEFAULT
aws_secret_access_key=default/secret+key
[ci]
  AWS_ACCESS_KEY_ID =  AKIDCI
  aws_secret_access_key = ci-secret
  aws_session_token = ci-token==
[broken]
aws_access_key_id = AKIDONLY
garbage line without equals
)";

TEST(S3Config, ParseIniReadsSectionsAndIgnoresJunk) {
  IniFile ini =
      ParseIni("x = before any section\n[a]\nk=v\n[ b ]\nk = 1\nk = 2\n[unclosed\nz=9\r\n");
  EXPECT_EQ(ini.size(), 2u);
  EXPECT_EQ(ini["a"]["k"], "v");
  EXPECT_EQ(ini["b"]["k"], "2");  // later duplicates win
  EXPECT_EQ(ini["b"]["z"], "9");  // a broken header leaves the section as it was
  EXPECT_TRUE(ParseIni("").empty());
}

TEST(S3Config, DefaultsWithNothingConfigured) {
  Env env;
  auto o = env.Options();
  ASSERT_TRUE(o.ok()) << o.status().ToString();
  EXPECT_EQ(o->endpoint, "");
  EXPECT_EQ(o->region, "us-east-1");
  EXPECT_EQ(o->access_key, "");  // anonymous
  EXPECT_FALSE(o->path_style);   // AWS: virtual-hosted
  EXPECT_EQ(o->spool_dir, "");
}

TEST(S3Config, EnvironmentKeysWinOverTheCredentialsFile) {
  Env env;
  env.WriteFile(".aws/credentials", kCredentials);
  env.Set("AWS_ACCESS_KEY_ID", "AKIDENV");
  env.Set("AWS_SECRET_ACCESS_KEY", "env-secret");
  env.Set("AWS_SESSION_TOKEN", "env-token");
  env.Set("AWS_PROFILE", "ci");
  auto o = env.Options();
  ASSERT_TRUE(o.ok()) << o.status().ToString();
  EXPECT_EQ(o->access_key, "AKIDENV");
  EXPECT_EQ(o->secret_key, "env-secret");
  EXPECT_EQ(o->session_token, "env-token");
}

TEST(S3Config, ReadsTheDefaultAndNamedProfiles) {
  Env env;
  env.WriteFile(".aws/credentials", kCredentials);
  auto def = env.Options();
  ASSERT_TRUE(def.ok()) << def.status().ToString();
  EXPECT_EQ(def->access_key, "AKIDDEFAULT");
  EXPECT_EQ(def->secret_key, "default/secret+key");
  EXPECT_EQ(def->session_token, "");
  env.Set("AWS_PROFILE", "ci");
  auto ci = env.Options();
  ASSERT_TRUE(ci.ok()) << ci.status().ToString();
  EXPECT_EQ(ci->access_key, "AKIDCI");
  EXPECT_EQ(ci->secret_key, "ci-secret");
  EXPECT_EQ(ci->session_token, "ci-token==");
}

TEST(S3Config, SharedFileLocationsComeFromTheEnvironment) {
  Env env;
  env.WriteFile("elsewhere/creds", "[p]\naws_access_key_id=A\naws_secret_access_key=S\n");
  env.WriteFile("elsewhere/config", "[profile p]\nregion = eu-west-3\n");
  env.Set("AWS_SHARED_CREDENTIALS_FILE", env.home() + "/elsewhere/creds");
  env.Set("AWS_CONFIG_FILE", env.home() + "/elsewhere/config");
  env.Set("AWS_DEFAULT_PROFILE", "p");
  auto o = env.Options();
  ASSERT_TRUE(o.ok()) << o.status().ToString();
  EXPECT_EQ(o->access_key, "A");
  EXPECT_EQ(o->region, "eu-west-3");
}

TEST(S3Config, MissingOrHalfProfilesAreErrorsWithoutSecrets) {
  Env env;
  env.WriteFile(".aws/credentials", kCredentials);
  env.Set("AWS_PROFILE", "nope");
  auto missing = env.Options();
  ASSERT_EQ(missing.status().code(), Code::kInvalidArgument);
  EXPECT_NE(missing.status().message().find("\"nope\""), std::string::npos);
  EXPECT_NE(missing.status().message().find(".aws/credentials"), std::string::npos);
  env.Set("AWS_PROFILE", "broken");
  auto half = env.Options();
  ASSERT_EQ(half.status().code(), Code::kInvalidArgument);
  EXPECT_NE(half.status().message().find("only one of"), std::string::npos);
  EXPECT_EQ(half.status().message().find("AKIDONLY"), std::string::npos);

  Env env2;
  env2.Set("AWS_SECRET_ACCESS_KEY", "lonely-secret");
  auto half_env = env2.Options();
  ASSERT_EQ(half_env.status().code(), Code::kInvalidArgument);
  EXPECT_NE(half_env.status().message().find("AWS_ACCESS_KEY_ID is not"), std::string::npos);
  EXPECT_EQ(half_env.status().message().find("lonely-secret"), std::string::npos);
}

TEST(S3Config, RegionEndpointAndAddressingStyle) {
  Env env;
  env.WriteFile(".aws/config", "[default]\nregion = ap-south-1\nendpoint_url = http://cfg:1\n");
  auto from_config = env.Options();
  ASSERT_TRUE(from_config.ok());
  EXPECT_EQ(from_config->region, "ap-south-1");
  EXPECT_EQ(from_config->endpoint, "http://cfg:1");
  EXPECT_TRUE(from_config->path_style);

  env.Set("AWS_DEFAULT_REGION", "eu-north-1");
  EXPECT_EQ(env.Options()->region, "eu-north-1");
  env.Set("AWS_REGION", "us-west-2");
  EXPECT_EQ(env.Options()->region, "us-west-2");

  env.Set("AWS_ENDPOINT_URL", "http://generic:2");
  EXPECT_EQ(env.Options()->endpoint, "http://generic:2");
  env.Set("AWS_ENDPOINT_URL_S3", "http://s3only:3");
  EXPECT_EQ(env.Options()->endpoint, "http://s3only:3");
  EXPECT_EQ(env.Options("http://flag:4")->endpoint, "http://flag:4");

  env.Set("DTE_S3_ADDRESSING_STYLE", "virtual");
  EXPECT_FALSE(env.Options()->path_style);
  env.Set("DTE_S3_ADDRESSING_STYLE", "sideways");
  EXPECT_EQ(env.Options().status().code(), Code::kInvalidArgument);
  env.Set("DTE_S3_ADDRESSING_STYLE", "");
  env.Set("AWS_REGION", "us-east-1:evil");
  EXPECT_EQ(env.Options().status().code(), Code::kInvalidArgument);
}

TEST(S3Config, TuningVariablesOverrideTheDefaults) {
  Env env;
  const S3Options defaults = *env.Options();
  EXPECT_EQ(defaults.retry.max_attempts, S3RetryPolicy{}.max_attempts);
  EXPECT_EQ(defaults.part_size, S3Options{}.part_size);
  env.Set("DTE_S3_MAX_ATTEMPTS", "3");
  env.Set("DTE_S3_RETRY_BASE_MS", "0");
  env.Set("DTE_S3_RETRY_MAX_MS", "40");
  env.Set("DTE_S3_LOW_SPEED_TIME", "2");
  env.Set("DTE_S3_LOW_SPEED_LIMIT", "4096");
  env.Set("DTE_S3_CONNECT_TIMEOUT_MS", "1500");
  env.Set("DTE_S3_PART_SIZE", "6MiB");
  env.Set("DTE_S3_PARALLEL_PARTS", "2");
  auto o = env.Options();
  ASSERT_TRUE(o.ok()) << o.status().ToString();
  EXPECT_EQ(o->retry.max_attempts, 3);
  EXPECT_EQ(o->retry.base_delay.count(), 0);
  EXPECT_EQ(o->retry.max_delay.count(), 40);
  EXPECT_EQ(o->low_speed_time.count(), 2);
  EXPECT_EQ(o->low_speed_limit, 4096);
  EXPECT_EQ(o->connect_timeout.count(), 1500);
  EXPECT_EQ(o->part_size, uint64_t{6} << 20);
  EXPECT_EQ(o->parallel_parts, 2);
}

TEST(S3Config, BadTuningValueNamesTheVariable) {
  for (const auto& [name, value] :
       std::vector<std::pair<std::string, std::string>>{{"DTE_S3_MAX_ATTEMPTS", "0"},
                                                        {"DTE_S3_MAX_ATTEMPTS", "three"},
                                                        {"DTE_S3_RETRY_BASE_MS", "-5"},
                                                        {"DTE_S3_LOW_SPEED_TIME", "99999999999999"},
                                                        {"DTE_S3_PARALLEL_PARTS", "65"},
                                                        {"DTE_S3_PART_SIZE", "1MiB"},
                                                        {"DTE_S3_PART_SIZE", "lots"}}) {
    Env env;
    env.Set(name, value);
    auto o = env.Options();
    ASSERT_FALSE(o.ok()) << name << "=" << value;
    EXPECT_EQ(o.status().code(), Code::kInvalidArgument);
    EXPECT_NE(o.status().message().find(name), std::string::npos) << o.status().message();
  }
}

}  // namespace
}  // namespace dte::internal
