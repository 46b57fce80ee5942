// The C ABI's handle checks (sync/capi/c_api.h, "Handles"): every exported
// function that takes a handle, called with every other kind of open
// handle, NULL, a closed handle and values the library never gave, answers
// DTE_INVALID_ARGUMENT and "FUNCTION: expected a KIND handle, got ...". The
// functions are the ones libdte.so exports (read from its dynamic symbol
// table), so a new function without a case here fails the test.
#include "sync/capi/internal/c_api_handles.h"

#include <elf.h>
#include <gtest/gtest.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "sync/capi/c_api.h"
#include "tests/testutil/checkpoint.h"
#include "tests/testutil/memory_store.h"
#include "tests/testutil/paths.h"

namespace dte {
namespace {

using capi::HandleKind;
using capi::KindName;

constexpr HandleKind kKinds[] = {
    HandleKind::kPublisher,    HandleKind::kStore, HandleKind::kTransport,  HandleKind::kPushServer,
    HandleKind::kPushReceiver, HandleKind::kLive,  HandleKind::kTensorTable};

// The exported functions of libdte.so named dte_*: its .dynsym entries that
// are defined global functions.
std::set<std::string> ExportedFunctions(const std::string& path, std::string* error) {
  std::ifstream f(path, std::ios::binary);
  std::string elf((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  std::set<std::string> names;
  if (elf.size() < sizeof(Elf64_Ehdr) || elf.compare(0, SELFMAG, ELFMAG) != 0) {
    *error = path + " is not an ELF file (build the dte_shared target)";
    return names;
  }
  const auto* eh = reinterpret_cast<const Elf64_Ehdr*>(elf.data());
  const auto* sections = reinterpret_cast<const Elf64_Shdr*>(elf.data() + eh->e_shoff);
  for (int i = 0; i < eh->e_shnum; ++i) {
    if (sections[i].sh_type != SHT_DYNSYM) continue;
    const char* strtab = elf.data() + sections[sections[i].sh_link].sh_offset;
    const auto* syms = reinterpret_cast<const Elf64_Sym*>(elf.data() + sections[i].sh_offset);
    for (size_t k = 0; k < sections[i].sh_size / sizeof(Elf64_Sym); ++k) {
      const Elf64_Sym& s = syms[k];
      std::string name = strtab + s.st_name;
      if (s.st_shndx != SHN_UNDEF && ELF64_ST_TYPE(s.st_info) == STT_FUNC &&
          ELF64_ST_BIND(s.st_info) == STB_GLOBAL && name.rfind("dte_", 0) == 0) {
        names.insert(name);
      }
    }
  }
  if (names.empty()) *error = path + " exports no dte_* function";
  return names;
}

// Exported functions that take no handle.
const std::set<std::string> kNoHandle = {"dte_last_error",
                                         "dte_c_api_version",
                                         "dte_code_transient",
                                         "dte_publisher_open",
                                         "dte_publisher_open_mcore",
                                         "dte_store_open",
                                         "dte_safetensors_tensors",
                                         "dte_dtype_width",
                                         "dte_transport_tcp",
                                         "dte_transport_callback",
                                         "dte_push_server_start",
                                         "dte_push_receiver_open",
                                         "dte_push_receiver_open_fp8",
                                         "dte_push_receiver_open_server",
                                         "dte_live_apply_version",
                                         "dte_live_get_status",
                                         "dte_live_open"};

int NoExchange(void*, const dte_message*, size_t, const dte_message*, size_t, char*, size_t) {
  return 0;
}

class CApiHandlesTest : public ::testing::Test {
 protected:
  // One open handle of each kind, and one of each kind closed.
  void SetUp() override {
    for (int round = 0; round < 2; ++round) {
      std::map<HandleKind, void*> opened;
      ASSERT_NO_FATAL_FAILURE(OpenAll(round, &opened));
      (round == 0 ? closed_ : open_) = opened;
    }
    for (auto& [kind, h] : closed_) ASSERT_EQ(CloseHandle(kind, h), DTE_OK) << dte_last_error();
  }

  void TearDown() override {
    for (auto& [kind, h] : open_) EXPECT_EQ(CloseHandle(kind, h), DTE_OK) << dte_last_error();
  }

  void OpenAll(int round, std::map<HandleKind, void*>* out) {
    std::string store = tmp_.path() + "/store" + std::to_string(round);
    std::string ckpt = tmp_.path() + "/ckpt" + std::to_string(round);
    test::TestCheckpoint c;
    test::TestSafetensors f{"model.safetensors", {}, {}};
    f.tensors.push_back({"w", DType::kBF16, {4, 4}, std::string(32, '\0')});
    c.safetensors.push_back(f);
    // Attention geometry, which a publisher with a push server needs.
    c.raw_files["config.json"] =
        "{\"model_type\": \"llama\", \"num_hidden_layers\": 1, \"hidden_size\": 4, "
        "\"num_attention_heads\": 1, \"num_key_value_heads\": 1, \"head_dim\": 4, "
        "\"intermediate_size\": 4, \"vocab_size\": 4}";
    ASSERT_TRUE(test::WriteCheckpoint(c, ckpt).ok());
    dte_publisher* pub = nullptr;
    ASSERT_EQ(dte_publisher_open(store.c_str(), nullptr, nullptr, &pub), DTE_OK)
        << dte_last_error();
    ASSERT_EQ(dte_publisher_import(pub, ckpt.c_str(), nullptr), DTE_OK) << dte_last_error();
    (*out)[HandleKind::kPublisher] = pub;
    dte_store* st = nullptr;
    ASSERT_EQ(dte_store_open(store.c_str(), nullptr, &st), DTE_OK) << dte_last_error();
    (*out)[HandleKind::kStore] = st;
    dte_tensor_table* table = nullptr;
    ASSERT_EQ(dte_store_version_tensors(st, 0, &table), DTE_OK) << dte_last_error();
    (*out)[HandleKind::kTensorTable] = table;
    dte_transport* t = nullptr;
    ASSERT_EQ(dte_transport_callback(0, 1, NoExchange, nullptr, &t), DTE_OK) << dte_last_error();
    (*out)[HandleKind::kTransport] = t;
    dte_push_server* server = nullptr;
    ASSERT_EQ(dte_push_server_start("127.0.0.1:0", nullptr, 2000, 0, -1, nullptr, nullptr, &server),
              DTE_OK)
        << dte_last_error();
    (*out)[HandleKind::kPushServer] = server;
    int32_t port = 0;
    ASSERT_EQ(dte_push_server_port(server, &port), DTE_OK);
    std::string address = "127.0.0.1:" + std::to_string(port);
    std::vector<uint16_t> w(16);
    int64_t shape[2] = {4, 4};
    dte_push_tensor tensor{"w", "BF16", 2, shape, w.data(), -1};
    dte_push_receiver* rx = nullptr;
    ASSERT_EQ(dte_push_receiver_open(address.c_str(), 0, 1, 0, 0, 0, 0, &tensor, 1, 0, 2000,
                                     nullptr, &rx),
              DTE_OK)
        << dte_last_error();
    receiver_tensors_.push_back(std::move(w));
    (*out)[HandleKind::kPushReceiver] = rx;
    // dte_live_open opens MOUNT/.dte/control; a plain file stands in for
    // a mount's (no ioctl reaches it here).
    std::string mount = tmp_.path() + "/mount" + std::to_string(round);
    ASSERT_EQ(
        std::system(("mkdir -p " + mount + "/.dte && touch " + mount + "/.dte/control").c_str()),
        0);
    dte_live* live = nullptr;
    ASSERT_EQ(dte_live_open(mount.c_str(), &live), DTE_OK) << dte_last_error();
    (*out)[HandleKind::kLive] = live;
  }

  static int CloseHandle(HandleKind kind, void* h) {
    switch (kind) {
      case HandleKind::kPublisher:
        return dte_publisher_close(static_cast<dte_publisher*>(h));
      case HandleKind::kStore:
        return dte_store_close(static_cast<dte_store*>(h));
      case HandleKind::kTensorTable:
        return dte_tensor_table_close(static_cast<dte_tensor_table*>(h));
      case HandleKind::kTransport:
        return dte_transport_close(static_cast<dte_transport*>(h));
      case HandleKind::kPushServer:
        return dte_push_server_close(static_cast<dte_push_server*>(h));
      case HandleKind::kPushReceiver:
        return dte_push_receiver_close(static_cast<dte_push_receiver*>(h));
      case HandleKind::kLive:
        return dte_live_close(static_cast<dte_live*>(h));
    }
    return -1;
  }

  // One handle argument of a function: the kind it takes, and a call with
  // `h` there and valid values everywhere else.
  struct Slot {
    HandleKind kind;
    std::function<int(void* h)> call;
    bool null_ok = false;  // NULL means none (set_push's server)
  };

  template <typename T>
  T* Open(HandleKind kind) {
    return static_cast<T*>(open_.at(kind));
  }

  std::map<std::string, std::vector<Slot>> Cases();
  std::map<std::string, std::vector<Slot>> PublisherCases();
  std::map<std::string, std::vector<Slot>> OtherCases();

  // Calls slot with `h` and checks the answer starts with
  // "fn: expected a KIND handle, got " + `got`.
  void ExpectRefused(const std::string& fn, const Slot& slot, void* h, const std::string& got) {
    SCOPED_TRACE(fn + " with " + got);
    EXPECT_EQ(slot.call(h), DTE_INVALID_ARGUMENT);
    std::string want = fn + ": expected a " + KindName(slot.kind) + " handle, got " + got;
    EXPECT_EQ(std::string(dte_last_error()).substr(0, want.size()), want) << dte_last_error();
  }

  size_t OpenCount() {
    size_t n = 0;
    for (HandleKind k : kKinds) n += capi::HandleTable::Global().Count(k);
    return n;
  }

  test::ScopedTempDir tmp_;
  std::map<HandleKind, void*> open_, closed_;
  std::vector<std::vector<uint16_t>> receiver_tensors_;
  dte_adamw_step step_{1e-4, 0.9, 0.999, 1e-8, 1e-2, 1, 0, 0, DTE_ORDER_TORCH_CPU};
  dte_publish_result result_{};
  const char* text_ = nullptr;
  int32_t i32_ = 0;
  int has_ = 0;
  uint64_t u64_ = 0;
  dte_dist_stats stats_{};
  dte_push_receiver_status rx_status_{};
  dte_live_register register_{};
  char byte_ = 0;
  const uint64_t* versions_ = nullptr;
  size_t size_ = 0;
  dte_tensor_table* table_ = nullptr;  // never set: every call is refused
  const dte_tensor_info* entries_ = nullptr;
};

// The cases of the publisher calls, then of the push, store, transport and
// live calls.
auto CApiHandlesTest::Cases() -> std::map<std::string, std::vector<Slot>> {
  auto cases = PublisherCases();
  cases.merge(OtherCases());
  return cases;
}

auto CApiHandlesTest::PublisherCases() -> std::map<std::string, std::vector<Slot>> {
  using P = dte_publisher;
  using S = dte_push_server;
  auto pub = HandleKind::kPublisher, server = HandleKind::kPushServer;
  auto transport = HandleKind::kTransport;
  auto* t = Open<dte_transport>(transport);
  const char* names[] = {"rank"};
  const char* values[] = {"0"};
  return {
      {"dte_publisher_close", {{pub, [](void* h) { return dte_publisher_close((P*)h); }}}},
      {"dte_publisher_import",
       {{pub, [=, this](void* h) { return dte_publisher_import((P*)h, "/nonexistent", &u64_); }}}},
      {"dte_publisher_set_anchor_policy",
       {{pub, [](void* h) { return dte_publisher_set_anchor_policy((P*)h, 1.0, 0); }}}},
      {"dte_publisher_set_join_budget",
       {{pub, [](void* h) { return dte_publisher_set_join_budget((P*)h, 0.1); }}}},
      {"dte_publisher_publish_adamw",
       {{pub,
         [=, this](void* h) {
           return dte_publisher_publish_adamw((P*)h, &step_, nullptr, 0, &result_);
         }}}},
      {"dte_publisher_publish_weights",
       {{pub,
         [=, this](void* h) {
           return dte_publisher_publish_weights((P*)h, -1, nullptr, 0, &result_);
         }}}},
      {"dte_publisher_weights_begin",
       {{pub, [](void* h) { return dte_publisher_weights_begin((P*)h, -1); }}}},
      {"dte_publisher_weights_add",
       {{pub,
         [](void* h) {
           static const int64_t shape[] = {1};
           static const uint16_t one = 0x3F80;
           const dte_weights_tensor w{"w", {&one, DTE_DTYPE_BF16, 1, shape}};
           return dte_publisher_weights_add((P*)h, &w);
         }}}},
      {"dte_publisher_weights_commit",
       {{pub, [=, this](void* h) { return dte_publisher_weights_commit((P*)h, &result_); }}}},
      {"dte_publisher_publish_adamw_mcore",
       {{pub,
         [=, this](void* h) {
           return dte_publisher_publish_adamw_mcore((P*)h, &step_, nullptr, 0, &result_);
         }}}},
      {"dte_publisher_set_push",
       {{pub, [=, this](void* h) { return dte_publisher_set_push((P*)h, Open<S>(server)); }},
        {server, [=, this](void* h) { return dte_publisher_set_push(Open<P>(pub), (S*)h); },
         true}}},
      {"dte_publisher_last_push_json",
       {{pub, [=, this](void* h) { return dte_publisher_last_push_json((P*)h, &text_); }}}},
      {"dte_publisher_metrics_text",
       {{pub, [=, this](void* h) { return dte_publisher_metrics_text((P*)h, &text_); }}}},
      {"dte_publisher_serve_metrics",
       {{pub, [=, this](void* h) { return dte_publisher_serve_metrics((P*)h, "0", &i32_); }}}},
      {"dte_publisher_push_metrics",
       {{pub,
         [=](void* h) {
           return dte_publisher_push_metrics((P*)h, "127.0.0.1:1", "job", names, values, 1);
         }}}},
      {"dte_publisher_set_group",
       {{pub, [=](void* h) { return dte_publisher_set_group((P*)h, 0, 1, t); }},
        {transport,
         [=, this](void* h) {
           return dte_publisher_set_group(Open<P>(pub), 0, 1, (dte_transport*)h);
         },
         true}}},
      {"dte_publisher_publish_ranges",
       {{pub,
         [=, this](void* h) {
           return dte_publisher_publish_ranges((P*)h, &step_, nullptr, 0, &result_);
         }}}},
      {"dte_publisher_last_stats",
       {{pub, [=, this](void* h) { return dte_publisher_last_stats((P*)h, &stats_); }}}},
      {"dte_publisher_share_push",
       {{pub, [](void* h) { return dte_publisher_share_push((P*)h); }}}},
      {"dte_transport_store",
       {{pub,
         [=](void* h) {
           dte_transport* out = nullptr;
           return dte_transport_store((P*)h, 0, 1, "job", 1000, &out);
         }}}},
      {"dte_transport_close",
       {{transport, [](void* h) { return dte_transport_close((dte_transport*)h); }}}},
  };
}

auto CApiHandlesTest::OtherCases() -> std::map<std::string, std::vector<Slot>> {
  using S = dte_push_server;
  using R = dte_push_receiver;
  auto server = HandleKind::kPushServer, rx = HandleKind::kPushReceiver;
  auto store = HandleKind::kStore, live = HandleKind::kLive;
  auto table = HandleKind::kTensorTable;
  return {
      {"dte_push_server_close", {{server, [](void* h) { return dte_push_server_close((S*)h); }}}},
      {"dte_push_server_port",
       {{server, [=, this](void* h) { return dte_push_server_port((S*)h, &i32_); }}}},
      {"dte_push_server_address",
       {{server, [=, this](void* h) { return dte_push_server_address((S*)h, &text_); }}}},
      {"dte_push_server_set_group",
       {{server, [](void* h) { return dte_push_server_set_group((S*)h, 0, 1); }}}},
      {"dte_push_server_status_json",
       {{server, [=, this](void* h) { return dte_push_server_status_json((S*)h, 0, &text_); }}}},
      {"dte_push_receiver_close", {{rx, [](void* h) { return dte_push_receiver_close((R*)h); }}}},
      {"dte_push_receiver_apply_pending",
       {{rx, [=, this](void* h) { return dte_push_receiver_apply_pending((R*)h, &u64_); }}}},
      {"dte_push_receiver_wait_for",
       {{rx, [](void* h) { return dte_push_receiver_wait_for((R*)h, 0, 10); }}}},
      {"dte_push_receiver_catch_up",
       {{rx,
         [=, this](void* h) {
           return dte_push_receiver_catch_up((R*)h, Open<dte_store>(store), 1, 0);
         }},
        {store,
         [=, this](void* h) {
           return dte_push_receiver_catch_up(Open<R>(rx), (dte_store*)h, 1, 0);
         }}}},
      {"dte_push_receiver_get_status",
       {{rx,
         [=, this](void* h) { return dte_push_receiver_get_status((R*)h, &rx_status_, &text_); }}}},
      {"dte_push_receiver_move_to",
       {{rx, [=, this](
                 void* h) { return dte_push_receiver_move_to((R*)h, Open<dte_store>(store), 1); }},
        {store,
         [=, this](void* h) { return dte_push_receiver_move_to(Open<R>(rx), (dte_store*)h, 1); }}}},
      {"dte_push_receiver_path",
       {{rx, [=, this](void* h) { return dte_push_receiver_path((R*)h, &u64_, 1, &size_); }}}},
      {"dte_push_receiver_apply_agreed",
       {{rx,
         [=, this](void* h) {
           return dte_push_receiver_apply_agreed((R*)h, &u64_, &size_, 1, &u64_);
         }}}},
      {"dte_push_receiver_server_status",
       {{rx,
         [=, this](void* h) {
           return dte_push_receiver_server_status((R*)h, &i32_, &u64_, &i32_, &text_);
         }}}},
      {"dte_store_close", {{store, [](void* h) { return dte_store_close((dte_store*)h); }}}},
      {"dte_store_latest",
       {{store, [=, this](void* h) { return dte_store_latest((dte_store*)h, &has_, &u64_); }}}},
      {"dte_store_read_tensor",
       {{store,
         [=, this](void* h) { return dte_store_read_tensor((dte_store*)h, 0, "w", &byte_, 1); }}}},
      {"dte_store_list_versions",
       {{store,
         [=, this](void* h) {
           return dte_store_list_versions((dte_store*)h, 0, 0, &versions_, &size_);
         }}}},
      {"dte_store_version_tensors",
       {{store,
         [=, this](void* h) { return dte_store_version_tensors((dte_store*)h, 0, &table_); }}}},
      {"dte_tensor_table_entries",
       {{table,
         [=, this](void* h) {
           return dte_tensor_table_entries((dte_tensor_table*)h, &entries_, &size_);
         }}}},
      {"dte_tensor_table_close",
       {{table, [](void* h) { return dte_tensor_table_close((dte_tensor_table*)h); }}}},
      {"dte_live_register_buffer",
       {{live, [=, this](void* h) { return dte_live_register_buffer((dte_live*)h, &register_); }}}},
      {"dte_live_unregister",
       {{live, [](void* h) { return dte_live_unregister((dte_live*)h, 0); }}}},
      {"dte_live_prepare",
       {{live,
         [](void* h) {
           uint32_t id = 0;
           return dte_live_prepare((dte_live*)h, DTE_LIVE_LATEST, &id, nullptr);
         }}}},
      {"dte_live_commit",
       {{live, [](void* h) { return dte_live_commit((dte_live*)h, 1, nullptr); }}}},
      {"dte_live_abort", {{live, [](void* h) { return dte_live_abort((dte_live*)h, 1); }}}},
      {"dte_live_close", {{live, [](void* h) { return dte_live_close((dte_live*)h); }}}},
  };
}

TEST_F(CApiHandlesTest, EveryExportedFunctionHasACase) {
  const char* build = test::BuildDir();
  std::string error;
  std::set<std::string> exported =
      ExportedFunctions(std::string(build) + "/sync/libdte.so", &error);
  ASSERT_TRUE(error.empty()) << error;
  auto cases = Cases();
  for (const std::string& fn : exported) {
    EXPECT_TRUE(cases.count(fn) + kNoHandle.count(fn) == 1)
        << fn << " is exported by libdte.so but has no wrong-handle case in " << __FILE__
        << " (or is not listed in kNoHandle)";
  }
  for (const auto& [fn, slots] : cases) {
    EXPECT_TRUE(exported.count(fn)) << fn << " has a case but libdte.so does not export it";
  }
}

TEST_F(CApiHandlesTest, EveryHandleArgumentRefusesWhatIsNotItsKind) {
  size_t open_before = OpenCount();
  std::string local;
  for (const auto& [fn, slots] : Cases()) {
    for (const Slot& slot : slots) {
      for (HandleKind other : kKinds) {
        if (other == slot.kind) continue;
        ExpectRefused(fn, slot, open_.at(other), std::string("a ") + KindName(other) + " (0x");
      }
      if (slot.null_ok) {
        EXPECT_EQ(slot.call(nullptr), DTE_OK) << fn << ": " << dte_last_error();
      } else {
        ExpectRefused(fn, slot, nullptr, "NULL");
      }
      ExpectRefused(fn, slot, closed_.at(slot.kind),
                    std::string("a ") + KindName(slot.kind) + " that is closed already");
      // A forged token, and a real address (of an object the library never saw).
      ExpectRefused(fn, slot, reinterpret_cast<void*>(0xdeadbeef0), "0xdeadbeef0, which is no");
      ExpectRefused(fn, slot, &local, "0x");
    }
  }
  // No refused close closed anything.
  EXPECT_EQ(OpenCount(), open_before);
  for (auto& [kind, h] : open_) {
    EXPECT_EQ(capi::HandleTable::Global().Count(kind), 1u) << KindName(kind);
  }
}

TEST_F(CApiHandlesTest, ClosingTwiceIsAnError) {
  dte_store* s = nullptr;
  ASSERT_EQ(dte_store_open((tmp_.path() + "/store1").c_str(), nullptr, &s), DTE_OK);
  EXPECT_EQ(dte_store_close(s), DTE_OK);
  EXPECT_EQ(dte_store_close(s), DTE_INVALID_ARGUMENT);
  EXPECT_NE(std::string(dte_last_error())
                .find("dte_store_close: expected a dte_store handle, "
                      "got a dte_store that is closed already"),
            std::string::npos)
      << dte_last_error();
  // A later open gets a new token: the closed one stays closed.
  dte_store* again = nullptr;
  ASSERT_EQ(dte_store_open((tmp_.path() + "/store1").c_str(), nullptr, &again), DTE_OK);
  EXPECT_NE(again, s);
  int has = 0;
  EXPECT_EQ(dte_store_latest(s, &has, &u64_), DTE_INVALID_ARGUMENT);
  EXPECT_EQ(dte_store_latest(again, &has, &u64_), DTE_OK) << dte_last_error();
  EXPECT_EQ(dte_store_close(again), DTE_OK);
}

TEST_F(CApiHandlesTest, ACloseRacingCallsLeavesThemWholeOrRefused) {
  for (int round = 0; round < 20; ++round) {
    dte_store* s = nullptr;
    ASSERT_EQ(dte_store_open((tmp_.path() + "/store1").c_str(), nullptr, &s), DTE_OK);
    std::atomic<int> ok{0}, refused{0}, other{0};
    std::vector<std::thread> callers;
    for (int i = 0; i < 4; ++i) {
      callers.emplace_back([&] {
        for (int k = 0; k < 50; ++k) {
          int has = 0;
          uint64_t v = 0;
          int rc = dte_store_latest(s, &has, &v);
          (rc == DTE_OK && has == 1 && v == 0 ? ok
           : rc == DTE_INVALID_ARGUMENT       ? refused
                                              : other)++;
        }
      });
    }
    EXPECT_EQ(dte_store_close(s), DTE_OK);
    for (auto& c : callers) c.join();
    EXPECT_EQ(other.load(), 0);
    EXPECT_EQ(ok.load() + refused.load(), 200);
  }
}

TEST_F(CApiHandlesTest, AServerSetOnAPublisherOutlivesItsClose) {
  dte_push_server* s = nullptr;
  ASSERT_EQ(dte_push_server_start("127.0.0.1:0", nullptr, 2000, 0, -1, nullptr, nullptr, &s),
            DTE_OK);
  auto* pub = Open<dte_publisher>(HandleKind::kPublisher);
  ASSERT_EQ(dte_publisher_set_push(pub, s), DTE_OK) << dte_last_error();
  EXPECT_EQ(dte_push_server_close(s), DTE_OK);
  EXPECT_EQ(dte_push_server_port(s, &i32_), DTE_INVALID_ARGUMENT);
  // The publisher still holds the server: a publish with no changes
  // pushes through it (nothing to free under it), then unsetting drops it.
  EXPECT_EQ(dte_publisher_publish_adamw(pub, &step_, nullptr, 0, &result_), DTE_OK)
      << dte_last_error();
  EXPECT_EQ(dte_publisher_set_push(pub, nullptr), DTE_OK);
}

}  // namespace
}  // namespace dte
