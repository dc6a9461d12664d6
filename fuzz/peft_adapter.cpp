// A PEFT adapter's adapter_config.json (ckpt/lora_export.h) for a tiny Llama,
// beside the adapter_model.safetensors export_peft writes for rank 2 on q/v.
#include <vector>

#include "fuzz_support.h"
#include "meshtrain/ckpt/lora_export.h"
#include "meshtrain/model/params.h"

namespace {

meshtrain::ModelConfig tiny_llama() {
  meshtrain::ModelConfig c;
  c.family = meshtrain::Family::llama;
  c.dim = 8;
  c.n_layers = 2;
  c.n_heads = 2;
  c.n_kv_heads = 1;
  c.hidden_dim = 16;
  c.vocab_size = 16;
  c.max_seq_len = 8;
  return c;
}

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
  static const ModelConfig base = tiny_llama();
  static const std::string dir = write_adapter(base);
  fuzz::write_file(dir + "/adapter_config.json", fuzz::as_text(data, size));
  fuzz::run_reader([&] { read_peft_adapter(dir, base); });
  return 0;
}
