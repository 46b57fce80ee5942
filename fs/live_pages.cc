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

#include "fs/internal/live_changes.h"
#include "fs/log.h"
#include "kernels/parallel.h"
#include "kernels/remap_math.h"
#include "kernels/width.h"

namespace dte::fs {
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
  const Version& T = *to.version;
  const Clock::time_point resident_start = Clock::now();
  std::vector<Run> runs;
  std::vector<std::vector<Segment>> segments(T.manifest.files.size());
  for (uint32_t f = 0; f < T.manifest.files.size(); ++f) {
    const FileEntry& file = T.manifest.files[f];
    const FileEntry& old = from.version->manifest.files[f];
    if (file.size == 0) continue;
    const uint64_t npages = (file.size + kPageBytes - 1) / kPageBytes;
    // Per page: 0 unchanged, 1 patched from entries, 2 from the read path.
    std::vector<uint8_t> how(npages, 0);
    bool any = false;
    // A whole blob that differs (a header, or a file other than safetensors,
    // of the same size) is replaced whole.
    const uint64_t whole = file.safetensors ? file.header_size : file.size;
    if (file.safetensors ? !(old.header_blob == file.header_blob) : !(old.blob == file.blob)) {
      for (uint64_t p = 0; p * kPageBytes < whole; ++p) how[p] = 2;
      any = true;
    }
    for (const Changes& c : changes) any = any || (c.file == f && !c.blocks.empty());
    if (!any) continue;
    std::vector<uint8_t> resident;
    dte::Status s = pages->Resident(file.name, file.size, &resident);
    if (!s.ok() || resident.size() != npages) {
      // Unknown residency: replace every changed page (the kernel then
      // caches them all, which costs memory but never shows old bytes).
      LogLine("dtefs: live apply: page residency of live/" + file.name + " unknown (" +
              s.message() + "); pushing every changed page");
      resident.assign(npages, 1);
    }
    // Changed pages, looked for only in blocks with a resident page.
    for (const Changes& c : changes) {
      if (c.file != f) continue;
      const uint64_t base = file.header_size + file.tensors[c.tensor].begin;
      const auto width = static_cast<uint64_t>(c.width);
      // Elements not aligned in the file may straddle pages: not patched.
      const uint8_t mark = base % width == 0 ? 1 : 2;
      for (const BlockChange& bc : c.blocks) {
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
          for (uint64_t p = p_lo; p <= p_hi; ++p) how[p] = std::max(how[p], mark);
        } else {
          for (uint32_t i : bc.idx) {
            const uint64_t at = base + (first + i) * width;
            for (uint64_t p = at / kPageBytes; p <= (at + width - 1) / kPageBytes; ++p) {
              how[p] = std::max(how[p], mark);
            }
          }
        }
        if (mark == 1) segments[f].push_back({lo, hi, base + first * width, c.width, &bc});
      }
    }
    std::sort(segments[f].begin(), segments[f].end(),
              [](const Segment& a, const Segment& b) { return a.lo < b.lo; });
    for (uint64_t p = 0; p < npages;) {
      if (!how[p] || !(resident[p] & 1)) {
        ++p;
        continue;
      }
      uint64_t q = p;
      while (q < npages && how[q] == how[p] && (resident[q] & 1) &&
             (q - p) * kPageBytes < kMaxRun) {
        ++q;
      }
      const uint64_t off = p * kPageBytes;
      runs.push_back({f, off, std::min(q * kPageBytes, file.size) - off, how[p] == 1});
      p = q;
    }
  }
  stats->resident_ns = Nanos(resident_start);

  // The runs, spread over the worker threads. Pages stored from T's bytes
  // (the read path) are right whatever the page held; patched ones are
  // listed for the check against concurrent reads below.
  Mutex mu;
  dte::Status first_error;
  std::vector<NotedRead> patched;
  std::atomic<uint64_t> patched_pages{0}, read_pages{0}, skipped{0}, fetches{0}, stores{0};
  std::atomic<uint64_t> fetch_ns{0}, patch_ns{0}, store_ns{0}, read_ns{0};
  auto fail = [&](const dte::Status& s) {
    MutexLock lock(&mu);
    if (first_error.ok()) first_error = s;
  };
  // T's bytes of [offset, offset + len) of file f into the page cache.
  auto from_read_path = [&](uint32_t f, uint64_t offset, uint64_t len, std::string* buf) {
    buf->resize(len);
    Clock::time_point t = Clock::now();
    dte::Status s = reader_->Read(to.version, f, offset, len,
                                  reinterpret_cast<uint8_t*>(buf->data()), &to.chain);
    read_ns += Nanos(t);
    t = Clock::now();
    if (s.ok()) s = pages->Store(f, offset, buf->data(), len);
    store_ns += Nanos(t);
    stores++;
    return s;
  };
  // One lane per thread, each with its own fetch buffer, reused.
  const size_t lanes = std::max<size_t>(1, std::min(kernels::NumThreads(), runs.size()));
  kernels::ParallelFor(lanes, 1, [&](size_t lane_begin, size_t lane_end) {
    for (size_t lane = lane_begin; lane < lane_end; ++lane) {
      std::string buf;  // read-path runs
      std::unique_ptr<char[]> data;
      std::vector<NotedRead> mine;
      dte::Status failed;
      for (size_t k = lane; failed.ok() && k < runs.size(); k += lanes) {
        const Run& run = runs[k];
        if (!run.patch) {
          if (failed = from_read_path(run.file, run.offset, run.len, &buf); failed.ok()) {
            read_pages += PagesOf(0, run.len);
          }
          continue;
        }
        if (!data) data.reset(new char[kMaxRun]);  // not zeroed: every byte used is fetched
        const uint64_t end_at = run.offset + run.len;
        for (uint64_t off = run.offset; off < end_at;) {
          size_t got = 0;
          Clock::time_point t = Clock::now();
          dte::Status s = pages->Fetch(run.file, off, end_at - off, data.get(), &got);
          fetch_ns += Nanos(t);
          fetches++;
          if (!s.ok()) {
            // The cache cannot be read back: T's bytes, from the read path.
            if (s.code() != Code::kUnimplemented) {
              LogLine("dtefs: live apply: fetching cached pages of live file " +
                      std::to_string(run.file) + " failed (" + s.message() +
                      "); filling them from the read path");
            }
            if (failed = from_read_path(run.file, off, end_at - off, &buf); failed.ok()) {
              read_pages += PagesOf(off, end_at);
            }
            break;
          }
          const uint64_t n = std::min<uint64_t>(got, end_at - off);
          if (n == 0) {  // evicted since it was listed: its next read serves T
            skipped++;
            off += kPageBytes;
            continue;
          }
          t = Clock::now();
          Patch(segments[run.file], off, n, reinterpret_cast<uint8_t*>(data.get()));
          patch_ns += Nanos(t);
          t = Clock::now();
          failed = pages->Store(run.file, off, data.get(), n);
          store_ns += Nanos(t);
          stores++;
          if (!failed.ok()) break;
          mine.push_back({run.file, off, n});
          patched_pages += PagesOf(off, off + n);
          off += n;
        }
      }
      if (!failed.ok()) return fail(failed);
      MutexLock lock(&mu);
      patched.insert(patched.end(), mine.begin(), mine.end());
    }
  });
  if (!first_error.ok()) return first_error;

  // Every patch is stored. A page a read of T filled during the step holds
  // T already, and was patched once more if it was fetched after that read:
  // store T's bytes of every patched page a noted read covers.
  std::vector<NotedRead> noted = StopWatchingReads();
  auto before = [](const NotedRead& x, const NotedRead& y) {
    return std::tie(x.file, x.offset) < std::tie(y.file, y.offset);
  };
  std::sort(patched.begin(), patched.end(), before);  // disjoint ranges
  std::vector<std::vector<std::pair<uint64_t, uint64_t>>> refresh(T.manifest.files.size());
  for (const NotedRead& r : noted) {
    const uint64_t lo = r.offset / kPageBytes * kPageBytes;
    const uint64_t hi = r.offset + r.len;
    // The patched ranges of r.file that end after lo, while they start before hi.
    auto it = std::partition_point(patched.begin(), patched.end(), [&](const NotedRead& p) {
      return p.file < r.file || (p.file == r.file && p.offset + p.len <= lo);
    });
    for (; it != patched.end() && it->file == r.file && it->offset < hi; ++it) {
      const uint64_t a = std::max(lo, it->offset), b = std::min(hi, it->offset + it->len);
      refresh[r.file].push_back(
          {a, std::min((b + kPageBytes - 1) / kPageBytes * kPageBytes, it->offset + it->len)});
    }
  }
  uint64_t refreshed = 0;
  std::string buf;
  for (uint32_t f = 0; f < refresh.size(); ++f) {
    auto& ranges = refresh[f];
    std::sort(ranges.begin(), ranges.end());
    for (size_t i = 0; i < ranges.size();) {
      uint64_t a = ranges[i].first, b = ranges[i].second;
      for (++i; i < ranges.size() && ranges[i].first <= b; ++i) b = std::max(b, ranges[i].second);
      if (dte::Status s = from_read_path(f, a, b - a, &buf); !s.ok()) return s;
      refreshed += PagesOf(a, b);
    }
  }

  stats->patched_pages = patched_pages.load();
  stats->read_path_pages = read_pages.load();
  stats->skipped_pages = skipped.load();
  stats->refreshed_pages = refreshed;
  stats->fetches = fetches.load();
  stats->stores = stores.load();
  stats->fetch_ns = fetch_ns.load();
  stats->patch_ns = patch_ns.load();
  stats->store_ns = store_ns.load();
  stats->read_ns = read_ns.load();
  *pushed += stats->patched_pages + stats->read_path_pages;
  return Status::Ok();
}

}  // namespace dte::fs
