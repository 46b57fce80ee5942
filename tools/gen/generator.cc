#include "tools/gen/generator.h"

#include <atomic>
#include <chrono>
#include <cstdio>
#include <thread>

#include "store/base/units.h"
#include "tools/gen/file_util.h"
#include "tools/gen/hf_files.h"
#include "tools/gen/shard_plan.h"

namespace dte::gen {
namespace {

constexpr int64_t kBlockElements = 1 << 17;  // per block: ~2.5 MiB of state

struct Block {
  size_t tensor = 0;
  int64_t row_begin = 0;
  int64_t row_end = 0;
};

// What every worker of one shard shares (read-only while they run).
struct ShardJob {
  const GenOptions* options = nullptr;
  const std::vector<TensorSpec>* specs = nullptr;
  const CheckpointPlan* plan = nullptr;
  const std::vector<File>* files = nullptr;  // one per written step
  std::vector<Block> blocks;
};

std::vector<Block> SplitIntoBlocks(const std::vector<TensorSpec>& specs,
                                   const std::vector<size_t>& tensors) {
  std::vector<Block> blocks;
  for (size_t t : tensors) {
    const int64_t rows = specs[t].rows();
    const int64_t per_block = std::max<int64_t>(1, kBlockElements / specs[t].cols());
    for (int64_t r = 0; r < rows; r += per_block) {
      blocks.push_back({t, r, std::min(rows, r + per_block)});
    }
  }
  return blocks;
}

void Count(const TensorSpec& spec, uint64_t changed, uint64_t total, StepStats* stats) {
  if (spec.dtype == DType::kBF16) {
    stats->bf16_changed += changed;
    stats->bf16_total += total;
    stats->role_changed[static_cast<size_t>(spec.role)] += changed;
    stats->role_total[static_cast<size_t>(spec.role)] += total;
  } else if (spec.dtype == DType::kF32) {
    stats->f32_changed += changed;
    stats->f32_total += total;
  }
}

// Carries one block through every step, writing the steps that are kept.
Status RunBlock(const ShardJob& job, const Block& block, ChunkSimulator* sim,
                std::vector<StepStats>* stats) {
  const GenOptions& opt = *job.options;
  const TensorSpec& spec = (*job.specs)[block.tensor];
  const uint64_t row_bytes = static_cast<uint64_t>(spec.cols()) * DTypeWidth(spec.dtype);
  const uint64_t offset = job.plan->placements[block.tensor].offset +
                          static_cast<uint64_t>(block.row_begin) * row_bytes;
  const uint64_t elements = static_cast<uint64_t>((block.row_end - block.row_begin) * spec.cols());
  sim->Begin(spec, block.row_begin, block.row_end);
  if (opt.first_step == 0) RETURN_IF_ERROR((*job.files)[0].PwriteAll(sim->encoded(), offset));
  for (uint64_t step = 1; step <= opt.steps; ++step) {
    Count(spec, sim->Advance(step), elements, &(*stats)[step]);
    if (step >= opt.first_step) {
      RETURN_IF_ERROR((*job.files)[step - opt.first_step].PwriteAll(sim->encoded(), offset));
    }
  }
  return Status::Ok();
}

void Merge(const std::vector<StepStats>& from, std::vector<StepStats>* into) {
  for (size_t t = 0; t < from.size(); ++t) {
    StepStats& s = (*into)[t];
    s.bf16_changed += from[t].bf16_changed;
    s.bf16_total += from[t].bf16_total;
    s.f32_changed += from[t].f32_changed;
    s.f32_total += from[t].f32_total;
    for (size_t r = 0; r < kRoleCount; ++r) {
      s.role_changed[r] += from[t].role_changed[r];
      s.role_total[r] += from[t].role_total[r];
    }
  }
}

// Runs the shard's blocks on options.threads workers; each worker keeps its
// own stats and status, merged after join, so no lock is needed.
Status RunShard(const ShardJob& job, std::vector<StepStats>* stats) {
  const int workers = std::max(1, job.options->threads);
  std::atomic<size_t> next{0};
  std::atomic<bool> failed{false};
  std::vector<Status> status(workers);
  std::vector<std::vector<StepStats>> local(workers, std::vector<StepStats>(stats->size()));
  auto work = [&](int id) {
    ChunkSimulator sim(job.options->seed, job.options->adamw);
    for (size_t b = next++; b < job.blocks.size() && !failed; b = next++) {
      status[id] = RunBlock(job, job.blocks[b], &sim, &local[id]);
      if (!status[id].ok()) failed = true;
    }
  };
  std::vector<std::thread> threads;
  for (int id = 1; id < workers; ++id) threads.emplace_back(work, id);
  work(0);
  for (auto& t : threads) t.join();
  for (int id = 0; id < workers; ++id) {
    RETURN_IF_ERROR(status[id]);
    Merge(local[id], stats);
  }
  return Status::Ok();
}

std::string StepDir(const GenOptions& opt, uint64_t step) {
  return opt.out_dir + "/" + StepDirName(step);
}

// Creates every step directory with its config, tokenizer and index files.
Status WriteStepDirs(const GenOptions& opt, const CheckpointPlan& plan) {
  const auto files = ModelDirFiles(opt.dims);
  for (uint64_t step = opt.first_step; step <= opt.steps; ++step) {
    const std::string dir = StepDir(opt, step);
    RETURN_IF_ERROR(MakeDirs(dir));
    RETURN_IF_ERROR(RemoveStaleWeights(dir));
    for (const auto& [name, contents] : files) {
      RETURN_IF_ERROR(WriteWholeFile(dir + "/" + name, contents));
    }
    if (!plan.index_json.empty()) {
      RETURN_IF_ERROR(WriteWholeFile(dir + "/" + kIndexFileName, plan.index_json));
    }
  }
  return Status::Ok();
}

// Creates the shard file of every written step, header in place.
Result<std::vector<File>> CreateShardFiles(const GenOptions& opt, const ShardPlan& shard) {
  std::vector<File> files;
  for (uint64_t step = opt.first_step; step <= opt.steps; ++step) {
    ASSIGN_OR_RETURN(File file,
                     File::Create(StepDir(opt, step) + "/" + shard.file_name, shard.file_size));
    RETURN_IF_ERROR(file.PwriteAll(
        {reinterpret_cast<const uint8_t*>(shard.header.data()), shard.header.size()}, 0));
    files.push_back(std::move(file));
  }
  return files;
}

}  // namespace

std::string StepDirName(uint64_t step) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "step-%06llu", static_cast<unsigned long long>(step));
  return buf;
}

Result<std::vector<StepStats>> Generate(const GenOptions& opt) {
  if (opt.first_step > opt.steps) {
    return InvalidArgument("first step " + std::to_string(opt.first_step) + " is after the last (" +
                           std::to_string(opt.steps) + ")");
  }
  const std::vector<TensorSpec> specs = BuildTensorList(opt.dims, opt.dtype_mix);
  const CheckpointPlan plan = PlanCheckpoint(specs, opt.max_shard_bytes);
  RETURN_IF_ERROR(WriteStepDirs(opt, plan));
  std::vector<StepStats> stats(opt.steps + 1);
  const auto start = std::chrono::steady_clock::now();
  for (size_t s = 0; s < plan.shards.size(); ++s) {
    ASSIGN_OR_RETURN(std::vector<File> files, CreateShardFiles(opt, plan.shards[s]));
    ShardJob job{&opt, &specs, &plan, &files, SplitIntoBlocks(specs, plan.shards[s].tensors)};
    RETURN_IF_ERROR(RunShard(job, &stats));
    for (File& f : files) RETURN_IF_ERROR(f.Close());
    if (opt.progress) {
      std::chrono::duration<double> elapsed = std::chrono::steady_clock::now() - start;
      std::fprintf(stderr, "dte-gen: shard %zu/%zu (%s, %s) written for %llu step(s), %.1f s\n",
                   s + 1, plan.shards.size(), plan.shards[s].file_name.c_str(),
                   FormatByteSize(plan.shards[s].file_size).c_str(),
                   static_cast<unsigned long long>(opt.steps - opt.first_step + 1),
                   elapsed.count());
    }
  }
  return stats;
}

}  // namespace dte::gen
