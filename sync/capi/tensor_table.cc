// The C ABI of dte_tensor_table: the tensors of one safetensors file as the
// store's parser reads its header, and the entries of a table (the tables
// of versions come from dte_store_version_tensors, sync/capi/store.cc); and
// dtype widths.
#include <memory>
#include <string>

#include "store/dtype.h"
#include "store/safetensors.h"
#include "sync/capi/c_api.h"
#include "sync/capi/internal/c_api_glue.h"
#include "sync/capi/internal/c_api_objects.h"

using dte::capi::Close;
using dte::capi::Fail;
using dte::capi::FailWith;
using dte::capi::Guard;
using dte::capi::Issue;
using dte::capi::WithHandle;

void dte_tensor_table::Seal() {
  entries.clear();
  entries.reserve(rows.size());
  for (const Row& r : rows) {
    entries.push_back(dte_tensor_info{r.name.c_str(), r.dtype.c_str(),
                                      static_cast<int32_t>(r.shape.size()), r.shape.data(), r.bytes,
                                      r.file.c_str(), r.offset, r.hash.c_str()});
  }
}

int dte_safetensors_tensors(const char* path, dte_tensor_table** out) {
  return Guard([&] {
    if (path == nullptr || out == nullptr) {
      return FailWith(DTE_INVALID_ARGUMENT, "dte_safetensors_tensors: path and out must be set");
    }
    auto header = dte::ReadSafetensorsHeader(path);
    if (!header.ok()) return Fail(header.status());
    const std::string p = path;
    const std::string file = p.substr(p.find_last_of('/') + 1);
    auto table = std::make_unique<dte_tensor_table>();
    for (const dte::TensorInfo& t : header->tensors) {
      table->rows.push_back({t.name, dte::DTypeName(t.dtype), file, "", t.shape, t.bytes(),
                             header->data_offset + t.begin});
    }
    table->Seal();
    *out = Issue(table.release());
    return static_cast<int>(DTE_OK);
  });
}

int dte_tensor_table_entries(dte_tensor_table* h, const dte_tensor_info** entries_out,
                             size_t* count_out) {
  return WithHandle(h, __func__, [&](dte_tensor_table& t) {
    if (entries_out == nullptr || count_out == nullptr) {
      return FailWith(DTE_INVALID_ARGUMENT, "dte_tensor_table_entries: arguments must be set");
    }
    *entries_out = t.entries.data();
    *count_out = t.entries.size();
    return static_cast<int>(DTE_OK);
  });
}

int dte_tensor_table_close(dte_tensor_table* t) { return Close(t, __func__); }

int dte_dtype_width(const char* dtype, int32_t* width_out) {
  return Guard([&] {
    if (dtype == nullptr || width_out == nullptr) {
      return FailWith(DTE_INVALID_ARGUMENT, "dte_dtype_width: dtype and width_out must be set");
    }
    auto parsed = dte::ParseDType(dtype);
    if (!parsed) {
      return FailWith(DTE_INVALID_ARGUMENT,
                      "dtype \"" + std::string(dtype) + "\" is not one dte knows");
    }
    *width_out = dte::DTypeWidth(*parsed);
    return static_cast<int>(DTE_OK);
  });
}
