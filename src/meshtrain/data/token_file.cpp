#include "meshtrain/data/token_file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <array>
#include <bit>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <utility>

#include "meshtrain/util/error.h"
#include "meshtrain/util/unique_fd.h"

namespace meshtrain {

static_assert(std::endian::native == std::endian::little,
              "token files are little-endian; a big-endian host needs byte swaps here");

TokenFile::TokenFile(std::string path, int64_t vocab_size) : path_(std::move(path)) {
  UniqueFd fd(::open(path_.c_str(), O_RDONLY | O_CLOEXEC));
  MESHTRAIN_CHECK(fd.valid(), "data file '{}': cannot open: {}", path_, std::strerror(errno));
  struct stat st {};
  MESHTRAIN_CHECK(::fstat(fd.get(), &st) == 0 && S_ISREG(st.st_mode),
                  "data file '{}': not a regular file", path_);
  auto file_bytes = static_cast<int64_t>(st.st_size);
  MESHTRAIN_CHECK(file_bytes >= kTokenFileHeaderBytes,
                  "data file '{}': truncated: {} bytes, shorter than the {}-byte header", path_,
                  file_bytes, kTokenFileHeaderBytes);
  map_bytes_ = static_cast<size_t>(file_bytes);
  map_ = ::mmap(nullptr, map_bytes_, PROT_READ, MAP_PRIVATE, fd.get(), 0);
  fd.reset();  // the mapping keeps the file
  if (map_ == MAP_FAILED) {
    map_ = nullptr;
    fail_as(ErrorKind::io, "data file '{}': mmap failed: {}", path_, std::strerror(errno));
  }
  // From here on the destructor will not run if we throw, so unmap by hand.
  try {
    std::array<int32_t, 3> header{};
    std::memcpy(header.data(), map_, sizeof header);
    MESHTRAIN_CHECK(header[0] == kTokenFileMagic,
                    "data file '{}': bad magic {} (expected {}: an llm.c token file)", path_,
                    header[0], kTokenFileMagic);
    MESHTRAIN_CHECK(header[1] == kTokenFileVersion || header[1] == kTokenFileVersionWide,
                    "data file '{}': unsupported version {} (expected {}: uint16 tokens, or {}: "
                    "uint32)", path_, header[1], kTokenFileVersion, kTokenFileVersionWide);
    width_ = header[1] == kTokenFileVersion ? 2 : 4;
    count_ = header[2];
    MESHTRAIN_CHECK(count_ >= 0, "data file '{}': negative token count {}", path_, count_);
    int64_t expected = kTokenFileHeaderBytes + width_ * count_;
    MESHTRAIN_CHECK(file_bytes >= expected,
                    "data file '{}': truncated: header says {} tokens ({} bytes), file has {} bytes",
                    path_, count_, expected, file_bytes);
    MESHTRAIN_CHECK(file_bytes == expected,
                    "data file '{}': {} bytes after the {} tokens the header announces", path_,
                    file_bytes - expected, count_);
    tokens_ = static_cast<const char*>(map_) + kTokenFileHeaderBytes;
    if (vocab_size > 0) {
      for (int64_t i = 0; i < count_; ++i) {
        const int64_t id = width_ == 2 ? int64_t{token(i)} : int64_t{static_cast<uint32_t>(token(i))};
        MESHTRAIN_CHECK(id < vocab_size,
                        "data file '{}': token {} has id {}, not below the vocabulary size {}",
                        path_, i, id, vocab_size);
      }
    }
  } catch (...) {
    unmap();
    throw;
  }
}

TokenFile::~TokenFile() { unmap(); }

int32_t TokenFile::token(int64_t i) const {
  if (width_ == 2) {
    uint16_t v;
    std::memcpy(&v, tokens_ + 2 * i, 2);
    return v;
  }
  int32_t v;
  std::memcpy(&v, tokens_ + 4 * i, 4);
  return v;
}

void TokenFile::read(int64_t first, int64_t n, int32_t* out) const {
  MESHTRAIN_CHECK(first >= 0 && n >= 0 && first + n <= count_,
                  "data file '{}': tokens [{}, {}) outside its {}", path_, first, first + n, count_);
  if (width_ == 4) {
    std::memcpy(out, tokens_ + 4 * first, 4 * static_cast<size_t>(n));
    return;
  }
  for (int64_t i = 0; i < n; ++i) out[i] = token(first + i);
}

void TokenFile::unmap() {
  if (map_ != nullptr) ::munmap(map_, map_bytes_);
  map_ = nullptr;
  tokens_ = nullptr;
}

TokenFile::TokenFile(TokenFile&& other) noexcept
    : path_(std::move(other.path_)),
      map_(std::exchange(other.map_, nullptr)),
      map_bytes_(other.map_bytes_),
      tokens_(std::exchange(other.tokens_, nullptr)),
      width_(other.width_),
      count_(other.count_) {}

TokenFile& TokenFile::operator=(TokenFile&& other) noexcept {
  if (this != &other) {
    unmap();
    path_ = std::move(other.path_);
    map_ = std::exchange(other.map_, nullptr);
    map_bytes_ = other.map_bytes_;
    tokens_ = std::exchange(other.tokens_, nullptr);
    width_ = other.width_;
    count_ = other.count_;
  }
  return *this;
}

bool is_token_file(const std::string& path) {
  std::FILE* f = std::fopen(path.c_str(), "rb");
  if (f == nullptr) return false;
  int32_t magic = 0;
  const bool read = std::fread(&magic, sizeof magic, 1, f) == 1;
  std::fclose(f);
  return read && magic == kTokenFileMagic;
}

namespace {

void write_tokens(const std::string& path, const void* tokens, size_t count, int width) {
  MESHTRAIN_CHECK(count <= 0x7fffffffu, "data file '{}': {} tokens exceed the format's limit",
                  path, count);
  std::array<int32_t, 256> header{};
  header[0] = kTokenFileMagic;
  header[1] = width == 2 ? kTokenFileVersion : kTokenFileVersionWide;
  header[2] = static_cast<int32_t>(count);
  std::string tmp = path + ".tmp";
  std::FILE* f = std::fopen(tmp.c_str(), "wb");
  MESHTRAIN_CHECK_AS(ErrorKind::io, f != nullptr, "data file '{}': cannot write: {}", tmp,
                     std::strerror(errno));
  bool ok = std::fwrite(header.data(), sizeof header, 1, f) == 1;
  if (count > 0) ok = ok && std::fwrite(tokens, static_cast<size_t>(width), count, f) == count;
  ok = (std::fclose(f) == 0) && ok;
  if (!ok || std::rename(tmp.c_str(), path.c_str()) != 0) {
    std::remove(tmp.c_str());
    fail_as(ErrorKind::io, "data file '{}': write failed: {}", path, std::strerror(errno));
  }
}

}  // namespace

void write_token_file(const std::string& path, std::span<const uint16_t> tokens) {
  write_tokens(path, tokens.data(), tokens.size(), 2);
}

void write_token_file(const std::string& path, std::span<const uint32_t> tokens) {
  write_tokens(path, tokens.data(), tokens.size(), 4);
}

}  // namespace meshtrain
