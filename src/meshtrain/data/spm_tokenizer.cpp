#include "meshtrain/data/spm_tokenizer.h"

#include <sentencepiece_processor.h>

#include "meshtrain/util/error.h"

namespace meshtrain {

SpmTokenizer::SpmTokenizer(std::string path, TokenizerConfig config)
    : path_(std::move(path)),
      config_(std::move(config)),
      sp_(std::make_unique<sentencepiece::SentencePieceProcessor>()) {}

SpmTokenizer::~SpmTokenizer() = default;

std::unique_ptr<SpmTokenizer> SpmTokenizer::load(const std::string& path, TokenizerConfig config,
                                                 std::vector<File> files) {
  std::unique_ptr<SpmTokenizer> t(new SpmTokenizer(path, std::move(config)));
  t->files_ = files.empty() ? std::vector<File>{{path, "tokenizer.model"}} : std::move(files);
  const auto status = t->sp_->Load(path);
  MESHTRAIN_CHECK(status.ok(), "tokenizer '{}': not a SentencePiece model: {}", path,
                  status.ToString());
  return t;
}

int64_t SpmTokenizer::vocab_size() const { return sp_->GetPieceSize(); }

int32_t SpmTokenizer::eot_id() const {
  MESHTRAIN_CHECK(sp_->eos_id() >= 0, "tokenizer '{}': the model has no </s> piece", path_);
  return sp_->eos_id();
}

void SpmTokenizer::encode_ordinary(std::string_view text, std::vector<int32_t>& ids) const {
  std::vector<int> out;
  const auto status = sp_->Encode(text, &out);
  MESHTRAIN_CHECK(status.ok(), "tokenizer '{}': {}", path_, status.ToString());
  ids.insert(ids.end(), out.begin(), out.end());
}

void SpmTokenizer::encode(std::string_view text, std::vector<int32_t>& ids, bool add_special) const {
  if (add_special && sp_->bos_id() >= 0) ids.push_back(sp_->bos_id());
  encode_ordinary(text, ids);
}

std::string SpmTokenizer::decode(std::span<const int32_t> ids) const {
  std::vector<int> in;
  in.reserve(ids.size());
  for (int32_t id : ids) {
    MESHTRAIN_CHECK(id >= 0 && id < vocab_size(), "tokenizer '{}': cannot decode id {}: outside "
                    "the vocabulary of {} ids", path_, id, vocab_size());
    in.push_back(id);
  }
  std::string out;
  const auto status = sp_->Decode(in, &out);
  MESHTRAIN_CHECK(status.ok(), "tokenizer '{}': {}", path_, status.ToString());
  return out;
}

std::optional<int32_t> SpmTokenizer::token_id(std::string_view token) const {
  const int id = sp_->PieceToId(token);
  if (id < 0 || sp_->IdToPiece(id) != token) return std::nullopt;
  return id;
}

Tokenizer::DocumentFrame SpmTokenizer::document_frame() const {
  if (sp_->bos_id() >= 0) return {{sp_->bos_id()}, {}};
  return {{}, {eot_id()}};
}

}  // namespace meshtrain
