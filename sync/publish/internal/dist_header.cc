#include "sync/publish/internal/dist_header.h"

#include <stdexcept>
#include <utility>

namespace dte::dist_internal {
namespace {

using json = nlohmann::json;

json OptJson(const std::optional<double>& v) { return v ? json(*v) : json(nullptr); }
std::optional<double> OptDouble(const json& j) {
  return j.is_null() ? std::nullopt : std::optional<double>(j.get<double>());
}

// An integer of the header: a JSON integer within T's range. Converting a
// float or an integer out of range would be undefined behaviour, and the
// bytes come from another process.
template <typename T>
T IntOf(const json& j, const char* what) {
  if (j.is_number_unsigned() && std::in_range<T>(j.get<uint64_t>())) {
    return static_cast<T>(j.get<uint64_t>());
  }
  if (j.is_number_integer() && !j.is_number_unsigned() && std::in_range<T>(j.get<int64_t>())) {
    return static_cast<T>(j.get<int64_t>());
  }
  throw std::out_of_range(std::string(what) + " " + j.dump() + " is not an integer in range");
}

}  // namespace

std::string EncodeHeader(const Header& h) {
  json j;
  j["error"] = h.error;
  j["fields"] = h.fields;
  j["latest"] = h.latest ? json(*h.latest) : json(nullptr);
  j["last_version"] = h.last_version ? json(*h.last_version) : json(nullptr);
  j["last_step"] = h.last_step ? json(*h.last_step) : json(nullptr);
  j["push"] = h.push;
  json ranges = json::array();
  for (const auto& r : h.ranges) {
    ranges.push_back({r.name, r.begin, r.end, r.state_step ? json(*r.state_step) : json(nullptr),
                      OptJson(r.lr), OptJson(r.wd), r.tp, r.ep});
  }
  j["ranges"] = std::move(ranges);
  return j.dump();
}

Result<Header> DecodeHeader(const std::string& text, int rank) {
  try {
    json j = json::parse(text);
    Header h;
    h.error = j.at("error").get<std::string>();
    h.fields = j.at("fields");
    if (!j.at("latest").is_null()) h.latest = IntOf<uint64_t>(j.at("latest"), "latest");
    if (!j.at("last_version").is_null()) {
      h.last_version = IntOf<uint64_t>(j.at("last_version"), "last_version");
    }
    if (!j.at("last_step").is_null()) h.last_step = IntOf<int64_t>(j.at("last_step"), "last_step");
    h.push = j.at("push").get<std::string>();
    for (const auto& r : j.at("ranges")) {
      Header::Range x;
      x.name = r.at(0).get<std::string>();
      x.begin = IntOf<uint64_t>(r.at(1), "a range's begin");
      x.end = IntOf<uint64_t>(r.at(2), "a range's end");
      if (!r.at(3).is_null()) x.state_step = IntOf<int64_t>(r.at(3), "a range's state step");
      x.lr = OptDouble(r.at(4));
      x.wd = OptDouble(r.at(5));
      x.tp = IntOf<int>(r.at(6), "a range's tp rank");
      x.ep = IntOf<int>(r.at(7), "a range's ep rank");
      h.ranges.push_back(std::move(x));
    }
    return h;
  } catch (const json::exception& e) {
    return Corruption("the publish header of rank " + std::to_string(rank) +
                      " is malformed: " + e.what());
  } catch (const std::out_of_range& e) {
    return Corruption("the publish header of rank " + std::to_string(rank) +
                      " is malformed: " + e.what());
  }
}

}  // namespace dte::dist_internal
