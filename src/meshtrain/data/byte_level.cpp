#include "meshtrain/data/byte_level.h"

#include <unordered_map>

namespace meshtrain {

const std::array<std::string, 256>& byte_level_chars() {
  static const std::array<std::string, 256> table = [] {
    std::array<std::string, 256> t;
    int next = 256;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
      const int code = printable ? b : next++;
      std::string s;
      if (code < 0x80) {
        s.push_back(static_cast<char>(code));
      } else {
        s.push_back(static_cast<char>(0xC0 | (code >> 6)));
        s.push_back(static_cast<char>(0x80 | (code & 0x3F)));
      }
      t[static_cast<size_t>(b)] = s;
    }
    return t;
  }();
  return table;
}

std::string byte_level(std::string_view bytes) {
  std::string out;
  for (unsigned char b : bytes) out += byte_level_chars()[b];
  return out;
}

std::optional<std::string> from_byte_level(std::string_view text) {
  // Every character of the alphabet is one or two UTF-8 bytes.
  static const std::unordered_map<std::string, char> back = [] {
    std::unordered_map<std::string, char> m;
    for (int b = 0; b < 256; ++b) m.emplace(byte_level_chars()[static_cast<size_t>(b)], static_cast<char>(b));
    return m;
  }();
  std::string out;
  for (size_t i = 0; i < text.size();) {
    const size_t len = (static_cast<unsigned char>(text[i]) & 0x80) == 0 ? 1 : 2;
    if (i + len > text.size()) return std::nullopt;
    auto it = back.find(std::string(text.substr(i, len)));
    if (it == back.end()) return std::nullopt;
    out.push_back(it->second);
    i += len;
  }
  return out;
}

}  // namespace meshtrain
