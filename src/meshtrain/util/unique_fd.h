// A file descriptor with one owner, closed when the owner goes. A class that
// opens a file in its constructor holds it in one of these: when a later check
// of the constructor throws, the destructor of the class does not run, but its
// members' do (the safetensors reader leaked a descriptor per rejected file
// until it did; found by fuzz_safetensors).
#pragma once

#include <unistd.h>

#include <utility>

namespace meshtrain {

class UniqueFd {
 public:
  UniqueFd() = default;  // owns nothing
  explicit UniqueFd(int fd) : fd_(fd) {}  // takes `fd` (may be -1: owns nothing)
  ~UniqueFd() { reset(); }
  UniqueFd(UniqueFd&& other) noexcept : fd_(std::exchange(other.fd_, -1)) {}
  UniqueFd& operator=(UniqueFd&& other) noexcept {
    if (this != &other) {
      reset();
      fd_ = std::exchange(other.fd_, -1);
    }
    return *this;
  }
  UniqueFd(const UniqueFd&) = delete;
  UniqueFd& operator=(const UniqueFd&) = delete;

  int get() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  // Closes what it owns (if anything); owns nothing afterwards.
  void reset() {
    if (fd_ >= 0) ::close(std::exchange(fd_, -1));
  }

 private:
  int fd_ = -1;
};

}  // namespace meshtrain
