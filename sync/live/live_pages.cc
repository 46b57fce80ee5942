// Step 6 of a live apply: the resident pages of live/ that hold changed
// bytes take the target's bytes (docs/live.md, "The page cache").
//
// A resident page of a tensor's bytes holds the old live version L (it was
// filled before the switch; every read after it is noted, below), and the
// changed set says what to add to L's elements. So each run of such pages
// is fetched (PageCache::Fetch: read through the mount, which the kernel
// answers from the page cache without asking the daemon), patched in place
// with the entries that fall in it, and stored back (PageCache::Store:
// fuse_lowlevel_notify_store), up to 1 MiB at a time: two copies of the
// resident bytes, with no block of either version materialized. Pages
// whose new bytes are not composed from entries (a header or another file
// whose content differs, a tensor whose elements are not aligned in the
// file) and runs the cache cannot fetch are filled from the read path
// instead.
//
// A page evicted before its fetch is read again through the daemon, from T
// (or skipped, by a cache that can tell). A page that a read of T refilled
// during the apply (evicted, then read again after the switch, by a
// reader or by the fetch itself) holds T, not L, and patching it would add
// the changes twice: every read of T during the step is noted
// (Live::NoteRead), and each patched page one of them covers is stored once
// more from the read path after the last patch, when every store the
// reads could race with has returned.

#include <algorithm>
#include <atomic>
#include <memory>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "kernels/parallel.h"
#include "kernels/remap_math.h"
#include "kernels/width.h"
#include "sync/live/internal/live_changes.h"

namespace dte::live {
namespace {

using internal::Clock;
using internal::Nanos;

// The most bytes one fetch or store covers: the kernel's largest FUSE
// transfer (256 pages).
constexpr uint64_t kMaxRun = uint64_t{1} << 20;

uint64_t PagesOf(uint64_t begin, uint64_t end) {
  return (end - begin + kPageBytes - 1) / kPageBytes;
}

// The changed entries of one block, as bytes of its file.
struct Segment {
  uint64_t lo = 0, hi = 0;  // the first changed byte and one past the last
  uint64_t base = 0;        // file offset of the block's element 0
  int width = 0;
  const Live::BlockChange* bc = nullptr;
};

// Pages of one live file to replace, all resident when listed.
struct Run {
  uint32_t file = 0;
  uint64_t offset = 0, len = 0;
  bool patch = false;  // fetched and patched; else T's bytes from the read path
};

// Bytes [offset, offset + len) of live file number `file`.
struct PageRange {
  uint32_t file = 0;
  uint64_t offset = 0, len = 0;
};

// Applies the entries of `s` that lie in file bytes [a, b) to buf, which
// holds those bytes.
template <int W>
void PatchSegment(const Segment& s, uint64_t a, uint64_t b, uint8_t* buf) {
  const std::vector<uint32_t>& idx = s.bc->idx;
  const uint64_t first = a > s.base ? (a - s.base + W - 1) / W : 0;
  auto it = std::lower_bound(idx.begin(), idx.end(), first,
                             [](uint32_t i, uint64_t v) { return uint64_t{i} < v; });
  for (auto k = static_cast<size_t>(it - idx.begin()); k < idx.size(); ++k) {
    const uint64_t pos = s.base + uint64_t{idx[k]} * W;
    if (pos + W > b) break;
    kernels::ApplyElement<W>(buf + (pos - a), s.bc->vals.data() + k * W, s.bc->Whole(k));
  }
}

// Applies every entry of `segments` (one file's, sorted by offset) that
// lies in file bytes [a, a + n) to buf.
void Patch(const std::vector<Segment>& segments, uint64_t a, uint64_t n, uint8_t* buf) {
  const uint64_t b = a + n;
  auto it = std::partition_point(segments.begin(), segments.end(),
                                 [a](const Segment& s) { return s.hi <= a; });
  for (; it != segments.end() && it->lo < b; ++it) {
    kernels::DispatchWidth(it->width,
                           [&](auto w) { PatchSegment<decltype(w)::value>(*it, a, b, buf); });
  }
}

// The page step of one apply, in the order PushPages runs it: the runs of
// resident changed pages, file by file (ListRuns); the runs replaced by the
// worker threads (ReplaceRuns); the patched pages that reads of T refilled
// meanwhile stored again from T (Refresh). Counts go to Report.
class PageStep {
 public:
  PageStep(const LiveView& from, const LiveView& to, const std::vector<Live::Changes>& changes,
           PageCache* pages, LiveMount* mount)
      : from_(from), to_(to), changes_(changes), pages_(pages), mount_(mount) {}

  void ListRuns();
  Status ReplaceRuns();
  Status Refresh(const std::vector<PageRange>& noted);
  void Report(LivePageStats* stats) const;

 private:
  // Marks per page of file f in *how: 0 unchanged, 1 patched from entries,
  // 2 from the read path; false when no page of f changed.
  bool MarkWholeBlob(uint32_t f, std::vector<uint8_t>* how) const;
  std::vector<uint8_t> ResidentPages(uint32_t f, uint64_t npages) const;
  void MarkChangedPages(uint32_t f, const std::vector<uint8_t>& resident,
                        std::vector<uint8_t>* how);
  void AddRuns(uint32_t f, const std::vector<uint8_t>& how, const std::vector<uint8_t>& resident);
  // T's bytes of [offset, offset + len) of file f into the page cache.
  Status FromReadPath(uint32_t f, uint64_t offset, uint64_t len, std::string* buf);
  // The runs lane, lane + lanes, ... of runs_; the ranges patched to *patched.
  Status ReplaceLane(size_t lane, size_t lanes, std::vector<PageRange>* patched);
  Status PatchRun(const Run& run, char* data, std::string* buf, std::vector<PageRange>* patched);
  // The patched ranges a noted read covers, per file, page-aligned.
  std::vector<std::vector<std::pair<uint64_t, uint64_t>>> Covered(
      const std::vector<PageRange>& noted);

  const LiveView& from_;
  const LiveView& to_;
  const std::vector<Live::Changes>& changes_;
  PageCache* const pages_;
  LiveMount* const mount_;

  std::vector<Run> runs_;
  std::vector<std::vector<Segment>> segments_;  // per file, sorted by offset
  uint64_t resident_ns_ = 0, refreshed_ = 0;
  std::atomic<uint64_t> patched_pages_{0}, read_pages_{0}, skipped_{0}, fetches_{0}, stores_{0};
  std::atomic<uint64_t> fetch_ns_{0}, patch_ns_{0}, store_ns_{0}, read_ns_{0};
  Mutex mu_;
  std::vector<PageRange> patched_ GUARDED_BY(mu_);  // disjoint
};

void PageStep::ListRuns() {
  const Clock::time_point start = Clock::now();
  const Version& T = *to_.version;
  segments_.assign(T.manifest.files.size(), {});
  for (uint32_t f = 0; f < T.manifest.files.size(); ++f) {
    const FileEntry& file = T.manifest.files[f];
    if (file.size == 0) continue;
    const uint64_t npages = (file.size + kPageBytes - 1) / kPageBytes;
    std::vector<uint8_t> how(npages, 0);
    if (!MarkWholeBlob(f, &how)) continue;
    std::vector<uint8_t> resident = ResidentPages(f, npages);
    MarkChangedPages(f, resident, &how);
    AddRuns(f, how, resident);
  }
  resident_ns_ = Nanos(start);
}

bool PageStep::MarkWholeBlob(uint32_t f, std::vector<uint8_t>* how) const {
  const FileEntry& file = to_.version->manifest.files[f];
  const FileEntry& old = from_.version->manifest.files[f];
  bool any = false;
  // A whole blob that differs (a header, or a file other than safetensors,
  // of the same size) is replaced whole.
  const uint64_t whole = file.safetensors ? file.header_size : file.size;
  if (file.safetensors ? !(old.header_blob == file.header_blob) : !(old.blob == file.blob)) {
    for (uint64_t p = 0; p * kPageBytes < whole; ++p) (*how)[p] = 2;
    any = true;
  }
  for (const Live::Changes& c : changes_) any = any || (c.file == f && !c.blocks.empty());
  return any;
}

std::vector<uint8_t> PageStep::ResidentPages(uint32_t f, uint64_t npages) const {
  const FileEntry& file = to_.version->manifest.files[f];
  std::vector<uint8_t> resident;
  dte::Status s = pages_->Resident(file.name, file.size, &resident);
  if (!s.ok() || resident.size() != npages) {
    // Unknown residency: replace every changed page (the kernel then
    // caches them all, which costs memory but never shows old bytes).
    mount_->Log("dtefs: live apply: page residency of live/" + file.name + " unknown (" +
                s.message() + "); pushing every changed page");
    resident.assign(npages, 1);
  }
  return resident;
}

// Changed pages, looked for only in blocks with a resident page.
void PageStep::MarkChangedPages(uint32_t f, const std::vector<uint8_t>& resident,
                                std::vector<uint8_t>* how) {
  const FileEntry& file = to_.version->manifest.files[f];
  for (const Live::Changes& c : changes_) {
    if (c.file != f) continue;
    const uint64_t base = file.header_size + file.tensors[c.tensor].begin;
    const auto width = static_cast<uint64_t>(c.width);
    // Elements not aligned in the file may straddle pages: not patched.
    const uint8_t mark = base % width == 0 ? 1 : 2;
    for (const Live::BlockChange& bc : c.blocks) {
      const uint64_t first = uint64_t{bc.block} * c.block_elements;
      const uint64_t lo = base + (first + bc.idx.front()) * width;
      const uint64_t hi = base + (first + bc.idx.back() + 1) * width;
      const uint64_t p_lo = lo / kPageBytes, p_hi = (hi - 1) / kPageBytes;
      bool cached = false;
      for (uint64_t p = p_lo; p <= p_hi && !cached; ++p) cached = (resident[p] & 1) != 0;
      if (!cached) continue;
      if (bc.idx.size() >= 4 * (p_hi - p_lo + 1)) {
        // Dense (a step of RL training: ~30 entries a page): the block's
        // whole span, without a pass over its entries; a page of it with
        // none is stored back as it was.
        for (uint64_t p = p_lo; p <= p_hi; ++p) (*how)[p] = std::max((*how)[p], mark);
      } else {
        for (uint32_t i : bc.idx) {
          const uint64_t at = base + (first + i) * width;
          for (uint64_t p = at / kPageBytes; p <= (at + width - 1) / kPageBytes; ++p) {
            (*how)[p] = std::max((*how)[p], mark);
          }
        }
      }
      if (mark == 1) segments_[f].push_back({lo, hi, base + first * width, c.width, &bc});
    }
  }
  std::sort(segments_[f].begin(), segments_[f].end(),
            [](const Segment& a, const Segment& b) { return a.lo < b.lo; });
}

// Runs of resident pages marked alike, up to kMaxRun bytes each.
void PageStep::AddRuns(uint32_t f, const std::vector<uint8_t>& how,
                       const std::vector<uint8_t>& resident) {
  const uint64_t size = to_.version->manifest.files[f].size;
  const uint64_t npages = how.size();
  for (uint64_t p = 0; p < npages;) {
    if (!how[p] || !(resident[p] & 1)) {
      ++p;
      continue;
    }
    uint64_t q = p;
    while (q < npages && how[q] == how[p] && (resident[q] & 1) && (q - p) * kPageBytes < kMaxRun) {
      ++q;
    }
    const uint64_t off = p * kPageBytes;
    runs_.push_back({f, off, std::min(q * kPageBytes, size) - off, how[p] == 1});
    p = q;
  }
}

Status PageStep::FromReadPath(uint32_t f, uint64_t offset, uint64_t len, std::string* buf) {
  buf->resize(len);
  Clock::time_point t = Clock::now();
  dte::Status s = mount_->Read(to_.version, f, offset, len, reinterpret_cast<uint8_t*>(buf->data()),
                               &to_.chain);
  read_ns_ += Nanos(t);
  t = Clock::now();
  if (s.ok()) s = pages_->Store(f, offset, buf->data(), len);
  store_ns_ += Nanos(t);
  stores_++;
  return s;
}

// The runs, spread over the worker threads, one lane per thread. Pages
// stored from T's bytes (the read path) are right whatever the page held;
// patched ones are listed for the check against concurrent reads (Refresh).
Status PageStep::ReplaceRuns() {
  const size_t lanes = std::max<size_t>(1, std::min(kernels::NumThreads(), runs_.size()));
  Mutex mu;
  dte::Status first_error;
  kernels::ParallelFor(lanes, 1, [&](size_t lane_begin, size_t lane_end) {
    for (size_t lane = lane_begin; lane < lane_end; ++lane) {
      std::vector<PageRange> mine;
      dte::Status s = ReplaceLane(lane, lanes, &mine);
      if (!s.ok()) {
        MutexLock lock(&mu);
        if (first_error.ok()) first_error = s;
        return;
      }
      MutexLock lock(&mu_);
      patched_.insert(patched_.end(), mine.begin(), mine.end());
    }
  });
  return first_error;
}

Status PageStep::ReplaceLane(size_t lane, size_t lanes, std::vector<PageRange>* patched) {
  std::string buf;               // read-path runs
  std::unique_ptr<char[]> data;  // the lane's fetch buffer, reused
  for (size_t k = lane; k < runs_.size(); k += lanes) {
    const Run& run = runs_[k];
    if (!run.patch) {
      RETURN_IF_ERROR(FromReadPath(run.file, run.offset, run.len, &buf));
      read_pages_ += PagesOf(0, run.len);
      continue;
    }
    if (!data) data.reset(new char[kMaxRun]);  // not zeroed: every byte used is fetched
    RETURN_IF_ERROR(PatchRun(run, data.get(), &buf, patched));
  }
  return Status::Ok();
}

// Fetches, patches and stores back the pages of `run`, up to kMaxRun bytes
// at a time.
Status PageStep::PatchRun(const Run& run, char* data, std::string* buf,
                          std::vector<PageRange>* patched) {
  const uint64_t end_at = run.offset + run.len;
  for (uint64_t off = run.offset; off < end_at;) {
    size_t got = 0;
    Clock::time_point t = Clock::now();
    dte::Status s = pages_->Fetch(run.file, off, end_at - off, data, &got);
    fetch_ns_ += Nanos(t);
    fetches_++;
    if (!s.ok()) {
      // The cache cannot be read back: T's bytes, from the read path.
      if (s.code() != Code::kUnimplemented) {
        mount_->Log("dtefs: live apply: fetching cached pages of live file " +
                    std::to_string(run.file) + " failed (" + s.message() +
                    "); filling them from the read path");
      }
      RETURN_IF_ERROR(FromReadPath(run.file, off, end_at - off, buf));
      read_pages_ += PagesOf(off, end_at);
      return Status::Ok();
    }
    const uint64_t n = std::min<uint64_t>(got, end_at - off);
    if (n == 0) {  // evicted since it was listed: its next read serves T
      skipped_++;
      off += kPageBytes;
      continue;
    }
    t = Clock::now();
    Patch(segments_[run.file], off, n, reinterpret_cast<uint8_t*>(data));
    patch_ns_ += Nanos(t);
    t = Clock::now();
    s = pages_->Store(run.file, off, data, n);
    store_ns_ += Nanos(t);
    stores_++;
    RETURN_IF_ERROR(s);
    patched->push_back({run.file, off, n});
    patched_pages_ += PagesOf(off, off + n);
    off += n;
  }
  return Status::Ok();
}

std::vector<std::vector<std::pair<uint64_t, uint64_t>>> PageStep::Covered(
    const std::vector<PageRange>& noted) {
  MutexLock lock(&mu_);
  auto before = [](const PageRange& x, const PageRange& y) {
    return std::tie(x.file, x.offset) < std::tie(y.file, y.offset);
  };
  std::sort(patched_.begin(), patched_.end(), before);  // disjoint ranges
  std::vector<std::vector<std::pair<uint64_t, uint64_t>>> covered(
      to_.version->manifest.files.size());
  for (const PageRange& r : noted) {
    const uint64_t lo = r.offset / kPageBytes * kPageBytes;
    const uint64_t hi = r.offset + r.len;
    // The patched ranges of r.file that end after lo, while they start before hi.
    auto it = std::partition_point(patched_.begin(), patched_.end(), [&](const PageRange& p) {
      return p.file < r.file || (p.file == r.file && p.offset + p.len <= lo);
    });
    for (; it != patched_.end() && it->file == r.file && it->offset < hi; ++it) {
      const uint64_t a = std::max(lo, it->offset), b = std::min(hi, it->offset + it->len);
      covered[r.file].push_back(
          {a, std::min((b + kPageBytes - 1) / kPageBytes * kPageBytes, it->offset + it->len)});
    }
  }
  return covered;
}

// Every patch is stored. A page a read of T filled during the step holds T
// already, and was patched once more if it was fetched after that read:
// store T's bytes of every patched page a noted read covers.
Status PageStep::Refresh(const std::vector<PageRange>& noted) {
  std::vector<std::vector<std::pair<uint64_t, uint64_t>>> refresh = Covered(noted);
  std::string buf;
  for (uint32_t f = 0; f < refresh.size(); ++f) {
    auto& ranges = refresh[f];
    std::sort(ranges.begin(), ranges.end());
    for (size_t i = 0; i < ranges.size();) {
      uint64_t a = ranges[i].first, b = ranges[i].second;
      for (++i; i < ranges.size() && ranges[i].first <= b; ++i) b = std::max(b, ranges[i].second);
      RETURN_IF_ERROR(FromReadPath(f, a, b - a, &buf));
      refreshed_ += PagesOf(a, b);
    }
  }
  return Status::Ok();
}

void PageStep::Report(LivePageStats* stats) const {
  stats->resident_ns = resident_ns_;
  stats->patched_pages = patched_pages_.load();
  stats->read_path_pages = read_pages_.load();
  stats->skipped_pages = skipped_.load();
  stats->refreshed_pages = refreshed_;
  stats->fetches = fetches_.load();
  stats->stores = stores_.load();
  stats->fetch_ns = fetch_ns_.load();
  stats->patch_ns = patch_ns_.load();
  stats->store_ns = store_ns_.load();
  stats->read_ns = read_ns_.load();
}

}  // namespace

void Live::NoteRead(const LiveView* view, uint32_t file, uint64_t offset, uint64_t len) {
  const LiveView* watched = watched_.load(std::memory_order_acquire);
  if (watched == nullptr || watched != view) return;
  MutexLock lock(&noted_mu_);
  noted_.push_back({file, offset, len});
}

void Live::WatchReads(const LiveView* view) {
  MutexLock lock(&noted_mu_);
  noted_.clear();
  watched_.store(view, std::memory_order_release);
}

std::vector<Live::NotedRead> Live::StopWatchingReads() {
  MutexLock lock(&noted_mu_);
  watched_.store(nullptr, std::memory_order_release);
  return std::move(noted_);
}

Status Live::PushPages(const LiveView& from, const LiveView& to,
                       const std::vector<Changes>& changes, PageCache* pages, uint64_t* pushed,
                       LivePageStats* stats) {
  struct StopWatching {
    Live* live;
    PageCache* pages;
    ~StopWatching() {
      live->StopWatchingReads();
      pages->Done();
    }
  } stop_watching{this, pages};
  PageStep step(from, to, changes, pages, mount_);
  step.ListRuns();
  RETURN_IF_ERROR(step.ReplaceRuns());
  std::vector<PageRange> noted;
  for (const NotedRead& r : StopWatchingReads()) noted.push_back({r.file, r.offset, r.len});
  RETURN_IF_ERROR(step.Refresh(noted));
  step.Report(stats);
  *pushed += stats->patched_pages + stats->read_path_pages;
  return Status::Ok();
}

}  // namespace dte::live
