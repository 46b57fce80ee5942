// mcore2hf: converts a sharded Megatron-Core checkpoint (per-rank safetensors
// files, see sync/convert/convert_dir.h) into a Hugging Face model directory that
// `dtectl import` / `dtectl commit` accept.
//
//   mcore2hf --tp 2 --ep 4 IN_DIR OUT_DIR
//
// IN_DIR holds config.json (the HF config of the model), the rank files
// mp_rank_TT_EEE.safetensors, and any tokenizer files, which are copied.
#include <CLI/CLI.hpp>
#include <cstdio>
#include <string>

#include "store/base/posix_file.h"
#include "store/base/units.h"
#include "sync/convert/convert.h"
#include "sync/convert/convert_dir.h"

namespace {

struct Args {
  std::string in_dir;
  std::string out_dir;
  dte::ParallelLayout layout;
  std::string norms = "te";
  std::string experts = "sequential";
  std::string max_file = "5GB";
};

dte::Status Run(const Args& args) {
  dte::ParallelLayout layout = args.layout;
  layout.norms = args.norms == "te" ? dte::McoreNorms::kTransformerEngine : dte::McoreNorms::kLocal;
  layout.experts =
      args.experts == "sequential" ? dte::McoreExperts::kSequential : dte::McoreExperts::kGrouped;
  const std::string config_path = args.in_dir + "/config.json";
  ASSIGN_OR_RETURN(std::string config, dte::ReadWholeFile(config_path));
  ASSIGN_OR_RETURN(dte::ModelSpec spec, dte::ParseHfConfig(config, config_path));
  ASSIGN_OR_RETURN(std::vector<dte::ConvertUnit> plan, dte::PlanConversion(spec, layout));
  ASSIGN_OR_RETURN(auto source, dte::RankFileSource::Open(args.in_dir, layout));
  dte::HfDirOptions options;
  ASSIGN_OR_RETURN(options.max_file_bytes, dte::ParseByteSize(args.max_file));
  if (options.max_file_bytes == 0) return dte::InvalidArgument("--max-file-size must be positive");
  options.copy_from = args.in_dir;
  ASSIGN_OR_RETURN(dte::HfDirResult result,
                   dte::WriteHfDirectory(plan, *source, args.out_dir, options));
  std::printf("%s: %llu units, %llu tensors, %s in %llu files; peak unit %s\n",
              args.out_dir.c_str(), static_cast<unsigned long long>(result.stats.units),
              static_cast<unsigned long long>(result.stats.tensors),
              dte::FormatByteSize(result.stats.bytes).c_str(),
              static_cast<unsigned long long>(result.files),
              dte::FormatByteSize(result.stats.peak_bytes).c_str());
  return dte::Status::Ok();
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Convert a sharded Megatron-Core checkpoint into a Hugging Face model directory"};
  Args args;
  app.add_option("in_dir", args.in_dir, "config.json + mp_rank_TT_EEE.safetensors files")
      ->required();
  app.add_option("out_dir", args.out_dir, "output directory (must not exist)")->required();
  app.add_option("--tp", args.layout.tp, "tensor parallel size")->required();
  app.add_option("--ep", args.layout.ep, "expert parallel size")->capture_default_str();
  app.add_option("--etp", args.layout.etp, "expert tensor parallel size (default: --tp)");
  app.add_option("--vocab-divisible-by", args.layout.vocab_divisible_by,
                 "Megatron's --make-vocab-size-divisible-by")
      ->capture_default_str();
  app.add_option("--norms", args.norms, "layer norm names: te (fused) or local")
      ->check(CLI::IsMember({"te", "local"}))
      ->capture_default_str();
  app.add_option("--experts", args.experts, "expert names: sequential or grouped")
      ->check(CLI::IsMember({"sequential", "grouped"}))
      ->capture_default_str();
  app.add_option("--max-file-size", args.max_file, "data bytes per output file")
      ->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  dte::Status st = Run(args);
  if (!st.ok()) {
    std::fprintf(stderr, "mcore2hf: %s\n", st.message().c_str());
    return 1;
  }
  return 0;
}
