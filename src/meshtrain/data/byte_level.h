// GPT-2's bytes_to_unicode, the alphabet byte-level BPE vocabularies are
// written in (tokenizers' ByteLevel pre-tokenizer and decoder): printable
// Latin-1 bytes stand for themselves, the others map to U+0100 onwards in byte
// order.
#pragma once

#include <array>
#include <optional>
#include <string>
#include <string_view>

namespace meshtrain {

// The UTF-8 text of each byte's character.
const std::array<std::string, 256>& byte_level_chars();
// `bytes` written in that alphabet.
std::string byte_level(std::string_view bytes);
// The bytes a string of that alphabet stands for; nullopt when a character is
// outside it (or the text is not UTF-8).
std::optional<std::string> from_byte_level(std::string_view text);

}  // namespace meshtrain
