// Token files in llm.c's format: a header of 256 little-endian int32 (magic
// 20240520, version 1, token count) followed by the tokens as little-endian
// uint16. Version 2 is meshtrain's for vocabularies past 65536 ids (Llama 3,
// Qwen): the same header, tokens as little-endian uint32 (llm.c reads version
// 1 only). Read by mmap; every header field and (given a vocabulary size)
// every token id is validated at open, so a bad file fails with one line
// naming it.
#pragma once

#include <cstdint>
#include <span>
#include <string>

namespace meshtrain {

inline constexpr int32_t kTokenFileMagic = 20240520;
inline constexpr int32_t kTokenFileVersion = 1;      // uint16 tokens
inline constexpr int32_t kTokenFileVersionWide = 2;  // uint32 tokens
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
  int bytes_per_token() const { return width_; }
  int32_t token(int64_t i) const;
  // Tokens [first, first + n) into out.
  void read(int64_t first, int64_t n, int32_t* out) const;

 private:
  void unmap();
  std::string path_;
  void* map_ = nullptr;
  size_t map_bytes_ = 0;
  const char* tokens_ = nullptr;
  int width_ = 2;
  int64_t count_ = 0;
};

// Whether `path` begins with a token file's magic (a cheap sniff: open validates the rest);
// false for a file that cannot be read.
bool is_token_file(const std::string& path);

// Writes `tokens` as a token file, atomically (temporary file, then rename):
// version 1 (uint16), or version 2 (uint32).
void write_token_file(const std::string& path, std::span<const uint16_t> tokens);
void write_token_file(const std::string& path, std::span<const uint32_t> tokens);

}  // namespace meshtrain
