// The objects behind the C ABI's handles (sync/capi/c_api.h declares them
// opaque). The C ABI hands out tokens of dte::capi::HandleTable, never these
// addresses; members a handle keeps alive (another handle's object) come
// first, so that they outlive impl.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "store/store.h"
#include "sync/capi/c_api.h"
#include "sync/live/live_client.h"
#include "sync/publish/publisher.h"
#include "sync/push/push_receiver.h"
#include "sync/push/push_server.h"
#include "sync/transport/transport.h"

struct dte_transport;

struct dte_publisher {
  std::shared_ptr<dte_push_server> push;  // set by dte_publisher_set_push
  // Set by dte_publisher_set_group; let go of by dte_publisher_close (a
  // store transport of this publisher holds it in turn).
  std::shared_ptr<dte_transport> exchange;
  std::unique_ptr<dte::Publisher> impl;
  std::string last_push = "null";  // dte_publisher_last_push_json
  std::string metrics;             // dte_publisher_metrics_text
};

struct dte_push_server {
  std::unique_ptr<dte::PushServer> impl;
  std::string json;
};

struct dte_push_receiver {
  std::unique_ptr<dte::PushReceiver> impl;
  std::string error, server_error;
};

struct dte_store {
  std::unique_ptr<dte::Store> impl;
  std::vector<uint64_t> listed;  // dte_store_list_versions
};

// The rows own the strings and shapes the entries point into; the entries
// are made once every row is in (Seal), and neither changes after.
struct dte_tensor_table {
  struct Row {
    std::string name, dtype, file, hash;  // hash: "" where not known
    std::vector<int64_t> shape;
    uint64_t bytes = 0, offset = 0;
  };
  std::vector<Row> rows;
  std::vector<dte_tensor_info> entries;
  void Seal();  // sync/capi/tensor_table.cc
};

struct dte_transport {
  std::shared_ptr<dte_publisher> store_of;  // dte_transport_store: whose store it uses
  std::unique_ptr<dte::Transport> impl;
};

struct dte_live {
  dte::live::Control impl;
};
