// dte-gen: writes a realistic sequence of BF16 checkpoints (AdamW at an RL
// learning rate on a Llama-style model) for tests, benchmarks and demos.
//
//   dte-gen --out DIR --size 8MiB --steps 5 --shard-size 3MiB
//
// See docs/generators.md.
#include <CLI/CLI.hpp>
#include <chrono>
#include <cstdio>
#include <string>
#include <thread>

#include "store/base/units.h"
#include "tools/gen/generator.h"
#include "tools/gen/model_spec.h"
#include "tools/gen/shard_plan.h"

namespace dte::gen {
namespace {

struct Flags {
  GenOptions gen;
  std::string size;
  std::string shard_size = "5GB";
  int64_t only_step = -1;
  bool dry_run = false;
  bool quiet = false;
};

void AddFlags(CLI::App* app, Flags* f) {
  app->add_option("-o,--out", f->gen.out_dir, "Output directory (gets step-NNNNNN/ dirs)")
      ->required();
  app->add_option("--size", f->size, "Target BF16 bytes per checkpoint, e.g. 8MiB, 512MiB, 2GiB");
  ModelDims& d = f->gen.dims;
  app->add_option("--hidden", d.hidden, "Hidden size (fixes it in the --size search)");
  app->add_option("--layers", d.layers, "Number of decoder layers");
  app->add_option("--intermediate", d.intermediate, "MLP intermediate size");
  app->add_option("--heads", d.heads, "Attention heads");
  app->add_option("--kv-heads", d.kv_heads, "Key/value heads (GQA)");
  app->add_option("--head-dim", d.head_dim, "Dimension per head");
  app->add_option("--vocab", d.vocab, "Vocabulary size");
  app->add_flag("--tie-embeddings", d.tied_embeddings, "Share embed_tokens with lm_head");
  app->add_flag("--dtype-mix", f->gen.dtype_mix, "Norms in F32 and an I64 buffer");
  app->add_option("--steps", f->gen.steps, "Optimizer steps (writes steps+1 checkpoints)")
      ->capture_default_str();
  app->add_option("--start", f->gen.first_step, "First step to write (earlier ones only run)");
  app->add_option("--only-step", f->only_step,
                  "Write just this step (same as --start K --steps K)");
  app->add_option("--seed", f->gen.seed, "Random seed")->capture_default_str();
  app->add_option("--lr", f->gen.adamw.lr, "AdamW learning rate")->capture_default_str();
  app->add_option("--weight-decay", f->gen.adamw.weight_decay, "AdamW weight decay")
      ->capture_default_str();
  app->add_option("--beta1", f->gen.adamw.beta1, "AdamW beta1")->capture_default_str();
  app->add_option("--beta2", f->gen.adamw.beta2, "AdamW beta2")->capture_default_str();
  app->add_option("--eps", f->gen.adamw.eps, "AdamW epsilon")->capture_default_str();
  app->add_option("--shard-size", f->shard_size, "Max bytes per shard file (HF max_shard_size)")
      ->capture_default_str();
  app->add_option("--threads", f->gen.threads,
                  "Worker threads (default: all cores; output does not depend on it)");
  app->add_flag("--dry-run", f->dry_run, "Print the model shape and sharding, write nothing");
  app->add_flag("-q,--quiet", f->quiet, "No progress on stderr");
}

std::string Percent(uint64_t part, uint64_t whole) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.3f%%", whole ? 100.0 * part / whole : 0.0);
  return buf;
}

void PrintStep(uint64_t step, const StepStats& s) {
  static const char* const kRoleNames[kRoleCount] = {"embed", "lm_head", "attn",
                                                     "mlp",   "norm",    "buffer"};
  std::string line = "step " + std::to_string(step) + " changed_bf16 " +
                     Percent(s.bf16_changed, s.bf16_total) + " (" + std::to_string(s.bf16_changed) +
                     "/" + std::to_string(s.bf16_total) + ")";
  if (s.f32_total > 0) line += " changed_f32 " + Percent(s.f32_changed, s.f32_total);
  line += "  [";
  for (size_t r = 0; r < kRoleCount; ++r) {
    if (s.role_total[r] == 0) continue;
    if (line.back() != '[') line += ", ";
    line += std::string(kRoleNames[r]) + " " + Percent(s.role_changed[r], s.role_total[r]);
  }
  std::printf("%s]\n", line.c_str());
}

Status Run(Flags* flags) {
  Flags& f = *flags;
  if (f.only_step >= 0) f.gen.first_step = f.gen.steps = static_cast<uint64_t>(f.only_step);
  uint64_t target = 0;
  if (!f.size.empty()) {
    ASSIGN_OR_RETURN(target, ParseByteSize(f.size));
  } else if (f.gen.dims.hidden == 0 && f.gen.dims.layers == 0) {
    target = 8ull << 20;
  }
  ASSIGN_OR_RETURN(f.gen.max_shard_bytes, ParseByteSize(f.shard_size));
  if ((!f.size.empty() && target == 0) || f.gen.max_shard_bytes == 0) {
    return InvalidArgument("--size and --shard-size must be positive");
  }
  ASSIGN_OR_RETURN(f.gen.dims, ChooseDims(target, f.gen.dims));
  if (f.gen.threads <= 0) f.gen.threads = std::max(1u, std::thread::hardware_concurrency());
  f.gen.progress = !f.quiet;
  const auto specs = BuildTensorList(f.gen.dims, f.gen.dtype_mix);
  const CheckpointPlan plan = PlanCheckpoint(specs, f.gen.max_shard_bytes);
  std::printf("model: %s\ncheckpoint: %s in %zu file(s), steps %llu..%llu\n",
              DescribeDims(f.gen.dims).c_str(), FormatByteSize(plan.total_size).c_str(),
              plan.shards.size(), static_cast<unsigned long long>(f.gen.first_step),
              static_cast<unsigned long long>(f.gen.steps));
  std::fflush(stdout);
  if (f.dry_run) return Status::Ok();
  const auto start = std::chrono::steady_clock::now();
  ASSIGN_OR_RETURN(std::vector<StepStats> stats, Generate(f.gen));
  for (uint64_t step = std::max<uint64_t>(1, f.gen.first_step); step <= f.gen.steps; ++step) {
    PrintStep(step, stats[step]);
  }
  std::chrono::duration<double> secs = std::chrono::steady_clock::now() - start;
  std::printf("wrote %llu checkpoint(s) to %s in %.2f s\n",
              static_cast<unsigned long long>(f.gen.steps - f.gen.first_step + 1),
              f.gen.out_dir.c_str(), secs.count());
  return Status::Ok();
}

}  // namespace
}  // namespace dte::gen

int main(int argc, char** argv) {
  CLI::App app{"Generate a sequence of BF16 checkpoints from simulated AdamW RL fine-tuning"};
  dte::gen::Flags flags;
  flags.gen.threads = 0;
  dte::gen::AddFlags(&app, &flags);
  CLI11_PARSE(app, argc, argv);
  dte::Status status = dte::gen::Run(&flags);
  if (!status.ok()) {
    std::fprintf(stderr, "dte-gen: %s\n", status.ToString().c_str());
    return 1;
  }
  return 0;
}
