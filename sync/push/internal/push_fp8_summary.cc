#include "sync/push/internal/push_fp8_summary.h"

#include <algorithm>
#include <cstring>
#include <tuple>

#include "kernels/parallel.h"
#include "store/store.h"
#include "sync/push/internal/push_plan.h"

namespace dte::push_internal {

static_assert(sizeof(Fp8BlockTop) == 40, "docs/push.md gives 40 bytes per FP8 block");

void Fp8BlockTop::Apply(uint32_t p, uint16_t m) {
  int j = 0;
  while (j < n && at[j] != p) ++j;
  if (j < n) {  // it leaves the list
    for (; j + 1 < n; ++j) {
      mag[j] = mag[j + 1];
      at[j] = at[j + 1];
    }
    --n;
  }
  if (m <= bound) return;
  if (n == kFp8Top) {  // the smallest of the list and m leaves it
    if (m <= mag[n - 1]) {
      bound = m;
      return;
    }
    bound = mag[--n];
  }
  for (j = n; j > 0 && mag[j - 1] < m; --j) {
    mag[j] = mag[j - 1];
    at[j] = at[j - 1];
  }
  mag[j] = m;
  at[j] = p;
  ++n;
}

std::optional<uint16_t> Fp8BlockTop::Amax() const {
  if (bound == 0) return n > 0 ? mag[0] : uint16_t{0};
  if (n > 0 && mag[0] >= bound) return mag[0];
  return std::nullopt;
}

bool Fp8Summarizable(const kernels::Fp8Layout& l) {
  return l.block_cols != 0 && l.block_rows <= (uint64_t{1} << 32) / l.block_cols;
}

uint64_t Fp8SummaryBytes(const kernels::Fp8Layout& l) {
  return l.num_blocks() * sizeof(Fp8BlockTop);
}

uint64_t Fp8SummaryBytes(const Fp8Summaries& s) {
  uint64_t bytes = 0;
  for (const auto& [key, summary] : s.of) bytes += summary.blocks.size() * sizeof(Fp8BlockTop);
  return bytes;
}

namespace {

// Element i's position within its block b.
uint32_t PositionOf(const kernels::Fp8Layout& l, uint64_t b, uint64_t i) {
  const uint64_t r0 = (b / l.grid_cols()) * l.block_rows;
  const uint64_t c0 = (b % l.grid_cols()) * l.block_cols;
  return static_cast<uint32_t>((i / l.cols - r0) * l.block_cols + (i % l.cols - c0));
}

Fp8BlockTop SummarizeBlock(const kernels::Fp8Layout& l, const uint16_t* x, uint64_t b) {
  Fp8BlockTop t;
  const uint64_t r0 = (b / l.grid_cols()) * l.block_rows;
  const uint64_t c0 = (b % l.grid_cols()) * l.block_cols;
  const uint64_t r1 = std::min(r0 + l.block_rows, l.rows);
  const uint64_t c1 = std::min(c0 + l.block_cols, l.cols);
  for (uint64_t r = r0; r < r1; ++r) {
    const uint16_t* row = x + r * l.cols;
    // Once the list is full, most rows hold nothing above its smallest.
    if (t.n == kFp8Top) {
      const uint16_t m = Bf16AmaxBits(row + c0, c1 - c0);
      if (m <= t.mag[kFp8Top - 1]) {
        t.bound = std::max(t.bound, m);
        continue;
      }
    }
    for (uint64_t c = c0; c < c1; ++c) {
      const uint16_t m = kernels::Bf16AbsBits(row[c]);
      // Most elements are below the full list's smallest: one comparison.
      if (m <= t.bound || (t.n == kFp8Top && m <= t.mag[kFp8Top - 1])) {
        t.bound = std::max(t.bound, m);
        continue;
      }
      t.Apply(static_cast<uint32_t>((r - r0) * l.block_cols + (c - c0)), m);
    }
  }
  return t;
}

uint16_t NewBits(const TensorChanges& c, size_t k) {
  uint16_t x;
  std::memcpy(&x, c.values.data() + 2 * k, 2);
  return x;
}

uint16_t OldBits(const TensorChanges& c, size_t k) {
  uint16_t x;
  std::memcpy(&x, c.old_values.data() + 2 * k, 2);
  return x;
}

float ScaleOf(uint16_t amax, kernels::Fp8ScaleRule rule) {
  return kernels::Fp8BlockScale(kernels::Bf16BitsToFp32(amax), rule);
}

// The entries of changes by block (a counting sort: entries stay ascending
// within each block).
void GroupByBlock(const kernels::Fp8Layout& l, const TensorChanges& c, Fp8StepPlan* out) {
  std::vector<size_t> next(l.num_blocks() + 1, 0);
  std::vector<uint64_t> block(c.indices.size());
  for (size_t k = 0; k < c.indices.size(); ++k) {
    block[k] = Fp8BlockOf(l, c.indices[k]);
    ++next[block[k] + 1];
  }
  out->blocks.clear();
  out->starts.clear();
  for (uint64_t b = 0; b < l.num_blocks(); ++b) {
    if (next[b + 1] != 0) {
      out->blocks.push_back(b);
      out->starts.push_back(next[b]);
    }
    next[b + 1] += next[b];
  }
  out->starts.push_back(c.indices.size());
  out->entries.resize(c.indices.size());
  for (size_t k = 0; k < c.indices.size(); ++k) out->entries[next[block[k]]++] = k;
}

// Block j of the plan stepped from its parent's summary into *next; false
// when the block needs the parent's elements.
bool StepBlock(const Fp8Summary& parent, const TensorChanges& c, bool exact,
               const Fp8StepPlan& plan, size_t j, Fp8BlockTop* next) {
  const kernels::Fp8Layout& l = parent.layout;
  const uint64_t b = plan.blocks[j];
  Fp8BlockTop t = parent.blocks[b];
  const std::optional<uint16_t> was = t.Amax();
  if (!was || kernels::Bf16AbsNonFinite(*was)) return false;
  for (size_t e = plan.starts[j]; e < plan.starts[j + 1]; ++e) {
    const size_t k = plan.entries[e];
    if (!exact || (!c.known.empty() && c.known[k] == 0)) return false;
    const uint16_t m = kernels::Bf16AbsBits(NewBits(c, k));
    if (kernels::Bf16AbsNonFinite(m)) return false;
    t.Apply(PositionOf(l, b, c.indices[k]), m);
  }
  const std::optional<uint16_t> now = t.Amax();
  if (!now ||
      kernels::FloatBits(ScaleOf(*was, l.rule)) != kernels::FloatBits(ScaleOf(*now, l.rule))) {
    return false;
  }
  *next = t;
  return true;
}

}  // namespace

Fp8Summary SummarizeFp8(const kernels::Fp8Layout& l, const uint16_t* x) {
  Fp8Summary s{l, {}, std::vector<Fp8BlockTop>(l.num_blocks())};
  kernels::ParallelFor(s.blocks.size(), 16, [&](size_t lo, size_t hi) {
    for (size_t b = lo; b < hi; ++b) s.blocks[b] = SummarizeBlock(l, x, b);
  });
  return s;
}

void PlanFp8Step(const Fp8Summary& parent, const TensorChanges& changes, Fp8StepPlan* out) {
  GroupByBlock(parent.layout, changes, out);
  const size_t n = out->blocks.size();
  out->read.assign(n, 0);
  out->next.resize(n);
  const bool exact = changes.old_exact && !changes.old_values.empty();
  kernels::ParallelFor(n, 16, [&](size_t lo, size_t hi) {
    for (size_t j = lo; j < hi; ++j) {
      out->read[j] = !StepBlock(parent, changes, exact, *out, j, &out->next[j]);
    }
  });
}

void MarkFp8Rows(const kernels::Fp8Layout& l, const Fp8StepPlan& plan, std::vector<uint8_t>* rows) {
  rows->resize(l.rows, 0);
  for (size_t j = 0; j < plan.blocks.size(); ++j) {
    if (!plan.read[j]) continue;
    const uint64_t r0 = (plan.blocks[j] / l.grid_cols()) * l.block_rows;
    std::fill(rows->begin() + r0, rows->begin() + std::min(r0 + l.block_rows, l.rows), 1);
  }
}

namespace {

// The runs of marked rows: [first, end) pairs.
std::vector<std::pair<uint64_t, uint64_t>> RowRuns(const std::vector<uint8_t>& rows) {
  std::vector<std::pair<uint64_t, uint64_t>> runs;
  for (uint64_t r = 0; r < rows.size(); ++r) {
    if (!rows[r]) continue;
    if (!runs.empty() && runs.back().second == r) {
      runs.back().second = r + 1;
    } else {
      runs.emplace_back(r, r + 1);
    }
  }
  return runs;
}

}  // namespace

Result<uint64_t> Fp8ReadRows(Materializer& reader, const std::shared_ptr<const Version>& v,
                             const std::string& tensor, uint64_t cols,
                             const std::vector<uint8_t>& rows, const std::string& what,
                             std::vector<uint16_t>* parent) {
  ASSIGN_OR_RETURN(const TensorBytes at, LocateTensor(*v, tensor, parent->size() * 2, what));
  if (rows.size() * cols != parent->size()) {
    return Internal(what + ": " + std::to_string(rows.size()) + " rows of " + std::to_string(cols) +
                    " columns for tensor " + tensor + " of " + std::to_string(parent->size()) +
                    " elements");
  }
  const uint64_t bb = v->manifest.block_bytes, row = cols * 2;
  // Byte ranges of the tensor, cut at store blocks, read in parallel.
  std::vector<std::pair<uint64_t, uint64_t>> pieces;
  for (const auto& [r0, r1] : RowRuns(rows)) {
    for (uint64_t lo = r0 * row; lo < r1 * row;) {
      const uint64_t hi = std::min(r1 * row, (lo / bb + 1) * bb);
      pieces.emplace_back(lo, hi);
      lo = hi;
    }
  }
  std::vector<Status> done(pieces.size());
  auto* dst = reinterpret_cast<uint8_t*>(parent->data());
  kernels::ParallelFor(pieces.size(), 1, [&](size_t lo, size_t hi) {
    for (size_t p = lo; p < hi; ++p) {
      const auto [from, to] = pieces[p];
      done[p] = reader.ReadFile(v, *at.file, at.offset + from, to - from, dst + from);
    }
  });
  uint64_t bytes = 0;
  for (size_t p = 0; p < pieces.size(); ++p) {
    RETURN_IF_ERROR(done[p].WithContext(what));
    bytes += pieces[p].second - pieces[p].first;
  }
  return bytes;
}

void Fp8ChildRows(uint64_t cols, const std::vector<uint8_t>& rows, const TensorChanges& changes,
                  Fp8Versions* v) {
  for (const auto& [r0, r1] : RowRuns(rows)) {
    std::memcpy(v->child.data() + r0 * cols, v->parent.data() + r0 * cols, (r1 - r0) * cols * 2);
  }
  for (size_t k = 0; k < changes.indices.size(); ++k) {
    const uint64_t i = changes.indices[k];
    if (!rows[i / cols]) continue;
    v->child[i] = ApplyFp8Change(changes, k, v->child[i]);
  }
}

namespace {

struct ByteEntry {
  uint64_t index;
  uint8_t now, was;
};

// The bytes that change in the blocks the plan does not read: at the
// changed elements, old and new values at the block's unchanged scale.
std::vector<ByteEntry> SummaryBytes(const Fp8Summary& parent, const Fp8StepPlan& plan,
                                    const TensorChanges& c) {
  std::vector<std::vector<ByteEntry>> per(plan.blocks.size());
  kernels::ParallelFor(plan.blocks.size(), 16, [&](size_t lo, size_t hi) {
    for (size_t j = lo; j < hi; ++j) {
      if (plan.read[j]) continue;
      const float s = ScaleOf(*parent.blocks[plan.blocks[j]].Amax(), parent.layout.rule);
      for (size_t e = plan.starts[j]; e < plan.starts[j + 1]; ++e) {
        const size_t k = plan.entries[e];
        const uint8_t was = kernels::QuantizeE4m3(kernels::Bf16BitsToFp32(OldBits(c, k)), s);
        const uint8_t now = kernels::QuantizeE4m3(kernels::Bf16BitsToFp32(NewBits(c, k)), s);
        if (was != now) per[j].push_back({c.indices[k], now, was});
      }
    }
  });
  std::vector<ByteEntry> all;
  for (const auto& p : per) all.insert(all.end(), p.begin(), p.end());
  std::sort(all.begin(), all.end(),
            [](const ByteEntry& a, const ByteEntry& b) { return a.index < b.index; });
  return all;
}

// Merges the summary blocks' bytes into out's (both ascending).
void MergeBytes(const std::vector<ByteEntry>& more, Fp8Changes* out) {
  kernels::Fp8ChangeSet& s = out->set;
  const size_t n = s.byte_index.size();
  std::vector<uint64_t> index;
  std::vector<uint8_t> now, was;
  index.reserve(n + more.size());
  now.reserve(n + more.size());
  was.reserve(n + more.size());
  size_t a = 0, b = 0;
  while (a < n || b < more.size()) {
    if (b == more.size() || (a < n && s.byte_index[a] < more[b].index)) {
      index.push_back(s.byte_index[a]);
      now.push_back(s.byte_value[a]);
      was.push_back(out->old_bytes[a++]);
    } else {
      index.push_back(more[b].index);
      now.push_back(more[b].now);
      was.push_back(more[b++].was);
    }
  }
  s.byte_index = std::move(index);
  s.byte_value = std::move(now);
  out->old_bytes = std::move(was);
}

}  // namespace

Status FinishFp8Step(const Fp8Summary& parent, const Fp8StepPlan& plan, const Fp8Versions& v,
                     const TensorChanges& changes, const std::string& tensor, Fp8Changes* out,
                     Fp8Summary* next) {
  const kernels::Fp8Layout& l = parent.layout;
  std::vector<uint64_t> at;  // the changed elements of the blocks read
  std::vector<size_t> reads;
  for (size_t j = 0; j < plan.blocks.size(); ++j) {
    if (!plan.read[j]) continue;
    reads.push_back(j);
    for (size_t e = plan.starts[j]; e < plan.starts[j + 1]; ++e) {
      at.push_back(changes.indices[plan.entries[e]]);
    }
  }
  std::sort(at.begin(), at.end());
  RETURN_IF_ERROR(ComputeFp8ChangesAt(l, v, at.data(), at.size(), tensor, out));
  MergeBytes(SummaryBytes(parent, plan, changes), out);
  out->set.blocks_touched += plan.blocks.size() - reads.size();
  next->layout = l;
  next->blocks = parent.blocks;
  for (size_t j = 0; j < plan.blocks.size(); ++j) {
    if (!plan.read[j]) next->blocks[plan.blocks[j]] = plan.next[j];
  }
  kernels::ParallelFor(reads.size(), 4, [&](size_t lo, size_t hi) {
    for (size_t q = lo; q < hi; ++q) {
      const uint64_t b = plan.blocks[reads[q]];
      next->blocks[b] = SummarizeBlock(l, v.child.data(), b);
    }
  });
  return Status::Ok();
}

}  // namespace dte::push_internal
