#include "meshtrain/data/spm_tokenizer.h"

#include <sentencepiece_processor.h>

#include <algorithm>
#include <functional>

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
  for (int id = 0; id < t->sp_->GetPieceSize(); ++id) {
    if (t->sp_->IsControl(id) && !t->sp_->IdToPiece(id).empty()) {
      t->controls_.emplace_back(t->sp_->IdToPiece(id), id);
      t->control_start_[static_cast<unsigned char>(t->controls_.back().first[0])] = true;
    }
  }
  std::ranges::stable_sort(t->controls_, std::greater{},
                           [](const auto& c) { return c.first.size(); });
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
  size_t begin = 0;  // of the stretch not yet encoded
  for (size_t i = 0; i < text.size();) {
    if (!control_start_[static_cast<unsigned char>(text[i])]) {
      ++i;
      continue;
    }
    const auto hit = std::ranges::find_if(
        controls_, [&](const auto& c) { return text.substr(i).starts_with(c.first); });
    if (hit == controls_.end()) {
      ++i;
      continue;
    }
    if (i > begin) encode_ordinary(text.substr(begin, i - begin), ids);
    ids.push_back(hit->second);
    i += hit->first.size();
    begin = i;
  }
  if (begin < text.size()) encode_ordinary(text.substr(begin), ids);
}

bool SpmTokenizer::is_special(int32_t id) const { return sp_->IsControl(id); }

std::string SpmTokenizer::token_text(int32_t id) const {
  MESHTRAIN_CHECK(id >= 0 && id < vocab_size(), "tokenizer '{}': no piece {}", path_, id);
  std::string piece = sp_->IdToPiece(id);
  if (sp_->IsByte(id)) return std::string(1, static_cast<char>(std::stoi(piece.substr(3, 2), nullptr, 16)));
  if (sp_->IsControl(id) || sp_->IsUnknown(id)) return piece;
  std::string out;  // "▁" (U+2581) is the space
  for (size_t i = 0; i < piece.size();) {
    if (piece.compare(i, 3, "\xE2\x96\x81") == 0) {
      out += ' ';
      i += 3;
    } else {
      out += piece[i++];
    }
  }
  return out;
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
