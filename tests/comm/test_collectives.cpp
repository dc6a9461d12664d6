// Every collective against a serial reference computed on each rank from the
// other ranks' (deterministic) inputs: f32, f64, bf16, i32, i64; sum, avg,
// max; uneven and zero-length parts; in-place all_gather; send/recv.
#include <gtest/gtest.h>

#include <cstring>
#include <numeric>
#include <vector>

#include "meshtrain/util/error.h"
#include "mpi_test.h"

namespace meshtrain {
namespace {

using testing::mpi_env;

// Rank r's input element i: small multiples of 1/4, so sums over a few ranks
// are exact in every floating type and in any order, and the reference can
// be compared exactly.
double input(int rank, int64_t i) {
  return static_cast<double>((rank * 7 + i * 3) % 17 - 8) * 0.25;
}

// A buffer of `n` elements of `dtype`, stored as bytes, read and written as doubles.
struct Buffer {
  CommDType dtype;
  std::vector<char> bytes;
  Buffer(CommDType t, int64_t n) : dtype(t), bytes(static_cast<size_t>(n) * comm_dtype_size(t)) {}
  int64_t size() const { return static_cast<int64_t>(bytes.size() / comm_dtype_size(dtype)); }
  void* data() { return bytes.data(); }
  double get(int64_t i) const {
    const char* p = bytes.data() + i * static_cast<int64_t>(comm_dtype_size(dtype));
    switch (dtype) {
      case CommDType::f32: return load<float>(p);
      case CommDType::bf16: return bf16_to_float(load<bf16>(p));
      case CommDType::f64: return load<double>(p);
      case CommDType::i32: return load<int32_t>(p);
      case CommDType::i64: return static_cast<double>(load<int64_t>(p));
      case CommDType::f16: return f16_to_float(load<f16>(p));
    }
    return 0;
  }
  void set(int64_t i, double x) {
    char* p = bytes.data() + i * static_cast<int64_t>(comm_dtype_size(dtype));
    switch (dtype) {
      case CommDType::f32: store(p, static_cast<float>(x)); break;
      case CommDType::bf16: store(p, float_to_bf16(static_cast<float>(x))); break;
      case CommDType::f64: store(p, x); break;
      case CommDType::i32: store(p, static_cast<int32_t>(x * 4)); break;
      case CommDType::i64: store(p, static_cast<int64_t>(x * 4) << 33); break;
      case CommDType::f16: store(p, float_to_f16(static_cast<float>(x))); break;
    }
  }
  template <typename T>
  static T load(const char* p) {
    T v;
    std::memcpy(&v, p, sizeof v);
    return v;
  }
  template <typename T>
  static void store(char* p, T v) {
    std::memcpy(p, &v, sizeof v);
  }
};

// Integers hold input * 4 (and i64 also shifted past 32 bits), so the same
// inputs serve every type.
double as_stored(CommDType dtype, double x) {
  Buffer b(dtype, 1);
  b.set(0, x);
  return b.get(0);
}

double reduce_reference(CommDType dtype, ReduceOp op, int size, int64_t i, int64_t part_offset) {
  double acc = op == ReduceOp::max ? -1e300 : 0.0;
  for (int r = 0; r < size; ++r) {
    double v = as_stored(dtype, input(r, part_offset + i));
    acc = op == ReduceOp::max ? std::max(acc, v) : acc + v;
  }
  if (op == ReduceOp::avg) acc /= size;
  // bf16 results are the exact (f32) reduction rounded once.
  return dtype == CommDType::bf16 ? bf16_to_float(float_to_bf16(static_cast<float>(acc))) : acc;
}

struct Case {
  CommDType dtype;
  ReduceOp op;
};

std::vector<Case> reduce_cases() {
  std::vector<Case> cases;
  for (CommDType t :
       {CommDType::f32, CommDType::bf16, CommDType::f64, CommDType::i32, CommDType::i64}) {
    for (ReduceOp op : {ReduceOp::sum, ReduceOp::avg, ReduceOp::max}) {
      if (op == ReduceOp::avg && !is_floating(t)) continue;
      cases.push_back({t, op});
    }
  }
  return cases;
}

class Collectives : public ::testing::Test {
 protected:
  MemoryTracker tracker_;
  std::unique_ptr<MpiCommunicator> world_ = mpi_env().world(tracker_);
  int rank() const { return world_->rank(); }
  int size() const { return world_->size(); }
};

TEST_F(Collectives, AllReduceMatchesSerialReference) {
  for (const Case& c : reduce_cases()) {
    for (int64_t n : {0, 1, 7, 1000, 100003}) {
      Buffer buf(c.dtype, n);
      for (int64_t i = 0; i < n; ++i) buf.set(i, input(rank(), i));
      world_->all_reduce(buf.data(), n, c.dtype, c.op);
      int bad = 0;
      for (int64_t i = 0; i < n && bad < 3; ++i) {
        double want = reduce_reference(c.dtype, c.op, size(), i, 0);
        if (buf.get(i) != want) {
          ++bad;
          ADD_FAILURE() << comm_dtype_name(c.dtype) << " " << reduce_op_name(c.op) << " n=" << n
                        << " [" << i << "]: " << buf.get(i) << " vs " << want;
        }
      }
    }
  }
}

TEST_F(Collectives, Bf16SumsAccumulateInF32) {
  // 256 + 1 + 1 + 1: rounding to bf16 after each addition would stay at 256;
  // an f32 sum rounded once gives bf16(259) = 260 with four ranks.
  bf16 v = float_to_bf16(rank() == 0 ? 256.0f : 1.0f);
  world_->all_reduce(&v, 1, CommDType::bf16, ReduceOp::sum);
  float exact = 256.0f + static_cast<float>(size() - 1);
  EXPECT_EQ(bf16_to_float(v), bf16_to_float(float_to_bf16(exact)));
  EXPECT_GT(tracker_.peak(MemCategory::comm), 0u) << "the f32 scratch is tracked";
}

// Uneven parts, one of them empty when there are several ranks.
std::vector<int64_t> uneven_counts(int size) {
  std::vector<int64_t> counts;
  for (int r = 0; r < size; ++r) counts.push_back(r == 1 ? 0 : 3 * r + 5);
  return counts;
}

TEST_F(Collectives, ReduceScatterUnevenMatchesReference) {
  const std::vector<int64_t> counts = uneven_counts(size());
  const int64_t total = std::accumulate(counts.begin(), counts.end(), int64_t{0});
  const int64_t offset = std::accumulate(counts.begin(), counts.begin() + rank(), int64_t{0});
  const int64_t mine = counts[static_cast<size_t>(rank())];
  for (const Case& c : reduce_cases()) {
    Buffer send(c.dtype, total), recv(c.dtype, mine);
    for (int64_t i = 0; i < total; ++i) send.set(i, input(rank(), i));
    world_->reduce_scatter(send.data(), recv.data(), counts, c.dtype, c.op);
    for (int64_t i = 0; i < mine; ++i) {
      EXPECT_EQ(recv.get(i), reduce_reference(c.dtype, c.op, size(), i, offset))
          << comm_dtype_name(c.dtype) << " " << reduce_op_name(c.op) << " [" << i << "]";
    }
  }
  // Even parts through the convenience form.
  std::vector<float> in(static_cast<size_t>(4 * size())), out(4);
  for (size_t i = 0; i < in.size(); ++i)
    in[i] = static_cast<float>(input(rank(), static_cast<int64_t>(i)));
  world_->reduce_scatter(in.data(), out.data(), 4, CommDType::f32, ReduceOp::sum);
  for (int64_t i = 0; i < 4; ++i) {
    EXPECT_EQ(out[static_cast<size_t>(i)],
              reduce_reference(CommDType::f32, ReduceOp::sum, size(), i, 4 * rank()));
  }
}

TEST_F(Collectives, AllGatherUnevenAndInPlace) {
  const std::vector<int64_t> counts = uneven_counts(size());
  const int64_t total = std::accumulate(counts.begin(), counts.end(), int64_t{0});
  const int64_t offset = std::accumulate(counts.begin(), counts.begin() + rank(), int64_t{0});
  const int64_t mine = counts[static_cast<size_t>(rank())];
  for (CommDType t : {CommDType::f32, CommDType::bf16, CommDType::i64}) {
    for (bool in_place : {false, true}) {
      Buffer send(t, mine), recv(t, total);
      for (int64_t i = 0; i < mine; ++i) {
        send.set(i, input(rank(), i));
        if (in_place) recv.set(offset + i, input(rank(), i));
      }
      const char* src = in_place
                            ? recv.bytes.data() + offset * static_cast<int64_t>(comm_dtype_size(t))
                            : send.bytes.data();
      world_->all_gather(src, recv.data(), counts, t);
      int64_t at = 0;
      for (int r = 0; r < size(); ++r) {
        for (int64_t i = 0; i < counts[static_cast<size_t>(r)]; ++i, ++at) {
          EXPECT_EQ(recv.get(at), as_stored(t, input(r, i)))
              << comm_dtype_name(t) << (in_place ? " in place" : "") << " rank " << r << " [" << i
              << "]";
        }
      }
    }
  }
}

// Rank r sends (r + 2q) % 3 elements to rank q (some pairs none), each
// naming its source and destination; every dtype is moved bit for bit.
TEST_F(Collectives, AllToAllUnevenMatchesReference) {
  auto count = [](int from, int to) { return static_cast<int64_t>((from + 2 * to) % 3); };
  auto value = [](int from, int to, int64_t i) { return input(from, to * 100 + i); };
  for (CommDType t : {CommDType::f32, CommDType::bf16, CommDType::i64}) {
    std::vector<int64_t> send_counts, recv_counts;
    for (int q = 0; q < size(); ++q) {
      send_counts.push_back(count(rank(), q));
      recv_counts.push_back(count(q, rank()));
    }
    Buffer send(t, std::accumulate(send_counts.begin(), send_counts.end(), int64_t{0}));
    Buffer recv(t, std::accumulate(recv_counts.begin(), recv_counts.end(), int64_t{0}));
    int64_t at = 0;
    for (int q = 0; q < size(); ++q) {
      for (int64_t i = 0; i < count(rank(), q); ++i) send.set(at++, value(rank(), q, i));
    }
    const uint64_t seq = world_->calls_issued();
    world_->all_to_all(send.data(), send_counts, recv.data(), recv_counts, t);
    EXPECT_EQ(world_->calls_issued(), seq + 1) << "one numbered call";
    EXPECT_EQ(world_->recent_calls().back().op, CommOp::all_to_all);
    EXPECT_EQ(world_->recent_calls().back().bytes,
              static_cast<size_t>(send.size()) * comm_dtype_size(t));
    at = 0;
    for (int p = 0; p < size(); ++p) {
      for (int64_t i = 0; i < count(p, rank()); ++i, ++at) {
        EXPECT_EQ(recv.get(at), as_stored(t, value(p, rank(), i)))
            << comm_dtype_name(t) << " from rank " << p << " [" << i << "]";
      }
    }
  }
}

TEST_F(Collectives, BroadcastFromEveryRoot) {
  for (int root = 0; root < size(); ++root) {
    for (CommDType t : {CommDType::f32, CommDType::bf16, CommDType::i32}) {
      Buffer buf(t, 5001);
      for (int64_t i = 0; i < buf.size(); ++i) buf.set(i, input(rank(), i));
      world_->broadcast(buf.data(), buf.size(), t, root);
      for (int64_t i = 0; i < buf.size(); i += 97) {
        EXPECT_EQ(buf.get(i), as_stored(t, input(root, i))) << "root " << root << " [" << i << "]";
      }
    }
  }
}

TEST_F(Collectives, SendRecvRing) {
  if (size() % 2 != 0) GTEST_SKIP() << "a ring of blocking pairs needs an even number of ranks";
  const int right = (rank() + 1) % size(), left = (rank() + size() - 1) % size();
  std::vector<int64_t> out(100000), in(out.size());
  std::iota(out.begin(), out.end(), int64_t{rank()} * 1000000);
  // Even ranks send first, odd ranks receive first: blocking pairs never cross.
  if (rank() % 2 == 0) {
    world_->send(out.data(), static_cast<int64_t>(out.size()), CommDType::i64, right, 7);
    world_->recv(in.data(), static_cast<int64_t>(in.size()), CommDType::i64, left, 7);
  } else {
    world_->recv(in.data(), static_cast<int64_t>(in.size()), CommDType::i64, left, 7);
    world_->send(out.data(), static_cast<int64_t>(out.size()), CommDType::i64, right, 7);
  }
  for (size_t i = 0; i < in.size(); i += 1013)
    EXPECT_EQ(in[i], int64_t{left} * 1000000 + static_cast<int64_t>(i));

  // A shorter message than expected is an Error from wait(), naming the peer.
  std::vector<float> small(10);
  if (rank() % 2 == 0) {
    world_->send(small.data(), 5, CommDType::f32, right);
  } else {
    try {
      world_->recv(small.data(), 10, CommDType::f32, left);
      ADD_FAILURE() << "no error";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("got 5 elements, expected 10"), std::string::npos)
          << e.what();
    }
  }
}

TEST_F(Collectives, BadArgumentsThrowBeforeAnythingIsQueued) {
  const uint64_t before = world_->calls_issued();
  float x = 0;
  std::vector<int64_t> wrong(static_cast<size_t>(size() + 1), 1);
  EXPECT_THROW(world_->all_reduce(&x, -1, CommDType::f32, ReduceOp::sum), Error);
  EXPECT_THROW(world_->all_reduce(&x, 1, CommDType::i32, ReduceOp::avg), Error);
  EXPECT_THROW(world_->all_gather(&x, &x, wrong, CommDType::f32), Error);
  EXPECT_THROW(world_->broadcast(&x, 1, CommDType::f32, size()), Error);
  std::vector<int64_t> ones(static_cast<size_t>(size()), 1);
  EXPECT_THROW(world_->all_to_all(&x, wrong, &x, ones, CommDType::f32), Error);
  try {
    world_->send(&x, 1, CommDType::f32, -1);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_STREQ(
        e.what(),
        ("comm world: send: peer -1 is not a rank in [0, " + std::to_string(size()) + ")").c_str());
  }
  EXPECT_EQ(world_->calls_issued(), before);
}

}  // namespace
}  // namespace meshtrain
