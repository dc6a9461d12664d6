#include "meshtrain/data/prepare.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <exception>
#include <filesystem>
#include <mutex>
#include <optional>
#include <regex>
#include <string_view>
#include <thread>

#include "meshtrain/data/token_file.h"
#include "meshtrain/util/error.h"
#include "meshtrain/util/progress.h"
#include "meshtrain/util/rng.h"
#include "meshtrain/util/unique_fd.h"

namespace meshtrain {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

// A read-only view of a whole file (empty files need no mapping).
class MappedText {
 public:
  explicit MappedText(const std::string& path) {
    const UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
    MESHTRAIN_CHECK(fd.valid(), "prepare: cannot open '{}': {}", path, std::strerror(errno));
    struct stat st {};
    MESHTRAIN_CHECK(::fstat(fd.get(), &st) == 0 && S_ISREG(st.st_mode),
                    "prepare: '{}' is not a regular file", path);
    size_ = static_cast<size_t>(st.st_size);
    if (size_ > 0) {
      map_ = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd.get(), 0);
      if (map_ == MAP_FAILED) {
        map_ = nullptr;
        fail("prepare: cannot map '{}': {}", path, std::strerror(errno));
      }
    }
  }
  ~MappedText() {
    if (map_ != nullptr) ::munmap(map_, size_);
  }
  MappedText(const MappedText&) = delete;
  MappedText& operator=(const MappedText&) = delete;
  std::string_view text() const { return {static_cast<const char*>(map_), map_ ? size_ : 0}; }

 private:
  void* map_ = nullptr;
  size_t size_ = 0;
};

std::vector<std::string> list_input_files(const std::vector<std::string>& inputs) {
  MESHTRAIN_CHECK(!inputs.empty(), "prepare: no input files or directories given");
  std::vector<std::string> files;
  for (const auto& input : inputs) {
    std::error_code ec;
    if (fs::is_directory(input, ec)) {
      std::vector<std::string> found;
      for (const auto& entry : fs::directory_iterator(input)) {
        if (entry.is_regular_file() && entry.path().extension() == ".txt") {
          found.push_back(entry.path().string());
        }
      }
      MESHTRAIN_CHECK(!found.empty(), "prepare: directory '{}' has no .txt files", input);
      std::sort(found.begin(), found.end());
      files.insert(files.end(), found.begin(), found.end());
    } else {
      MESHTRAIN_CHECK(fs::exists(input, ec), "prepare: input '{}' does not exist", input);
      files.push_back(input);
    }
  }
  return files;
}

// Empty documents are dropped: they would add nothing but an end-of-text id.
std::vector<std::string_view> split_documents(std::string_view text, const std::string& separator) {
  std::vector<std::string_view> docs;
  if (separator.empty()) {
    if (!text.empty()) docs.push_back(text);
    return docs;
  }
  for (size_t pos = 0; pos <= text.size();) {
    size_t end = text.find(separator, pos);
    if (end == std::string_view::npos) end = text.size();
    if (end > pos) docs.push_back(text.substr(pos, end - pos));
    pos = end + separator.size();
  }
  return docs;
}

// Which documents are validation: the n with the smallest keyed hashes.
std::vector<bool> choose_validation(int64_t documents, double fraction, uint64_t seed) {
  std::vector<bool> is_val(static_cast<size_t>(documents), false);
  if (fraction <= 0) return is_val;
  int64_t n_val = std::max<int64_t>(1, std::llround(fraction * static_cast<double>(documents)));
  MESHTRAIN_CHECK(n_val < documents,
                  "prepare: val_fraction {} leaves no training document ({} documents)", fraction,
                  documents);
  uint64_t key = stream_key(seed, "prepare.validation");
  std::vector<std::pair<uint64_t, int64_t>> order;
  for (int64_t i = 0; i < documents; ++i) order.emplace_back(mix64(key ^ mix64(i)), i);
  std::sort(order.begin(), order.end());
  for (int64_t i = 0; i < n_val; ++i) is_val[static_cast<size_t>(order[i].second)] = true;
  return is_val;
}

std::string with_commas(int64_t v) {
  std::string digits = std::to_string(v), out;
  for (size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && (digits.size() - i) % 3 == 0) out.push_back(',');
    out.push_back(digits[i]);
  }
  return out;
}

// The bar (util/progress.h) on a terminal; plain lines every 10 s otherwise.
class Progress {
 public:
  Progress(std::FILE* out, const std::string& mode, int64_t total_bytes)
      : bar_(out, mode, "prepare", "prepare"), out_(out), total_(total_bytes),
        start_(Clock::now()), last_(start_) {}

  void update(int64_t bytes, int64_t tokens, bool done = false) {
    if (!bar_.enabled()) return;
    auto now = Clock::now();
    double elapsed = std::chrono::duration<double>(now - start_).count();
    double rate = elapsed > 0 ? static_cast<double>(bytes) / elapsed : 0;
    double frac = total_ > 0 ? static_cast<double>(bytes) / static_cast<double>(total_) : 1.0;
    std::string eta = eta_text(static_cast<double>(bytes), static_cast<double>(total_), elapsed);
    if (bar_.bar()) {
      bar_.draw(frac, fmt::format("{:5.1f}%  {:7.2f} MB/s  {} tokens  ETA {}", 100 * frac,
                                  rate / 1e6, with_commas(tokens), eta),
                done);
      return;
    }
    if (done || std::chrono::duration<double>(now - last_).count() < 10.0) return;
    last_ = now;
    std::fprintf(out_, "prepare: %.1f%% (%.1f of %.1f MB), %.2f MB/s, %s tokens, ETA %s\n",
                 100 * frac, static_cast<double>(bytes) / 1e6, static_cast<double>(total_) / 1e6,
                 rate / 1e6, with_commas(tokens).c_str(), eta.c_str());
    std::fflush(out_);
  }

 private:
  ProgressBar bar_;
  std::FILE* out_;
  int64_t total_;
  Clock::time_point start_, last_;
};

// Cuts one token stream (train or val) into shards named <dir>/<split>_NNNNNN.bin.
class ShardWriter {
 public:
  // wide: uint32 tokens (token file version 2), for vocabularies past 65536 ids.
  ShardWriter(std::string dir, std::string split, int64_t shard_tokens, bool wide)
      : dir_(std::move(dir)), split_(std::move(split)), shard_tokens_(shard_tokens), wide_(wide) {}

  void append(const std::vector<uint32_t>& tokens) {
    for (size_t pos = 0; pos < tokens.size();) {
      if (buffer_.empty()) buffer_.reserve(static_cast<size_t>(std::min<int64_t>(shard_tokens_, 1 << 24)));
      size_t room = static_cast<size_t>(shard_tokens_) - buffer_.size();
      size_t take = std::min(room, tokens.size() - pos);
      buffer_.insert(buffer_.end(), tokens.begin() + static_cast<std::ptrdiff_t>(pos),
                     tokens.begin() + static_cast<std::ptrdiff_t>(pos + take));
      pos += take;
      total_ += static_cast<int64_t>(take);
      if (buffer_.size() == static_cast<size_t>(shard_tokens_)) flush();
    }
  }

  // Writes the last partial shard and removes shards of an earlier, longer run.
  void finish() {
    if (!buffer_.empty()) flush();
    std::regex own(split_ + R"(_(\d{6})\.bin)");
    for (const auto& entry : fs::directory_iterator(dir_)) {
      std::smatch m;
      std::string name = entry.path().filename().string();
      if (std::regex_match(name, m, own) && std::stoll(m[1].str()) >= static_cast<int64_t>(files_.size())) {
        fs::remove(entry.path());
      }
    }
  }

  int64_t total() const { return total_; }
  const std::vector<std::string>& files() const { return files_; }

 private:
  void flush() {
    std::string path = (fs::path(dir_) / fmt::format("{}_{:06}.bin", split_, files_.size())).string();
    if (wide_) {
      write_token_file(path, buffer_);
    } else {
      write_token_file(path, std::vector<uint16_t>(buffer_.begin(), buffer_.end()));
    }
    files_.push_back(path);
    buffer_.clear();
  }

  std::string dir_, split_;
  int64_t shard_tokens_;
  bool wide_;
  std::vector<uint32_t> buffer_;
  std::vector<std::string> files_;
  int64_t total_ = 0;
};

}  // namespace

PrepareSummary prepare_corpus(const PrepareOptions& options, std::FILE* progress_out) {
  auto start = Clock::now();
  MESHTRAIN_CHECK(!options.output_dir.empty(), "prepare: no output directory given");
  MESHTRAIN_CHECK(options.shard_tokens >= 1 && options.shard_tokens <= 0x7fffffff,
                  "prepare: shard_tokens {} is not in [1, 2^31)", options.shard_tokens);
  MESHTRAIN_CHECK(options.val_fraction >= 0 && options.val_fraction < 1,
                  "prepare: val_fraction {} is not in [0, 1)", options.val_fraction);
  MESHTRAIN_CHECK(options.threads >= 0, "prepare: threads {} is negative", options.threads);
  auto tokenizer = make_tokenizer(options.tokenizer, options.gpt2_ranks);
  const bool wide = tokenizer->vocab_size() > 65536;
  // Each document between the tokenizer's own ids: GPT-2's end-of-text
  // before it, a post-processor's BOS before (Llama) or EOS after (Qwen).
  const Tokenizer::DocumentFrame frame = tokenizer->document_frame();

  std::vector<std::unique_ptr<MappedText>> texts;
  std::vector<std::string_view> docs;
  for (const auto& file : list_input_files(options.inputs)) {
    texts.push_back(std::make_unique<MappedText>(file));
    // Tokenizers are defined on text; the bytes tokenizer takes any file.
    if (tokenizer->name() != "bytes") {
      const std::string_view text = texts.back()->text();
      const size_t bad = first_non_text_byte(text);
      MESHTRAIN_CHECK(bad == std::string_view::npos,
                      "prepare: '{}' is not UTF-8 text (byte 0x{:02x} at offset {}); the "
                      "tokenizer needs text (--tokenizer bytes takes any file)",
                      file, static_cast<unsigned char>(text[bad]), bad);
    }
    auto parts = split_documents(texts.back()->text(), options.separator);
    docs.insert(docs.end(), parts.begin(), parts.end());
  }
  const auto n_docs = static_cast<int64_t>(docs.size());
  MESHTRAIN_CHECK(n_docs > 0, "prepare: the inputs hold no text");
  std::vector<bool> is_val = choose_validation(n_docs, options.val_fraction, options.seed);
  int64_t total_bytes = 0;
  for (auto d : docs) total_bytes += static_cast<int64_t>(d.size());

  std::error_code ec;
  fs::create_directories(options.output_dir, ec);
  MESHTRAIN_CHECK(fs::is_directory(options.output_dir),
                  "prepare: cannot create output directory '{}'", options.output_dir);
  ShardWriter train(options.output_dir, "train", options.shard_tokens, wide);
  ShardWriter val(options.output_dir, "val", options.shard_tokens, wide);

  int threads = options.threads > 0 ? options.threads
                                    : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  threads = static_cast<int>(std::min<int64_t>(threads, n_docs));
  // Workers encode documents in any order; this thread writes them in input
  // order. A window bounds how far workers run ahead (and so the memory held).
  const int64_t window = 4 * static_cast<int64_t>(threads);
  // Encoded documents waiting to be written; document d sits in slot d % window.
  std::vector<std::optional<std::vector<uint32_t>>> done(static_cast<size_t>(window));
  auto slot = [&](int64_t doc) -> std::optional<std::vector<uint32_t>>& {
    return done[static_cast<size_t>(doc % window)];
  };
  std::mutex mutex;
  std::condition_variable ready, room;
  int64_t next_claim = 0, next_write = 0;
  std::exception_ptr error;

  auto work = [&] {
    std::vector<int32_t> ids;
    for (;;) {
      int64_t doc;
      {
        std::unique_lock lock(mutex);
        room.wait(lock, [&] { return error || next_claim >= n_docs || next_claim < next_write + window; });
        if (error || next_claim >= n_docs) return;
        doc = next_claim++;
      }
      try {
        ids.assign(frame.before.begin(), frame.before.end());
        tokenizer->encode_ordinary(docs[static_cast<size_t>(doc)], ids);
        ids.insert(ids.end(), frame.after.begin(), frame.after.end());
        std::vector<uint32_t> tokens(ids.begin(), ids.end());
        std::lock_guard lock(mutex);
        slot(doc) = std::move(tokens);
      } catch (...) {
        std::lock_guard lock(mutex);
        if (!error) error = std::current_exception();
      }
      ready.notify_all();
    }
  };
  Progress progress(progress_out, options.progress, total_bytes);
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t) pool.emplace_back(work);

  int64_t bytes_done = 0;
  try {
    while (next_write < n_docs) {
      std::vector<uint32_t> tokens;
      {
        std::unique_lock lock(mutex);
        while (!error && !slot(next_write)) {
          ready.wait_for(lock, std::chrono::milliseconds(200));
          if (!slot(next_write)) {
            lock.unlock();
            progress.update(bytes_done, train.total() + val.total());
            lock.lock();
          }
        }
        if (error) break;
        tokens = std::move(*slot(next_write));
        slot(next_write).reset();
      }
      (is_val[static_cast<size_t>(next_write)] ? val : train).append(tokens);
      bytes_done += static_cast<int64_t>(docs[static_cast<size_t>(next_write)].size());
      {
        std::lock_guard lock(mutex);
        ++next_write;
      }
      room.notify_all();
      progress.update(bytes_done, train.total() + val.total());
    }
  } catch (...) {
    std::lock_guard lock(mutex);
    if (!error) error = std::current_exception();
  }
  room.notify_all();
  for (auto& t : pool) t.join();
  if (error) std::rethrow_exception(error);
  train.finish();
  val.finish();
  progress.update(bytes_done, train.total() + val.total(), /*done=*/true);

  PrepareSummary summary;
  summary.documents = n_docs;
  summary.val_documents = std::count(is_val.begin(), is_val.end(), true);
  summary.train_documents = n_docs - summary.val_documents;
  summary.text_bytes = total_bytes;
  summary.train_tokens = train.total();
  summary.val_tokens = val.total();
  summary.train_files = train.files();
  summary.val_files = val.files();
  summary.threads = threads;
  summary.frame_tokens = static_cast<int64_t>(frame.before.size() + frame.after.size());
  summary.bytes_per_token = wide ? 4 : 2;
  summary.seconds = std::chrono::duration<double>(Clock::now() - start).count();
  return summary;
}

int run_prepare(const PrepareOptions& options) {
  PrepareSummary s = prepare_corpus(options, stderr);
  int64_t tokens = s.train_tokens + s.val_tokens;
  int64_t text_tokens = tokens - s.documents * s.frame_tokens;  // without the framing ids
  std::printf("prepare: %s documents (%s train, %s validation), %s bytes -> %s tokens, "
              "%.2f bytes/token (%s tokenizer)\n",
              with_commas(s.documents).c_str(), with_commas(s.train_documents).c_str(),
              with_commas(s.val_documents).c_str(), with_commas(s.text_bytes).c_str(),
              with_commas(tokens).c_str(),
              text_tokens > 0 ? static_cast<double>(s.text_bytes) / static_cast<double>(text_tokens) : 0.0,
              options.tokenizer.c_str());
  auto files_line = [](const char* split, int64_t n, const std::vector<std::string>& files) {
    if (files.empty()) return;
    std::string last = files.size() > 1 ? " .. " + files.back() : "";
    std::printf("prepare: %s: %s tokens in %zu shard%s: %s%s\n", split, with_commas(n).c_str(),
                files.size(), files.size() == 1 ? "" : "s", files.front().c_str(), last.c_str());
  };
  files_line("train", s.train_tokens, s.train_files);
  files_line("val", s.val_tokens, s.val_files);
  if (s.bytes_per_token == 4) {
    std::printf("prepare: token files of version %d (uint32 ids: the vocabulary passes 65536)\n",
                kTokenFileVersionWide);
  }
  std::printf("prepare: %.2f s, %.2f MB/s on %d thread%s\n", s.seconds,
              s.seconds > 0 ? static_cast<double>(s.text_bytes) / s.seconds / 1e6 : 0.0, s.threads,
              s.threads == 1 ? "" : "s");
  return 0;
}

}  // namespace meshtrain
