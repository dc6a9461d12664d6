#include "meshtrain/comm/bench.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>

#include "meshtrain/util/error.h"

namespace meshtrain {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// The buffers of one (op, size) point and the per-rank element counts.
struct Point {
  CommOp op = CommOp::all_reduce;
  int64_t count = 0;  // elements of the whole buffer (see bench.h)
  int64_t part = 0;   // reduce_scatter / all_gather: elements per rank
  Tensor a, b;
};

// Even ranks of each pair send first, odd ones receive first; a rank
// without a partner (odd world, last rank) sits out.
int partner(int rank, int size) {
  const int p = rank ^ 1;
  return p < size ? p : -1;
}

void run_meshtrain(MpiCommunicator& comm, Point& p) {
  float* a = p.a.data<float>();
  float* b = p.b.data<float>();
  switch (p.op) {
    case CommOp::all_reduce: comm.all_reduce(a, p.count, CommDType::f32, ReduceOp::sum); break;
    case CommOp::reduce_scatter:
      comm.reduce_scatter(a, b, p.part, CommDType::f32, ReduceOp::sum);
      break;
    case CommOp::all_gather: comm.all_gather(a, b, p.part, CommDType::f32); break;
    case CommOp::broadcast: comm.broadcast(a, p.count, CommDType::f32, 0); break;
    case CommOp::send: {
      const int peer = partner(comm.rank(), comm.size());
      if (peer < 0) break;
      if (comm.rank() % 2 == 0) {
        comm.send(a, p.count, CommDType::f32, peer);
        comm.recv(b, p.count, CommDType::f32, peer);
      } else {
        comm.recv(b, p.count, CommDType::f32, peer);
        comm.send(a, p.count, CommDType::f32, peer);
      }
      break;
    }
    default: fail("bench comm: {} is not benchmarked", comm_op_name(p.op));
  }
}

void run_raw(MPI_Comm comm, int rank, int size, Point& p) {
  float* a = p.a.data<float>();
  float* b = p.b.data<float>();
  const int n = static_cast<int>(p.count), part = static_cast<int>(p.part);
  switch (p.op) {
    case CommOp::all_reduce: MPI_Allreduce(MPI_IN_PLACE, a, n, MPI_FLOAT, MPI_SUM, comm); break;
    case CommOp::reduce_scatter:
      MPI_Reduce_scatter_block(a, b, part, MPI_FLOAT, MPI_SUM, comm);
      break;
    case CommOp::all_gather: MPI_Allgather(a, part, MPI_FLOAT, b, part, MPI_FLOAT, comm); break;
    case CommOp::broadcast: MPI_Bcast(a, n, MPI_FLOAT, 0, comm); break;
    case CommOp::send: {
      const int peer = partner(rank, size);
      if (peer < 0) break;
      if (rank % 2 == 0) {
        MPI_Send(a, n, MPI_FLOAT, peer, 0, comm);
        MPI_Recv(b, n, MPI_FLOAT, peer, 0, comm, MPI_STATUS_IGNORE);
      } else {
        MPI_Recv(b, n, MPI_FLOAT, peer, 0, comm, MPI_STATUS_IGNORE);
        MPI_Send(a, n, MPI_FLOAT, peer, 0, comm);
      }
      break;
    }
    default: break;
  }
}

double slowest(Communicator& comm, double seconds) {
  comm.all_reduce(&seconds, 1, CommDType::f64, ReduceOp::max);
  return seconds;
}

}  // namespace

CommBenchOptions quick_comm_bench() {
  CommBenchOptions o;
  o.max_bytes = 16 << 20;
  o.bytes_per_point = 128 << 20;
  return o;
}

double bus_bandwidth_factor(CommOp op, int ranks) {
  const double n = ranks;
  switch (op) {
    case CommOp::all_reduce: return 2 * (n - 1) / n;
    case CommOp::reduce_scatter:
    case CommOp::all_gather: return (n - 1) / n;
    default: return 1;
  }
}

std::vector<CommBenchRow> run_comm_bench(MpiCommunicator& world, MemoryTracker& tracker,
                                         const CommBenchOptions& options,
                                         const std::function<void(const CommBenchRow&)>& on_row) {
  MESHTRAIN_CHECK(options.min_bytes >= 4 && options.min_bytes <= options.max_bytes,
                  "bench comm: sizes must satisfy 4 <= min ({}) <= max ({})", options.min_bytes,
                  options.max_bytes);
  MESHTRAIN_CHECK(options.max_bytes <= (int64_t{1} << 31) - 4,
                  "bench comm: sizes above 2 GB are not supported, got {}", options.max_bytes);
  const int n = world.size(), rank = world.rank();
  std::vector<CommBenchRow> rows;
  for (CommOp op : options.ops) {
    if (op == CommOp::send && n < 2) continue;  // needs a partner
    for (int64_t bytes = options.min_bytes; bytes <= options.max_bytes; bytes *= 4) {
      Point p;
      p.op = op;
      p.count = bytes / 4;
      Shape a_shape{p.count}, b_shape{p.count};
      if (op == CommOp::reduce_scatter || op == CommOp::all_gather) {
        p.part = std::max<int64_t>(1, p.count / n);
        p.count = p.part * n;
        (op == CommOp::reduce_scatter ? b_shape : a_shape) = Shape{p.part};
        (op == CommOp::reduce_scatter ? a_shape : b_shape) = Shape{p.count};
      }
      p.a = Tensor(a_shape, DType::f32, MemCategory::comm, tracker);
      p.b = Tensor(b_shape, DType::f32, MemCategory::comm, tracker);
      const int iters = static_cast<int>(
          std::clamp<int64_t>(options.bytes_per_point / std::max<int64_t>(bytes, 1), 3, 200));

      // Warm-up of both paths, then two rounds of raw and meshtrain calls
      // alternating (the machine's state drifts); the faster round of each counts.
      run_meshtrain(world, p);
      world.run_raw([&](MPI_Comm c) { run_raw(c, rank, n, p); });
      double raw = 1e30, ours = 1e30;
      for (int round = 0; round < 2; ++round) {
        world.run_raw([&](MPI_Comm c) {
          MPI_Barrier(c);
          auto t0 = Clock::now();
          for (int i = 0; i < iters; ++i) run_raw(c, rank, n, p);
          raw = std::min(raw, seconds_since(t0) / iters);
        });
        world.barrier();
        auto t0 = Clock::now();
        for (int i = 0; i < iters; ++i) run_meshtrain(world, p);
        ours = std::min(ours, seconds_since(t0) / iters);
      }

      CommBenchRow row;
      row.op = op;
      row.bytes = p.count * 4;
      row.iterations = iters;
      const double half = op == CommOp::send ? 0.5 : 1.0;  // ping-pong: one way
      row.seconds = slowest(world, ours) * half;
      row.raw_seconds = slowest(world, raw) * half;
      const double factor = bus_bandwidth_factor(op, n);
      row.algbw = static_cast<double>(row.bytes) / row.seconds;
      row.busbw = row.algbw * factor;
      row.raw_algbw = static_cast<double>(row.bytes) / row.raw_seconds;
      row.raw_busbw = row.raw_algbw * factor;
      rows.push_back(row);
      if (on_row) on_row(row);
    }
  }
  return rows;
}

std::string comm_bench_header() {
  return fmt::format(
      "{:<15}{:>11}{:>6} |{:>11}{:>9}{:>9} |{:>11}{:>9}{:>9} |{:>7}\n{:<15}{:>11}{:>6} |{:>29} "
      "|{:>29} |{:>7}",
      "op", "size", "iters", "time (us)", "algbw", "busbw", "time (us)", "algbw", "busbw", "speed",
      "", "(bytes)", "", "meshtrain (GB/s)", "raw MPI (GB/s)", "vs raw");
}

std::string format_comm_bench_row(const CommBenchRow& r) {
  return fmt::format(
      "{:<15}{:>11}{:>6} |{:>11.1f}{:>9.2f}{:>9.2f} |{:>11.1f}{:>9.2f}{:>9.2f} |{:>7.3f}",
      comm_op_name(r.op) == "send" ? "send/recv" : comm_op_name(r.op), r.bytes, r.iterations,
      r.seconds * 1e6, r.algbw / 1e9, r.busbw / 1e9, r.raw_seconds * 1e6, r.raw_algbw / 1e9,
      r.raw_busbw / 1e9, r.raw_seconds / r.seconds);
}

}  // namespace meshtrain
