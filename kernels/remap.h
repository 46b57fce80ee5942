// Index remapping between tensor layouts on the CPU backend (multi-threaded).
//
// A delta lists changed elements by flat index in the publisher's tensor; a
// receiver may hold a different tensor (a TP shard, a fused qkv or gate_up
// buffer) that overlaps it in a hyperrectangle. RemapIndices keeps the changed
// elements inside the overlap and turns their indices into the receiver's
// flat indices; RemapScatter does that and writes the elements' values into
// the receiver's tensor in one pass. The element math is in
// kernels/remap_math.h.
//
// Thread-safety: pure functions over caller-owned buffers.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "kernels/remap_math.h"

namespace dte::kernels {

// One overlap, all vectors of the same length ndim in [1, kRemapMaxDims],
// outermost dimension first, row-major tensors.
struct RemapSpec {
  std::vector<uint64_t> src_shape;
  std::vector<uint64_t> rect_start;   // box start in source coordinates
  std::vector<uint64_t> rect_extent;  // box size (zero extents allowed)
  std::vector<uint64_t> dst_shape;
  std::vector<uint64_t> dst_start;  // where rect_start lands in the destination
};

// Validates spec and fills *plan. Returns an empty string on success, else a
// message naming the offending dimension (the plan is then untouched). Checks:
// equal lengths, 1..8 dims, box within both tensors, element counts < 2^64.
std::string MakeRemapPlan(const RemapSpec& spec, RemapPlan* plan);

// src_idx[0 .. n) are flat source indices sorted ascending (duplicates
// allowed). For each k in order whose index lies in the box, writes its flat
// destination index to dst_idx_out[j] and, when pos_out is not null, k to
// pos_out[j], j counting from 0. Returns the number j of kept indices.
// Outputs need room for n entries in the worst case.
size_t RemapIndices(const RemapPlan& plan, const uint64_t* src_idx, size_t n, uint64_t* dst_idx_out,
                    uint64_t* pos_out);

// Fused remap + scatter: for each k in [0, n) whose src_idx[k] lies in the
// box, copies the k-th element (width bytes: 1, 2, 4 or 8; any other width
// is a caller bug treated as 8, as in change_detect.h) of vals to its
// destination index in dst. Returns the number of elements written. The
// src_idx must be distinct (any order); every destination index is then
// written at most once, so the work runs in parallel. dst must hold the
// whole destination tensor of the plan.
size_t RemapScatter(const RemapPlan& plan, const uint64_t* src_idx, const void* vals, size_t n,
                    int width, void* dst);
size_t RemapScatter(const RemapPlan& plan, const uint32_t* src_idx, const void* vals, size_t n,
                    int width, void* dst);

}  // namespace dte::kernels
