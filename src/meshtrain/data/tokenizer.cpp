#include "meshtrain/data/tokenizer.h"

#include "meshtrain/data/bpe_tokenizer.h"
#include "meshtrain/util/error.h"

namespace meshtrain {

void ByteTokenizer::encode_ordinary(std::string_view text, std::vector<int32_t>& ids) const {
  ids.reserve(ids.size() + text.size());
  for (char c : text) ids.push_back(static_cast<unsigned char>(c));
}

std::string ByteTokenizer::decode(std::span<const int32_t> ids) const {
  std::string out;
  out.reserve(ids.size());
  for (int32_t id : ids) {
    MESHTRAIN_CHECK(id >= 0 && id < 256, "tokenizer 'bytes': cannot decode id {}: not a byte", id);
    out.push_back(static_cast<char>(id));
  }
  return out;
}

std::unique_ptr<Tokenizer> make_tokenizer(std::string_view kind, const std::string& gpt2_ranks) {
  if (kind == "gpt2") return BpeTokenizer::load(gpt2_ranks);
  if (kind == "bytes") return std::make_unique<ByteTokenizer>();
  fail("tokenizer '{}': unknown (expected 'gpt2' or 'bytes')", kind);
}

}  // namespace meshtrain
