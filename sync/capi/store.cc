// The C ABI of dte_store: a store opened to read its versions, their
// tensor tables and their tensors.
#include "store/store.h"

#include <memory>
#include <string>

#include "store/hash.h"
#include "store/materialize.h"
#include "store/snapshot.h"
#include "sync/capi/c_api.h"
#include "sync/capi/internal/c_api_glue.h"
#include "sync/capi/internal/c_api_objects.h"

using dte::capi::Close;
using dte::capi::Fail;
using dte::capi::FailWith;
using dte::capi::Guard;
using dte::capi::Issue;
using dte::capi::OrEmpty;
using dte::capi::WithHandle;

int dte_store_open(const char* store, const char* cache_dir, dte_store** out) {
  return Guard([&] {
    if (store == nullptr || out == nullptr) {
      return FailWith(DTE_INVALID_ARGUMENT, "dte_store_open: store and out must be set");
    }
    dte::StoreOptions o;
    o.uri = store;
    o.cache_dir = OrEmpty(cache_dir);
    o.index_optional = true;
    auto opened = dte::Store::Open(o);
    if (!opened.ok()) return Fail(opened.status());
    *out = Issue(new dte_store{std::move(opened).value(), {}});
    return static_cast<int>(DTE_OK);
  });
}

int dte_store_close(dte_store* s) { return Close(s, __func__); }

int dte_store_latest(dte_store* h, int* has_version_out, uint64_t* version_out) {
  return WithHandle(h, __func__, [&](dte_store& s) {
    if (has_version_out == nullptr || version_out == nullptr) {
      return FailWith(DTE_INVALID_ARGUMENT, "dte_store_latest: arguments must be set");
    }
    auto latest = s.impl->Latest();
    if (!latest.ok()) return Fail(latest.status());
    *has_version_out = latest->has_value() ? 1 : 0;
    *version_out = latest->value_or(0);
    return static_cast<int>(DTE_OK);
  });
}

int dte_store_list_versions(dte_store* h, int32_t has_after, uint64_t after,
                            const uint64_t** versions_out, size_t* count_out) {
  return WithHandle(h, __func__, [&](dte_store& s) {
    if (versions_out == nullptr || count_out == nullptr) {
      return FailWith(DTE_INVALID_ARGUMENT, "dte_store_list_versions: arguments must be set");
    }
    auto committed = s.impl->ListCommitted();
    if (!committed.ok()) return Fail(committed.status());
    s.listed.clear();
    for (auto it = has_after ? committed->upper_bound(after) : committed->begin();
         it != committed->end(); ++it) {
      s.listed.push_back(it->first);
    }
    *versions_out = s.listed.data();
    *count_out = s.listed.size();
    return static_cast<int>(DTE_OK);
  });
}

int dte_store_version_tensors(dte_store* h, uint64_t version, dte_tensor_table** out) {
  return WithHandle(h, __func__, [&](dte_store& s) {
    if (out == nullptr) {
      return FailWith(DTE_INVALID_ARGUMENT, "dte_store_version_tensors: out must be set");
    }
    auto v = s.impl->GetVersion(version);
    if (!v.ok()) return Fail(v.status());
    auto table = std::make_unique<dte_tensor_table>();
    for (const dte::FileEntry& f : (*v)->manifest.files) {
      for (const dte::TensorEntry& t : f.tensors) {
        table->rows.push_back({t.name, dte::DTypeName(t.dtype), f.name, t.hash.Hex(), t.shape,
                               t.bytes(), f.header_size + t.begin});
      }
    }
    table->Seal();
    *out = Issue(table.release());
    return static_cast<int>(DTE_OK);
  });
}

int dte_store_read_tensor(dte_store* h, uint64_t version, const char* name, void* dst,
                          uint64_t bytes) {
  return WithHandle(h, __func__, [&](dte_store& s) {
    if (name == nullptr || (dst == nullptr && bytes > 0)) {
      return FailWith(DTE_INVALID_ARGUMENT, "dte_store_read_tensor: arguments must be set");
    }
    auto v = s.impl->GetVersion(version);
    if (!v.ok()) return Fail(v.status());
    auto at = (*v)->manifest.FindTensor(name);
    if (!at) {
      return FailWith(DTE_NOT_FOUND, "tensor " + std::string(name) + " is not in " +
                                         dte::VersionName(version) + " of store " + s.impl->uri());
    }
    const dte::FileEntry& f = *at->file;
    const dte::TensorEntry& t = *at->tensor;
    if (t.bytes() != bytes) {
      return FailWith(DTE_INVALID_ARGUMENT,
                      "tensor " + t.name + " of " + dte::VersionName(version) + " holds " +
                          std::to_string(t.bytes()) + " bytes, not " + std::to_string(bytes));
    }
    dte::Materializer reader(s.impl.get());
    // Chain walks start at this host's snapshots where there are some.
    std::unique_ptr<dte::SnapshotSet> snapshots = dte::OpenStoreSnapshots(*s.impl);
    reader.SetBase(snapshots.get());
    auto* out = static_cast<uint8_t*>(dst);
    dte::Status st = reader.ReadFile(*v, f, f.header_size + t.begin, bytes, out);
    if (!st.ok()) return Fail(st);
    if (dte::HashBytes(out, bytes) != t.hash) {
      return FailWith(DTE_CORRUPTION, "tensor " + t.name + " of " + dte::VersionName(version) +
                                          " does not match its content hash");
    }
    return static_cast<int>(DTE_OK);
  });
}
