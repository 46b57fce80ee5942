#include "tests/testutil/checkpoint.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <set>

#include "store/base/posix_file.h"
#include "store/delta_codec.h"
#include "store/hash.h"
#include "store/safetensors.h"

namespace dte::test {

uint64_t Rng::Next() {
  uint64_t z = (state_ += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

uint64_t TestTensor::elements() const {
  uint64_t n = 1;
  for (int64_t d : shape) n *= static_cast<uint64_t>(d);
  return n;
}

TestTensor& TestCheckpoint::tensor(const std::string& name) {
  for (auto& f : safetensors) {
    for (auto& t : f.tensors) {
      if (t.name == name) return t;
    }
  }
  std::fprintf(stderr, "test checkpoint has no tensor %s\n", name.c_str());
  std::abort();
}

std::string RandomBf16(uint64_t elements, uint64_t seed) {
  Rng rng(seed);
  std::string out(elements * 2, '\0');
  for (uint64_t i = 0; i < elements; ++i) {
    // Sum of uniforms: roughly normal, scaled to about 0.02.
    double x = 0;
    for (int k = 0; k < 4; ++k) x += static_cast<double>(rng.Next() >> 11) * 0x1.0p-53 - 0.5;
    float f = static_cast<float>(x * 0.035);
    uint32_t bits;
    std::memcpy(&bits, &f, sizeof(bits));
    const auto bf16 = static_cast<uint16_t>(bits >> 16);
    std::memcpy(&out[i * 2], &bf16, sizeof(bf16));
  }
  return out;
}

std::string RandomBytes(uint64_t bytes, uint64_t seed) {
  Rng rng(seed);
  std::string out(bytes, '\0');
  for (auto& c : out) c = static_cast<char>(rng.Next() >> 56);
  return out;
}

TestTensor Bf16Tensor(const std::string& name, std::vector<int64_t> shape, uint64_t seed) {
  TestTensor t{name, DType::kBF16, std::move(shape), ""};
  t.data = RandomBf16(t.elements(), seed);
  return t;
}

std::vector<uint64_t> PerturbElements(std::string* data, int width, uint64_t count, uint64_t seed) {
  const uint64_t n = data->size() / static_cast<uint64_t>(width);
  Rng rng(seed);
  std::set<uint64_t> picked;
  while (picked.size() < count) picked.insert(rng.Below(n));
  for (uint64_t i : picked) {
    uint64_t v = 0;
    std::memcpy(&v, data->data() + i * width, static_cast<size_t>(width));
    // A step of 1..4 units in the last place, either way: never zero.
    const uint64_t step = 1 + rng.Below(4);
    v = (rng.Next() & 1) ? v + step : v - step;
    std::memcpy(data->data() + i * width, &v, static_cast<size_t>(width));
  }
  return {picked.begin(), picked.end()};
}

std::vector<TestTensor> PerturbEveryBlock(std::vector<TestTensor> tensors, uint64_t block_bytes,
                                          uint64_t per_block, uint64_t seed) {
  for (auto& t : tensors) {
    const uint64_t blocks = (t.data.size() + block_bytes - 1) / block_bytes;
    PerturbElements(&t.data, 2, std::min<uint64_t>(t.elements(), per_block * blocks), seed++);
  }
  return tensors;
}

uint64_t CountDifferingElements(std::string_view a, std::string_view b, int width) {
  uint64_t n = 0;
  for (size_t i = 0; i + static_cast<size_t>(width) <= a.size(); i += static_cast<size_t>(width)) {
    if (std::memcmp(a.data() + i, b.data() + i, static_cast<size_t>(width)) != 0) ++n;
  }
  return n;
}

std::string SafetensorsBytes(const TestSafetensors& file) {
  std::vector<TensorInfo> infos;
  uint64_t pos = 0;
  for (const auto& t : file.tensors) {
    TensorInfo info{t.name, t.dtype, t.shape, pos, pos + t.data.size()};
    pos = info.end;
    infos.push_back(std::move(info));
  }
  std::string out = BuildSafetensorsHeader(infos, file.metadata);
  for (const auto& t : file.tensors) out += t.data;
  return out;
}

Status WriteCheckpoint(const TestCheckpoint& ckpt, const std::string& dir) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) return IOError("cannot create " + dir + ": " + ec.message());
  for (const auto& f : ckpt.safetensors) {
    RETURN_IF_ERROR(WriteFileBytes(dir + "/" + f.name, SafetensorsBytes(f)));
  }
  for (const auto& [name, bytes] : ckpt.raw_files) {
    RETURN_IF_ERROR(WriteFileBytes(dir + "/" + name, bytes));
  }
  return Status::Ok();
}

std::unique_ptr<Store> OpenTestStore(const std::string& uri, const std::string& cache_dir) {
  StoreOptions o;
  o.uri = uri;
  o.cache_dir = cache_dir;
  o.create = true;
  auto s = Store::Open(o);
  EXPECT_TRUE(s.ok()) << s.status().message();
  return s.ok() ? std::move(s).value() : nullptr;
}

Result<std::string> ReadFileBytes(const std::string& path) { return ReadWholeFile(path); }

Status WriteFileBytes(const std::string& path, std::string_view bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  out.close();
  if (!out) return IOError("cannot write " + path);
  return Status::Ok();
}

Status FlipBits(const std::string& path, uint64_t offset, uint8_t mask) {
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  if (!f.is_open()) return IOError("cannot open " + path);
  f.seekg(static_cast<std::streamoff>(offset));
  const int c = f.get();
  f.seekp(static_cast<std::streamoff>(offset));
  f.put(static_cast<char>(c ^ mask));
  if (c == EOF || !f.good())
    return IOError("cannot change byte " + std::to_string(offset) + " of " + path);
  return Status::Ok();
}

namespace {

constexpr uint64_t kBB = kDefaultBlockBytes;

// The record of block `b` of `t` (which starts at `begin` in the data
// section): dense for an anchor (old == nullptr), else encoded against old,
// its payload appended to `payload`.
BlockRecord MakeRecord(const TestTensor& t, const TestTensor* old, uint64_t begin, uint32_t b,
                       std::string* payload) {
  const uint64_t len = std::min<uint64_t>(kBB, t.data.size() - b * kBB);
  const auto* now = reinterpret_cast<const uint8_t*>(t.data.data()) + b * kBB;
  BlockRecord r;
  r.hash = HashBlock(now, len);
  if (old == nullptr) {
    r.kind = BlockKind::kDenseRaw;
    r.offset = begin + b * kBB;
    r.length = static_cast<uint32_t>(len);
    return r;
  }
  const auto* was = reinterpret_cast<const uint8_t*>(old->data.data()) + b * kBB;
  EncodedBlock e = EncodeBlock(was, now, len, DTypeWidth(t.dtype), nullptr);
  r.kind = e.kind;
  r.changed = e.changed;
  if (e.kind != BlockKind::kSame) {
    r.offset = payload->size();
    r.length = static_cast<uint32_t>(e.payload.size());
    *payload += e.payload;
  }
  return r;
}

}  // namespace

Result<Hash128> VersionWriter::Put(const std::string& bytes) {
  Hash128 h = HashBytes(bytes.data(), bytes.size());
  RETURN_IF_ERROR(objects_->Put(BlobKey(h), bytes));
  return h;
}

Status VersionWriter::Write(uint64_t version, const std::vector<TestTensor>& tensors, bool anchor) {
  const std::string bytes = SafetensorsBytes(TestSafetensors{kModelFile, tensors, {}});
  uint64_t data_size = 0;
  for (const auto& t : tensors) data_size += t.data.size();
  Manifest m;
  m.version = version;
  m.created = NowRfc3339();
  if (!anchor) m.parent = last_;
  const std::string config_bytes = "{\"version\": " + std::to_string(version) + "}";
  FileEntry config{"config.json", config_bytes.size(), false, {}, {}, 0, {}};
  ASSIGN_OR_RETURN(config.blob, Put(config_bytes));
  FileEntry model{kModelFile, bytes.size(), true, {}, {}, bytes.size() - data_size, {}};
  ASSIGN_OR_RETURN(model.header_blob, Put(bytes.substr(0, model.header_size)));
  std::string payload;
  std::vector<BlockRecord> records;
  uint64_t pos = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const TestTensor& t = tensors[i];
    TensorEntry e{t.name, t.dtype, t.shape, pos, pos + t.data.size(), {}, 0, 0, 0};
    e.hash = HashBytes(t.data.data(), t.data.size());
    e.first_block = static_cast<uint32_t>(records.size());
    e.blocks = static_cast<uint32_t>((e.bytes() + kBB - 1) / kBB);
    for (uint32_t b = 0; b < e.blocks; ++b) {
      records.push_back(MakeRecord(t, anchor ? nullptr : &prev_[i], e.begin, b, &payload));
      e.changed += anchor ? 0 : records.back().changed;
    }
    if (anchor) e.changed = e.elements();
    pos = e.end;
    model.tensors.push_back(e);
  }
  m.files = {config, model};
  if (anchor || !payload.empty()) {
    const std::string blob = anchor ? bytes.substr(model.header_size) : payload;
    ASSIGN_OR_RETURN(Hash128 h, Put(blob));
    m.blobs.push_back(BlobRef{h, blob.size(), true});
  }
  const std::string table = EncodeBlockTable(records);
  ASSIGN_OR_RETURN(m.block_table.hash, Put(table));
  m.block_table.size = table.size();
  RETURN_IF_ERROR(objects_->CreateExclusive(ManifestKey(version, 0), EncodeManifest(m)));
  files_[version] = bytes;
  records_[version] = std::move(records);
  prev_ = tensors;
  last_ = version;
  return Status::Ok();
}

}  // namespace dte::test
