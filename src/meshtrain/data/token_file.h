// Token files in llm.c's format: a header of 256 little-endian int32 (magic
// 20240520, version 1, token count) followed by the tokens as little-endian
// uint16. Read by mmap; every header field and (given a vocabulary size) every
// token id is validated at open, so a bad file fails with one line naming it.
#pragma once

#include <cstdint>
#include <span>
#include <string>

namespace meshtrain {

inline constexpr int32_t kTokenFileMagic = 20240520;
inline constexpr int32_t kTokenFileVersion = 1;
inline constexpr int64_t kTokenFileHeaderBytes = 256 * 4;

class TokenFile {
 public:
  // Maps `path`. vocab_size > 0 also checks that every token id is below it.
  explicit TokenFile(std::string path, int64_t vocab_size = 0);
  ~TokenFile();
  TokenFile(TokenFile&& other) noexcept;
  TokenFile& operator=(TokenFile&& other) noexcept;
  TokenFile(const TokenFile&) = delete;
  TokenFile& operator=(const TokenFile&) = delete;

  const std::string& path() const { return path_; }
  int64_t size() const { return count_; }  // number of tokens
  const uint16_t* tokens() const { return tokens_; }

 private:
  void unmap();
  std::string path_;
  void* map_ = nullptr;
  size_t map_bytes_ = 0;
  const uint16_t* tokens_ = nullptr;
  int64_t count_ = 0;
};

// Whether `path` begins with a token file's magic (a cheap sniff: open validates the rest);
// false for a file that cannot be read.
bool is_token_file(const std::string& path);

// Writes `tokens` as a token file, atomically (temporary file, then rename).
void write_token_file(const std::string& path, std::span<const uint16_t> tokens);

}  // namespace meshtrain
