#include "sync/transfer/plan_inputs.h"

#include <string>

#include "store/materialize.h"
#include "store/store.h"
#include "sync/convert/convert.h"

namespace dte {

Result<PlanInputs> PlanInputsOf(Store& store, const Version& v) {
  const std::string name = VersionName(v.manifest.version);
  const FileEntry* config = nullptr;
  PlanInputs in;
  for (const FileEntry& f : v.manifest.files) {
    if (f.name == "config.json") config = &f;
    for (const TensorEntry& t : f.tensors) {
      PlanTensor p{t.name, t.dtype, {}};
      for (int64_t d : t.shape) p.shape.push_back(static_cast<uint64_t>(d));
      in.canonical.push_back(std::move(p));
    }
  }
  if (!config) {
    return InvalidArgument("receivers need the attention geometry from config.json, and " + name +
                           " has none");
  }
  Materializer reader(&store);
  ASSIGN_OR_RETURN(std::string json,
                   reader.ReadWholeBlob(config->blob, config->size, name + "/config.json"));
  ASSIGN_OR_RETURN(HfAttention g, ParseHfAttention(json, name + "/config.json"));
  in.geometry = {static_cast<uint64_t>(g.heads), static_cast<uint64_t>(g.kv_heads),
                 static_cast<uint64_t>(g.head_dim)};
  return in;
}

}  // namespace dte
