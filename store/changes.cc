#include "store/changes.h"

#include <algorithm>
#include <cstring>

#include "kernels/width.h"
#include "store/store.h"

namespace dte {
namespace {

template <int W>
void DifferingIn(const uint8_t* a, const uint8_t* b, size_t begin, size_t end,
                 std::vector<uint32_t>* idx) {
  using U = typename kernels::ElementBits<W>::type;
  for (size_t i = begin; i < end; ++i) {
    U x, y;
    std::memcpy(&x, a + i * W, W);
    std::memcpy(&y, b + i * W, W);
    if (x != y) idx->push_back(static_cast<uint32_t>(i));
  }
}

// Eight bytes at a time: changes are sparse, so most words are equal and
// skipped whole.
template <int W>
void DifferingTyped(const uint8_t* a, const uint8_t* b, size_t n, std::vector<uint32_t>* idx) {
  constexpr size_t kPerWord = 8 / W;
  const size_t words = n / kPerWord;
  for (size_t k = 0; k < words; ++k) {
    uint64_t x, y;
    std::memcpy(&x, a + k * 8, 8);
    std::memcpy(&y, b + k * 8, 8);
    if (x != y) DifferingIn<W>(a, b, k * kPerWord, (k + 1) * kPerWord, idx);
  }
  DifferingIn<W>(a, b, words * kPerWord, n, idx);
}

void AppendBytes(std::vector<uint8_t>* to, const uint8_t* from, size_t n) {
  to->insert(to->end(), from, from + n);
}

}  // namespace

Status DecodeRecordEntries(std::string_view blob, const BlockRecord& rec, size_t len, int width,
                           BlockEntries* out, CodecScratch* scratch, const std::string& what) {
  if (rec.offset > blob.size() || rec.length > blob.size() - rec.offset) {
    return Corruption(what + ": record lies outside its blob");
  }
  return DecodeSparseEntries(blob.substr(rec.offset, rec.length), len, width, &out->idx, &out->vals,
                             &out->whole, scratch, what);
}

void DifferingElements(const uint8_t* a, const uint8_t* b, size_t len, int width,
                       std::vector<uint32_t>* idx) {
  const size_t n = len / static_cast<size_t>(width);
  kernels::DispatchWidth(width, [&](auto w) { DifferingTyped<w.value>(a, b, n, idx); });
}

Result<std::unique_ptr<VersionChangesReader>> VersionChangesReader::Open(
    Store& store, std::shared_ptr<const Version> v) {
  if (!v->manifest.parent) {
    return InvalidArgument(VersionName(v->manifest.version) + " has no parent: it is not a change");
  }
  ASSIGN_OR_RETURN(auto parent, store.GetVersion(*v->manifest.parent));
  return std::unique_ptr<VersionChangesReader>(
      new VersionChangesReader(store, std::move(v), std::move(parent)));
}

VersionChangesReader::VersionChangesReader(Store& store, std::shared_ptr<const Version> v,
                                           std::shared_ptr<const Version> parent)
    : v_(std::move(v)), parent_(std::move(parent)), reader_(&store) {}

bool VersionChangesReader::MayChange(const std::string& name) const {
  auto at = v_->manifest.FindTensor(name);
  if (!at) return false;
  const TensorEntry& t = *at->tensor;
  for (uint32_t b = 0; b < t.blocks; ++b) {
    if (v_->records[size_t{t.first_block} + b].kind != BlockKind::kSame) return true;
  }
  return false;
}

Result<const TensorChanges*> VersionChangesReader::Read(const std::string& name) {
  c_ = TensorChanges{};
  c_.name = name;
  auto at = v_->manifest.FindTensor(name);
  if (!at) return &c_;
  const FileEntry& f = *at->file;
  const TensorEntry& t = *at->tensor;
  const uint64_t bb = v_->manifest.block_bytes;
  const int w = DTypeWidth(t.dtype);
  for (uint32_t b = 0; b < t.blocks; ++b) {
    const BlockRecord& rec = v_->records[size_t{t.first_block} + b];
    if (rec.kind == BlockKind::kSame) continue;
    const size_t len = static_cast<size_t>(std::min<uint64_t>(bb, t.bytes() - uint64_t{b} * bb));
    const uint64_t first = uint64_t{b} * (bb / static_cast<uint64_t>(w));
    if (rec.kind == BlockKind::kSparse) {
      const std::string what = VersionName(v_->manifest.version) + "/" + f.name + ": tensor " +
                               t.name + " block " + std::to_string(b);
      RETURN_IF_ERROR(ReadSparse(rec, first, len, w, what));
    } else {
      RETURN_IF_ERROR(CompareDense(f, t, b, first, len, w));
    }
  }
  return &c_;
}

// Differences where the record has them (over an old value of 0, so that
// values - old_values is the difference), whole values where not.
Status VersionChangesReader::ReadSparse(const BlockRecord& rec, uint64_t first, size_t len,
                                        int width, const std::string& what) {
  RETURN_IF_ERROR(reader_.ReadRecordPayload(*v_, rec, &payload_, what));
  RETURN_IF_ERROR(DecodeSparseEntries(payload_, len, width, &entries_.idx, &entries_.vals,
                                      &entries_.whole, nullptr, what));
  const auto w = static_cast<size_t>(width);
  for (size_t k = 0; k < entries_.idx.size(); ++k) {
    c_.indices.push_back(first + entries_.idx[k]);
    AppendBytes(&c_.values, entries_.vals.data() + k * w, w);
    c_.old_values.insert(c_.old_values.end(), w, 0);
    c_.known.push_back(entries_.whole.empty() || !entries_.whole[k]);
  }
  return Status::Ok();
}

// A block stored dense: compared with the parent's.
Status VersionChangesReader::CompareDense(const FileEntry& f, const TensorEntry& t, uint32_t b,
                                          uint64_t first, size_t len, int width) {
  old_block_.resize(len);
  new_block_.resize(len);
  RETURN_IF_ERROR(reader_.ReadBlock(parent_, f, t, b, old_block_.data()));
  RETURN_IF_ERROR(reader_.ReadBlock(v_, f, t, b, new_block_.data()));
  differ_.clear();
  DifferingElements(old_block_.data(), new_block_.data(), len, width, &differ_);
  const auto w = static_cast<size_t>(width);
  for (uint32_t k : differ_) {
    c_.indices.push_back(first + k);
    AppendBytes(&c_.values, new_block_.data() + k * w, w);
    AppendBytes(&c_.old_values, old_block_.data() + k * w, w);
    c_.known.push_back(1);
  }
  return Status::Ok();
}

Result<std::vector<TensorChanges>> ReadVersionChanges(Store& store,
                                                      const std::shared_ptr<const Version>& v) {
  ASSIGN_OR_RETURN(auto reader, VersionChangesReader::Open(store, v));
  std::vector<TensorChanges> out;
  for (const FileEntry& f : v->manifest.files) {
    for (const TensorEntry& t : f.tensors) {
      if (!reader->MayChange(t.name)) continue;
      ASSIGN_OR_RETURN(const TensorChanges* c, reader->Read(t.name));
      if (!c->indices.empty()) out.push_back(*c);
    }
  }
  return out;
}

}  // namespace dte
