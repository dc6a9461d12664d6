// A whole-tensor checkpoint's train_state.json (train/checkpoint.h): the train
// state and the saved config in it, as a resume reads them.
#include "fuzz_support.h"
#include "meshtrain/train/checkpoint.h"
#include "meshtrain/train/config.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace meshtrain;
  static const std::string dir = fuzz::scratch_dir("step_1");
  fuzz::write_file(dir + "/train_state.json", fuzz::as_text(data, size));
  fuzz::run_reader([&] {
    TrainConfig config;
    read_train_state(dir, &config);
  });
  return 0;
}
