#include "meshtrain/train/data_source.h"

#include "meshtrain/data/preference.h"
#include "meshtrain/data/sft.h"
#include "meshtrain/data/tokenizer.h"
#include "meshtrain/util/error.h"

namespace meshtrain {

std::unique_ptr<SampleSource> open_sample_source(const TrainConfig& config,
                                                 const std::vector<std::string>& files,
                                                 bool train) {
  const TrainSettings& t = config.train;
  if (!config.data.records()) {
    return std::make_unique<TokenDataset>(files, config.model.vocab_size, t.seq_len);
  }
  const std::unique_ptr<Tokenizer> tokenizer =
      make_tokenizer(config.data.tokenizer, config.data.gpt2_ranks);
  MESHTRAIN_CHECK(tokenizer->vocab_size() <= config.model.vocab_size,
                  "data: tokenizer '{}' has {} ids; model.vocab_size is {}", tokenizer->name(),
                  tokenizer->vocab_size(), config.model.vocab_size);
  SftOptions options;
  options.seq_len = t.seq_len;
  options.pack = config.data.sft_pack;
  options.truncate = config.data.sft_overflow == "truncate";
  options.shuffle = train;
  options.seed = t.seed;
  if (config.data.preference()) return open_preference_dataset(files, *tokenizer, options);
  return std::make_unique<SftDataset>(files, sft_record_reader(config.data.format, *tokenizer),
                                      tokenizer->eot_id(), options);
}

}  // namespace meshtrain
