// A PEFT adapter's adapter_config.json (ckpt/lora_export.h) for a tiny Llama,
// beside the adapter_model.safetensors export_peft writes for rank 2 on q/v.
#include <algorithm>
#include <vector>

#include "fuzz_support.h"
#include "meshtrain/ckpt/lora_export.h"
#include "meshtrain/model/params.h"
#include "model_support.h"

namespace {

std::string write_adapter(const meshtrain::ModelConfig& base) {
  using namespace meshtrain;
  ModelConfig with_lora = base;
  with_lora.lora.rank = 2;
  const std::string dir = fuzz::scratch_dir("adapter");
  export_peft(with_lora, [](const ParamSpec& spec, float* out) {
    std::fill_n(out, shape_numel(spec.shape), 0.5f);
  }, dir);
  return dir;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace meshtrain;
  static const ModelConfig base = fuzz::tiny_llama(2, true);
  static const std::string dir = write_adapter(base);
  fuzz::write_file(dir + "/adapter_config.json", fuzz::as_text(data, size));
  fuzz::run_reader([&] { read_peft_adapter(dir, base); });
  return 0;
}
