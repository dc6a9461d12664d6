// Tokenizer and `prepare` throughput, driven by bench/bench_tokenizer.sh and
// bench/tokenizers_hf.sh (which time PyPI tiktoken / tokenizers / sentencepiece
// in the same run, alternating A B A B). TOKENIZER: make_tokenizer's kind
// ("gpt2" with RANKS, or a tokenizer file or folder).
//   bench_tokenizer speed TOKENIZER RANKS REPS FILE...   single-threaded encode, MB/s (best of REPS)
//   bench_tokenizer prepare TOKENIZER RANKS THREADS OUT INPUT...   one prepare run, MB/s
#include <chrono>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "meshtrain/data/bpe_tokenizer.h"
#include "meshtrain/data/prepare.h"
#include "meshtrain/util/error.h"

namespace {

using Clock = std::chrono::steady_clock;

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  MESHTRAIN_CHECK(in.good(), "bench_tokenizer: cannot open '{}'", path);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

int speed(const std::string& kind, const std::string& ranks, int reps,
          const std::vector<std::string>& files) {
  auto tok = meshtrain::make_tokenizer(kind, ranks);
  std::vector<std::string> texts;
  size_t bytes = 0;
  for (const auto& f : files) {
    texts.push_back(read_file(f));
    bytes += texts.back().size();
  }
  std::vector<int32_t> ids;
  for (const auto& t : texts) tok->encode_ordinary(t, ids);  // warm-up, as for tiktoken
  double best = 1e30;
  for (int r = 0; r < reps; ++r) {
    ids.clear();
    auto start = Clock::now();
    for (const auto& t : texts) tok->encode_ordinary(t, ids);
    best = std::min(best, std::chrono::duration<double>(Clock::now() - start).count());
  }
  std::printf("meshtrain %.2f MB/s %.0f tokens/s (%zu bytes, %zu tokens, best of %d)\n",
              static_cast<double>(bytes) / best / 1e6, static_cast<double>(ids.size()) / best, bytes,
              ids.size(), reps);
  return 0;
}

int prepare(const std::string& kind, const std::string& ranks, int threads, const std::string& out,
            const std::vector<std::string>& inputs) {
  meshtrain::PrepareOptions o;
  o.tokenizer = kind;
  o.inputs = inputs;
  o.output_dir = out;
  o.gpt2_ranks = ranks;
  o.threads = threads;
  o.val_fraction = 0.05;
  o.progress = "none";
  auto s = meshtrain::prepare_corpus(o, nullptr);
  std::printf("prepare threads=%d %.2f MB/s (%.3f s, %lld tokens)\n", s.threads,
              static_cast<double>(s.text_bytes) / s.seconds / 1e6, s.seconds,
              static_cast<long long>(s.train_tokens + s.val_tokens));
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string> a(argv + 1, argv + argc);
  try {
    if (a.size() >= 5 && a[0] == "speed") {
      return speed(a[1], a[2], std::stoi(a[3]), {a.begin() + 4, a.end()});
    }
    if (a.size() >= 6 && a[0] == "prepare") {
      return prepare(a[1], a[2], std::stoi(a[3]), a[4], {a.begin() + 5, a.end()});
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_tokenizer: %s\n", e.what());
    return 1;
  }
  std::fprintf(stderr,
               "usage: bench_tokenizer speed RANKS REPS FILE... | prepare RANKS THREADS OUT INPUT...\n");
  return 2;
}
