// A safetensors file (ckpt/safetensors.h): the header, then every tensor read.
#include "fuzz_support.h"
#include "meshtrain/ckpt/safetensors.h"
#include "meshtrain/tensor/memory_tracker.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace meshtrain;
  static const std::string path = fuzz::scratch_dir() + "/model.safetensors";
  fuzz::write_file(path, fuzz::as_text(data, size));
  fuzz::run_reader([&] {
    SafetensorsReader reader(path);
    MemoryTracker tracker;
    for (const StTensorInfo& t : reader.tensors()) {
      if (st_dtype_is_float(t.dtype)) {
        reader.read_tensor(t.name, DType::f32, MemCategory::workspace, tracker);
      } else {
        reader.read_ints(t.name);
      }
    }
    for (const auto& entry : reader.metadata()) reader.metadata(entry.first);
  });
  return 0;
}
