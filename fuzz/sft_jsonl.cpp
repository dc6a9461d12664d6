// SFT JSONL records (data/sft.h) through the byte tokenizer: the dataset built
// from the file (packed or not, by the first byte), then every row read.
#include <vector>

#include "fuzz_support.h"
#include "meshtrain/data/sft.h"
#include "meshtrain/data/tokenizer.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace meshtrain;
  if (size < 1) return 0;
  static const std::string path = fuzz::scratch_dir() + "/train.jsonl";
  fuzz::write_file(path, fuzz::as_text(data + 1, size - 1));
  SftOptions options;
  options.seq_len = 1 + (data[0] >> 3);
  options.pack = data[0] & 1;
  options.truncate = data[0] & 2;
  options.shuffle = data[0] & 4;
  fuzz::run_reader([&] {
    const ByteTokenizer tokenizer;
    const SftDataset dataset({path}, tokenizer, options);
    std::vector<int32_t> inputs(options.seq_len), targets(options.seq_len), positions(options.seq_len);
    for (int64_t i = 0; i < dataset.num_samples(); ++i) {
      dataset.read_sample(i, inputs.data(), targets.data());
      if (dataset.has_positions()) dataset.read_positions(i, positions.data());
      dataset.loss_tokens(i);
    }
  });
  return 0;
}
