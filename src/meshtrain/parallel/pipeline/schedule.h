// Pipeline schedules as data: for each pipeline rank, the list of actions it
// runs in one step (forward / backward of a chunk on a micro-batch, and
// batches of sends and receives), generated for GPipe, 1F1B and interleaved
// 1F1B. The executor (executor.h) runs whatever list it is given; simulate()
// checks a schedule for deadlocks and gives its timeline.
//
// Virtual stages: with v chunks per rank, virtual stage s = c * p + r is chunk
// c of rank r (Megatron's interleaving); the layers are cut into v * p
// consecutive parts in virtual-stage order. Activations go from s to s + 1,
// gradients from s to s - 1.
//
// Communication: every transfer is asynchronous (Communicator::send_recv_async,
// which does not hold up later calls). A compute's outgoing activation or
// gradient is posted right after it; the receive a compute needs is posted one
// compute earlier, so the transfer overlaps that compute, and the compute
// waits only for it. A schedule is then deadlock-free when its computes'
// dependencies are: simulate() checks that by running every rank's list.
#pragma once

#include <string>
#include <vector>

namespace meshtrain::pipeline {

enum class ScheduleKind { gpipe, one_f_one_b, interleaved };
ScheduleKind parse_schedule_kind(const std::string& name);  // "gpipe" | "1f1b" | "interleaved"
const char* schedule_kind_name(ScheduleKind kind);

struct PipelineShape {
  int stages = 1;          // p: pipeline ranks
  int micro_batches = 1;   // m
  int virtual_stages = 1;  // v: chunks per rank (interleaved only)
  int total_stages() const { return stages * virtual_stages; }
};

// Throws Error naming the constraint: gpipe and 1f1b need v = 1, interleaved
// v >= 2 and m divisible by p (Megatron's micro-batch groups).
void check_shape(ScheduleKind kind, const PipelineShape& shape);

struct Transfer {
  bool send = true;
  bool grad = false;  // gradient (backward) or activation (forward)
  int chunk = 0;      // this rank's chunk that produced (send) / consumes (recv) it
  int micro_batch = 0;
  int peer = 0;  // pipeline rank
  int tag = 0;   // unique per message within a step
};

enum class ActionKind { forward, backward, send_recv };

struct Action {
  ActionKind kind = ActionKind::forward;
  int chunk = 0, micro_batch = 0;   // forward / backward
  int receive = -1;                 // forward / backward: index of the send_recv it waits for
  std::vector<Transfer> transfers;  // send_recv
};

using RankSchedule = std::vector<Action>;
using Schedule = std::vector<RankSchedule>;  // by pipeline rank

// Every rank's actions.
Schedule make_schedule(ScheduleKind kind, const PipelineShape& shape);

// The result of running all ranks' lists against each other: compute takes
// forward_ticks / backward_ticks, a transfer completes as soon as both sides
// have posted it. deadlock: no rank could progress (message says where).
struct SimResult {
  bool deadlock = false;
  std::string message;
  struct Slot {
    int start = 0, end = 0;
    Action action;
  };
  std::vector<std::vector<Slot>> compute;  // by rank, in execution order
  int makespan = 0;
  double bubble() const;  // idle / busy, averaged over ranks: theory (p-1)/(v*m)
};
SimResult simulate(const Schedule& schedule, const PipelineShape& shape, int forward_ticks = 1,
                   int backward_ticks = 2);

// One line per rank, one cell per tick: "F3" forward of micro-batch 3 (chunk
// letter appended when v > 1: "F3a"), "B3" backward, "." idle.
std::string format_timeline(const SimResult& result, const PipelineShape& shape);

// The theoretical bubble (p - 1) / (v * m).
double theoretical_bubble(const PipelineShape& shape);

}  // namespace meshtrain::pipeline
