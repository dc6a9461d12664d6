// Test helper for the ctest reference_hf_export: loads a fixture's weights,
// exports them as a Hugging Face checkpoint and writes meshtrain's logits for
// fixed tokens, so check_hf_export.py can evaluate the exported files with a
// rotate_half (Hugging Face convention) reference and compare.
//   hf_export_tool <case.weights.safetensors> <out_dir>
#include <cstdio>
#include <vector>

#include "meshtrain/backend/cpu/cpu_backend.h"
#include "meshtrain/ckpt/hf.h"
#include "meshtrain/ckpt/safetensors.h"
#include "meshtrain/ckpt/weights.h"
#include "meshtrain/util/error.h"

int main(int argc, char** argv) {
  using namespace meshtrain;
  if (argc != 3) {
    std::fprintf(stderr, "usage: hf_export_tool <weights.safetensors> <out_dir>\n");
    return 2;
  }
  try {
    MemoryTracker tracker;
    cpu::CpuBackend ctx(0, tracker);
    SafetensorsReader weights(argv[1]);
    Model model(parse_hf_config(weights.metadata("config"), argv[1]), Precision::fp32, ctx);
    load_model_weights(model, weights);
    const std::string out = argv[2];
    export_hf(model, out + "/hf");

    const int64_t batch = 2, seq = model.config().max_seq_len, vocab = model.config().vocab_size;
    std::vector<int32_t> ids(static_cast<size_t>(batch * seq));
    for (size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<int32_t>((i * 31 + 7) % vocab);
    Tensor logits({batch * seq, vocab}, DType::f32, MemCategory::workspace, tracker);
    model.forward_logits(ids.data(), batch, seq, logits.data<float>());
    SafetensorsWriter writer;
    writer.add("tokens", StDType::I32, {batch, seq}, ids.data());
    writer.add("logits", logits);
    writer.write(out + "/meshtrain_logits.safetensors");
  } catch (const Error& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
  return 0;
}
