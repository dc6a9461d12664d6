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
    MESHTRAIN_CHECK(header[1] == kTokenFileVersion,
                    "data file '{}': unsupported version {} (expected {})", path_, header[1],
                    kTokenFileVersion);
    count_ = header[2];
    MESHTRAIN_CHECK(count_ >= 0, "data file '{}': negative token count {}", path_, count_);
    int64_t expected = kTokenFileHeaderBytes + 2 * count_;
    MESHTRAIN_CHECK(file_bytes >= expected,
                    "data file '{}': truncated: header says {} tokens ({} bytes), file has {} bytes",
                    path_, count_, expected, file_bytes);
    MESHTRAIN_CHECK(file_bytes == expected,
                    "data file '{}': {} bytes after the {} tokens the header announces", path_,
                    file_bytes - expected, count_);
    tokens_ = reinterpret_cast<const uint16_t*>(static_cast<const char*>(map_) +
                                                kTokenFileHeaderBytes);
    if (vocab_size > 0) {
      for (int64_t i = 0; i < count_; ++i) {
        MESHTRAIN_CHECK(tokens_[i] < vocab_size,
                        "data file '{}': token {} has id {}, not below the vocabulary size {}",
                        path_, i, tokens_[i], vocab_size);
      }
    }
  } catch (...) {
    unmap();
    throw;
  }
}

TokenFile::~TokenFile() { unmap(); }

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
      count_(other.count_) {}

TokenFile& TokenFile::operator=(TokenFile&& other) noexcept {
  if (this != &other) {
    unmap();
    path_ = std::move(other.path_);
    map_ = std::exchange(other.map_, nullptr);
    map_bytes_ = other.map_bytes_;
    tokens_ = std::exchange(other.tokens_, nullptr);
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

void write_token_file(const std::string& path, std::span<const uint16_t> tokens) {
  MESHTRAIN_CHECK(tokens.size() <= 0x7fffffffu, "data file '{}': {} tokens exceed the format's limit",
                  path, tokens.size());
  std::array<int32_t, 256> header{};
  header[0] = kTokenFileMagic;
  header[1] = kTokenFileVersion;
  header[2] = static_cast<int32_t>(tokens.size());
  std::string tmp = path + ".tmp";
  std::FILE* f = std::fopen(tmp.c_str(), "wb");
  MESHTRAIN_CHECK_AS(ErrorKind::io, f != nullptr, "data file '{}': cannot write: {}", tmp,
                     std::strerror(errno));
  bool ok = std::fwrite(header.data(), sizeof header, 1, f) == 1;
  if (!tokens.empty()) ok = ok && std::fwrite(tokens.data(), 2, tokens.size(), f) == tokens.size();
  ok = (std::fclose(f) == 0) && ok;
  if (!ok || std::rename(tmp.c_str(), path.c_str()) != 0) {
    std::remove(tmp.c_str());
    fail_as(ErrorKind::io, "data file '{}': write failed: {}", path, std::strerror(errno));
  }
}

}  // namespace meshtrain
