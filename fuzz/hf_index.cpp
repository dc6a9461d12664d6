// A sharded Hugging Face directory's model.safetensors.index.json (ckpt/hf.h)
// over two fixed shards of a tiny Llama, then every tensor read through it.
#include <algorithm>
#include <vector>

#include "fuzz_support.h"
#include "meshtrain/ckpt/hf.h"
#include "meshtrain/ckpt/safetensors.h"
#include "meshtrain/model/params.h"
#include "model_support.h"

namespace {

// The model's tensors, the first half in shard 1, the rest in shard 2 (zeros).
std::string write_shards(const meshtrain::ModelConfig& config) {
  using namespace meshtrain;
  const std::string dir = fuzz::scratch_dir("hf");
  const std::vector<ParamSpec> specs = build_param_specs(config);
  static std::vector<float> zeros;
  for (const ParamSpec& spec : specs) {
    zeros.resize(std::max<size_t>(zeros.size(), static_cast<size_t>(shape_numel(spec.shape))));
  }
  SafetensorsWriter first, second;
  for (size_t i = 0; i < specs.size(); ++i) {
    (i < specs.size() / 2 ? first : second).add(specs[i].name, StDType::F32, specs[i].shape, zeros.data());
  }
  first.write(dir + "/model-00001-of-00002.safetensors");
  second.write(dir + "/model-00002-of-00002.safetensors");
  return dir;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace meshtrain;
  static const ModelConfig config = fuzz::tiny_llama(1, false);
  static const std::string dir = write_shards(config);
  fuzz::write_file(dir + "/model.safetensors.index.json", fuzz::as_text(data, size));
  fuzz::run_reader([&] {
    MemoryTracker tracker;
    const TensorSource source = hf_tensors(dir, config, tracker);
    std::vector<float> out;
    for (const ParamSpec& spec : build_param_specs(config)) {
      out.resize(static_cast<size_t>(shape_numel(spec.shape)));
      source(spec, out.data());
    }
  });
  return 0;
}
